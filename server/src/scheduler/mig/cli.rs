//! `tessera-server mig …`: the planner from the command line, no server or database
//! needed. Prints the plan as JSON on stdout; a bad request gets one sentence on stderr
//! and exit status 2.

use std::path::PathBuf;

use clap::{Subcommand, ValueEnum};

use super::input::{parse_request, respond};
use super::planner::Algorithm;

#[derive(Debug, Subcommand)]
pub enum MigCommand {
    /// Plan MIG partitions and replica placement for a set of services.
    Plan {
        /// Request file: {"gpu","services":[{"name","throughput","latency_ms"}],"profiles":{…}}.
        #[arg(long)]
        input: PathBuf,
        /// Which planner to run.
        #[arg(long, value_enum, default_value_t = AlgorithmArg::Best)]
        algorithm: AlgorithmArg,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum AlgorithmArg {
    Greedy,
    Genetic,
    Mcts,
    Exact,
    Best,
}

impl From<AlgorithmArg> for Algorithm {
    fn from(a: AlgorithmArg) -> Algorithm {
        match a {
            AlgorithmArg::Greedy => Algorithm::Greedy,
            AlgorithmArg::Genetic => Algorithm::Genetic,
            AlgorithmArg::Mcts => Algorithm::Mcts,
            AlgorithmArg::Exact => Algorithm::Exact,
            AlgorithmArg::Best => Algorithm::Best,
        }
    }
}

/// Runs the command and returns the process exit status.
pub fn run(command: MigCommand) -> i32 {
    match command {
        MigCommand::Plan { input, algorithm } => {
            let text = match std::fs::read_to_string(&input) {
                Ok(text) => text,
                Err(e) => {
                    eprintln!("error: cannot read {}: {e}", input.display());
                    return 2;
                }
            };
            let response = parse_request(&text).and_then(|request| respond(&request, algorithm.into()));
            match response {
                Ok(response) => {
                    println!("{}", serde_json::to_string_pretty(&response).expect("plans serialise"));
                    0
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    2
                }
            }
        }
    }
}
