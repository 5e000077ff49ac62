//! Exactly once on the consuming side: for one run of one engine, which
//! events to apply and where the holes are. Plain state, no I/O, so a
//! recorder rebuilds it from its log after a restart ([`Tracker::resume`])
//! and a property test checks it against a model.
//!
//! JetStream may hand a consumer the same batch twice (a publisher that
//! re-sent after its acknowledgement was lost outside the duplicate window,
//! a redelivery after the consumer restarted before acknowledging); an
//! event whose seq is not above the last one applied is a duplicate and is
//! skipped. A seq that jumps is a *hole*: events that never arrived. The
//! publisher declares what it dropped itself (cumulative, in every batch),
//! so a hole can be told apart as *declared* (the publisher knows and
//! counted it) or *unexplained*.

/// What to do with one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Apply it; `hole_before` events are missing just before it (for the
    /// first event of a run: `before_start` seqs were never seen).
    Apply {
        /// Events missing between the previous applied event and this one.
        hole_before: u64,
    },
    /// Already applied: skip it.
    Duplicate,
}

/// The bookkeeping of one (engine, run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tracker {
    /// First seq applied.
    pub first: Option<u64>,
    /// Last seq applied.
    pub last: Option<u64>,
    /// Events applied.
    pub applied: u64,
    /// Events skipped as already applied.
    pub duplicates: u64,
    /// Events missing between applied ones.
    pub holes: u64,
    /// Seqs before the first one applied (0 when the run was seen from its
    /// start): the stream's limits had discarded them, or the publisher
    /// dropped them.
    pub before_start: u64,
    /// The most the publisher declared it dropped (it declares a running
    /// total, so the largest seen is the latest). Kept, never lowered, so
    /// a declaration must be possible to be taken: [`wire`](super::wire)
    /// refuses a batch declaring more than its first seq.
    pub declared_dropped: u64,
}

impl Tracker {
    /// The state after a restart, from what the log holds: its first and
    /// last seq, its event count and the publisher's last declaration.
    pub fn resume(first: u64, last: u64, events: u64, declared_dropped: u64) -> Tracker {
        let span = last.saturating_sub(first).saturating_add(1);
        Tracker {
            first: Some(first),
            last: Some(last),
            applied: events,
            duplicates: 0,
            holes: span.saturating_sub(events),
            before_start: first,
            declared_dropped,
        }
    }

    /// A batch's declaration of what its publisher dropped so far.
    pub fn declared(&mut self, dropped_before: u64) {
        self.declared_dropped = self.declared_dropped.max(dropped_before);
    }

    /// Whether to apply the event with `seq`; records it if so.
    pub fn admit(&mut self, seq: u64) -> Admit {
        match self.last {
            Some(last) if seq <= last => {
                self.duplicates += 1;
                Admit::Duplicate
            }
            Some(last) => {
                let hole = seq - last - 1;
                self.holes += hole;
                self.last = Some(seq);
                self.applied += 1;
                Admit::Apply { hole_before: hole }
            }
            None => {
                self.first = Some(seq);
                self.last = Some(seq);
                self.before_start = seq;
                self.applied = 1;
                Admit::Apply { hole_before: 0 }
            }
        }
    }

    /// Admits the consecutive seqs `first..=last` at once when every one
    /// of them is new: `Some(hole_before)`, with the state as if each had
    /// been [`admit`](Self::admit)ted in turn. `None` when some were
    /// applied already (or the range is empty), and nothing is recorded:
    /// admit them one by one.
    pub fn admit_range(&mut self, first: u64, last: u64) -> Option<u64> {
        if last < first || self.last.is_some_and(|l| first <= l) {
            return None;
        }
        let hole = match self.last {
            Some(l) => {
                let hole = first - l - 1;
                self.holes += hole;
                hole
            }
            None => {
                self.first = Some(first);
                self.before_start = first;
                0
            }
        };
        self.last = Some(last);
        self.applied += last - first + 1;
        Some(hole)
    }

    /// Events missing, between applied ones and before the first.
    pub fn missing(&self) -> u64 {
        self.holes + self.before_start
    }

    /// Missing events the publisher did not declare.
    pub fn unexplained(&self) -> u64 {
        self.missing().saturating_sub(self.declared_dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Any order of deliveries with repeats: each seq is applied at most
        /// once, applied seqs increase, and applied + holes + before_start
        /// covers 0..=last exactly.
        #[test]
        fn each_seq_applies_once_and_holes_add_up(
            seqs in proptest::collection::vec(0u64..200, 0..300),
        ) {
            let mut t = Tracker::default();
            let mut applied = BTreeSet::new();
            let mut prev = None;
            for s in seqs {
                match t.admit(s) {
                    Admit::Apply { .. } => {
                        prop_assert!(applied.insert(s), "seq {s} applied twice");
                        prop_assert!(prev.is_none_or(|p| s > p));
                        prev = Some(s);
                    }
                    Admit::Duplicate => prop_assert!(prev.is_some_and(|p| s <= p)),
                }
            }
            prop_assert_eq!(t.applied, applied.len() as u64);
            if let Some(last) = t.last {
                prop_assert_eq!(t.applied + t.missing(), last + 1);
                // Rebuilt from the log alone, the counts are the same.
                let r = Tracker::resume(t.first.unwrap(), last, t.applied, 0);
                prop_assert_eq!((r.holes, r.before_start), (t.holes, t.before_start));
            }
        }
    }

    proptest! {
        /// A range admitted at once leaves the state that admitting its
        /// seqs one by one leaves, and is refused exactly when one of them
        /// would be a duplicate.
        #[test]
        fn a_range_admits_like_its_seqs_one_by_one(
            ranges in proptest::collection::vec((0u64..300, 0u64..20), 0..40),
        ) {
            let (mut whole, mut single) = (Tracker::default(), Tracker::default());
            for (first, len) in ranges {
                let last = first + len;
                let before = single;
                let holes: Vec<Admit> = (first..=last).map(|s| single.admit(s)).collect();
                match whole.admit_range(first, last) {
                    Some(hole) => {
                        prop_assert_eq!(holes[0], Admit::Apply { hole_before: hole });
                        let rest_follow = holes[1..]
                            .iter()
                            .all(|a| *a == Admit::Apply { hole_before: 0 });
                        prop_assert!(rest_follow, "a hole inside a range: {:?}", holes);
                    }
                    None => {
                        prop_assert!(holes.contains(&Admit::Duplicate));
                        prop_assert_eq!(whole, before, "a refused range recorded something");
                        // Refused whole: one by one, as the recorder does.
                        for s in first..=last {
                            whole.admit(s);
                        }
                    }
                }
                prop_assert_eq!(whole, single);
            }
        }
    }

    #[test]
    fn declared_losses_explain_holes() {
        let mut t = Tracker::default();
        assert_eq!(t.admit(0), Admit::Apply { hole_before: 0 });
        assert_eq!(t.admit(5), Admit::Apply { hole_before: 4 });
        assert_eq!(t.unexplained(), 4);
        t.declared(4);
        t.declared(1); // an older batch redelivered
        assert_eq!(t.unexplained(), 0);
        assert_eq!(t.admit(5), Admit::Duplicate);
        assert_eq!(t.duplicates, 1);
    }
}
