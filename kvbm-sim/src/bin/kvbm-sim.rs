//! `kvbm-sim`: runs the simulated engine on a workload and reports.
//!
//! ```sh
//! kvbm-sim --trace ../shared/data/mooncake/synthetic_trace.jsonl --block-size 512 --json
//! kvbm-sim --requests 200 --rate 20 --prompt-len 2048 --shared-prefix-ratio 0.5
//! # serve the attach protocol while it runs (and after, until Ctrl-C):
//! kvbm-sim --requests 5000 --rate 6 --real-time 1 --serve 127.0.0.1:7070
//! ```
//!
//! With `--serve ADDR` the engine runs with breakpoints installed and an
//! attach server (see `kvbm_attach::server`) on ADDR; the first line on
//! stdout is `serving on http://HOST:PORT` (the real port when ADDR ends in
//! `:0`). Anything but 127.0.0.1 and ::1 needs `--token` (or `KVBM_TOKEN`).

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvbm_attach::server::{FeederConfig, ServedEngine, Server, ServerConfig, spawn_feeder};
use kvbm_core::hooks::{Breakpoints, HookSet};
use kvbm_events::ring::{RingBuffer, RingConfig};
use kvbm_sim::args::SimArgs;
use kvbm_sim::sim::{SimReport, Simulator};
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "kvbm-sim",
    version,
    about = "Simulated LLM engine driving the kvbm block manager"
)]
struct Args {
    #[command(flatten)]
    sim: SimArgs,
    /// Print one JSON object instead of a readable summary.
    #[arg(long)]
    json: bool,
    /// Serve the attach protocol on this address while the engine runs
    /// (port 0 picks a free port), with breakpoints installed.
    #[arg(long)]
    serve: Option<SocketAddr>,
    /// Bearer token for the server (needed off loopback; then required on
    /// every request). Defaults to the KVBM_TOKEN environment variable.
    #[arg(long, requires = "serve")]
    token: Option<String>,
    /// With a token: let read-only requests through without it.
    #[arg(long, requires = "serve")]
    open_read: bool,
    /// Most WebSocket clients at once.
    #[arg(long, default_value_t = 64, requires = "serve")]
    max_clients: usize,
    /// Most TCP connections at once, HTTP and WebSocket together (at least
    /// --max-clients); one more is answered 503 and closed.
    #[arg(long, default_value_t = 256, requires = "serve")]
    max_connections: usize,
    /// Most TCP connections from one client address (taken as at most
    /// --max-connections); one more place is kept for 127.0.0.1 / ::1.
    #[arg(long, default_value_t = 64, requires = "serve")]
    max_connections_per_ip: usize,
    /// Keep a client's breakpoints (and its paused calls paused) when it
    /// disconnects.
    #[arg(long, requires = "serve")]
    keep_breakpoints_on_disconnect: bool,
    /// After the workload ends, keep serving this many seconds, then exit
    /// (default: until Ctrl-C).
    #[arg(long, requires = "serve")]
    linger_s: Option<f64>,
    /// Events the server's ring keeps.
    #[arg(long, default_value_t = 1 << 20, requires = "serve")]
    ring: usize,
    /// Seconds a paused call waits before it resumes by itself.
    #[arg(long, default_value_t = 60, requires = "serve")]
    bp_deadline_s: u64,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let loaded = a.sim.load()?;
    if let Some(path) = &a.sim.trace {
        for s in loaded.skipped.iter().take(5) {
            eprintln!(
                "warning: {}: line {} skipped: {}",
                path.display(),
                s.line,
                s.error
            );
        }
        if loaded.skipped.len() > 5 {
            eprintln!("warning: {} more lines skipped", loaded.skipped.len() - 5);
        }
    }
    let (cfg, workload) = (loaded.config, loaded.workload);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let sim = Simulator::new(cfg, workload, rt.handle())?;
    let report = match a.serve {
        Some(addr) => serve(&a, addr, sim)?,
        None => sim.run(),
    };
    print_report(&report, a.json)?;
    Ok(())
}

fn print_report(report: &SimReport, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        print_summary(report);
    }
    std::io::stdout().flush()?;
    Ok(())
}

/// Runs the engine with breakpoints and an attach server; returns the
/// report once the engine finished and the server stopped (Ctrl-C, or
/// `--linger-s` after the workload).
fn serve(a: &Args, addr: SocketAddr, mut sim: Simulator) -> Result<SimReport> {
    if let Some(l) = a.linger_s
        && !(l.is_finite() && l >= 0.0)
    {
        bail!("--linger-s must be a non-negative number");
    }
    let token = a
        .token
        .clone()
        .or_else(|| std::env::var("KVBM_TOKEN").ok().filter(|t| !t.is_empty()));
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvbm-server")
        .enable_all()
        .build()?;
    let emitter = sim.emitter().clone();
    let bps = Arc::new(Breakpoints::new(
        Some(emitter.clone()),
        Duration::from_secs(a.bp_deadline_s.max(1)),
    ));
    sim.leader_mut().set_hooks(
        HookSet::none()
            .with_emitter(emitter.clone())
            .with_breakpoints(bps.clone()),
    );
    let ring = Arc::new(RingBuffer::new(RingConfig::with_capacity(a.ring)).context("--ring")?);
    let tap = emitter
        .bus()
        .take_tap()
        .context("the engine's tap was already taken")?;
    let bus = emitter.clone();
    let engine = ServedEngine::new(ring.clone(), emitter.engine())
        .with_run(emitter.run())
        .with_control(bps.clone())
        .with_bus_counters(move || bus.bus().counters());
    let feeder = spawn_feeder(tap, ring, engine.signal(), FeederConfig::default())
        .context("starting the feeder")?;
    let cfg = ServerConfig {
        addr,
        token,
        open_read: a.open_read,
        max_clients: a.max_clients,
        max_connections: a.max_connections,
        max_connections_per_ip: a.max_connections_per_ip,
        release_on_disconnect: !a.keep_breakpoints_on_disconnect,
        ..ServerConfig::default()
    };
    let server = server_rt.block_on(Server::bind(cfg, engine))?;
    println!("serving on http://{}", server.local_addr());
    std::io::stdout().flush()?;
    let handle = {
        let _g = server_rt.enter();
        server.spawn()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let engine_thread = std::thread::Builder::new()
        .name("kvbm-sim-engine".into())
        .spawn(move || {
            while !stop2.load(Ordering::Relaxed) && sim.step() {}
            sim.finish()
        })?;
    let interrupted = server_rt.block_on(async {
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let finished = async {
            while !engine_thread.is_finished() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            _ = &mut ctrl_c => true,
            _ = finished => {
                match a.linger_s {
                    Some(s) => tokio::select! {
                        _ = &mut ctrl_c => {}
                        _ = tokio::time::sleep(Duration::from_secs_f64(s)) => {}
                    },
                    None => {
                        eprintln!("workload finished; serving until Ctrl-C");
                        let _ = (&mut ctrl_c).await;
                    }
                }
                false
            }
        }
    });
    if interrupted {
        stop.store(true, Ordering::Relaxed);
    }
    // No client can set a breakpoint once the server is down; then nothing
    // may stay paused.
    let served = server_rt.block_on(handle.shutdown());
    bps.clear_all();
    bps.resume_all();
    let report = engine_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    feeder.stop();
    served?;
    Ok(report)
}

fn print_summary(r: &SimReport) {
    println!("requests finished   {}", r.requests_finished);
    println!(
        "prompt tokens       {}  (prefix hits {} = {:.1}%)",
        r.prompt_tokens,
        r.prefix_hit_tokens,
        100.0 * r.prefix_hit_ratio
    );
    for (tier, t) in &r.prefix_hit_tokens_by_tier {
        println!("  hits on {tier:<7}   {t}");
    }
    println!("preemptions         {}", r.preemptions);
    for (d, s) in &r.transfers_by_direction {
        println!(
            "transfers {d}      {} completed, {} skipped, {} blocks, {} bytes",
            s.completed, s.skipped, s.blocks, s.bytes
        );
    }
    println!(
        "TTFT ms             p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1}",
        r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99, r.ttft_ms.max
    );
    println!(
        "events              {} emitted, {} lost",
        r.events_emitted, r.events_lost
    );
    println!(
        "iterations          {} ({:.0} ms virtual, {:.0} ms wall)",
        r.iterations, r.virtual_time_ms, r.wall_time_ms
    );
}
