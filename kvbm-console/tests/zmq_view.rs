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
