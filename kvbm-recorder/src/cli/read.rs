//! The commands that read a log back: `inspect`, `replay`, `check`,
//! `stats`, `export` and `diff`.

use super::Format;
use anyhow::{Context, Result, bail};
use kvbm_events::Event;
use kvbm_recorder::analysis::{self, ReplayMode, Replayer};
use kvbm_recorder::progress::Progress;
use kvbm_recorder::recorder;
use std::io::{BufWriter, Write};
use std::path::Path;

/// Reads a log; damage becomes an error for commands that need it all.
fn load(dir: &Path) -> Result<(Vec<Event>, Option<String>)> {
    let total = recorder::open_log(dir)
        .map(|r| r.info().total_records)
        .unwrap_or(0);
    let p = Progress::new(total, "events read");
    let read = recorder::read_events(dir, |n| p.set(n))
        .with_context(|| format!("opening log {}", dir.display()))?;
    p.done();
    Ok((read.events, read.damage.map(|d| d.to_string())))
}

/// `inspect`: header, counts by kind, time range and losses.
pub fn inspect(log: &Path, json: bool) -> Result<i32> {
    let reader =
        recorder::open_log(log).with_context(|| format!("opening log {}", log.display()))?;
    let info = reader.info().clone();
    let (events, damage) = load(log)?;
    let st = kvbm_events::reducer::fold(&events);
    let counts: Vec<(&str, u64)> = st.counts_by_kind().filter(|(_, n)| *n > 0).collect();
    let side = recorder::read_sidecar(log);
    let v = serde_json::json!({
        "dir": log,
        "engine": info.header.as_ref().map(|h| h.engine_id),
        "schema_version": info.header.as_ref().map(|h| h.schema_version),
        "segments": info.segments.len(),
        "events": events.len(),
        "first_seq": info.first_seq,
        "last_seq": info.last_seq,
        "time_range_ns": info.time_range_ns,
        "counts_by_kind": counts.iter().map(|(k, n)| (k.to_string(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
        "lost": side.as_ref().map_or(0, |s| s.lost),
        "seq_gaps": st.seq_gaps(),
        "torn_tail_bytes": info.torn_tail_bytes,
        "damage": damage,
    });
    if json {
        println!("{v}");
        return Ok(0);
    }
    println!("log           {}", log.display());
    println!("segments      {}", info.segments.len());
    println!("events        {}", events.len());
    println!("seq           {:?} ..= {:?}", info.first_seq, info.last_seq);
    if let Some((a, b)) = info.time_range_ns {
        println!(
            "time          {:.3} s .. {:.3} s",
            a as f64 / 1e9,
            b as f64 / 1e9
        );
    }
    println!(
        "lost          {} (tap), {} (seq gaps)",
        v["lost"],
        st.seq_gaps()
    );
    println!("torn tail     {} bytes", info.torn_tail_bytes);
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
    let (events, damage) = load(log)?;
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
    if let Some(d) = damage {
        eprintln!("stopped early: {d}");
        return Ok(2);
    }
    Ok(0)
}

/// `check`: the invariants; 0 ok, 1 a violation, 2 a damaged log.
pub fn check(log: &Path) -> Result<i32> {
    let (events, damage) = load(log)?;
    let side = recorder::read_sidecar(log);
    // A recording from a remote source stops while the engine runs on:
    // transfers still in flight at its end are not lost.
    let complete = damage.is_none() && side.as_ref().is_none_or(|s| s.is_stream_complete());
    let report = recorder::check_recording(&events, side.as_ref(), complete);
    if let Some(d) = damage {
        println!("damaged log: {d}");
        return Ok(2);
    }
    match report.first_violation() {
        None => {
            println!("ok: {} events, invariants hold", events.len());
            Ok(0)
        }
        Some(v) => {
            println!("violation ({} in all): {v}", report.violation_count());
            Ok(1)
        }
    }
}

/// `stats`: time in each state, TTFT, transfer latency, batch sizes.
pub fn stats(log: &Path, json: bool) -> Result<i32> {
    let (events, _) = load(log)?;
    let s = analysis::stats::stats(&events, analysis::StatsConfig::default())?;
    if json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!("{s}");
    }
    Ok(0)
}

/// `export`: JSON lines or a Chrome trace, to a file or stdout.
pub fn export(log: &Path, format: Format, out: Option<&Path>) -> Result<i32> {
    let (events, damage) = load(log)?;
    let sink: Box<dyn Write> = match out {
        Some(p) => {
            Box::new(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)
        }
        None => Box::new(std::io::stdout().lock()),
    };
    let mut w = BufWriter::new(sink);
    match format {
        Format::Jsonl => analysis::export::write_jsonl(&events, &mut w)?,
        Format::Chrome => analysis::export::write_chrome_trace(
            &events,
            &mut w,
            analysis::ChromeOptions::default(),
        )?,
    };
    w.flush()?;
    if let Some(d) = damage {
        eprintln!("warning: the log is damaged; exported what came before: {d}");
    }
    Ok(0)
}

/// `diff`: the first divergence of two logs; 1 when they diverge.
pub fn diff(a: &Path, b: &Path) -> Result<i32> {
    let (ea, _) = load(a)?;
    let (eb, _) = load(b)?;
    match analysis::diff(&ea, &eb, &analysis::DiffOptions::default()) {
        None => {
            println!("no divergence ({} events each)", ea.len());
            Ok(0)
        }
        Some(d) => {
            println!("{d}");
            Ok(1)
        }
    }
}
