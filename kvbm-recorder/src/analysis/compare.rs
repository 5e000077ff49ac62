//! `kvbm-recorder compare BASE NEW`: two recordings' figures side by side,
//! and the gates a CI job holds the new one to.
//!
//! [`Summary`] reads the figures a team changing its KV configuration asks
//! about from one stream: requests and prompt tokens, the hit ratio per
//! tier, TTFT, bytes and latency moved per direction, evictions per tier,
//! preemptions. [`Summary::metrics`] flattens them under the names gates
//! use (`hit_ratio`, `hit_ratio.G2`, `ttft_p99_ms`, `evictions.G2`,
//! `transfer_bytes.G1->G2`, ...).
//!
//! A [`Gate`] is `METRIC OP RHS`: `OP` one of `>=`, `<=`, `>`, `<`, `==`;
//! `RHS` a number, or `base` scaled and shifted (`base`, `1.10*base`,
//! `base+5`, `0.9*base-1`), where `base` is the metric's value in the base
//! recording. [`evaluate`] checks every gate and says, for each, the new
//! value, the base value and the threshold; [`write_junit`] writes them as
//! JUnit XML, one test case a gate, which CI systems render.

use super::stats::{StatsConfig, StatsError, stats};
use kvbm_events::{Event, EventKind, SlotState, Tier};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};

/// One recording's figures.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Requests seen.
    pub requests: u64,
    /// Requests that finished.
    pub finished: u64,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Prefix-hit tokens per tier (`G1`, `G2`, `G3`) and `external`
    /// (another connector's), over all requests.
    pub hit_tokens: BTreeMap<String, u64>,
    /// Time to first token, ms: median and 99th percentile.
    pub ttft_p50_ms: f64,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: f64,
    /// Bytes moved per direction (`G1->G2`, ...), completed batches.
    pub transfer_bytes: BTreeMap<String, u64>,
    /// Planned-to-completed latency per direction, ms: median.
    pub transfer_p50_ms: BTreeMap<String, f64>,
    /// Blocks evicted per tier.
    pub evictions: BTreeMap<String, u64>,
    /// Times a request was preempted.
    pub preemptions: u64,
}

fn tier_name(t: Tier) -> String {
    t.short_name().to_string()
}

/// A direction's name with an ASCII arrow, as gates spell it.
fn direction_name(d: &str) -> String {
    d.replace('→', "->")
}

impl Summary {
    /// The figures of `events`.
    pub fn from_events(events: &[Event]) -> Result<Summary, StatsError> {
        let st = stats(events, StatsConfig::default())?;
        let state = kvbm_events::reducer::fold(events);
        let mut s = Summary {
            requests: st.requests,
            finished: st.finished,
            ttft_p50_ms: st.ttft_ns.p50 as f64 / 1e6,
            ttft_p99_ms: st.ttft_ns.p99 as f64 / 1e6,
            ..Summary::default()
        };
        for t in Tier::ALL {
            s.hit_tokens.insert(tier_name(t), 0);
            s.evictions.insert(tier_name(t), 0);
        }
        s.hit_tokens.insert("external".into(), 0);
        for slot in state.slots() {
            s.prompt_tokens += u64::from(slot.prompt_tokens);
            for t in Tier::ALL {
                *s.hit_tokens.entry(tier_name(t)).or_default() += slot.hit_tokens[t.index()];
            }
            *s.hit_tokens.entry("external".into()).or_default() += slot.external_tokens;
        }
        for (dir, p) in &st.transfer_latency_ns {
            s.transfer_p50_ms
                .insert(direction_name(dir), p.p50 as f64 / 1e6);
        }
        for e in events {
            match &e.kind {
                EventKind::BatchCompleted {
                    direction,
                    ok: true,
                    bytes,
                    ..
                } => {
                    *s.transfer_bytes
                        .entry(direction_name(&direction.to_string()))
                        .or_default() += bytes;
                }
                EventKind::BlockEvicted { tier, .. } => {
                    *s.evictions.entry(tier_name(*tier)).or_default() += 1;
                }
                EventKind::SlotTransition {
                    to: SlotState::Preempted,
                    ..
                } => s.preemptions += 1,
                _ => {}
            }
        }
        Ok(s)
    }

    /// Hit tokens over prompt tokens: all tiers, or one.
    fn ratio(&self, hits: u64) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            hits as f64 / self.prompt_tokens as f64
        }
    }

    /// The figures under the names gates use.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        m.insert("requests".into(), self.requests as f64);
        m.insert("finished".into(), self.finished as f64);
        m.insert("prompt_tokens".into(), self.prompt_tokens as f64);
        let all: u64 = self.hit_tokens.values().sum();
        m.insert("hit_ratio".into(), self.ratio(all));
        for (t, h) in &self.hit_tokens {
            m.insert(format!("hit_ratio.{t}"), self.ratio(*h));
        }
        m.insert("ttft_p50_ms".into(), self.ttft_p50_ms);
        m.insert("ttft_p99_ms".into(), self.ttft_p99_ms);
        for (d, b) in &self.transfer_bytes {
            m.insert(format!("transfer_bytes.{d}"), *b as f64);
        }
        for (d, p) in &self.transfer_p50_ms {
            m.insert(format!("transfer_p50_ms.{d}"), *p);
        }
        for (t, n) in &self.evictions {
            m.insert(format!("evictions.{t}"), *n as f64);
        }
        m.insert("preemptions".into(), self.preemptions as f64);
        m
    }
}

/// A gate's comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Op {
    /// `>=`
    Ge,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `<`
    Lt,
    /// `==`
    Eq,
}

impl Op {
    fn text(self) -> &'static str {
        match self {
            Op::Ge => ">=",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Lt => "<",
            Op::Eq => "==",
        }
    }

    fn holds(self, a: f64, b: f64) -> bool {
        match self {
            Op::Ge => a >= b,
            Op::Le => a <= b,
            Op::Gt => a > b,
            Op::Lt => a < b,
            Op::Eq => a == b,
        }
    }
}

/// What a gate compares against: `factor * base + offset`, or a number
/// (`factor` 0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rhs {
    /// Times the base recording's value (0: not used).
    pub factor: f64,
    /// Added.
    pub offset: f64,
}

/// `METRIC OP RHS`, as written on the command line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gate {
    /// As written.
    pub text: String,
    /// The metric's name.
    pub metric: String,
    /// The comparison.
    pub op: Op,
    /// The right-hand side.
    pub rhs: Rhs,
}

/// A gate that does not read, or names no metric of the recordings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    /// No operator.
    #[error("gate '{0}': expected METRIC OP VALUE with OP one of >= <= > < ==")]
    NoOperator(String),
    /// No metric name before the operator.
    #[error("gate '{0}': no metric before the operator")]
    NoMetric(String),
    /// The right-hand side is not a number or `[F*]base[±N]`.
    #[error("gate '{gate}': '{rhs}' is not a number, nor base, F*base, base+N or F*base-N")]
    BadValue {
        /// The gate.
        gate: String,
        /// Its right-hand side.
        rhs: String,
    },
    /// Neither recording has the metric.
    #[error("gate '{gate}': no metric '{metric}' in these recordings (they have: {known})")]
    UnknownMetric {
        /// The gate.
        gate: String,
        /// The name.
        metric: String,
        /// The names they have.
        known: String,
    },
}

fn number(s: &str) -> Option<f64> {
    let v: f64 = s.trim().parse().ok()?;
    v.is_finite().then_some(v)
}

fn parse_rhs(s: &str) -> Option<Rhs> {
    let s = s.trim();
    let Some(at) = s.find("base") else {
        return number(s).map(|offset| Rhs {
            factor: 0.0,
            offset,
        });
    };
    let (before, after) = (s[..at].trim(), s[at + 4..].trim());
    let factor = if before.is_empty() {
        1.0
    } else {
        number(before.strip_suffix('*')?)?
    };
    let offset = match after.chars().next() {
        None => 0.0,
        Some('+') => number(&after[1..])?,
        Some('-') => -number(&after[1..])?,
        Some(_) => return None,
    };
    Some(Rhs { factor, offset })
}

impl Gate {
    /// Reads `METRIC OP RHS` (spaces optional). A metric name is letters,
    /// digits, `_`, `.` and `->` (a direction: `transfer_bytes.G1->G2`).
    pub fn parse(text: &str) -> Result<Gate, GateError> {
        let b = text.as_bytes();
        let mut i = 0;
        while i < b.len() {
            if b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'.' {
                i += 1;
            } else if b[i..].starts_with(b"->") {
                i += 2;
            } else {
                break;
            }
        }
        let metric = text[..i].trim();
        let rest = text[i..].trim_start();
        let at = text.len() - rest.len();
        // Two-character operators first, so `>=` is not read as `>`.
        let Some(op_text) = ["<=", ">=", "==", "<", ">"]
            .into_iter()
            .find(|op| rest.starts_with(op))
        else {
            return Err(GateError::NoOperator(text.to_string()));
        };
        if metric.is_empty() {
            return Err(GateError::NoMetric(text.to_string()));
        }
        let op = match op_text {
            ">=" => Op::Ge,
            "<=" => Op::Le,
            ">" => Op::Gt,
            "<" => Op::Lt,
            _ => Op::Eq,
        };
        let rhs_text = &text[at + op_text.len()..];
        let rhs = parse_rhs(rhs_text).ok_or_else(|| GateError::BadValue {
            gate: text.to_string(),
            rhs: rhs_text.trim().to_string(),
        })?;
        Ok(Gate {
            text: text.to_string(),
            metric: metric.to_string(),
            op,
            rhs,
        })
    }
}

/// One gate, judged.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateResult {
    /// The gate.
    pub gate: Gate,
    /// The new recording's value.
    pub value: f64,
    /// The base recording's value.
    pub base: f64,
    /// What it was compared with.
    pub threshold: f64,
    /// Whether it held.
    pub passed: bool,
}

impl fmt::Display for GateResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} = {} (base {}), wanted {} {}",
            if self.passed { "passed" } else { "FAILED" },
            self.gate.metric,
            fmt_value(self.value),
            fmt_value(self.base),
            self.gate.op.text(),
            fmt_value(self.threshold)
        )
    }
}

/// A value as tables show it: integers whole, others to 4 significant
/// decimals.
pub fn fmt_value(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

/// NEW against BASE as the compare table shows it: `=` when equal, else
/// the signed difference and, from a non-zero base, the change in percent
/// (`+0.0120 (+1.7%)`).
pub fn fmt_delta(base: f64, new: f64) -> String {
    let d = new - base;
    if d == 0.0 {
        return "=".into();
    }
    let pct = if base != 0.0 {
        format!(" ({:+.1}%)", 100.0 * d / base.abs())
    } else {
        String::new()
    };
    format!("{}{}{pct}", if d > 0.0 { "+" } else { "" }, fmt_value(d))
}

/// Judges every gate: the new recording's metrics against the base's.
/// A metric one recording lacks (a direction it never moved) counts as 0
/// there; a metric neither has is an error naming the ones they have.
pub fn evaluate(
    gates: &[Gate],
    base: &BTreeMap<String, f64>,
    new: &BTreeMap<String, f64>,
) -> Result<Vec<GateResult>, GateError> {
    gates
        .iter()
        .map(|g| {
            if !base.contains_key(&g.metric) && !new.contains_key(&g.metric) {
                // Both maps are sorted: their union, once each, in order.
                let known: std::collections::BTreeSet<&str> =
                    base.keys().chain(new.keys()).map(String::as_str).collect();
                return Err(GateError::UnknownMetric {
                    gate: g.text.clone(),
                    metric: g.metric.clone(),
                    known: known.into_iter().collect::<Vec<_>>().join(", "),
                });
            }
            let value = new.get(&g.metric).copied().unwrap_or(0.0);
            let b = base.get(&g.metric).copied().unwrap_or(0.0);
            let threshold = g.rhs.factor * b + g.rhs.offset;
            Ok(GateResult {
                gate: g.clone(),
                value,
                base: b,
                threshold,
                passed: g.op.holds(value, threshold),
            })
        })
        .collect()
}

fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 has no form for most control characters.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('?'),
            c => out.push(c),
        }
    }
    out
}

/// The gates as JUnit XML: one `testsuite` named `suite`, one `testcase`
/// a gate, a `failure` in each that failed saying its values.
pub fn write_junit<W: Write>(results: &[GateResult], suite: &str, mut w: W) -> io::Result<()> {
    let failures = results.iter().filter(|r| !r.passed).count();
    writeln!(w, r#"<?xml version="1.0" encoding="UTF-8"?>"#)?;
    writeln!(
        w,
        r#"<testsuites tests="{}" failures="{failures}">"#,
        results.len()
    )?;
    writeln!(
        w,
        r#"  <testsuite name="{}" tests="{}" failures="{failures}">"#,
        xml_escape(suite),
        results.len()
    )?;
    for r in results {
        let name = xml_escape(&r.gate.text);
        if r.passed {
            writeln!(
                w,
                r#"    <testcase classname="kvbm.compare" name="{name}"/>"#
            )?;
        } else {
            writeln!(
                w,
                r#"    <testcase classname="kvbm.compare" name="{name}">"#
            )?;
            writeln!(
                w,
                r#"      <failure message="{}"/>"#,
                xml_escape(&r.to_string())
            )?;
            writeln!(w, "    </testcase>")?;
        }
    }
    writeln!(w, "  </testsuite>")?;
    writeln!(w, "</testsuites>")?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn metrics(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn deltas_are_signed_with_a_percent_from_a_non_zero_base() {
        assert_eq!(fmt_delta(0.5, 0.5), "=");
        assert_eq!(fmt_delta(100.0, 110.0), "+10 (+10.0%)");
        assert_eq!(fmt_delta(0.7, 0.35), "-0.3500 (-50.0%)");
        assert_eq!(fmt_delta(0.0, 3.0), "+3");
    }

    #[test]
    fn gates_read_numbers_and_scaled_bases() {
        let g = Gate::parse("hit_ratio >= 0.55").unwrap();
        assert_eq!((g.metric.as_str(), g.op), ("hit_ratio", Op::Ge));
        assert_eq!(
            g.rhs,
            Rhs {
                factor: 0.0,
                offset: 0.55
            }
        );
        let g = Gate::parse("ttft_p99_ms<=1.10*base").unwrap();
        assert_eq!(g.op, Op::Le);
        assert_eq!(
            g.rhs,
            Rhs {
                factor: 1.10,
                offset: 0.0
            }
        );
        let g = Gate::parse("evictions.G2 <= base").unwrap();
        assert_eq!(
            g.rhs,
            Rhs {
                factor: 1.0,
                offset: 0.0
            }
        );
        let g = Gate::parse("transfer_bytes.G1->G2 > 0.9*base - 10").unwrap();
        assert_eq!(g.metric, "transfer_bytes.G1->G2");
        assert_eq!(g.op, Op::Gt);
        assert_eq!(
            g.rhs,
            Rhs {
                factor: 0.9,
                offset: -10.0
            }
        );
        assert_eq!(Gate::parse("preemptions == 0").unwrap().op, Op::Eq);
        assert_eq!(Gate::parse("requests < base+1").unwrap().rhs.offset, 1.0);
    }

    #[test]
    fn bad_gates_say_what_is_wrong() {
        assert!(matches!(
            Gate::parse("hit_ratio 0.5"),
            Err(GateError::NoOperator(_))
        ));
        assert!(matches!(Gate::parse(">= 0.5"), Err(GateError::NoMetric(_))));
        for bad in [
            "x >= ",
            "x >= fast",
            "x >= 2*bass",
            "x >= base*2",
            "x >= inf",
            "x >= NaN",
        ] {
            assert!(
                matches!(Gate::parse(bad), Err(GateError::BadValue { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn gates_hold_or_fail_with_their_values() {
        let base = metrics(&[("hit_ratio", 0.6), ("evictions.G2", 10.0)]);
        let new = metrics(&[("hit_ratio", 0.5), ("evictions.G2", 12.0)]);
        let gates: Vec<Gate> = ["hit_ratio >= 0.55", "evictions.G2 <= 1.25*base"]
            .iter()
            .map(|g| Gate::parse(g).unwrap())
            .collect();
        let r = evaluate(&gates, &base, &new).unwrap();
        assert!(!r[0].passed);
        assert_eq!(
            r[0].to_string(),
            "FAILED: hit_ratio = 0.5000 (base 0.6000), wanted >= 0.5500"
        );
        assert!(r[1].passed, "{}", r[1]);
        assert_eq!(r[1].threshold, 12.5);
        let unknown = evaluate(&[Gate::parse("nope >= 1").unwrap()], &base, &new);
        assert!(matches!(unknown, Err(GateError::UnknownMetric { .. })));
        // Known to one recording only: 0 in the other.
        let r = evaluate(
            &[Gate::parse("evictions.G2 <= base").unwrap()],
            &metrics(&[]),
            &new,
        )
        .unwrap();
        assert_eq!((r[0].base, r[0].passed), (0.0, false));
    }

    #[test]
    fn junit_names_each_gate_and_escapes_it() {
        let base = metrics(&[("ttft_p99_ms", 10.0)]);
        let new = metrics(&[("ttft_p99_ms", 20.0)]);
        let gates = [
            Gate::parse("ttft_p99_ms <= 1.10*base").unwrap(),
            Gate::parse("ttft_p99_ms > 0").unwrap(),
        ];
        let r = evaluate(&gates, &base, &new).unwrap();
        let mut out = Vec::new();
        write_junit(&r, "kvbm compare", &mut out).unwrap();
        let xml = String::from_utf8(out).unwrap();
        assert!(
            xml.contains(r#"<testsuites tests="2" failures="1">"#),
            "{xml}"
        );
        assert!(
            xml.contains(r#"name="ttft_p99_ms &lt;= 1.10*base">"#),
            "{xml}"
        );
        assert!(
            xml.contains(
                "<failure message=\"FAILED: ttft_p99_ms = 20 (base 10), wanted &lt;= 11\"/>"
            ),
            "{xml}"
        );
        assert!(
            xml.contains(r#"<testcase classname="kvbm.compare" name="ttft_p99_ms &gt; 0"/>"#),
            "{xml}"
        );
    }

    proptest! {
        /// Any text is a gate or an error, never a panic; a gate's parts
        /// come back from its text.
        #[test]
        fn any_text_parses_or_errs(text in ".{0,40}") {
            if let Ok(g) = Gate::parse(&text) {
                prop_assert!(!g.metric.is_empty());
                prop_assert!(text.contains(&g.metric));
                prop_assert!(g.rhs.factor.is_finite() && g.rhs.offset.is_finite());
            }
        }

        #[test]
        fn written_gates_read_back(
            metric in "[a-z_]{1,12}(\\.G[123])?",
            op in prop::sample::select(vec![">=", "<=", ">", "<", "=="]),
            factor in prop::option::of(0.0f64..10.0),
            offset in -1000i32..1000,
        ) {
            let rhs = match factor {
                Some(f) => format!("{f}*base+{offset}"),
                None => format!("{offset}"),
            };
            let g = Gate::parse(&format!("{metric} {op} {rhs}")).unwrap();
            prop_assert_eq!(g.metric, metric);
            prop_assert_eq!(g.op.text(), op);
            prop_assert_eq!(g.rhs.factor, factor.unwrap_or(0.0));
            prop_assert_eq!(g.rhs.offset, f64::from(offset));
        }
    }
}
