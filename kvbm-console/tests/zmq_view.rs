//! The console on vLLM's KV-event ZMQ stream: what the ZMQ source forwards
//! reaches the views, the Slots view says the source has none, and the
//! header shows the subscription's state.

use kvbm_console::app::{App, Source};
use kvbm_console::model::{Model, ModelConfig};
use kvbm_console::remote::{ZmqRemote, forward_zmq};
use kvbm_console::source::LiveSource;
use kvbm_events::ring::RingBuffer;
use kvbm_events::tier::Tier;
use kvbm_ingest::vllm::{
    KvBatch, KvEvent, Medium, NO_SLOTS_REASON, Skipped, Translator, TranslatorConfig, ZmqConfig,
    ZmqEndpoint, ZmqItem,
};
use ratatui::Terminal;
use ratatui::backend::TestBackend;
use std::sync::Arc;

#[test]
fn zmq_items_reach_the_views_and_slots_say_there_are_none() {
    let ring = Arc::new(RingBuffer::with_capacity(1000).unwrap());
    let mut tr = Translator::new(TranslatorConfig::default());
    let mut evs = Vec::new();
    tr.batch(
        &KvBatch {
            ts: 1.0,
            events: vec![KvEvent::Stored {
                block_hashes: vec![1, 2, 3],
                parent: None,
                num_tokens: 48,
                block_size: Some(16),
                medium: Medium::Gpu,
                group: None,
            }],
            skipped: Skipped::default(),
            dp_rank: None,
        },
        &mut evs,
    );
    forward_zmq(&ring, ZmqItem::Events(evs));
    forward_zmq(
        &ring,
        ZmqItem::Gap {
            from_seq: 4,
            to_seq: 6,
        },
    );
    assert_eq!(ring.counters().lost, 3);
    let source = LiveSource::new(ring.clone(), None).without_slots(NO_SLOTS_REASON);
    let mut app = App::new(
        Model::new(ModelConfig::default()),
        Source::Live(source),
        "zmq://127.0.0.1:5557",
    );
    app.pull(std::time::Instant::now());
    app.tick();
    assert_eq!(app.model.state().pool(Tier::Device).active, 3);
    assert_eq!(app.model.state().pool(Tier::Device).registered.len(), 3);
    app.resize(160, 30);
    let mut t = Terminal::new(TestBackend::new(160, 30)).unwrap();
    t.draw(|f| app.render(f)).unwrap();
    let buf = t.backend().buffer();
    let text: String = (0..30)
        .map(|y| (0..160).map(|x| buf[(x, y)].symbol()).collect::<String>() + "\n")
        .collect();
    assert!(text.contains("this source has no slots"), "{text}");
    assert!(!text.contains("no requests yet"), "{text}");
    assert!(text.contains("LIVE"), "{text}");
}

#[test]
fn the_header_shows_the_zmq_subscription_state() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // Nothing listens on port 9 of loopback: the subscription keeps
    // trying to connect (ZeroMQ retries), so the state stays put.
    let endpoint = ZmqEndpoint::parse("zmq://127.0.0.1:9").unwrap();
    let remote = ZmqRemote::start(ZmqConfig::new(endpoint), 1000, rt.handle()).unwrap();
    let mut app = App::new(
        Model::new(ModelConfig::default()),
        Source::Live(remote.source()),
        remote.handle().url(),
    );
    app.resize(160, 30);
    let mut t = Terminal::new(TestBackend::new(160, 30)).unwrap();
    t.draw(|f| app.render(f)).unwrap();
    let top: String = (0..160)
        .map(|x| t.backend().buffer()[(x, 0)].symbol().to_string())
        .collect();
    assert!(top.contains("ZMQ CONNECTING"), "{top}");
    assert!(!top.contains("LIVE"), "{top}");
    drop(remote);
}

/// The badge says when the publisher is gone and what went wrong so far;
/// the notices turn each new trouble into a bottom-line message.
#[test]
fn the_zmq_badge_and_notices_say_what_happened() {
    use kvbm_console::remote::{ZmqNotices, zmq_badge};
    use kvbm_console::source::Tone;
    use kvbm_ingest::vllm::{RestartAt, RestartCause, ZmqCounters, ZmqState};
    use std::time::Duration;
    let mut c = ZmqCounters::default();
    let b = zmq_badge(ZmqState::Subscribed, None, &c);
    assert_eq!((b.text.as_str(), b.tone), ("ZMQ SUBSCRIBED", Tone::Ok));
    let b = zmq_badge(ZmqState::Gone, Some(Duration::from_millis(4_200)), &c);
    assert_eq!(
        (b.text.as_str(), b.tone),
        ("ZMQ PUBLISHER GONE 4s, reconnecting", Tone::Down)
    );
    let mut n = ZmqNotices::default();
    assert_eq!(n.next(&c, false), None);
    c.first_seq = Some(879);
    c.missed_before_start = 879;
    let (text, error) = n.next(&c, false).unwrap();
    assert!(
        error && text.contains("batch 879") && text.contains("--replay-endpoint"),
        "{text}"
    );
    c.restarts = 1;
    c.restart_log.push(RestartAt {
        last_seq: 1499,
        new_seq: 122,
        cause: RestartCause::SeqWentBack,
    });
    c.replay_failures = 2;
    c.last_replay_error = Some("no answer".into());
    c.skipped.unknown_medium = 3;
    let (text, _) = n.next(&c, true).unwrap();
    assert!(text.contains("batch 1499 then 122"), "{text}");
    assert_eq!(n.next(&c, true), None, "said once");
    let b = zmq_badge(ZmqState::Subscribed, None, &c);
    assert_eq!(
        (b.text.as_str(), b.tone),
        (
            "ZMQ SUBSCRIBED · restarts 1 · replay failed 2 · skipped 3",
            Tone::Caution
        )
    );
}
