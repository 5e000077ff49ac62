//! What a recording can be trusted to hold, from its sidecar (how it
//! ended, how many events the recorder wrote) and what its log holds.
//! `check` and `inspect` say it; `check`'s exit status follows it.
//!
//! | sidecar says | the log | verdict |
//! |---|---|---|
//! | finished cleanly (or: the engine restarted) | holds every event the sidecar counts, no torn tail | [`Verdict::Whole`] |
//! | finished cleanly | fewer events, or a torn tail | [`Verdict::Damaged`]: a recorder that finished has no torn tail to forgive, so a cut-off end is damage |
//! | unfinished (the recorder was killed or crashed) | anything | [`Verdict::EndedEarly`]: what is there is good, what came after was never written |
//! | writing failed (a full disk) | anything | [`Verdict::EndedEarly`], with the error |
//! | missing or unreadable | anything | [`Verdict::Unknown`]: whether anything is missing, or was lost, cannot be told |
//!
//! A recording that is whole may still be of a stream that did not end
//! with it (a remote engine that ran on, an engine that restarted):
//! [`Assessment::stream_complete`] says whether transfers still in flight
//! at its end can be judged.

use crate::log::LogInfo;
use crate::sidecar::{Ended, Recording, SIDECAR, Sidecar};
use std::fmt;

/// What a recording can be trusted to hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every event the recorder wrote is in the log.
    Whole,
    /// The recorder finished cleanly, but the log does not hold what it
    /// wrote: damage (a bad last block taken for a torn tail, a file cut
    /// short), not a crash.
    Damaged(String),
    /// The recording ended before its stream did: the writer died or
    /// failed. What the log holds is good; what came after is not there.
    EndedEarly(String),
    /// There is no usable sidecar: whether the log is whole, and what was
    /// lost, cannot be told.
    Unknown(String),
}

impl Verdict {
    /// A one-word name for JSON: `whole`, `damaged`, `ended_early`,
    /// `unknown`.
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Whole => "whole",
            Verdict::Damaged(_) => "damaged",
            Verdict::EndedEarly(_) => "ended_early",
            Verdict::Unknown(_) => "unknown",
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Whole => write!(f, "whole"),
            Verdict::Damaged(m) => write!(f, "damaged: {m}"),
            Verdict::EndedEarly(m) => write!(f, "ended early: {m}"),
            Verdict::Unknown(m) => write!(f, "unknown: {m}"),
        }
    }
}

/// The verdict, with what `check` needs to judge the events.
#[derive(Debug, Clone, PartialEq)]
pub struct Assessment {
    /// What the recording can be trusted to hold.
    pub verdict: Verdict,
    /// The sidecar's recording, when it could be read.
    pub recording: Option<Recording>,
    /// Whether the engine's stream ended with the recording, so that work
    /// still in flight at its end is a violation (an in-process engine
    /// whose recorder finished cleanly). False for a remote engine that ran
    /// on, an engine that restarted, and a recording that ended early.
    pub stream_complete: bool,
    /// Whether the losses are known (a sidecar that finished counting
    /// them): without them, holes in the sequence cannot be judged.
    pub losses_known: bool,
    /// Other things worth saying (the engine restarted, a torn tail cut).
    pub notes: Vec<String>,
}

/// What the log holds, as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LogHolds {
    /// Events read.
    pub events: u64,
    /// The first event's seq.
    pub first_seq: Option<u64>,
    /// The last event's seq.
    pub last_seq: Option<u64>,
}

/// Judges a recording: its sidecar as found, what opening the log found
/// (`info`, for the torn tail) and what reading it gave (`holds`).
pub fn assess(sidecar: &Sidecar, info: &LogInfo, holds: LogHolds) -> Assessment {
    let torn = info.torn_tail.as_ref().map(|t| {
        format!(
            "a torn tail of {} bytes in {} from byte {} is not read",
            t.bytes, t.segment, t.offset
        )
    });
    let rec = match sidecar {
        Sidecar::Missing => {
            return Assessment {
                verdict: Verdict::Unknown(format!(
                    "no sidecar ({SIDECAR}): the recorder never finished, or it was removed; \
                     whether events are missing at the end, and what was lost, cannot be told"
                )),
                recording: None,
                stream_complete: false,
                losses_known: false,
                notes: torn.into_iter().collect(),
            };
        }
        Sidecar::Unreadable(why) => {
            return Assessment {
                verdict: Verdict::Unknown(format!(
                    "{why}; whether events are missing at the end, and what was lost, cannot \
                     be told"
                )),
                recording: None,
                stream_complete: false,
                losses_known: false,
                notes: torn.into_iter().collect(),
            };
        }
        Sidecar::Present(r) => &**r,
    };
    let mut notes = Vec::new();
    let cut = |what: &str| {
        format!(
            "{what}; the log holds {} events{}, the recorder had taken {}",
            holds.events,
            holds
                .last_seq
                .map_or(String::new(), |s| format!(" up to seq {s}")),
            rec.events
        )
    };
    let (verdict, stream_complete, losses_known) = match &rec.ended {
        Ended::Unfinished => {
            notes.extend(torn);
            (
                Verdict::EndedEarly(format!(
                    "the recorder did not finish (it was killed or crashed: its sidecar still \
                     says it was recording); the log holds {} events{}, and whatever came after \
                     was never written",
                    holds.events,
                    holds
                        .last_seq
                        .map_or(String::new(), |s| format!(" up to seq {s}")),
                )),
                false,
                false,
            )
        }
        Ended::WriteFailed { error } => {
            notes.extend(torn);
            (
                Verdict::EndedEarly(cut(&format!("writing failed: {error}"))),
                false,
                true,
            )
        }
        Ended::Finished { .. } | Ended::NewRun { .. } => {
            let short = holds.events != rec.events || holds.last_seq != rec.last_seq;
            let verdict = if short {
                Verdict::Damaged(format!(
                    "the recorder finished cleanly after writing {} events{}, but the log \
                     holds {}{}: {}",
                    rec.events,
                    seq_range(rec.first_seq, rec.last_seq),
                    holds.events,
                    seq_range(holds.first_seq, holds.last_seq),
                    where_missing(rec, holds)
                ))
            } else if let Some(t) = torn {
                Verdict::Damaged(format!(
                    "the recorder finished cleanly, yet {t}: a recorder that finished leaves no \
                     torn tail"
                ))
            } else {
                Verdict::Whole
            };
            let complete = match &rec.ended {
                Ended::NewRun { run } => {
                    notes.push(format!(
                        "the engine restarted after this recording's last event (run {} → {run}){}; \
                         work in flight when it stopped is not judged",
                        rec.run.map_or("?".to_string(), |r| r.to_string()),
                        rec.next.as_ref().map_or(String::new(), |n| format!(
                            ": its next run is recorded in {}",
                            n.display()
                        ))
                    ));
                    false
                }
                _ => rec.stream_complete.unwrap_or(true),
            };
            (verdict, complete, true)
        }
    };
    if let Some(p) = &rec.previous {
        notes.push(format!(
            "this run began when the engine restarted; the run before is recorded in {}",
            p.display()
        ));
    }
    Assessment {
        verdict,
        recording: Some(rec.clone()),
        stream_complete,
        losses_known,
        notes,
    }
}

/// ` (seq A..=B)`, or nothing without events.
fn seq_range(first: Option<u64>, last: Option<u64>) -> String {
    match last {
        Some(_) => format!(" ({})", seq_span(first, last)),
        None => String::new(),
    }
}

/// A log's seqs for people: `seq A..=B`, `up to seq B`, or `no events`.
pub fn seq_span(first: Option<u64>, last: Option<u64>) -> String {
    match (first, last) {
        (Some(a), Some(b)) => format!("seq {a}..={b}"),
        (None, Some(b)) => format!("up to seq {b}"),
        (Some(a), None) => format!("from seq {a}"),
        (None, None) => "no events".to_string(),
    }
}

/// Where the events a finished recording wrote and its log does not hold
/// went missing, as far as its first and last seqs tell.
fn where_missing(rec: &Recording, holds: LogHolds) -> String {
    if holds.events > rec.events {
        return format!(
            "{} more than the sidecar counts, so the sidecar is not this log's (replaced or \
             edited)",
            holds.events - rec.events
        );
    }
    let missing = rec.events - holds.events;
    if holds.last_seq != rec.last_seq {
        format!(
            "{missing} are missing, its end among them (a damaged or removed last block or \
             segment; not a torn tail: a recorder that finished leaves none)"
        )
    } else if holds.first_seq != rec.first_seq && rec.first_seq.is_some() {
        format!("{missing} are missing, its start among them (a damaged or removed first segment)")
    } else {
        format!(
            "{missing} are missing from within it, its first and last events there (a segment \
             or block removed)"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log::{LogReader, ReaderOptions};
    use kvbm_events::RunId;

    fn info() -> LogInfo {
        LogReader::from_files(Vec::new(), ReaderOptions::default())
            .unwrap()
            .info()
            .clone()
    }

    fn rec(events: u64, ended: Ended) -> Recording {
        Recording {
            events,
            first_seq: (events > 0).then_some(0),
            last_seq: events.checked_sub(1),
            ended,
            ..Recording::default()
        }
    }

    fn holds(events: u64) -> LogHolds {
        LogHolds {
            events,
            first_seq: (events > 0).then_some(0),
            last_seq: events.checked_sub(1),
        }
    }

    #[test]
    fn a_short_log_says_where_its_events_went_missing() {
        let side = Sidecar::Present(Box::new(rec(10, Ended::Finished { why: String::new() })));
        let said = |first: Option<u64>, last: Option<u64>, events: u64| {
            let a = assess(
                &side,
                &info(),
                LogHolds {
                    events,
                    first_seq: first,
                    last_seq: last,
                },
            );
            match a.verdict {
                Verdict::Damaged(m) => m,
                v => panic!("{v:?}"),
            }
        };
        let end = said(Some(0), Some(6), 7);
        assert!(end.contains("3 are missing, its end among them"), "{end}");
        assert!(
            end.contains("(seq 0..=9)") && end.contains("(seq 0..=6)"),
            "{end}"
        );
        let start = said(Some(3), Some(9), 7);
        assert!(start.contains("its start among them"), "{start}");
        let within = said(Some(0), Some(9), 7);
        assert!(within.contains("missing from within it"), "{within}");
        let more = said(Some(0), Some(9), 12);
        assert!(more.contains("2 more than the sidecar counts"), "{more}");
        let none = said(None, None, 0);
        assert!(
            none.contains("10 are missing, its end among them"),
            "{none}"
        );
    }

    #[test]
    fn each_ending_gets_its_verdict() {
        let clean = Ended::Finished { why: "done".into() };
        let whole = assess(
            &Sidecar::Present(Box::new(rec(10, clean.clone()))),
            &info(),
            holds(10),
        );
        assert_eq!(whole.verdict, Verdict::Whole);
        assert!(whole.stream_complete && whole.losses_known);

        let short = assess(
            &Sidecar::Present(Box::new(rec(10, clean))),
            &info(),
            holds(7),
        );
        let Verdict::Damaged(m) = &short.verdict else {
            panic!("{short:?}")
        };
        assert!(m.contains("3 are missing"), "{m}");

        let killed = assess(
            &Sidecar::Present(Box::new(rec(0, Ended::Unfinished))),
            &info(),
            holds(7),
        );
        assert!(matches!(killed.verdict, Verdict::EndedEarly(_)));
        assert!(!killed.stream_complete && !killed.losses_known);

        let full = Ended::WriteFailed {
            error: "I/O error on 00.kvlog: No space left on device".into(),
        };
        let failed = assess(&Sidecar::Present(Box::new(rec(9, full))), &info(), holds(7));
        let Verdict::EndedEarly(m) = &failed.verdict else {
            panic!()
        };
        assert!(m.contains("00.kvlog") && m.contains("had taken 9"), "{m}");
        assert!(failed.losses_known);

        for s in [Sidecar::Missing, Sidecar::Unreadable("garbled".into())] {
            let a = assess(&s, &info(), holds(7));
            assert!(matches!(a.verdict, Verdict::Unknown(_)), "{a:?}");
            assert!(!a.losses_known && !a.stream_complete);
        }

        let mut restarted = rec(10, Ended::NewRun { run: RunId(2) });
        restarted.run = Some(RunId(1));
        restarted.next = Some("/tmp/r-run2".into());
        let a = assess(&Sidecar::Present(Box::new(restarted)), &info(), holds(10));
        assert_eq!(a.verdict, Verdict::Whole);
        assert!(!a.stream_complete);
        assert!(a.notes[0].contains("/tmp/r-run2"), "{:?}", a.notes);
    }
}
