//! A toy engine instrumented only with `tracing` macros, fed to the kvbm
//! bus by [`kvbm_ingest::tracing_layer::KvbmLayer`] and served with the
//! attach server, so the console can watch it:
//!
//! ```sh
//! cargo run -p kvbm-ingest --example traced_engine -- --serve 127.0.0.1:7071
//! kvbm-console attach http://127.0.0.1:7071
//! ```
//!
//! The engine logic below knows nothing of kvbm's types: it admits one
//! request per iteration, prefills it in one step (registering its full
//! blocks on G1 and offloading them to G2), decodes a few tokens and
//! finishes. Every step is a `tracing::info!(target: "kvbm", kind = …)`.
//!
//! With `--serve ADDR` the first line on stdout is `serving on
//! http://HOST:PORT` (the real port when ADDR ends in `:0`); after the
//! workload it keeps serving `--linger-s` seconds (default: until Ctrl-C).
//! The layer's counters go to stderr at the end.

use anyhow::{Context, Result, bail};
use clap::Parser;
use kvbm_attach::server::{FeederConfig, ServedEngine, Server, ServerConfig, spawn_feeder};
use kvbm_events::bus::BusConfig;
use kvbm_events::ring::{RingBuffer, RingConfig};
use kvbm_events::{Emitter, MonotonicClock};
use kvbm_ingest::tracing_layer::KvbmLayer;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tracing_subscriber::prelude::*;

#[derive(Debug, Parser)]
#[command(name = "traced_engine", about = "A toy engine traced into kvbm")]
struct Args {
    /// Requests to run.
    #[arg(long, default_value_t = 8)]
    requests: u32,
    /// Wall time per scheduler iteration, ms.
    #[arg(long, default_value_t = 100)]
    step_ms: u64,
    /// Serve the attach protocol here (port 0 picks a free port).
    #[arg(long)]
    serve: Option<SocketAddr>,
    /// After the workload, keep serving this many seconds (default: until
    /// Ctrl-C).
    #[arg(long, requires = "serve")]
    linger_s: Option<f64>,
}

const BLOCK_TOKENS: u32 = 16;
const BYTES_PER_BLOCK: u64 = 16 * 1024;
const DEVICE_BLOCKS: u32 = 256;

/// One request of the toy engine.
struct Request {
    id: String,
    prompt: u32,
    output: u32,
    computed: u32,
    blocks: u32,
    first_block: u32,
    transfer: u64,
    phase: Phase,
}

#[derive(PartialEq)]
enum Phase {
    Prefilled,
    Decoding,
}

/// The engine: nothing but `tracing` calls.
struct ToyEngine {
    waiting: Vec<Request>,
    running: Vec<Request>,
    next_block: u32,
    used_blocks: u32,
    iteration: u64,
}

impl ToyEngine {
    fn new(requests: u32) -> Self {
        let waiting = (0..requests)
            .rev()
            .map(|i| Request {
                id: format!("traced-{i}"),
                prompt: 64 + 16 * (i % 4),
                output: 4 + i % 3,
                computed: 0,
                blocks: 0,
                first_block: 0,
                transfer: u64::from(i) + 1,
                phase: Phase::Prefilled,
            })
            .collect();
        ToyEngine {
            waiting,
            running: Vec::new(),
            next_block: 0,
            used_blocks: 0,
            iteration: 0,
        }
    }

    fn is_done(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    fn step(&mut self) {
        self.iteration += 1;
        tracing::info!(target: "kvbm", kind = "iteration", iteration = self.iteration);
        self.advance_running();
        if let Some(r) = self.waiting.pop() {
            self.admit(r);
        }
        tracing::info!(
            target: "kvbm",
            kind = "pool_gauge",
            tier = "G1",
            capacity = DEVICE_BLOCKS,
            active = self.used_blocks,
            empty = DEVICE_BLOCKS - self.used_blocks,
        );
    }

    fn admit(&mut self, mut r: Request) {
        let id = r.id.as_str();
        tracing::info!(
            target: "kvbm",
            kind = "slot_created",
            request_id = %id,
            prompt_tokens = r.prompt,
            max_output_tokens = r.output,
        );
        r.blocks = r.prompt / BLOCK_TOKENS;
        tracing::info!(target: "kvbm", kind = "match_result", request_id = %id, tier = "G1",
            looked_up = r.blocks, hit_blocks = 0, hit_tokens = 0);
        tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id,
            state = "Prefilling");
        r.first_block = self.next_block % DEVICE_BLOCKS;
        self.next_block += r.blocks;
        self.used_blocks += r.blocks;
        tracing::info!(target: "kvbm", kind = "blocks_allocated", request_id = %id, tier = "G1",
            blocks = r.blocks, first_block = r.first_block);
        r.computed = r.prompt;
        tracing::info!(target: "kvbm", kind = "tokens_scheduled", request_id = %id,
            prefill = r.prompt, computed = r.computed);
        for b in 0..r.blocks {
            tracing::info!(target: "kvbm", kind = "block_registered", request_id = %id,
                tier = "G1", block = r.first_block + b, hash = block_hash(&r, b));
        }
        tracing::info!(target: "kvbm", kind = "transfer_planned", request_id = %id,
            transfer = r.transfer, direction = "G1->G2", blocks = r.blocks);
        tracing::info!(target: "kvbm", kind = "transfer_promoted", request_id = %id,
            transfer = r.transfer, direction = "G1->G2", blocks = r.blocks);
        tracing::info!(target: "kvbm", kind = "batch_dispatched", batch = r.transfer,
            direction = "G1->G2", transfers = %r.transfer, blocks = r.blocks);
        self.running.push(r);
    }

    fn advance_running(&mut self) {
        for r in &mut self.running {
            let id = r.id.as_str();
            if r.phase == Phase::Prefilled {
                // The offload issued at prefill lands one iteration later.
                tracing::info!(target: "kvbm", kind = "transfer_completed", request_id = %id,
                    transfer = r.transfer, direction = "G1->G2", blocks = r.blocks);
                tracing::info!(target: "kvbm", kind = "batch_completed", batch = r.transfer,
                    direction = "G1->G2", ok = true, blocks = r.blocks,
                    bytes = u64::from(r.blocks) * BYTES_PER_BLOCK, elapsed_ns = 250_000u64);
                for b in 0..r.blocks {
                    tracing::info!(target: "kvbm", kind = "block_registered", tier = "G2",
                        block = r.first_block + b, hash = block_hash(r, b));
                }
                tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id,
                    state = "Decoding");
                r.phase = Phase::Decoding;
            }
            r.computed += 1;
            tracing::info!(target: "kvbm", kind = "tokens_scheduled", request_id = %id,
                decode = 1, computed = r.computed);
        }
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            if r.computed < r.prompt + r.output {
                i += 1;
                continue;
            }
            let r = self.running.swap_remove(i);
            let id = r.id.as_str();
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id,
                state = "Finishing");
            tracing::info!(target: "kvbm", kind = "blocks_released", request_id = %id,
                tier = "G1", count = r.blocks);
            self.used_blocks -= r.blocks;
            tracing::info!(target: "kvbm", kind = "slot_transition", request_id = %id,
                state = "Finished");
        }
    }
}

/// A distinct sequence hash per (request, block).
fn block_hash(r: &Request, b: u32) -> u64 {
    (r.transfer << 32) | u64::from(b)
}

fn main() -> Result<()> {
    let a = Args::parse();
    if a.requests == 0 {
        bail!("--requests must be at least 1");
    }
    if let Some(l) = a.linger_s
        && !(l.is_finite() && l >= 0.0)
    {
        bail!("--linger-s must be a non-negative number");
    }
    let emitter = Arc::new(Emitter::new(
        0,
        BusConfig::default(),
        Arc::new(MonotonicClock::new()),
    )?);
    let layer = KvbmLayer::new(emitter.clone());
    let stats = layer.handle();
    tracing_subscriber::registry()
        .with(layer)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
                ),
        )
        .init();

    let run_engine = move || {
        let mut engine = ToyEngine::new(a.requests);
        while !engine.is_done() {
            engine.step();
            std::thread::sleep(Duration::from_millis(a.step_ms));
        }
    };
    match a.serve {
        None => run_engine(),
        Some(addr) => serve(addr, a.linger_s, &emitter, run_engine)?,
    }
    let s = stats.stats();
    let bus = emitter.bus().counters();
    eprintln!(
        "traced_engine: {} tracing events, {} kvbm events emitted, {} refused \
         (kind {}+{}, fields {}+{}), tap dropped {}",
        s.seen,
        s.emitted,
        s.missing_kind + s.unknown_kind + s.missing_field + s.bad_value,
        s.missing_kind,
        s.unknown_kind,
        s.missing_field,
        s.bad_value,
        bus.tap_dropped,
    );
    Ok(())
}

/// Runs `engine` on its own thread with an attach server up, then lingers.
fn serve(
    addr: SocketAddr,
    linger_s: Option<f64>,
    emitter: &Arc<Emitter>,
    engine: impl FnOnce() + Send + 'static,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kvbm-server")
        .enable_all()
        .build()?;
    let ring = Arc::new(RingBuffer::new(RingConfig::with_capacity(1 << 16)).context("ring")?);
    let tap = emitter
        .bus()
        .take_tap()
        .context("the emitter's tap was already taken")?;
    let bus = emitter.clone();
    let server_engine = ServedEngine::new(ring.clone(), emitter.engine())
        .with_bus_counters(move || bus.bus().counters());
    let feeder = spawn_feeder(tap, ring, server_engine.signal(), FeederConfig::default())
        .context("starting the feeder")?;
    let cfg = ServerConfig {
        addr,
        ..ServerConfig::default()
    };
    let server = rt.block_on(Server::bind(cfg, server_engine))?;
    println!("serving on http://{}", server.local_addr());
    std::io::stdout().flush()?;
    let handle = {
        let _g = rt.enter();
        server.spawn()
    };
    let engine_thread = std::thread::Builder::new()
        .name("traced-engine".into())
        .spawn(engine)?;
    rt.block_on(async {
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let finished = async {
            while !engine_thread.is_finished() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        tokio::select! {
            _ = &mut ctrl_c => {}
            _ = finished => match linger_s {
                Some(s) => tokio::select! {
                    _ = &mut ctrl_c => {}
                    _ = tokio::time::sleep(Duration::from_secs_f64(s)) => {}
                },
                None => {
                    eprintln!("workload finished; serving until Ctrl-C");
                    let _ = (&mut ctrl_c).await;
                }
            },
        }
    });
    let served = rt.block_on(handle.shutdown());
    feeder.stop();
    served?;
    Ok(())
}
