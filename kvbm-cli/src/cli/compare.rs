//! `compare`: two recordings side by side, and the gates a CI job holds
//! the new one to (exit 1 naming each failed gate, 2 for damage).

use super::read::{Judged, judge};
use anyhow::{Context, Result};
use kvbm_recorder::analysis::compare::{
    Gate, GateResult, Summary, evaluate, fmt_delta, fmt_value, write_junit,
};
use std::collections::BTreeMap;
use std::path::Path;

/// A recording's summary and `check`'s first line and status.
struct Side {
    summary: Summary,
    metrics: BTreeMap<String, f64>,
    verdict: String,
    code: i32,
}

fn side(log: &Path) -> Result<Side> {
    let Judged {
        code,
        lines,
        events,
    } = judge(log)?;
    let summary =
        Summary::from_events(&events).with_context(|| format!("summarising {}", log.display()))?;
    Ok(Side {
        metrics: summary.metrics(),
        summary,
        verdict: lines.first().cloned().unwrap_or_default(),
        code,
    })
}

fn print_table(b: &Side, n: &Side, results: &[GateResult]) {
    let names: std::collections::BTreeSet<&String> =
        b.metrics.keys().chain(n.metrics.keys()).collect();
    println!("{:<28}{:>16}{:>16}  delta", "metric", "base", "new");
    for name in names {
        let (x, y) = (
            b.metrics.get(name).copied().unwrap_or(0.0),
            n.metrics.get(name).copied().unwrap_or(0.0),
        );
        println!(
            "{name:<28}{:>16}{:>16}  {}",
            fmt_value(x),
            fmt_value(y),
            fmt_delta(x, y)
        );
    }
    println!("check (base): {}", b.verdict);
    println!("check (new):  {}", n.verdict);
    if !results.is_empty() {
        let failed = results.iter().filter(|r| !r.passed).count();
        println!(
            "gates: {} of {} passed",
            results.len() - failed,
            results.len()
        );
        for r in results {
            println!("  {}  [{}]", r, r.gate.text);
        }
    }
}

/// `compare BASE NEW`: the exit status is 2 when either log is damaged,
/// else 1 when a gate failed, else 0.
pub fn compare(
    base: &Path,
    new: &Path,
    expect: &[String],
    junit: Option<&Path>,
    json: bool,
) -> Result<i32> {
    // Gates are read before the logs: a typo costs no read.
    let gates = expect
        .iter()
        .map(|g| Gate::parse(g))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(j) = junit {
        super::read::refuse_output_inside(j, base)?;
        super::read::refuse_output_inside(j, new)?;
    }
    let (b, n) = (side(base)?, side(new)?);
    let results = evaluate(&gates, &b.metrics, &n.metrics)?;
    if let Some(j) = junit {
        let f = std::fs::File::create(j).with_context(|| format!("creating {}", j.display()))?;
        write_junit(
            &results,
            "kvbm-recorder compare",
            std::io::BufWriter::new(f),
        )
        .with_context(|| format!("writing {}", j.display()))?;
    }
    if json {
        let deltas: BTreeMap<&String, f64> = n
            .metrics
            .iter()
            .map(|(k, v)| (k, v - b.metrics.get(k).copied().unwrap_or(0.0)))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "base": {"summary": b.summary, "metrics": b.metrics, "check": b.verdict, "check_exit": b.code},
                "new": {"summary": n.summary, "metrics": n.metrics, "check": n.verdict, "check_exit": n.code},
                "deltas": deltas,
                "gates": results,
            })
        );
    } else {
        print_table(&b, &n, &results);
    }
    for r in results.iter().filter(|r| !r.passed) {
        eprintln!("gate failed: {r}  [{}]", r.gate.text);
    }
    Ok(if b.code == 2 || n.code == 2 {
        2
    } else if results.iter().any(|r| !r.passed) {
        1
    } else {
        0
    })
}
