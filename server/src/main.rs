use std::path::PathBuf;

use clap::{Parser, Subcommand};
use tessera_server::app;
use tessera_server::config::Config;
use tessera_server::state::AppState;

/// Tessera control plane: REST API, dashboard, model registry and job scheduler.
#[derive(Debug, Parser)]
#[command(name = "tessera-server", version)]
struct Cli {
    #[command(flatten)]
    config: Config,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the API and dashboard (the default).
    Serve,
    /// Register a model folder from this machine's disk, owned by an admin.
    ImportModel {
        /// Name to register the model under.
        #[arg(long)]
        name: String,
        /// The admin who will own it.
        #[arg(long, default_value = "admin")]
        owner: String,
        /// Folder with config.json, model.safetensors, tokenizer.json, …
        dir: PathBuf,
    },
    /// MIG partition planning from a JSON file; needs no server or database.
    Mig {
        #[command(subcommand)]
        command: tessera_server::scheduler::mig::cli::MigCommand,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn,tower_http=warn".into()),
        )
        .init();
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => Ok(app::serve(cli.config).await?),
        Command::ImportModel { name, owner, dir } => {
            let max_bytes = cli.config.max_upload_bytes;
            let state = AppState::open(cli.config).await?;
            let outcome = tessera_server::registry::import_dir(&state, &owner, &name, &dir, max_bytes).await?;
            println!("{outcome}");
            Ok(())
        }
        Command::Mig { command } => std::process::exit(tessera_server::scheduler::mig::cli::run(command)),
    }
}
