//! `GET /metrics`: Prometheus text exposition (version 0.0.4).

use super::AppState;
use kvbm_events::Direction;
use kvbm_events::reducer::DirectionTotals;
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

pub(super) fn render(state: &AppState) -> String {
    let mut o = Out(String::with_capacity(8 * 1024));
    let ring = state.engine.ring.counters();
    let bus = state.engine.bus_counters.as_ref().map(|f| f());
    let stats = state.counters.stats();

    // Events.
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
        state.engine.ring.capacity(),
    );

    // WebSocket clients.
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
        state.cfg.max_clients,
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
        state.cfg.max_connections,
    );
    o.one(
        "kvbm_http_connections_refused_total",
        "counter",
        "TCP connections answered 503 and closed because too many were open.",
        stats.connections_refused,
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

    // Breakpoints.
    if let Some(c) = &state.engine.control {
        let v = c.view();
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

    // The reducer's view.
    let g = state.reduced.lock();
    let st = &g.state;
    o.one(
        "kvbm_reducer_events_total",
        "counter",
        "Events the server's reducer applied.",
        st.stream().events,
    );
    o.one(
        "kvbm_reducer_missed_total",
        "counter",
        "Events the server's reducer never saw (overwritten in the ring first).",
        g.missed,
    );
    let pools = st.pools();
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
            (|p| p.lookups) as fn(&kvbm_events::reducer::PoolView) -> u64,
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

    // Transfers by direction: the four the tiers link always (zero until
    // used, so the series are stable), and any other seen.
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
    let dirs = &dirs;
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
    o.head(
        "kvbm_transfers_skipped_total",
        "counter",
        "Skipped transfer candidates (offloads and onboards) by direction and reason.",
    );
    for ((d, reason), v) in &g.skips {
        o.val(
            "kvbm_transfers_skipped_total",
            &[("direction", &dir_label(*d)), ("reason", reason)],
            v,
        );
    }
    o.head(
        "kvbm_slots",
        "gauge",
        "Request slots by state (finished slots are pruned after a while).",
    );
    for (name, n) in st.state_counts() {
        o.val("kvbm_slots", &[("state", name)], n);
    }
    o.one(
        "kvbm_transfers_in_flight",
        "gauge",
        "Transfer candidates not yet terminal.",
        st.in_flight_count(),
    );
    o.one(
        "kvbm_reducer_inconsistencies_total",
        "counter",
        "Events that contradicted the reducer's state.",
        st.inconsistencies().total(),
    );
    drop(g);
    o.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_escaped() {
        assert_eq!(esc("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(dir_label(Direction::DEVICE_TO_HOST), "G1->G2");
    }
}
