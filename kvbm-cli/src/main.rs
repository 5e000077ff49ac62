//! `kvbm-recorder`: record, inspect, replay, check, summarise, export and
//! compare kvbm event logs.

use kvbm_cli::cli;

use clap::Parser;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    quiet_on_closed_stdout();
    // A fleet recording keeps a file open per engine.
    kvbm_recorder::fleet::raise_open_files_limit();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => std::process::exit(code),
        // The reader of our output went away (`| head`): done, as Unix
        // tools are.
        Err(e) if is_broken_pipe(&e) => std::process::exit(0),
        Err(e) => {
            eprintln!("error: {}", cli::said(&e));
            std::process::exit(2);
        }
    }
}

/// Whether `e` comes from writing to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            || c.downcast_ref::<kvbm_recorder::analysis::export::ExportError>()
                .is_some_and(|x| x.is_broken_pipe())
    })
}

/// `println!` panics when stdout is a closed pipe (Rust ignores SIGPIPE);
/// for the commands that print that way, end quietly with status 0
/// instead, as `| head` expects.
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default(info);
    }));
}
