//! `GET /metrics`: Prometheus text exposition (version 0.0.4).

use super::reduce::ReducedInner;
use super::{AppState, ServerConfig, ServerStats};
use kvbm_events::Direction;
use kvbm_events::bus::BusCounters;
use kvbm_events::control::BreakpointsView;
use kvbm_events::reducer::{DirectionTotals, EngineState, PoolView};
use kvbm_events::ring::RingCounters;
use std::collections::BTreeMap;
use std::fmt::Write;

/// A direction as a label value: `G1->G2`.
fn dir_label(d: Direction) -> String {
    format!("{}->{}", d.src.short_name(), d.dst.short_name())
}

/// Escapes a label value (backslash, quote, newline).
fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

/// The exposition being written.
struct Out(String);

impl Out {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn val(&mut self, name: &str, labels: &[(&str, &str)], v: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (k, val)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{k}=\"{}\"", esc(val));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {v}");
    }

    fn one(&mut self, name: &str, kind: &str, help: &str, v: impl std::fmt::Display) {
        self.head(name, kind, help);
        self.val(name, &[], v);
    }
}

/// The whole exposition: one family after another, always in this order.
pub(super) fn render(state: &AppState) -> String {
    let mut o = Out(String::with_capacity(8 * 1024));
    let ring = state.engine.ring.counters();
    let bus = state.engine.bus_counters.as_ref().map(|f| f());
    let stats = state.stats();
    events(&mut o, &ring, bus);
    ring_buffer(&mut o, &ring, state.engine.ring.capacity());
    server(&mut o, &stats, &state.cfg);
    if let Some(c) = &state.engine.control {
        breakpoints(&mut o, &c.view());
    }
    // Every family the reducer feeds comes from one lock, so they agree
    // with each other.
    let g = state.reduced.lock();
    reducer_progress(&mut o, &g);
    pools(&mut o, g.state.pools());
    prefix_and_blocks(&mut o, g.state.pools());
    let dirs = directions(&g.state);
    blocks_moved(&mut o, &dirs);
    transfer_outcomes(&mut o, &dirs);
    transfer_skips(&mut o, &g.skips);
    slots(&mut o, &g.state);
    transfers_in_flight(&mut o, &g.state);
    reducer_inconsistencies(&mut o, &g.state);
    drop(g);
    o.0
}

/// What the engine emitted and its bus did with it; without bus counters,
/// what the ring saw stands in.
fn events(o: &mut Out, ring: &RingCounters, bus: Option<BusCounters>) {
    let emitted = bus.map_or(ring.pushed + ring.lost, |b| b.published);
    o.one(
        "kvbm_events_emitted_total",
        "counter",
        "Events the engine emitted.",
        emitted,
    );
    o.one(
        "kvbm_events_lagged_total",
        "counter",
        "Events live bus subscribers missed by lagging.",
        bus.map_or(0, |b| b.lagged_total),
    );
    o.one(
        "kvbm_events_dropped_total",
        "counter",
        "Events the engine's lossless tap dropped because it was full (never reached the server).",
        bus.map_or(ring.lost, |b| b.tap_dropped),
    );
    o.one(
        "kvbm_events_tap_queued",
        "gauge",
        "Events waiting in the engine's tap.",
        bus.map_or(0, |b| b.tap_queued),
    );
}

/// The server's ring.
fn ring_buffer(o: &mut Out, ring: &RingCounters, capacity: usize) {
    o.one(
        "kvbm_ring_events_total",
        "counter",
        "Events pushed into the server's ring.",
        ring.pushed,
    );
    o.one(
        "kvbm_ring_overwritten_total",
        "counter",
        "Events the ring overwrote with newer ones.",
        ring.overwritten,
    );
    o.one(
        "kvbm_ring_lost_total",
        "counter",
        "Events lost before they reached the ring.",
        ring.lost,
    );
    o.one(
        "kvbm_ring_events",
        "gauge",
        "Events held in the ring.",
        ring.len,
    );
    o.one(
        "kvbm_ring_capacity_events",
        "gauge",
        "Events the ring holds at most.",
        capacity,
    );
}

/// The server's own counters: WebSocket clients, TCP connections, tokens.
fn server(o: &mut Out, stats: &ServerStats, cfg: &ServerConfig) {
    o.one(
        "kvbm_ws_clients",
        "gauge",
        "WebSocket clients connected.",
        stats.clients_connected,
    );
    o.one(
        "kvbm_ws_clients_max",
        "gauge",
        "WebSocket clients allowed at once.",
        cfg.max_clients,
    );
    o.one(
        "kvbm_http_connections_open",
        "gauge",
        "TCP connections open now (HTTP and WebSocket).",
        stats.connections_open,
    );
    o.one(
        "kvbm_http_connections_max",
        "gauge",
        "TCP connections allowed at once.",
        cfg.max_connections,
    );
    o.one(
        "kvbm_http_connections_per_ip_max",
        "gauge",
        "TCP connections allowed at once from one address.",
        cfg.max_connections_per_ip.min(cfg.max_connections),
    );
    o.one(
        "kvbm_http_connections_refused_total",
        "counter",
        "TCP connections answered 503 and closed because too many were open (in all, or from one address).",
        stats.connections_refused,
    );
    o.one(
        "kvbm_http_refusals_unlogged_total",
        "counter",
        "Refused connections not logged one by one (the warning is written at most every 10 s).",
        stats.refusals_unlogged,
    );
    o.one(
        "kvbm_http_reserved_connections_total",
        "counter",
        "Connections taken into the place kept for loopback when every other was taken.",
        stats.reserve_used,
    );
    o.one(
        "kvbm_http_unparsable_requests_total",
        "counter",
        "Requests the HTTP layer could not parse (answered 400, 414 or 431 with a JSON error).",
        stats.unparsable_requests,
    );
    o.one(
        "kvbm_http_request_timeouts_total",
        "counter",
        "Requests whose body did not arrive in time (answered 408).",
        stats.request_timeouts,
    );
    o.one(
        "kvbm_ws_clients_accepted_total",
        "counter",
        "WebSocket clients accepted.",
        stats.clients_accepted,
    );
    o.one(
        "kvbm_ws_clients_rejected_total",
        "counter",
        "WebSocket clients refused because too many were connected.",
        stats.clients_rejected,
    );
    o.one(
        "kvbm_ws_slow_disconnects_total",
        "counter",
        "WebSocket clients disconnected because a send stalled past the timeout.",
        stats.slow_disconnects,
    );
    o.one(
        "kvbm_ws_silent_disconnects_total",
        "counter",
        "WebSocket clients disconnected because nothing, not even a pong, came from them for the silence timeout.",
        stats.silent_disconnects,
    );
    o.one(
        "kvbm_ws_messages_too_large_total",
        "counter",
        "WebSocket messages from clients over the size limit (answered, then closed).",
        stats.messages_too_large,
    );
    o.one(
        "kvbm_ws_events_sent_total",
        "counter",
        "Events sent to WebSocket clients, summed over clients.",
        stats.events_sent,
    );
    o.one(
        "kvbm_ws_gaps_total",
        "counter",
        "Gap messages sent to WebSocket clients.",
        stats.gaps_sent,
    );
    o.one(
        "kvbm_ws_gap_events_total",
        "counter",
        "Events announced missing to WebSocket clients, summed over clients.",
        stats.gap_events,
    );
    o.one(
        "kvbm_http_unauthorized_total",
        "counter",
        "Requests refused for a missing or wrong token.",
        stats.unauthorized,
    );
    o.one(
        "kvbm_breakpoint_leases_expired_total",
        "counter",
        "Leases of breakpoints set over HTTP without a client that ran out (their breakpoints removed).",
        stats.leases_expired,
    );
    o.one(
        "kvbm_breakpoint_leases",
        "gauge",
        "Leases of breakpoints and steps set over HTTP without a client, alive now.",
        stats.leases_alive,
    );
    o.one(
        "kvbm_breakpoint_leases_refused_total",
        "counter",
        "Breakpoints and steps set over HTTP without a client refused because as many leases as the server keeps owned something.",
        stats.leases_refused,
    );
}

/// Breakpoints set and calls paused (only for an engine with control).
fn breakpoints(o: &mut Out, v: &BreakpointsView) {
    o.one(
        "kvbm_breakpoints",
        "gauge",
        "Breakpoints set.",
        v.breakpoints.len(),
    );
    o.one(
        "kvbm_paused_calls",
        "gauge",
        "Engine calls paused at a breakpoint now.",
        v.paused.len(),
    );
}

/// How far the server's reducer got.
fn reducer_progress(o: &mut Out, g: &ReducedInner) {
    o.one(
        "kvbm_reducer_events_total",
        "counter",
        "Events the server's reducer applied.",
        g.state.stream().events,
    );
    o.one(
        "kvbm_reducer_missed_total",
        "counter",
        "Events the server's reducer never saw (overwritten in the ring first).",
        g.missed,
    );
}

/// Blocks per tier, by state, and in all.
fn pools(o: &mut Out, pools: &[PoolView]) {
    o.head(
        "kvbm_pool_blocks",
        "gauge",
        "Blocks per tier by state (active: in use; inactive: cached, evictable; free: empty).",
    );
    for p in pools.iter() {
        let t = p.tier.short_name();
        o.val(
            "kvbm_pool_blocks",
            &[("tier", t), ("state", "active")],
            p.active,
        );
        o.val(
            "kvbm_pool_blocks",
            &[("tier", t), ("state", "inactive")],
            p.inactive,
        );
        o.val(
            "kvbm_pool_blocks",
            &[("tier", t), ("state", "free")],
            p.empty,
        );
    }
    o.head(
        "kvbm_pool_capacity_blocks",
        "gauge",
        "Blocks per tier in all.",
    );
    for p in pools.iter() {
        o.val(
            "kvbm_pool_capacity_blocks",
            &[("tier", p.tier.short_name())],
            p.capacity,
        );
    }
}

/// Prefix lookups, evictions and registrations per tier.
fn prefix_and_blocks(o: &mut Out, pools: &[PoolView]) {
    o.head(
        "kvbm_prefix_hit_ratio",
        "gauge",
        "Prefix-cache hit rate per tier: blocks found over blocks looked up (0 before any lookup).",
    );
    for p in pools.iter() {
        let r = if p.looked_up_blocks == 0 {
            0.0
        } else {
            p.hit_blocks as f64 / p.looked_up_blocks as f64
        };
        o.val("kvbm_prefix_hit_ratio", &[("tier", p.tier.short_name())], r);
    }
    for (name, help, f) in [
        (
            "kvbm_prefix_lookups_total",
            "Prefix lookups per tier.",
            (|p| p.lookups) as fn(&PoolView) -> u64,
        ),
        (
            "kvbm_prefix_lookup_blocks_total",
            "Blocks looked up per tier.",
            |p| p.looked_up_blocks,
        ),
        (
            "kvbm_prefix_hit_blocks_total",
            "Blocks found by prefix lookups per tier.",
            |p| p.hit_blocks,
        ),
        (
            "kvbm_prefix_hit_tokens_total",
            "Tokens covered by prefix hits per tier.",
            |p| p.hit_tokens,
        ),
        (
            "kvbm_block_evictions_total",
            "Blocks evicted per tier.",
            |p| p.evictions,
        ),
        (
            "kvbm_block_registrations_total",
            "Block registrations per tier (duplicates included).",
            |p| p.registrations,
        ),
    ] {
        o.head(name, "counter", help);
        for p in pools.iter() {
            o.val(name, &[("tier", p.tier.short_name())], f(p));
        }
    }
}

/// Every direction with transfer totals: the four the tiers link always
/// (zero until used, so the series are stable), and any other seen, in
/// direction order.
fn directions(st: &EngineState) -> Vec<DirectionTotals> {
    let mut dirs: Vec<DirectionTotals> = [
        Direction::DEVICE_TO_HOST,
        Direction::HOST_TO_DISK,
        Direction::HOST_TO_DEVICE,
        Direction::DISK_TO_HOST,
    ]
    .into_iter()
    .filter(|d| st.direction(*d).is_none())
    .map(DirectionTotals::new)
    .collect();
    dirs.extend(st.direction_totals().iter().cloned());
    dirs.sort_by_key(|d| d.direction);
    dirs
}

/// Blocks and bytes offloaded and onboarded, by direction.
fn blocks_moved(o: &mut Out, dirs: &[DirectionTotals]) {
    for (name, help, onboard, f) in [
        (
            "kvbm_offload_blocks_total",
            "Blocks offloaded (to a slower tier) by direction, from completed batches.",
            false,
            (|d| d.blocks) as fn(&DirectionTotals) -> u64,
        ),
        (
            "kvbm_offload_bytes_total",
            "Bytes offloaded by direction, from completed batches.",
            false,
            |d| d.bytes,
        ),
        (
            "kvbm_onboard_blocks_total",
            "Blocks onboarded (to a faster tier) by direction, from completed batches.",
            true,
            |d| d.blocks,
        ),
        (
            "kvbm_onboard_bytes_total",
            "Bytes onboarded by direction, from completed batches.",
            true,
            |d| d.bytes,
        ),
    ] {
        o.head(name, "counter", help);
        for d in dirs.iter().filter(|d| d.direction.is_onboard() == onboard) {
            o.val(name, &[("direction", &dir_label(d.direction))], f(d));
        }
    }
}

/// Transfer candidates by direction and outcome.
fn transfer_outcomes(o: &mut Out, dirs: &[DirectionTotals]) {
    o.head(
        "kvbm_transfers_total",
        "counter",
        "Transfer candidates by direction and outcome.",
    );
    for d in dirs {
        let l = dir_label(d.direction);
        for (outcome, v) in [
            ("planned", d.planned),
            ("promoted", d.promoted),
            ("completed", d.completed),
            ("skipped", d.skipped),
            ("cancelled", d.cancelled),
            ("failed", d.failed),
        ] {
            o.val(
                "kvbm_transfers_total",
                &[("direction", &l), ("outcome", outcome)],
                v,
            );
        }
    }
}

/// Skipped transfer candidates by direction and reason.
fn transfer_skips(o: &mut Out, skips: &BTreeMap<(Direction, String), u64>) {
    o.head(
        "kvbm_transfers_skipped_total",
        "counter",
        "Skipped transfer candidates (offloads and onboards) by direction and reason.",
    );
    for ((d, reason), v) in skips {
        o.val(
            "kvbm_transfers_skipped_total",
            &[("direction", &dir_label(*d)), ("reason", reason)],
            v,
        );
    }
}

/// Request slots by state.
fn slots(o: &mut Out, st: &EngineState) {
    o.head(
        "kvbm_slots",
        "gauge",
        "Request slots by state (finished slots are pruned after a while).",
    );
    for (name, n) in st.state_counts() {
        o.val("kvbm_slots", &[("state", name)], n);
    }
}

/// Transfer candidates not yet terminal.
fn transfers_in_flight(o: &mut Out, st: &EngineState) {
    o.one(
        "kvbm_transfers_in_flight",
        "gauge",
        "Transfer candidates not yet terminal.",
        st.in_flight_count(),
    );
}

/// Events the reducer could not square with its state.
fn reducer_inconsistencies(o: &mut Out, st: &EngineState) {
    o.one(
        "kvbm_reducer_inconsistencies_total",
        "counter",
        "Events that contradicted the reducer's state.",
        st.inconsistencies().total(),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::{Counters, ServedEngine, ServerConfig};
    use kvbm_events::breakpoint::{BreakpointInfo, BreakpointSpec, CallInfo, PausedCall};
    use kvbm_events::bus::BusCounters;
    use kvbm_events::control::{
        BreakpointsView, Control, ControlCommand, ControlError, ControlResult,
    };
    use kvbm_events::ring::RingBuffer;
    use kvbm_events::{EntryPoint, Event, EventKind, SequenceHash, SlotState, Tier};
    use std::path::Path;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Duration;
    use tokio::sync::watch;

    #[test]
    fn labels_are_escaped() {
        assert_eq!(esc("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(dir_label(Direction::DEVICE_TO_HOST), "G1->G2");
    }

    /// A control that always shows the same breakpoints.
    struct FixedControl(BreakpointsView);

    impl Control for FixedControl {
        fn execute(
            &self,
            _: ControlCommand,
            _: Option<u64>,
        ) -> Result<ControlResult, ControlError> {
            Ok(ControlResult::List(self.0.clone()))
        }
    }

    fn state(engine: ServedEngine) -> AppState {
        let cfg = ServerConfig {
            max_clients: 8,
            max_connections: 16,
            ..ServerConfig::default()
        };
        AppState::new(cfg, engine, Counters::default(), watch::channel(false).1)
    }

    fn ev(seq: u64, request: Option<&str>, kind: EventKind) -> Event {
        Event {
            engine: 3,
            seq,
            ts_ns: 1_000 * seq,
            iteration: seq / 4,
            request: request.map(Arc::from),
            kind,
        }
    }

    /// Something in every family: bus and ring counters, server counters,
    /// breakpoints, pools, prefix lookups, transfers in every outcome (one
    /// in a direction outside the four usual ones), skips (one reason that
    /// needs escaping), slots and an inconsistency.
    fn busy() -> AppState {
        let st = state(busy_engine());
        store_server_counters(&st.counters);
        let kinds = slot_and_block_events()
            .into_iter()
            .chain(transfer_events())
            .chain([ghost_transition()]);
        {
            let mut g = st.reduced.lock();
            for (seq, (request, kind)) in kinds.enumerate() {
                g.state.apply(&ev(seq as u64, request, kind));
            }
            g.missed = 11;
            g.skips
                .insert((Direction::HOST_TO_DEVICE, "already_present".into()), 2);
            g.skips
                .insert((Direction::DEVICE_TO_HOST, "we\"ird\\".into()), 1);
        }
        st
    }

    /// The engine behind `busy`: a ring that has lapped and recorded a gap,
    /// a control showing two breakpoints and one paused call, and bus
    /// counters.
    fn busy_engine() -> ServedEngine {
        let ring = Arc::new(RingBuffer::with_capacity(4).unwrap());
        for s in 0..6 {
            ring.push(ev(
                s,
                None,
                EventKind::TokensScheduled {
                    prefill: 0,
                    decode: 1,
                    computed: 0,
                },
            ));
        }
        ring.record_gap(3);
        let paused = PausedCall {
            pause_id: 1,
            breakpoint: 2,
            call: CallInfo::new(EntryPoint::TransferExecute),
            waited: Duration::from_millis(5),
            deadline_in: Duration::from_secs(9),
        };
        let bp = |id| BreakpointInfo {
            id,
            spec: BreakpointSpec::default().with_state("Decoding"),
            hits: id,
        };
        let view = BreakpointsView {
            breakpoints: vec![bp(1), bp(2)],
            paused: vec![paused],
        };
        ServedEngine::new(ring, 3)
            .with_control(Arc::new(FixedControl(view)))
            .with_bus_counters(|| BusCounters {
                published: 1234,
                lagged_total: 5,
                tap_dropped: 6,
                tap_queued: 7,
                ..BusCounters::default()
            })
    }

    /// Gives every server counter its own value, so that a family printed
    /// from the wrong counter shows in the golden file.
    fn store_server_counters(c: &Counters) {
        c.connected.store(2, Ordering::Relaxed);
        c.accepted.store(9, Ordering::Relaxed);
        c.rejected.store(1, Ordering::Relaxed);
        c.slow.store(1, Ordering::Relaxed);
        c.silent.store(2, Ordering::Relaxed);
        c.request_timeouts.store(5, Ordering::Relaxed);
        c.leases_expired.store(6, Ordering::Relaxed);
        c.leases_refused.store(2, Ordering::Relaxed);
        c.conns.unlogged.store(7, Ordering::Relaxed);
        c.conns.reserve_used.store(8, Ordering::Relaxed);
        c.conns.unparsable.store(9, Ordering::Relaxed);
        c.too_large.store(1, Ordering::Relaxed);
        c.events_sent.store(500, Ordering::Relaxed);
        c.gaps_sent.store(2, Ordering::Relaxed);
        c.gap_events.store(30, Ordering::Relaxed);
        c.unauthorized.store(4, Ordering::Relaxed);
        c.conns.refused.store(3, Ordering::Relaxed);
    }

    /// Two slots, prefix lookups in two tiers, two pool gauges, a duplicate
    /// registration and an eviction.
    fn slot_and_block_events() -> Vec<(Option<&'static str>, EventKind)> {
        let (a, b) = (Some("a"), Some("b"));
        vec![
            (
                a,
                EventKind::SlotCreated {
                    prompt_tokens: 64,
                    max_output_tokens: 8,
                },
            ),
            (
                a,
                EventKind::SlotTransition {
                    from: SlotState::Initialized,
                    to: SlotState::Prefilling,
                },
            ),
            (
                b,
                EventKind::SlotCreated {
                    prompt_tokens: 16,
                    max_output_tokens: 4,
                },
            ),
            (
                a,
                EventKind::MatchResult {
                    tier: Tier::Host,
                    looked_up: 4,
                    hit_blocks: 3,
                    hit_tokens: 48,
                },
            ),
            (
                a,
                EventKind::MatchResult {
                    tier: Tier::Device,
                    looked_up: 4,
                    hit_blocks: 1,
                    hit_tokens: 16,
                },
            ),
            (
                None,
                EventKind::PoolGauge {
                    tier: Tier::Device,
                    capacity: 100,
                    active: 10,
                    inactive: 5,
                    empty: 85,
                },
            ),
            (
                None,
                EventKind::PoolGauge {
                    tier: Tier::Host,
                    capacity: 400,
                    active: 0,
                    inactive: 40,
                    empty: 360,
                },
            ),
            (
                a,
                EventKind::BlockRegistered {
                    tier: Tier::Device,
                    block: 1,
                    sequence_hash: SequenceHash(11),
                    duplicate_of: None,
                },
            ),
            (
                b,
                EventKind::BlockRegistered {
                    tier: Tier::Device,
                    block: 2,
                    sequence_hash: SequenceHash(11),
                    duplicate_of: Some(1),
                },
            ),
            (
                None,
                EventKind::BlockEvicted {
                    tier: Tier::Host,
                    block: 7,
                    sequence_hash: SequenceHash(99),
                },
            ),
        ]
    }

    /// Transfers in every outcome, one in a direction outside the four
    /// usual ones.
    fn transfer_events() -> Vec<(Option<&'static str>, EventKind)> {
        let device_to_disk = Direction {
            src: Tier::Device,
            dst: Tier::Disk,
        };
        let (a, b) = (Some("a"), Some("b"));
        vec![
            (
                a,
                EventKind::TransferPlanned {
                    transfer: 1,
                    direction: Direction::DEVICE_TO_HOST,
                    blocks: 2,
                },
            ),
            (
                a,
                EventKind::TransferPromoted {
                    transfer: 1,
                    direction: Direction::DEVICE_TO_HOST,
                    blocks: 2,
                },
            ),
            (
                None,
                EventKind::BatchDispatched {
                    batch: 1,
                    direction: Direction::DEVICE_TO_HOST,
                    transfers: vec![1],
                    blocks: 2,
                },
            ),
            (
                a,
                EventKind::TransferCompleted {
                    transfer: 1,
                    direction: Direction::DEVICE_TO_HOST,
                    blocks: 2,
                },
            ),
            (
                None,
                EventKind::BatchCompleted {
                    batch: 1,
                    direction: Direction::DEVICE_TO_HOST,
                    ok: true,
                    blocks: 2,
                    bytes: 8192,
                    elapsed_ns: 400,
                },
            ),
            (
                b,
                EventKind::TransferPlanned {
                    transfer: 2,
                    direction: Direction::HOST_TO_DEVICE,
                    blocks: 1,
                },
            ),
            (
                b,
                EventKind::TransferSkipped {
                    transfer: 2,
                    direction: Direction::HOST_TO_DEVICE,
                    reason: "already_present".into(),
                },
            ),
            (
                a,
                EventKind::TransferPlanned {
                    transfer: 3,
                    direction: device_to_disk,
                    blocks: 1,
                },
            ),
            (
                a,
                EventKind::TransferPlanned {
                    transfer: 4,
                    direction: Direction::HOST_TO_DISK,
                    blocks: 1,
                },
            ),
            (
                a,
                EventKind::TransferFailed {
                    transfer: 4,
                    direction: Direction::HOST_TO_DISK,
                    error: "io".into(),
                },
            ),
            (
                b,
                EventKind::TransferPlanned {
                    transfer: 5,
                    direction: Direction::DISK_TO_HOST,
                    blocks: 1,
                },
            ),
            (
                b,
                EventKind::TransferCancelled {
                    transfer: 5,
                    direction: Direction::DISK_TO_HOST,
                },
            ),
        ]
    }

    /// A transition for a request that was never created: the
    /// inconsistency.
    fn ghost_transition() -> (Option<&'static str>, EventKind) {
        (
            Some("ghost"),
            EventKind::SlotTransition {
                from: SlotState::Decoding,
                to: SlotState::Finished,
            },
        )
    }

    /// Compares with `tests/metrics/NAME.prom`; `UPDATE_METRICS=1` writes it.
    fn golden(name: &str, got: &str) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/metrics")
            .join(format!("{name}.prom"));
        if std::env::var_os("UPDATE_METRICS").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, got).unwrap();
            return;
        }
        let want = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (UPDATE_METRICS=1 writes it)", path.display()));
        assert_eq!(got, want, "/metrics differs from {}", path.display());
    }

    /// The exposition is byte for byte what it was: every family, in order,
    /// with its help text, labels and values.
    #[test]
    fn every_family_renders_as_before() {
        golden("busy", &render(&busy()));
        // Without bus counters or control: the ring's fallbacks, no
        // breakpoint family, and the four usual directions at zero.
        let bare = ServedEngine::new(Arc::new(RingBuffer::with_capacity(4).unwrap()), 0);
        golden("bare", &render(&state(bare)));
    }
}
