//! `kvbm-console`: the terminal console for kvbm.
//!
//! Today it has one subcommand, `demo`, which runs the block manager through
//! a built-in scenario and prints what happened (see [`demo`]). The live
//! console, `replay` and `attach` come with later work.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod demo;

#[derive(Debug, Parser)]
#[command(
    name = "kvbm-console",
    version,
    about = "Console for the kvbm KV-cache block manager"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the block manager on a built-in scenario and print what happened.
    Demo(demo::DemoArgs),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    match cli.command {
        Command::Demo(args) => rt.block_on(demo::run(&args, std::io::stdout().lock())),
    }
}
