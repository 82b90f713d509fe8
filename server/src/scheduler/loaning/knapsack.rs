//! The multiple-choice knapsack Aryl solves to hand spare slices to elastic jobs (Li et al.,
//! arXiv 2202.07896, the elastic-scaling allocation; research note §3): every job is a
//! class, every number of extra ranks an item whose weight is the slices it takes and whose
//! value is the job's expected JCT reduction; exactly one item per class, total weight
//! within the spare slices, total value as large as possible.
//!
//! Solved exactly by dynamic programming over capacity, O(classes × capacity × items), as
//! the paper does; the valuation lives in `elastic`.

/// One option of a class.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Item {
    pub weight: u32,
    pub value: f64,
}

/// The chosen item of each class and the total value.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub chosen: Vec<usize>,
    pub value: f64,
    pub weight: u32,
}

/// Picks exactly one item per class with total weight at most `capacity`, maximising the
/// total value. `None` when no such pick exists (a class with no item, or every pick too
/// heavy). Ties go to the lighter pick, then to earlier items.
pub fn solve(classes: &[Vec<Item>], capacity: u32) -> Option<Selection> {
    let cap = capacity as usize;
    // best[c]: the best value of the classes so far within weight c (NEG = impossible).
    const NEG: f64 = f64::NEG_INFINITY;
    let mut best = vec![0.0f64; cap + 1];
    let mut next = vec![NEG; cap + 1];
    // choice[i][c]: the item class i takes in the best pick within weight c.
    let mut choice: Vec<Vec<u32>> = Vec::with_capacity(classes.len());
    for items in classes {
        let mut row = vec![u32::MAX; cap + 1];
        next.iter_mut().for_each(|v| *v = NEG);
        for (k, item) in items.iter().enumerate() {
            let w = item.weight as usize;
            if w > cap || !item.value.is_finite() {
                continue;
            }
            for c in w..=cap {
                let before = best[c - w];
                if before == NEG {
                    continue;
                }
                let v = before + item.value;
                if v > next[c] || (v == next[c] && items[row[c] as usize].weight > item.weight) {
                    next[c] = v;
                    row[c] = k as u32;
                }
            }
        }
        std::mem::swap(&mut best, &mut next);
        choice.push(row);
    }
    if best[cap] == NEG {
        return None;
    }
    let mut chosen = vec![0usize; classes.len()];
    let mut c = cap;
    for i in (0..classes.len()).rev() {
        let k = choice[i][c] as usize;
        chosen[i] = k;
        c -= classes[i][k].weight as usize;
    }
    let weight = chosen.iter().zip(classes).map(|(&k, items)| items[k].weight).sum();
    let value = chosen.iter().zip(classes).map(|(&k, items)| items[k].value).sum();
    Some(Selection { chosen, value, weight })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn brute(classes: &[Vec<Item>], capacity: u32) -> Option<f64> {
        fn go(classes: &[Vec<Item>], i: usize, left: i64, acc: f64, best: &mut Option<f64>) {
            if i == classes.len() {
                if best.is_none_or(|b| acc > b) {
                    *best = Some(acc);
                }
                return;
            }
            for item in &classes[i] {
                if item.weight as i64 <= left {
                    go(classes, i + 1, left - item.weight as i64, acc + item.value, best);
                }
            }
        }
        let mut best = None;
        go(classes, 0, capacity as i64, 0.0, &mut best);
        best
    }

    #[test]
    fn picks_the_better_split_of_spare_slices() {
        // Two jobs, three spare slices: job A gains 10 from one rank and 12 from three,
        // job B gains 9 from two ranks. Best: A one rank, B two ranks = 19.
        let a = vec![Item { weight: 0, value: 0.0 }, Item { weight: 1, value: 10.0 }, Item { weight: 3, value: 12.0 }];
        let b = vec![Item { weight: 0, value: 0.0 }, Item { weight: 2, value: 9.0 }];
        let s = solve(&[a, b], 3).unwrap();
        assert_eq!(s.chosen, vec![1, 1]);
        assert_eq!(s.value, 19.0);
        assert_eq!(s.weight, 3);
    }

    #[test]
    fn infeasible_when_a_class_cannot_fit() {
        assert!(solve(&[vec![Item { weight: 5, value: 1.0 }]], 4).is_none());
        assert!(solve(&[vec![]], 4).is_none());
        assert_eq!(solve(&[], 0).unwrap().chosen, Vec::<usize>::new());
    }

    #[test]
    fn optimal_against_brute_force_and_never_over_capacity() {
        let mut rng = StdRng::seed_from_u64(2202);
        for case in 0..2000 {
            let n = rng.gen_range(0..6);
            let classes: Vec<Vec<Item>> = (0..n)
                .map(|_| {
                    (0..rng.gen_range(1..5))
                        .map(|_| Item { weight: rng.gen_range(0..6), value: rng.gen_range(-5.0..20.0) })
                        .collect()
                })
                .collect();
            let capacity = rng.gen_range(0..15);
            let got = solve(&classes, capacity);
            let want = brute(&classes, capacity);
            match (got, want) {
                (None, None) => {}
                (Some(s), Some(v)) => {
                    assert!((s.value - v).abs() < 1e-9, "case {case}: {} vs {v}", s.value);
                    assert!(s.weight <= capacity, "case {case}: over capacity");
                    let w: u32 = s.chosen.iter().zip(&classes).map(|(&k, c)| c[k].weight).sum();
                    assert_eq!(w, s.weight);
                }
                (g, w) => panic!("case {case}: solver {g:?}, brute force {w:?}"),
            }
        }
    }
}
