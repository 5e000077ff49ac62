//! `kvbm-recorder diff A B`: do two recordings tell the same story, and if
//! not, where do they part?
//!
//! Each event is reduced to its *signature*: what happened and to which
//! request, without the parts that legitimately differ between two runs of
//! the same workload — the timestamp, the engine id, the sequence number,
//! the wall-clock time a transfer engine reports for a batch
//! (`BatchCompleted.elapsed_ns`, zeroed), a breakpoint's absolute deadline
//! (made relative to its hit) — and with request ids renamed `r0`, `r1`, … in order of first appearance
//! in each stream (so `req-A` in one run and `req-X` in another both become
//! `r0` if each came first). The scheduler iteration is kept by default
//! (the same workload schedules the same way); [`DiffOptions`] can drop it
//! and leave out whole kinds (gauges, hook calls) that are noise for a
//! comparison.
//!
//! The streams are walked in lockstep, and the first position where the
//! signatures differ — or where one stream ends before the other — is the
//! [`Divergence`]. Equal streams give `None`. Memory is one map of request
//! ids per stream; the streams themselves are not held.

use kvbm_events::{Event, EventKind, RequestId};
use serde::{Deserialize, Serialize};
use std::borrow::Borrow;
use std::collections::{BTreeSet, HashMap};
use std::fmt;

/// What to compare.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffOptions {
    /// Leave the scheduler iteration out of the signature.
    pub ignore_iteration: bool,
    /// Event kinds to skip (by [`EventKind::name`]), e.g. `PoolGauge`.
    pub ignore_kinds: BTreeSet<String>,
}

/// An event with its envelope normalised: what [`diff`] compares.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Signature {
    /// The request, renamed by order of first appearance (`r0`, `r1`, …).
    pub request: Option<u64>,
    /// The iteration (`None` when ignored).
    pub iteration: Option<u64>,
    /// What happened.
    pub kind: EventKind,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(i) = self.iteration {
            write!(f, "iter {i} ")?;
        }
        if let Some(r) = self.request {
            write!(f, "r{r} ")?;
        }
        // The kind's JSON shows every field, which is what a reader needs
        // to see the difference.
        match serde_json::to_string(&self.kind) {
            Ok(s) => f.write_str(&s),
            Err(_) => write!(f, "{:?}", self.kind),
        }
    }
}

/// One side of a divergence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Side {
    /// Position of the event in its stream (0-based, counting every event
    /// read, ignored kinds included); for an ended stream, its length.
    pub index: u64,
    /// The event's signature, `None` when the stream ended.
    pub signature: Option<Signature>,
    /// The original request id, for the reader.
    pub request: Option<RequestId>,
    /// The original sequence number.
    pub seq: Option<u64>,
}

/// Where two streams first differ.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Divergence {
    /// Events with equal signatures before it.
    pub matched: u64,
    /// Stream A's side.
    pub a: Side,
    /// Stream B's side.
    pub b: Side,
    /// A sentence saying what differs.
    pub message: String,
}

impl fmt::Display for Divergence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Renames request ids by order of first appearance.
#[derive(Debug, Default)]
struct Normaliser {
    names: HashMap<RequestId, u64>,
}

impl Normaliser {
    fn signature(&mut self, ev: &Event, opts: &DiffOptions) -> Signature {
        let request = ev.request.as_ref().map(|r| {
            let next = self.names.len() as u64;
            *self.names.entry(r.clone()).or_insert(next)
        });
        let mut kind = ev.kind.clone();
        match &mut kind {
            // Measured on the wall clock by the transfer engine: differs
            // between any two runs.
            EventKind::BatchCompleted { elapsed_ns, .. } => *elapsed_ns = 0,
            // On the events' clock: keep only the pause's length.
            EventKind::BreakpointHit { deadline_ns, .. } => {
                *deadline_ns = deadline_ns.saturating_sub(ev.ts_ns);
            }
            _ => {}
        }
        Signature {
            request,
            iteration: (!opts.ignore_iteration).then_some(ev.iteration),
            kind,
        }
    }
}

/// The next event not ignored, with its index.
fn next_kept<E: Borrow<Event>>(
    it: &mut impl Iterator<Item = E>,
    index: &mut u64,
    opts: &DiffOptions,
) -> Option<(u64, E)> {
    for e in it.by_ref() {
        let i = *index;
        *index += 1;
        if !opts.ignore_kinds.contains(e.borrow().kind.name()) {
            return Some((i, e));
        }
    }
    None
}

fn side(index: u64, sig: Option<Signature>, ev: Option<&Event>) -> Side {
    Side {
        index,
        signature: sig,
        request: ev.and_then(|e| e.request.clone()),
        seq: ev.map(|e| e.seq),
    }
}

/// Compares two streams by signature; `None` when they are equal.
pub fn diff<A, B>(
    a: impl IntoIterator<Item = A>,
    b: impl IntoIterator<Item = B>,
    opts: &DiffOptions,
) -> Option<Divergence>
where
    A: Borrow<Event>,
    B: Borrow<Event>,
{
    let (mut a, mut b) = (a.into_iter(), b.into_iter());
    let (mut na, mut nb) = (Normaliser::default(), Normaliser::default());
    let (mut ia, mut ib) = (0u64, 0u64);
    let mut matched = 0u64;
    loop {
        let ea = next_kept(&mut a, &mut ia, opts);
        let eb = next_kept(&mut b, &mut ib, opts);
        let (xa, xb) = match (ea, eb) {
            (None, None) => return None,
            (Some((i, e)), None) => {
                let e = e.borrow();
                let sig = na.signature(e, opts);
                let message = format!(
                    "stream B ended after {ib} events; stream A goes on at event #{i} \
                     (seq {}) with {sig}",
                    e.seq
                );
                return Some(Divergence {
                    matched,
                    a: side(i, Some(sig), Some(e)),
                    b: side(ib, None, None),
                    message,
                });
            }
            (None, Some((i, e))) => {
                let e = e.borrow();
                let sig = nb.signature(e, opts);
                let message = format!(
                    "stream A ended after {ia} events; stream B goes on at event #{i} \
                     (seq {}) with {sig}",
                    e.seq
                );
                return Some(Divergence {
                    matched,
                    a: side(ia, None, None),
                    b: side(i, Some(sig), Some(e)),
                    message,
                });
            }
            (Some(xa), Some(xb)) => (xa, xb),
        };
        let (ea, eb) = (xa.1.borrow(), xb.1.borrow());
        let (sa, sb) = (na.signature(ea, opts), nb.signature(eb, opts));
        if sa != sb {
            let what = if sa.request != sb.request {
                "the request differs"
            } else if sa.iteration != sb.iteration {
                "the iteration differs"
            } else if sa.kind.name() != sb.kind.name() {
                "the event kind differs"
            } else {
                "the payload differs"
            };
            let message = format!(
                "streams diverge after {matched} equal events ({what}):\n  \
                 A #{} (seq {}): {sa}\n  B #{} (seq {}): {sb}",
                xa.0, ea.seq, xb.0, eb.seq
            );
            return Some(Divergence {
                matched,
                a: side(xa.0, Some(sa), Some(ea)),
                b: side(xb.0, Some(sb), Some(eb)),
                message,
            });
        }
        matched += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testutil::{Stream, arb_events};
    use kvbm_events::slot::SlotState;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn two_lives(a: &str, b: &str, t0: u64, engine: u32) -> Vec<Event> {
        let mut s = Stream::with_engine(engine);
        s.at(t0).life(a, 1);
        s.at(t0 + 1_000).life(b, 2);
        s.into_events()
    }

    #[test]
    fn identical_streams_are_equal() {
        let x = two_lives("a", "b", 0, 0);
        assert_eq!(diff(&x, &x, &DiffOptions::default()), None);
        assert_eq!(diff(&x, x.clone(), &DiffOptions::default()), None);
        let empty: Vec<Event> = Vec::new();
        assert_eq!(diff(&empty, &empty, &DiffOptions::default()), None);
    }

    #[test]
    fn renamed_requests_shifted_timestamps_and_other_engines_are_equal() {
        let x = two_lives("req-A", "req-B", 0, 0);
        let mut y = two_lives("req-X", "req-Y", 5_000_000, 3);
        for e in &mut y {
            e.seq += 100;
            // Iterations come from timestamps in the builder; keep them.
            e.iteration -= 50_000;
        }
        assert_eq!(diff(&x, &y, &DiffOptions::default()), None);
    }

    #[test]
    fn wall_clock_durations_and_absolute_deadlines_are_normalised() {
        let d = kvbm_events::Direction::DEVICE_TO_HOST;
        let mk = |ts: u64, elapsed_ns: u64| {
            let mut s = Stream::new();
            s.at(ts).push(
                None,
                EventKind::BatchCompleted {
                    batch: 1,
                    direction: d,
                    ok: true,
                    blocks: 2,
                    bytes: 64,
                    elapsed_ns,
                },
            );
            s.at(ts + 10).breakpoint(None, 1); // deadline = ts + 10 + 1000
            s.into_events()
        };
        // (Shifted by less than the 100 ns the builder makes an iteration.)
        assert_eq!(diff(mk(0, 5), mk(77, 9_000), &DiffOptions::default()), None);
        let mut other = mk(0, 5);
        if let EventKind::BreakpointHit { deadline_ns, .. } = &mut other[1].kind {
            *deadline_ns += 1; // a longer pause is a difference
        }
        assert!(diff(mk(0, 5), other, &DiffOptions::default()).is_some());
    }

    #[test]
    fn a_changed_event_is_reported_at_its_index() {
        let x = two_lives("a", "b", 0, 0);
        let mut y = x.clone();
        y[5].kind = EventKind::SlotTransition {
            from: SlotState::Prefilling,
            to: SlotState::Preempted,
        };
        let d = diff(&x, &y, &DiffOptions::default()).unwrap();
        assert_eq!((d.a.index, d.b.index, d.matched), (5, 5, 5));
        assert_eq!(d.a.signature.as_ref().unwrap().kind, x[5].kind);
        assert_eq!(d.b.signature.as_ref().unwrap().kind, y[5].kind);
        assert!(d.message.contains("payload differs"), "{d}");
        assert!(d.message.contains("Preempted"), "{d}");
    }

    #[test]
    fn a_request_swap_is_a_divergence() {
        let x = two_lives("a", "b", 0, 0);
        let mut y = x.clone();
        // Event 3 of y names the second request instead of the first.
        y[3].request = Some(Arc::from("b"));
        let d = diff(&x, &y, &DiffOptions::default()).unwrap();
        assert_eq!((d.a.index, d.b.index), (3, 3));
        assert!(d.message.contains("request differs"), "{d}");
        assert_eq!(d.b.request.as_deref(), Some("b"));
    }

    #[test]
    fn a_missing_or_extra_event_is_reported() {
        let x = two_lives("a", "b", 0, 0);
        let mut y = x.clone();
        y.remove(7);
        let d = diff(&x, &y, &DiffOptions::default()).unwrap();
        assert_eq!((d.a.index, d.b.index), (7, 7));
        // Extra event at the end of B.
        let mut z = x.clone();
        z.push(x[0].clone());
        let d = diff(&x, &z, &DiffOptions::default()).unwrap();
        assert_eq!((d.a.index, d.b.index), (x.len() as u64, x.len() as u64));
        assert_eq!(d.a.signature, None);
        assert!(d.message.starts_with("stream A ended"), "{d}");
        // And the other way round.
        let d = diff(&z, &x, &DiffOptions::default()).unwrap();
        assert!(d.message.starts_with("stream B ended"), "{d}");
        assert_eq!(d.b.signature, None);
    }

    #[test]
    fn ignored_kinds_and_iterations() {
        let x = two_lives("a", "b", 0, 0);
        let mut y: Vec<Event> = x
            .iter()
            .filter(|e| e.kind.name() != "BatchDispatched")
            .cloned()
            .collect();
        for e in &mut y {
            e.iteration += 1;
        }
        assert!(diff(&x, &y, &DiffOptions::default()).is_some());
        let opts = DiffOptions {
            ignore_iteration: true,
            ignore_kinds: ["BatchDispatched".to_string()].into(),
        };
        assert_eq!(diff(&x, &y, &opts), None);
        // Indices count the ignored events too.
        y[10].kind = EventKind::SlotCreated {
            prompt_tokens: 1,
            max_output_tokens: 1,
        };
        let d = diff(&x, &y, &opts).unwrap();
        assert_eq!(d.b.index, 10);
        assert_eq!(d.a.index, 11, "one ignored batch event before it in A");
    }

    proptest! {
        #[test]
        fn never_panics_and_a_stream_equals_itself(a in arb_events(40), b in arb_events(40)) {
            prop_assert_eq!(diff(&a, &a, &DiffOptions::default()), None);
            if let Some(d) = diff(&a, &b, &DiffOptions::default()) {
                prop_assert!(d.a.index <= a.len() as u64);
                prop_assert!(d.b.index <= b.len() as u64);
                let _ = d.to_string();
            }
        }
    }
}
