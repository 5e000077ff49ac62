//! End to end on loopback: the `traced_engine` example (an engine that only
//! calls `tracing` macros, fed to the bus by `KvbmLayer`) serves the attach
//! protocol; a [`kvbm_attach::client::Client`] attaches, and what it
//! receives folds into the state the toy engine went through: every request
//! finished, its blocks registered on G1 and G2, one completed G1→G2
//! transfer per request, no gaps and no inconsistencies.
//!
//! The example is built with the same cargo and profile (a no-op when it is
//! fresh), or taken from `KVBM_BIN_TRACED_ENGINE`.

use kvbm_attach::client::{Client, ClientConfig, ClientEvent};
use kvbm_events::reducer::{EngineState, fold};
use kvbm_events::slot::SlotState;
use kvbm_events::tier::Tier;
use kvbm_events::{Direction, Event};
use kvbm_testkit::served::Served;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

const REQUESTS: u32 = 6;

fn example_bin() -> PathBuf {
    kvbm_testkit::bin::workspace_example("kvbm-ingest", "traced_engine")
}

fn serve() -> (Served, String) {
    let mut cmd = Command::new(example_bin());
    cmd.args([
        "--serve",
        "127.0.0.1:0",
        "--step-ms",
        "5",
        "--linger-s",
        "60",
    ])
    .args(["--requests", &REQUESTS.to_string()]);
    kvbm_testkit::served::serve(cmd)
}

fn finished(state: &EngineState) -> usize {
    state
        .slots()
        .filter(|s| s.state == SlotState::Finished)
        .count()
}

#[test]
fn a_traced_engine_shows_up_over_attach() {
    let (_proc, url) = serve();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut client = Client::spawn(ClientConfig::new(&url).unwrap(), rt.handle()).unwrap();
    let mut events: Vec<Event> = Vec::new();
    let mut gaps = 0u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    let state = rt.block_on(async {
        loop {
            let state = fold(&events);
            if finished(&state) == REQUESTS as usize
                && state
                    .direction(Direction::DEVICE_TO_HOST)
                    .map(|d| d.completed)
                    == Some(u64::from(REQUESTS))
            {
                return state;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "timed out: {}", state.summary());
            match tokio::time::timeout(left, client.recv()).await {
                Ok(Some(ClientEvent::Events(batch))) => events.extend(batch),
                Ok(Some(ClientEvent::Gap(g))) => gaps += g.len(),
                Ok(Some(ClientEvent::Failed(e))) => panic!("client failed: {e}"),
                Ok(Some(_)) => {}
                Ok(None) => panic!("client ended"),
                Err(_) => panic!("timed out: {}", state.summary()),
            }
        }
    });
    assert_eq!(gaps, 0);
    assert_eq!(state.seq_gaps(), 0);
    assert_eq!(
        state.inconsistencies(),
        &Default::default(),
        "{}",
        state.summary()
    );
    // Every slot went Initialized → Prefilling → Decoding → Finishing →
    // Finished, with `from` filled in by the layer.
    assert_eq!(state.slot_count(), REQUESTS as usize);
    assert_eq!(state.count_of("SlotCreated"), u64::from(REQUESTS));
    assert_eq!(state.count_of("SlotTransition"), 4 * u64::from(REQUESTS));
    let slot = state.slot("traced-0").expect("traced-0");
    assert_eq!(slot.prompt_tokens, 64);
    // Blocks: prompt 64 + 16·(i mod 4) tokens in 16-token blocks.
    let blocks: u64 = (0..REQUESTS).map(|i| 4 + u64::from(i % 4)).sum();
    assert_eq!(state.registered(Tier::Device).len() as u64, blocks);
    assert_eq!(state.registered(Tier::Host).len() as u64, blocks);
    assert_eq!(state.pool(Tier::Device).allocated_blocks, blocks);
    assert_eq!(state.pool(Tier::Device).released_blocks, blocks);
    let d2h = state.direction(Direction::DEVICE_TO_HOST).unwrap();
    assert_eq!(d2h.completed_blocks, blocks);
    assert_eq!(d2h.bytes, blocks * 16 * 1024);
    assert_eq!(state.in_flight_count(), 0);
    assert_eq!(state.count_of("PoolGauge"), state.iteration());
    assert!(state.iteration() >= u64::from(REQUESTS));
}
