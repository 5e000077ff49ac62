//! The connector's `publish`: its counters say what it emitted and what
//! its NATS publisher had acknowledged by JetStream — live while it runs,
//! final after shutdown (when the publisher has drained) — so a run can be
//! compared with the fleet recording, and a loss is seen. Against a real
//! `nats-server` (`scripts/setup-nats.sh`); the real-vLLM version is
//! `kvbm-py/tests/vllm/fleet_publish.py`.

use kvbm_py::config::Config;
use kvbm_py::scheduler::{Parallel, Scheduled, SchedulerSide, StepInput};
use kvbm_py::tiers::Geometry;
use kvbm_testkit::nats::NatsServer;
use serde_json::json;

const BLOCKS: usize = 16;

fn geometry() -> Geometry {
    Geometry {
        num_gpu_blocks: BLOCKS,
        block_size: 4,
        num_layers: 2,
        page_bytes: 64,
    }
}

fn start(extra: serde_json::Value, dir: &tempfile::TempDir) -> SchedulerSide {
    let mut extra = extra;
    extra["shm_dir"] = json!(dir.path().to_str().unwrap());
    extra["host_capacity_tokens"] = json!(64);
    SchedulerSide::start(
        Config::from_json(&extra).unwrap(),
        geometry(),
        "engine-1",
        Parallel::default(),
    )
    .unwrap()
}

/// A request looked up, allocated, scheduled and finished.
fn one_request(s: &mut SchedulerSide) {
    let p: Vec<u32> = (100..109).collect();
    assert_eq!(s.get_num_new_matched_tokens("A", &p, 0).unwrap(), Some(0));
    s.update_state_after_alloc("A", &[1, 2, 3], 0).unwrap();
    s.build_meta(StepInput {
        scheduled: vec![Scheduled {
            request: "A".into(),
            new_tokens: Vec::new(),
            prompt_len: p.len(),
            computed_before: 0,
            scheduled: p.len(),
            block_ids: Some(vec![1, 2, 3]),
        }],
        preempted: Vec::new(),
        g1_free: Some(BLOCKS - 3),
        refused: Vec::new(),
    })
    .unwrap();
    s.request_finished("A", &[1, 2, 3]).unwrap();
}

#[test]
fn publishing_counts_every_event_emitted_as_sent() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut s = start(json!({"publish": nats.url(), "engine_id": "pod-t"}), &dir);
    assert!(
        s.publisher_counters().is_some(),
        "publishing: the counters are there from the start"
    );
    one_request(&mut s);
    assert!(s.events_emitted() > 0);
    // A request on the engine's control subject that is not one: answered
    // with an error, and counted.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let reply = rt.block_on(async {
        let client = kvbm_attach::nats::connect(&nats.url(), "test")
            .await
            .unwrap();
        // The responder subscribes in the background: until it has, the
        // server says there are no responders.
        for _ in 0..100 {
            let subject = kvbm_attach::nats::control_subject("pod-t");
            match client.request(subject, "not json".into()).await {
                Ok(reply) => return reply,
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
        panic!("no reply on the engine's control subject in 2 s")
    });
    let reply = String::from_utf8_lossy(&reply.payload).into_owned();
    assert!(reply.contains("malformed request"), "{reply}");
    s.shutdown().unwrap();
    let c = s
        .publisher_counters()
        .expect("the publisher's final counters after shutdown");
    assert_eq!(c.events_in, s.events_emitted(), "{c:?}");
    assert_eq!(c.events_sent, s.events_emitted(), "{c:?}");
    assert_eq!(c.lost(), 0, "{c:?}");
    assert_eq!(c.publish_errors, 0, "{c:?}");
    // Control was served beside it, and its counters outlive it too.
    let control = s
        .control_counters()
        .expect("control's final counters after shutdown");
    assert_eq!(
        (control.requests, control.malformed, control.sessions),
        (1, 1, 0),
        "{control:?}"
    );
}

#[test]
fn without_publish_there_are_no_publisher_counters() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = start(json!({}), &dir);
    one_request(&mut s);
    assert!(s.events_emitted() > 0);
    s.shutdown().unwrap();
    assert!(s.publisher_counters().is_none());
    assert!(s.control_counters().is_none());
}
