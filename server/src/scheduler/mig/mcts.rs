//! The tree-search stage of MIG-serving (Tan et al., arXiv 2109.11067; research note §1,
//! details marked as a guess): Monte Carlo tree search where an action opens one more
//! GPU with a configuration, roll-outs finish the plan with the greedy, and the score is
//! the GPU count.
//!
//! Choices made here: the actions at a node are the best configuration of each of the
//! `actions` most useful partitions (by the greedy's utility); selection is UCT on the
//! reward lower_bound / score, where score = GPUs − ½·(idle share of the emptiest GPU) so
//! that among equal counts a nearly empty last GPU counts as progress. The search commits
//! to one GPU at a time (the child with the best roll-out after a few iterations) and
//! continues from there, so its depth reaches the whole plan; the iterations per GPU
//! shrink for large plans so the whole search stays within a roll-out budget. Roll-outs take a random
//! one of the top three configurations with probability 0.1 (seeded), and the best plan
//! found is compacted ([`super::compact`]) at the end.

use rand::rngs::StdRng;
use rand::SeedableRng;

use super::compact::compact;
use super::greedy::{candidates, complete, prices, solve as greedy, trim, Noise, Utility};
use super::space::{Config, LatticeCache, Solution, Space};

/// Size of the search.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MctsOptions {
    /// Most iterations before committing each GPU.
    pub iterations: usize,
    /// Roll-outs for the whole search, spread over the GPUs of the incumbent plan (at least
    /// three iterations per GPU).
    pub rollouts: usize,
    /// Configurations tried at each node.
    pub actions: usize,
    /// UCT exploration constant.
    pub exploration: f64,
}

impl Default for MctsOptions {
    fn default() -> Self {
        MctsOptions { iterations: 12, rollouts: 320, actions: 4, exploration: 0.5 }
    }
}

struct Node {
    parent: Option<usize>,
    action: Option<Config>,
    children: Vec<usize>,
    untried: Option<Vec<Config>>,
    visits: u32,
    reward: f64,
    best_score: f64,
}

struct Tree<'a> {
    space: &'a Space<'a>,
    nodes: Vec<Node>,
    price: Vec<f64>,
    options: MctsOptions,
    lower_bound: f64,
    rng: StdRng,
    cache: LatticeCache,
    best: Option<(f64, Solution)>,
}

fn score(space: &Space, s: &Solution) -> f64 {
    let emptiest = s.iter().map(|c| space.fill(c)).fold(1.0, f64::min);
    s.len() as f64 - 0.5 * (1.0 - emptiest)
}

impl Tree<'_> {
    fn path(&self, mut node: usize) -> Vec<Config> {
        let mut actions = Vec::new();
        while let Some(parent) = self.nodes[node].parent {
            actions.push(self.nodes[node].action.clone().expect("non-root nodes have actions"));
            node = parent;
        }
        actions.reverse();
        actions
    }

    fn is_done(&self, state: &Solution) -> bool {
        self.space.is_feasible(state)
    }

    fn iterate(&mut self, root: usize, prefix: &Solution) {
        let mut node = root;
        let mut state = prefix.clone();
        state.extend(self.path(root));
        loop {
            if self.is_done(&state) {
                break;
            }
            if self.nodes[node].untried.is_none() {
                let remaining = self.space.remaining(&state);
                let options: Vec<Config> = candidates(self.space, &remaining, &self.price)
                    .into_iter()
                    .take(self.options.actions)
                    .map(|c| c.config)
                    .collect();
                self.nodes[node].untried = Some(options.into_iter().rev().collect());
            }
            if let Some(action) = self.nodes[node].untried.as_mut().unwrap().pop() {
                state.push(action.clone());
                let child = self.nodes.len();
                self.nodes.push(Node {
                    parent: Some(node),
                    action: Some(action),
                    children: Vec::new(),
                    untried: None,
                    visits: 0,
                    reward: 0.0,
                    best_score: f64::INFINITY,
                });
                self.nodes[node].children.push(child);
                node = child;
                break;
            }
            if self.nodes[node].children.is_empty() {
                break;
            }
            let parent_visits = self.nodes[node].visits.max(1) as f64;
            let c = self.options.exploration;
            let pick = *self.nodes[node]
                .children
                .iter()
                .max_by(|&&a, &&b| {
                    let uct = |i: usize| {
                        let n = &self.nodes[i];
                        let v = n.visits.max(1) as f64;
                        n.reward / v + c * (parent_visits.ln() / v).sqrt()
                    };
                    uct(a).total_cmp(&uct(b)).then(b.cmp(&a))
                })
                .unwrap();
            state.push(self.nodes[pick].action.clone().unwrap());
            node = pick;
        }
        let mut noise = Noise { rng: &mut self.rng, probability: 0.1, top: 3 };
        let mut rollout = complete(self.space, state, &self.price, Some(&mut noise), &mut self.cache);
        trim(self.space, &mut rollout);
        let s = score(self.space, &rollout);
        if self.best.as_ref().is_none_or(|(b, _)| s < *b) {
            self.best = Some((s, rollout));
        }
        let reward = self.lower_bound / s.max(1e-9);
        let mut at = Some(node);
        while let Some(i) = at {
            let n = &mut self.nodes[i];
            n.visits += 1;
            n.reward += reward;
            n.best_score = n.best_score.min(s);
            at = n.parent;
        }
    }
}

/// Searches from an empty plan; returns the best plan any roll-out found, or `incumbent`
/// (by default the greedy's plan) if that is better, compacted.
pub(crate) fn solve(
    space: &Space,
    incumbent: Option<Solution>,
    lower_bound: usize,
    options: MctsOptions,
    seed: u64,
) -> Solution {
    let mut tree = Tree {
        space,
        nodes: vec![Node {
            parent: None,
            action: None,
            children: Vec::new(),
            untried: None,
            visits: 0,
            reward: 0.0,
            best_score: f64::INFINITY,
        }],
        price: prices(space, Utility::DemandShare),
        options,
        lower_bound: lower_bound.max(1) as f64,
        rng: StdRng::seed_from_u64(seed),
        cache: LatticeCache::default(),
        best: incumbent
            .filter(|s| space.is_feasible(s))
            .or_else(|| Some(greedy(space, Utility::DemandShare)))
            .map(|s| (score(space, &s), s)),
    };
    let depth = tree.best.as_ref().map_or(1, |(_, s)| s.len().max(1));
    let per_gpu = (options.rollouts / depth).clamp(3, options.iterations.max(3));
    let mut root = 0;
    let prefix: Solution = Vec::new();
    loop {
        for _ in 0..per_gpu {
            tree.iterate(root, &prefix);
        }
        let next = tree.nodes[root].children.iter().copied().min_by(|&a, &b| {
            let (x, y) = (&tree.nodes[a], &tree.nodes[b]);
            x.best_score.total_cmp(&y.best_score).then(y.visits.cmp(&x.visits)).then(a.cmp(&b))
        });
        match next {
            Some(child) => root = child,
            None => break,
        }
        let mut state = prefix.clone();
        state.extend(tree.path(root));
        if tree.is_done(&state) {
            break;
        }
    }
    let (_, mut best) = tree.best.take().expect("every iteration records a roll-out");
    compact(space, &mut best, &mut tree.cache);
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::mig::bound::lower_bound;
    use crate::scheduler::mig::catalog::GpuModel;
    use crate::scheduler::mig::plan::Problem;
    use crate::scheduler::mig::space::tests::bert_like;

    #[test]
    fn tree_search_meets_every_demand_and_matches_the_greedy_or_better() {
        let services = (0..14)
            .map(|i| bert_like(&format!("s{i}"), 100.0 * (1.0 + (i * 5 % 9) as f64).powf(1.5), 1.0 + 0.03 * i as f64))
            .collect();
        let problem = Problem { gpu: GpuModel::A100_80GB, services };
        let space = Space::new(&problem);
        let lb = lower_bound(&space).gpus;
        let found = solve(&space, None, lb, MctsOptions::default(), 1);
        space.to_plan(&found).check(&problem).unwrap();
        assert!(found.len() <= greedy(&space, Utility::DemandShare).len());
        assert!(found.len() >= lb);
    }
}
