//! Creating the fleet's stream on a real `nats-server`: the default limits
//! are accepted, and limits the server cannot reserve fail with an error
//! that says what to do (the failure a CI machine with little free disk
//! met in the fleet benchmark).

use kvbm_attach::nats::{STREAM, StreamLimits, async_nats, connect, ensure_stream};
use kvbm_testkit::nats::NatsServer;

#[test]
fn a_stream_the_server_cannot_hold_is_refused_with_a_way_out() {
    let nats = NatsServer::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = connect(&nats.url(), "nats-stream-test").await.unwrap();
        let js = async_nats::jetstream::new(client);
        // A petabyte: more than any machine running this test has free.
        let huge = StreamLimits {
            max_bytes: 1 << 50,
            ..StreamLimits::default()
        };
        let err = ensure_stream(&js, &huge).await.unwrap_err().to_string();
        assert!(err.contains("insufficient storage"), "{err}");
        assert!(
            err.contains(&format!("create the stream {STREAM} beforehand")),
            "{err}"
        );
        assert!(err.contains(&(1u64 << 50).to_string()), "{err}");
        // Nothing was left half-made: the defaults then create it.
        let stream = ensure_stream(&js, &StreamLimits::default()).await.unwrap();
        assert_eq!(stream.cached_info().config.name, STREAM);
    });
}

/// The two mistakes an operator makes first, each answered with what to
/// do: no server at the address, and a server started without JetStream
/// (the real `nats-server`, without `-js`).
#[test]
fn no_server_and_no_jetstream_are_told_apart_with_what_to_do() {
    use kvbm_testkit::nats::free_port;
    use std::time::Duration;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Nothing listens on a free port; a short request timeout keeps the
    // test quick (the client's default is 5 s).
    let nowhere = format!("nats://127.0.0.1:{}", free_port());
    let err = rt.block_on(async {
        let client = connect(&nowhere, "nats-stream-test").await.unwrap();
        let js = async_nats::jetstream::ContextBuilder::new()
            .timeout(Duration::from_millis(300))
            .build(client);
        ensure_stream(&js, &StreamLimits::default())
            .await
            .unwrap_err()
            .to_string()
    });
    assert!(err.contains("no NATS server answers"), "{err}");

    let plain = NatsServer::start_without_jetstream();
    let err = rt.block_on(async {
        let client = connect(&plain.url(), "nats-stream-test").await.unwrap();
        let js = async_nats::jetstream::new(client);
        ensure_stream(&js, &StreamLimits::default())
            .await
            .unwrap_err()
            .to_string()
    });
    assert!(err.contains("start it with `nats-server -js`"), "{err}");
}

/// An engine whose last events found the tap full, and that stopped before
/// its bus closed: no later event carries those losses and the close never
/// comes, so the publisher takes them when it stops. They were never
/// counted before (a CI run's engine said it emitted 57 events more than
/// its publisher took in or dropped).
#[test]
fn losses_at_the_end_are_counted_when_the_publisher_stops() {
    use kvbm_attach::nats::publish::{Publisher, PublisherConfig};
    use kvbm_events::bus::BusConfig;
    use kvbm_events::{Emitter, EventKind, HookPhase, VirtualClock};
    use std::sync::Arc;
    let nats = NatsServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let bus = BusConfig {
        tap_capacity: 4,
        ..BusConfig::default()
    };
    let emitter = Emitter::new(1, bus, Arc::new(VirtualClock::new())).unwrap();
    let tap = emitter.bus().take_tap().unwrap();
    // Four fit; the last six are dropped, and nothing after them.
    for _ in 0..10 {
        emitter.emit(
            None,
            EventKind::HookCall {
                entry: kvbm_events::EntryPoint::CreateSlot,
                phase: HookPhase::Will,
            },
        );
    }
    let publisher = Publisher::spawn(
        tap,
        PublisherConfig::new(nats.url(), "end-losses"),
        rt.handle(),
    )
    .unwrap();
    let c = publisher.stop(std::time::Duration::from_secs(10));
    assert_eq!((c.events_in, c.tap_dropped), (4, 6), "{c:?}");
    assert_eq!(c.events_sent, 4, "{c:?}");
    drop(emitter);
}
