//! The commands that read a log back: `inspect`, `replay`, `check`,
//! `stats`, `export` and `diff`.

use super::Format;
use anyhow::{Context, Result, bail};
use kvbm_events::Event;
use kvbm_recorder::analysis::{self, ReplayMode, Replayer};
use kvbm_recorder::log::LogInfo;
use kvbm_recorder::progress::Progress;
use kvbm_recorder::recorder::{self, Ended};
use kvbm_recorder::sidecar::{self, Sidecar};
use kvbm_recorder::verdict::{self, Assessment, LogHolds, Verdict};
use std::io::{BufWriter, Write};
use std::path::Path;

/// A log read whole: its index's view (taken when it was opened), the
/// events read, and the damage that stopped the read, if any.
struct Loaded {
    info: LogInfo,
    events: Vec<Event>,
    damage: Option<String>,
}

/// Reads a log, opened once, with a progress line for long reads.
fn load(dir: &Path) -> Result<Loaded> {
    let reader =
        recorder::open_log(dir).with_context(|| format!("opening log {}", dir.display()))?;
    let p = Progress::new(reader.info().total_records, "events read");
    let read = recorder::read_all(&reader, |n| p.set(n));
    p.done();
    Ok(Loaded {
        info: reader.info().clone(),
        events: read.events,
        damage: read.damage.map(|d| d.to_string()),
    })
}

/// Reads a log for a command that works on whatever it holds (`stats`,
/// `export`, `diff`, `replay`, `capacity`): its events, and what makes
/// them fewer than the recording's, to be said beside the results: damage
/// that stopped the read, or a finished recording whose log holds fewer
/// events than were written (a segment removed).
pub fn load_for_analysis(dir: &Path) -> Result<(Vec<Event>, Option<String>)> {
    let Loaded {
        info,
        events,
        damage,
    } = load(dir)?;
    if damage.is_some() {
        return Ok((events, damage));
    }
    let (_, a) = assess(dir, &info, &events);
    let problem = match a.verdict {
        Verdict::Damaged(why) => Some(why),
        _ => None,
    };
    Ok((events, problem))
}

/// Says on stderr that the results of `log` cover only what was read,
/// when something was wrong with it; the exit status (2 then, as `check`
/// gives a damaged log).
fn warn_partial(log: &Path, problem: Option<&str>, what: &str) -> i32 {
    match problem {
        None => 0,
        Some(p) => {
            eprintln!("warning: {}: {p}", log.display());
            eprintln!("warning: {what}");
            2
        }
    }
}

/// What the recording in `log` can be trusted to hold, given what was read.
fn assess(log: &Path, info: &LogInfo, events: &[Event]) -> (Sidecar, Assessment) {
    let side = sidecar::load(log);
    let holds = LogHolds {
        events: events.len() as u64,
        first_seq: events.first().map(|e| e.seq),
        last_seq: events.last().map(|e| e.seq),
    };
    let a = verdict::assess(&side, info, holds);
    (side, a)
}

/// How a recording ended, in a few words.
fn ending(side: &Sidecar) -> String {
    match side {
        Sidecar::Missing => "unknown (no sidecar)".into(),
        Sidecar::Unreadable(why) => format!("unknown ({why})"),
        Sidecar::Present(r) => match &r.ended {
            Ended::Unfinished => {
                "never said: the recorder was killed or crashed while recording".into()
            }
            Ended::Finished { why } if why.is_empty() => "finished".into(),
            Ended::Finished { why } => format!("finished ({why})"),
            Ended::NewRun { run } => format!(
                "the engine restarted: its new run {run} is recorded in {}",
                r.next
                    .as_ref()
                    .map_or("(not recorded)".to_string(), |n| n.display().to_string())
            ),
            Ended::WriteFailed { error } => format!("writing failed: {error}"),
        },
    }
}

/// `inspect`: header, counts by kind, time range, losses and how the
/// recording ended.
pub fn inspect(log: &Path, json: bool) -> Result<i32> {
    let Loaded {
        info,
        events,
        damage,
    } = load(log)?;
    let st = kvbm_events::reducer::fold(&events);
    let counts: Vec<(&str, u64)> = st.counts_by_kind().filter(|(_, n)| *n > 0).collect();
    let (side, a) = assess(log, &info, &events);
    let rec = side.recording();
    // What was read, not what the index says the segments hold: after
    // damage the two differ, and the index's range would claim events no
    // reader can reach.
    let (first_seq, last_seq) = (events.first().map(|e| e.seq), events.last().map(|e| e.seq));
    let time_range_ns = events.iter().fold(None, |r: Option<(u64, u64)>, e| {
        Some(r.map_or((e.ts_ns, e.ts_ns), |(a, z)| {
            (a.min(e.ts_ns), z.max(e.ts_ns))
        }))
    });
    // Losses are known only from a sidecar that finished counting them.
    let lost = rec.filter(|_| a.losses_known).map(|r| r.lost);
    let v = serde_json::json!({
        "dir": log,
        "engine": info.header.as_ref().map(|h| h.engine_id),
        "run": rec.and_then(|r| r.run).map(|r| r.to_string()),
        "schema_version": info.header.as_ref().map(|h| h.schema_version),
        "segments": info.segments.len(),
        "events": events.len(),
        "events_written": rec.map(|r| r.events),
        "first_seq": first_seq,
        "last_seq": last_seq,
        "time_range_ns": time_range_ns,
        "indexed_last_seq": info.last_seq,
        "counts_by_kind": counts.iter().map(|(k, n)| (k.to_string(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
        "lost": lost,
        "seq_gaps": st.seq_gaps(),
        "torn_tail_bytes": info.torn_tail_bytes,
        "damage": damage,
        "sidecar": match &side {
            Sidecar::Present(_) => "present".to_string(),
            Sidecar::Missing => "missing".to_string(),
            Sidecar::Unreadable(why) => format!("unreadable: {why}"),
        },
        "ended": rec.map(|r| &r.ended),
        "verdict": a.verdict.name(),
        "verdict_detail": a.verdict.to_string(),
        "previous": rec.and_then(|r| r.previous.as_ref()),
        "next": rec.and_then(|r| r.next.as_ref()),
        "engine_info": rec.and_then(|r| r.engine_info.as_ref()),
        "notes": a.notes,
    });
    if json {
        println!("{v}");
        return Ok(0);
    }
    println!("log           {}", log.display());
    if let Some(run) = rec.and_then(|r| r.run) {
        println!("run           {run}");
    }
    if let Some(summary) = rec.and_then(|r| r.engine_summary()) {
        println!("runs as       {summary}");
    }
    println!("segments      {}", info.segments.len());
    match rec {
        Some(r) if a.losses_known => {
            println!(
                "events        {} (the recorder wrote {})",
                events.len(),
                r.events
            )
        }
        _ => println!("events        {}", events.len()),
    }
    println!("seq           {}", verdict::seq_span(first_seq, last_seq));
    if let Some((a, b)) = time_range_ns {
        println!(
            "time          {:.3} s .. {:.3} s",
            a as f64 / 1e9,
            b as f64 / 1e9
        );
    }
    match lost {
        Some(n) => {
            // Who counted the losses: the local tap, a remote server's
            // gaps, or batches missing from vLLM's publisher.
            let counted_by = match rec.and_then(|r| r.source.as_deref()) {
                None => "tap",
                Some(s) if s.starts_with("zmq://") => "publisher batches",
                Some(_) => "gaps the server reported",
            };
            println!(
                "lost          {n} ({counted_by}), {} (seq gaps)",
                st.seq_gaps()
            )
        }
        None => println!(
            "lost          unknown (no finished sidecar), {} (seq gaps)",
            st.seq_gaps()
        ),
    }
    println!("torn tail     {} bytes", info.torn_tail_bytes);
    println!("ended         {}", ending(&side));
    println!("verdict       {}", a.verdict);
    for n in &a.notes {
        println!("note          {n}");
    }
    if let Some(d) = &damage {
        println!("damage        {d}");
    }
    for (k, n) in counts {
        println!("  {k:<20} {n}");
    }
    Ok(0)
}

/// `replay`: the log through the reducer, as fast as possible or paced.
pub fn replay(
    log: &Path,
    speed: Option<f64>,
    until_seq: Option<u64>,
    verbose: bool,
) -> Result<i32> {
    let (events, damage) = load_for_analysis(log)?;
    let mode = match speed {
        Some(s) if !(s.is_finite() && s > 0.0) => {
            bail!("--speed must be a positive number")
        }
        Some(s) => ReplayMode::RealTime { speed: s },
        None => ReplayMode::AsFastAsPossible,
    };
    let mut r = Replayer::from_events(events, mode);
    let mut n = 0u64;
    while let Some(ev) = r.next_event() {
        if verbose {
            println!("{} {} {:?} {:?}", ev.seq, ev.ts_ns, ev.request, ev.kind);
        }
        n += 1;
        if until_seq.is_some_and(|u| ev.seq >= u) {
            break;
        }
    }
    println!("replayed {n} events");
    println!("{}", r.state().summary());
    Ok(warn_partial(
        log,
        damage.as_deref(),
        &format!("replayed the {n} events read"),
    ))
}

/// `check`'s exit status when the invariants hold over what is there,
/// but the recording ended early or its completeness is unknown.
pub const EXIT_INCOMPLETE: i32 = 3;

/// The worse of two `check` statuses: damaged (2), then a violation (1),
/// then incomplete or unknown (3), then ok (0).
pub fn worse(a: i32, b: i32) -> i32 {
    let rank = |c: i32| match c {
        2 => 3,
        1 => 2,
        EXIT_INCOMPLETE => 1,
        _ => 0,
    };
    if rank(b) > rank(a) { b } else { a }
}

/// `check`: the invariants; 0 ok, 1 a violation, 2 a damaged log (or a
/// cleanly finished recording missing events), 3 a recording that ended
/// early (recorder killed, disk full) or whose completeness is unknown (no
/// usable sidecar), with no violation in what is there.
pub fn check(log: &Path) -> Result<i32> {
    check_one(log, "")
}

/// [`check`] of one log, each line it prints led by `prefix` (a fleet
/// recording's engine name).
pub fn check_one(log: &Path, prefix: &str) -> Result<i32> {
    let judged = judge(log)?;
    for line in &judged.lines {
        println!("{prefix}{line}");
    }
    Ok(judged.code)
}

/// What `check` says of a log: its exit status and lines, and the
/// events read.
pub struct Judged {
    /// `check`'s exit status.
    pub code: i32,
    /// What it prints.
    pub lines: Vec<String>,
    /// The events read (up to any damage).
    pub events: Vec<Event>,
}

/// [`check`] of one log, without printing.
pub fn judge(log: &Path) -> Result<Judged> {
    let Loaded {
        info,
        events,
        damage,
    } = load(log)?;
    let (_, a) = assess(log, &info, &events);
    let mut lines = Vec::new();
    if let Some(d) = damage.or(match &a.verdict {
        Verdict::Damaged(why) => Some(why.clone()),
        _ => None,
    }) {
        lines.push(format!("damaged log: {d}"));
        return Ok(Judged {
            code: 2,
            lines,
            events,
        });
    }
    // A recording that stopped while its engine ran on, or whose engine
    // restarted, or that ended early: what was in flight at its end is
    // not judged; and without known losses, neither are the holes.
    let report = recorder::check_recording_with(
        &events,
        a.recording.as_ref(),
        a.stream_complete,
        a.losses_known,
    );
    let mut what = format!("{} events", events.len());
    if let Some(s) = events.last().map(|e| e.seq) {
        what.push_str(&format!(" (up to seq {s})"));
    }
    if report.not_judged_before_start > 0 {
        what.push_str(&format!(
            "; not judged: {} events on requests, transfers or blocks that began before \
             its first event (the engine ran before the recording started)",
            report.not_judged_before_start
        ));
    }
    if !report.unreleased_at_end.is_empty() || !report.promoted_in_flight.is_empty() {
        what.push_str(&format!(
            "; not judged at the cut: {} promoted transfers in flight, {} finished slots \
             awaiting their release",
            report.promoted_in_flight.len(),
            report.unreleased_at_end.len()
        ));
    }
    let code = match report.first_violation() {
        Some(v) => {
            lines.push(format!(
                "violation ({} in all): {v}",
                report.violation_count()
            ));
            1
        }
        None => match &a.verdict {
            Verdict::Whole => {
                lines.push(format!("ok: {what}, invariants hold"));
                0
            }
            Verdict::EndedEarly(why) => {
                lines.push(format!("ended early: {why}"));
                lines.push(format!("  invariants hold over the {what}"));
                EXIT_INCOMPLETE
            }
            Verdict::Unknown(why) => {
                lines.push(format!("unknown: {why}"));
                lines.push(format!("  invariants hold over the {what}"));
                EXIT_INCOMPLETE
            }
            Verdict::Damaged(_) => 2,
        },
    };
    if code == 1 && !matches!(a.verdict, Verdict::Whole) {
        lines.push(format!("  note: {}", a.verdict));
    }
    for n in &a.notes {
        lines.push(format!("  note: {n}"));
    }
    Ok(Judged {
        code,
        lines,
        events,
    })
}

/// `stats`: time in each state, TTFT, transfer latency, batch sizes.
pub fn stats(log: &Path, json: bool) -> Result<i32> {
    let (events, problem) = load_for_analysis(log)?;
    let s = analysis::stats::stats(&events, analysis::StatsConfig::default())?;
    if json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!("{s}");
    }
    Ok(warn_partial(
        log,
        problem.as_deref(),
        &format!("the figures cover the {} events read", events.len()),
    ))
}

/// Refuses an output file inside the recording being read: writing there
/// would replace one of its files (a segment, its sidecar) or leave one
/// that is not its own among them.
pub fn refuse_output_inside(out: &Path, recording: &Path) -> Result<()> {
    // What cannot be resolved is left to the read or the write, which
    // fail naming it.
    let Ok(rec) = recording.canonicalize() else {
        return Ok(());
    };
    let resolved = match out.canonicalize() {
        Ok(p) => p, // it exists (a link is followed, as writing would)
        Err(_) => {
            let parent = out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let Ok(dir) = parent.canonicalize() else {
                return Ok(());
            };
            match out.file_name() {
                Some(name) => dir.join(name),
                None => dir,
            }
        }
    };
    if resolved.starts_with(&rec) {
        bail!(
            "{} is inside the recording {}: writing there would overwrite or add to its files; \
             write the output elsewhere",
            out.display(),
            recording.display()
        );
    }
    Ok(())
}

/// Where an output goes: the file `out` (created or truncated), or stdout.
pub fn output(out: Option<&Path>) -> Result<Box<dyn Write>> {
    Ok(match out {
        Some(p) => {
            Box::new(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => Box::new(std::io::stdout().lock()),
    })
}

/// Writes `events` as `format` to `out` (a file) or stdout.
pub fn write_export(events: &[Event], format: Format, out: Option<&Path>) -> Result<()> {
    let mut w = BufWriter::new(output(out)?);
    match format {
        Format::Jsonl => analysis::export::write_jsonl(events, &mut w)?,
        Format::Chrome => analysis::export::write_chrome_trace(
            events,
            &mut w,
            analysis::ChromeOptions::default(),
        )?,
        Format::Mooncake => {
            write_mooncake(events, &mut w, out)?;
            0
        }
    };
    w.flush()?;
    Ok(())
}

/// The requests of `events` as a Mooncake trace into `w`; what the trace
/// leaves out (block size, tiers, the simulator's flags) beside `out` as
/// `OUT.meta.json`, or on stderr when the trace goes to stdout.
fn write_mooncake(events: &[Event], w: &mut impl Write, out: Option<&Path>) -> Result<()> {
    let (requests, meta) = analysis::mooncake::trace_of(events);
    analysis::mooncake::write_trace(&requests, &mut *w)?;
    let text = serde_json::to_string_pretty(&meta)?;
    match out {
        Some(p) => {
            let mut side = p.as_os_str().to_owned();
            side.push(".meta.json");
            std::fs::write(&side, text + "\n")
                .with_context(|| format!("writing {}", Path::new(&side).display()))?;
        }
        None => eprintln!("{text}"),
    }
    if meta.skipped_no_lookup > 0 {
        eprintln!(
            "warning: {} requests left out of the trace: no prefix lookup recorded for them",
            meta.skipped_no_lookup
        );
    }
    if requests.is_empty() {
        bail!("no request in the recording has a prefix lookup: nothing to write as a trace");
    }
    Ok(())
}

/// `export`: JSON lines or a Chrome trace, to a file or stdout.
pub fn export(log: &Path, format: Format, out: Option<&Path>) -> Result<i32> {
    let (events, problem) = load_for_analysis(log)?;
    write_export(&events, format, out)?;
    Ok(warn_partial(
        log,
        problem.as_deref(),
        &format!("exported the {} events read", events.len()),
    ))
}

/// `diff`: the first divergence of two logs; 1 when they diverge, 2 when
/// either is damaged (what was compared is then not the recordings).
pub fn diff(a: &Path, b: &Path) -> Result<i32> {
    let (ea, pa) = load_for_analysis(a)?;
    let (eb, pb) = load_for_analysis(b)?;
    let code = match analysis::diff(&ea, &eb, &analysis::DiffOptions::default()) {
        None => {
            println!("no divergence ({} events each)", ea.len());
            0
        }
        Some(d) => {
            println!("{d}");
            1
        }
    };
    // Damage decides the status: what was compared is not the recordings.
    let da = warn_partial(
        a,
        pa.as_deref(),
        &format!("compared the {} events read", ea.len()),
    );
    let db = warn_partial(
        b,
        pb.as_deref(),
        &format!("compared the {} events read", eb.len()),
    );
    Ok(if da != 0 || db != 0 { 2 } else { code })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_status_is_damage_then_violation_then_incomplete() {
        assert_eq!(worse(0, 3), 3);
        assert_eq!(worse(3, 1), 1);
        assert_eq!(worse(1, 3), 1);
        assert_eq!(worse(2, 1), 2);
        assert_eq!(worse(1, 2), 2);
        assert_eq!(worse(0, 0), 0);
    }
}
