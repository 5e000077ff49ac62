//! `capacity`: the hit ratio every cache size would have had, from a log
//! or straight from a Mooncake trace; as text, JSON or an SVG chart.

use crate::policies::{PolicyCurves, PolicyPoint};
use crate::trace::capacity_and_policies_of_trace;
use anyhow::{Context, Result, bail};
use kvbm_recorder::analysis::capacity::{
    CapacityAnalyzer, CapacityConfig, CapacityReport, Sampling,
};
use kvbm_recorder::fleet::{RecordingKind, recording_kind};
use std::collections::BTreeMap;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// Distinct blocks tracked exactly before sampling starts, unless
/// `--max-exact-blocks` or `--sample` says otherwise.
pub const DEFAULT_MAX_EXACT_BLOCKS: usize = 1 << 24;

/// What `capacity` was asked.
#[derive(Debug)]
pub struct CapacityArgs {
    pub log: Option<PathBuf>,
    pub trace: Option<PathBuf>,
    pub capacities: Vec<u64>,
    pub json: bool,
    pub svg: Option<PathBuf>,
    pub sample: Option<f64>,
    pub max_exact_blocks: Option<usize>,
    pub block_size: Option<u32>,
    /// `--policies`: also simulate these.
    pub policies: Option<Vec<kvbm_core::CachePolicy>>,
}

/// Feeds every first lookup of `events` to `curves` (prepared for the
/// first lookup's block size).
fn feed_lookups(curves: &mut PolicyCurves, events: &[kvbm_events::Event]) -> Result<()> {
    let mut keys = Vec::new();
    for e in events {
        if let kvbm_events::EventKind::PrefixLookup {
            tokens,
            block_size,
            hashes,
            ..
        } = &e.kind
        {
            curves.prepare(*block_size)?;
            keys.clear();
            keys.extend(hashes.iter().map(|h| h.0));
            curves.request(u64::from(*tokens), *block_size, &keys);
        }
    }
    Ok(())
}

pub fn capacity(a: &CapacityArgs) -> Result<i32> {
    let sampling = match (a.sample, a.max_exact_blocks) {
        (Some(r), _) => {
            if !(r.is_finite() && r > 0.0 && r <= 1.0) {
                bail!("--sample must be a rate in (0, 1], got {r}");
            }
            if r >= 1.0 {
                Sampling::Exact
            } else {
                Sampling::Fixed(r)
            }
        }
        (None, Some(0)) => bail!("--max-exact-blocks must be at least 1"),
        (None, Some(m)) => Sampling::Bounded(m),
        // Exact while it fits in memory (16M distinct blocks at about 30
        // bytes each), sampled past that, as the report then says.
        (None, None) => Sampling::Bounded(DEFAULT_MAX_EXACT_BLOCKS),
    };
    if let (Some(svg), Some(log)) = (&a.svg, &a.log) {
        super::read::refuse_output_inside(svg, log)?;
    }
    let mut problems: Vec<String> = Vec::new();
    let mut curves = a
        .policies
        .clone()
        .map(|p| PolicyCurves::new(p, &a.capacities));
    let mut report = match (&a.log, &a.trace) {
        (Some(_), Some(_)) => bail!("give a LOG or --trace, not both"),
        (None, None) => bail!("give a LOG directory, or --trace FILE"),
        (None, Some(t)) => {
            let f =
                std::fs::File::open(t).with_context(|| format!("opening trace {}", t.display()))?;
            let mut skipped = 0u64;
            if let Some(c) = curves.as_mut() {
                c.prepare(kvbm_sim::workload::MooncakeOptions::default().block_tokens as u32)?;
            }
            let rep = capacity_and_policies_of_trace(
                BufReader::new(f),
                sampling,
                &a.capacities,
                curves.as_mut(),
                |line, why| {
                    skipped += 1;
                    eprintln!("skipping line {line} of {}: {why}", t.display());
                },
            )
            .with_context(|| format!("reading trace {}", t.display()))?;
            if rep.requests == 0 && skipped > 0 {
                bail!(
                    "no usable request in trace {}: all {skipped} of its lines were skipped \
                     (above: why)",
                    t.display()
                );
            }
            rep
        }
        (Some(dir), None)
            if recording_kind(dir).map_err(anyhow::Error::msg)? == RecordingKind::Fleet =>
        {
            // One cache every engine shares (a shared host or disk tier,
            // an external store): every engine's lookups in time order.
            // Each engine alone: `capacity DIR/engines/NAME`.
            let fleet = super::fleet::fleet_events(dir)?;
            problems = fleet.problems;
            let mut events = fleet.events;
            events.sort_by_key(|e| e.ts_ns);
            for (i, e) in events.iter_mut().enumerate() {
                e.seq = i as u64;
            }
            if let Some(c) = curves.as_mut() {
                feed_lookups(c, &events)?;
            }
            let cfg = CapacityConfig {
                sampling,
                max_tracked_blocks: None,
            };
            let mut rep =
                CapacityAnalyzer::from_events(cfg, &events).report(&a.capacities, a.block_size);
            rep.notes.push(
                "a fleet recording: one cache shared by every engine, their lookups merged \
                 by their timestamps (each engine alone: capacity DIR/engines/NAME)"
                    .into(),
            );
            rep
        }
        (Some(log), None) => {
            let (events, problem) = super::read::load_for_analysis(log)?;
            if let Some(c) = curves.as_mut() {
                feed_lookups(c, &events)?;
            }
            let cfg = CapacityConfig {
                sampling,
                max_tracked_blocks: None,
            };
            let an = CapacityAnalyzer::from_events(cfg, &events);
            let rep = an.report(&a.capacities, a.block_size);
            problems.extend(problem.map(|p| format!("{}: {p}", log.display())));
            rep
        }
    };
    for p in &problems {
        report
            .notes
            .push(format!("only what could be read is counted: {p}"));
    }
    let policies = curves.as_ref().map(|c| {
        if c.mixed_block_sizes() > 0 {
            report.notes.push(format!(
                "the policies skipped {} lookups whose block size differed from the first's",
                c.mixed_block_sizes()
            ));
        }
        (c.policies().to_vec(), c.report())
    });
    if let Some(svg) = &a.svg {
        draw_svg(&report, policies.as_ref().map(|p| &p.1), svg)
            .with_context(|| format!("writing {}", svg.display()))?;
    }
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        // The drawing grid is for --svg; JSON readers get the points asked for.
        if let Some(o) = v.as_object_mut() {
            o.remove("grid");
            if let Some((_, p)) = &policies {
                o.insert("policies".into(), serde_json::to_value(p)?);
            }
        }
        println!("{v}");
    } else {
        print_text(&report);
        if let Some((order, p)) = &policies {
            print_policies(&report, order, p);
        }
    }
    for p in &problems {
        eprintln!("warning: {p}");
    }
    // As `check` gives a damaged log: the curve is of part of the run.
    Ok(if problems.is_empty() { 0 } else { 2 })
}

fn tokens(t: u64) -> String {
    const K: u64 = 1 << 10;
    const M: u64 = 1 << 20;
    const G: u64 = 1 << 30;
    let f = |v: f64, s: &str| {
        if (v - v.round()).abs() < 1e-9 {
            format!("{}{s}", v.round())
        } else {
            format!("{v:.2}{s}")
        }
    };
    match t {
        t if t >= G => f(t as f64 / G as f64, "G"),
        t if t >= M => f(t as f64 / M as f64, "M"),
        t if t >= K => f(t as f64 / K as f64, "K"),
        t => t.to_string(),
    }
}

fn print_text(r: &CapacityReport) {
    println!(
        "{} requests, {} prompt tokens, {} block references (blocks of {} tokens), from a {}",
        r.requests, r.prompt_tokens, r.references, r.block_size, r.source
    );
    let m = &r.method;
    if m.method == "exact" {
        println!("method        exact ({} distinct blocks)", m.tracked_blocks);
    } else {
        println!(
            "method        sampled by hash (SHARDS) at rate {:.4}; standard error about {:.4}",
            m.rate, r.error_estimate
        );
    }
    println!(
        "ceiling       {:.4} of prompt tokens ({:.4} of blocks looked up): an unbounded cache",
        r.ceiling, r.ceiling_blocks
    );
    if !r.points.is_empty() {
        println!("capacity      hit ratio   (blocks)");
        for p in &r.points {
            let se = if p.stderr > 0.0 {
                format!(" ± {:.4}", p.stderr)
            } else {
                String::new()
            };
            println!(
                "  {:>10}  {:.4}{se}    ({:.4})",
                tokens(p.capacity_tokens),
                p.hit_ratio,
                p.block_hit_ratio
            );
        }
    }
    if let Some(run) = &r.run {
        println!(
            "this run      measured {:.4}; curve at its capacity {}: {}",
            run.measured_hit_ratio,
            run.capacity_tokens.map_or("unknown".into(), tokens),
            run.curve_hit_ratio
                .map_or("-".into(), |v| format!("{v:.4}"))
        );
        for t in &run.tiers {
            println!(
                "  {} {:>8}  served {:.4}, curve {:.4}; doubled to {} the tiers together give {:.4} (now {:.4})",
                t.tier.short_name(),
                tokens(t.capacity_tokens),
                t.measured_hit_ratio,
                t.curve_hit_ratio,
                tokens(t.doubled_capacity_tokens),
                t.curve_hit_ratio_doubled,
                t.curve_hit_ratio_now
            );
        }
    }
    if let Some(mr) = &r.miss_reasons {
        println!(
            "miss reasons  (share of prompt tokens, first lookups; {} later lookups not counted)",
            mr.later_lookups
        );
        for (name, share) in &mr.shares {
            if *share > 0.0 {
                println!("  {name:<16} {share:.4}");
            }
        }
    }
    for t in &r.restores {
        println!(
            "re-stores {}  {} stores, {} removals, {} stored again after removal (most held: {} blocks)",
            t.tier.short_name(),
            t.stores,
            t.removals,
            t.restores,
            t.max_live_blocks
        );
        for p in &t.points {
            let cap = p
                .capacity_tokens
                .map_or(format!("{} blocks", p.capacity_blocks), tokens);
            println!(
                "  {cap:>12}  at least {} more hits (lower bound)",
                p.extra_hits_lower_bound
            );
        }
    }
    for n in &r.notes {
        println!("note: {n}");
    }
}

/// `--policies` as a table: a row per capacity, a column per policy, the
/// exact LRU curve first and the ceiling last; the best policy at each
/// capacity starred.
fn print_policies(
    r: &CapacityReport,
    order: &[kvbm_core::CachePolicy],
    p: &BTreeMap<String, Vec<PolicyPoint>>,
) {
    let names: Vec<String> = order.iter().map(|c| c.to_string()).collect();
    let mut head = format!("policies      {:>10}  {:>11}", "capacity", "lru (exact)");
    for n in &names {
        head.push_str(&format!("  {n:>13}"));
    }
    println!("{head}  {:>8}", "ceiling");
    for (i, lru) in r.points.iter().enumerate() {
        let ratios: Vec<f64> = names.iter().map(|n| p[n][i].hit_ratio).collect();
        let best = ratios.iter().copied().fold(lru.hit_ratio, f64::max);
        let cell = |v: f64| {
            let star = if (v - best).abs() < 5e-5 { "*" } else { " " };
            format!("{v:.4}{star}")
        };
        let mut row = format!(
            "              {:>10}  {:>11}",
            tokens(lru.capacity_tokens),
            cell(lru.hit_ratio)
        );
        for v in ratios {
            row.push_str(&format!("  {:>13}", cell(v)));
        }
        println!("{row}  {:>8.4}", r.ceiling);
    }
    println!(
        "              (simulated over the same lookups; * the best at that capacity, \
         within 0.0001)"
    );
}

/// The curve as an SVG: hit ratio against capacity on a log axis, the
/// ceiling, the run's capacity per tier, the points asked for, and a line
/// per `--policies` policy through its points.
fn draw_svg(
    r: &CapacityReport,
    policies: Option<&BTreeMap<String, Vec<PolicyPoint>>>,
    path: &Path,
) -> Result<()> {
    use plotters::prelude::*;
    if r.grid.is_empty() || r.block_size == 0 {
        bail!("no curve to draw: the input has no lookups");
    }
    let xmin = r
        .grid
        .iter()
        .map(|p| p.capacity_tokens)
        .min()
        .unwrap_or(1)
        .max(1) as f64;
    let mut xmax = r.grid.iter().map(|p| p.capacity_tokens).max().unwrap_or(2) as f64;
    for c in r.points.iter().map(|p| p.capacity_tokens) {
        xmax = xmax.max(c as f64 * 1.2);
    }
    if let Some(run) = &r.run {
        for t in &run.tiers {
            xmax = xmax.max(t.capacity_tokens as f64 * 1.2);
        }
    }
    let xmax = xmax.max(xmin * 2.0);
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing: {e}");
    let root = SVGBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let title = format!(
        "Prefix-hit ratio by LRU capacity ({} requests, {})",
        r.requests,
        if r.method.method == "exact" {
            "exact".to_string()
        } else {
            format!("sampled at {:.3}", r.method.rate)
        }
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0f64..1f64)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("capacity (tokens, log scale)")
        .y_desc("prefix-hit ratio (tokens)")
        .x_label_formatter(&|x| tokens(*x as u64))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .draw()
        .map_err(|e| err(&e))?;
    let curve: Vec<(f64, f64)> = r
        .grid
        .iter()
        .map(|p| (p.capacity_tokens.max(1) as f64, p.hit_ratio))
        .chain(std::iter::once((xmax, r.ceiling)))
        .collect();
    chart
        .draw_series(LineSeries::new(curve, BLUE.stroke_width(2)))
        .map_err(|e| err(&e))?
        .label("LRU hit ratio")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(
            vec![(xmin, r.ceiling), (xmax, r.ceiling)],
            RED.stroke_width(1),
        ))
        .map_err(|e| err(&e))?
        .label(format!("ceiling {:.3} (unbounded cache)", r.ceiling))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart
        .draw_series(r.points.iter().map(|p| {
            Circle::new(
                (p.capacity_tokens.max(1) as f64, p.hit_ratio),
                4,
                BLUE.filled(),
            )
        }))
        .map_err(|e| err(&e))?;
    draw_policies(&mut chart, policies)?;
    if let Some(run) = &r.run {
        let colors = [GREEN, MAGENTA, CYAN];
        for t in &run.tiers {
            let c = colors[t.tier.index()];
            let x = t.capacity_tokens.max(1) as f64;
            chart
                .draw_series(LineSeries::new(vec![(x, 0.0), (x, 1.0)], c.stroke_width(1)))
                .map_err(|e| err(&e))?
                .label(format!(
                    "{} capacity {} (run measured {:.3} from it)",
                    t.tier.short_name(),
                    tokens(t.capacity_tokens),
                    t.measured_hit_ratio
                ))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        }
        if let (Some(cap), Some(_)) = (run.capacity_tokens, run.curve_hit_ratio) {
            chart
                .draw_series(std::iter::once(Cross::new(
                    (cap.max(1) as f64, run.measured_hit_ratio),
                    6,
                    BLACK.stroke_width(2),
                )))
                .map_err(|e| err(&e))?
                .label(format!("the run: {:.3} measured", run.measured_hit_ratio))
                .legend(|(x, y)| Cross::new((x + 10, y), 5, BLACK.stroke_width(2)));
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

type Chart<'a, 'b> = plotters::chart::ChartContext<
    'a,
    plotters::backend::SVGBackend<'b>,
    plotters::coord::cartesian::Cartesian2d<
        plotters::coord::combinators::LogCoord<f64>,
        plotters::coord::types::RangedCoordf64,
    >,
>;

/// A line with triangle markers per policy, through its points.
fn draw_policies(
    chart: &mut Chart<'_, '_>,
    policies: Option<&BTreeMap<String, Vec<PolicyPoint>>>,
) -> Result<()> {
    use plotters::prelude::*;
    let Some(policies) = policies else {
        return Ok(());
    };
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing: {e}");
    let palette = [
        RGBColor(230, 120, 0),
        RGBColor(0, 150, 60),
        RGBColor(150, 0, 180),
        RGBColor(0, 140, 170),
        RGBColor(120, 80, 0),
        RGBColor(200, 0, 90),
    ];
    for (i, (name, points)) in policies.iter().enumerate() {
        let c = palette[i % palette.len()];
        let xy: Vec<(f64, f64)> = points
            .iter()
            .map(|p| (p.capacity_tokens.max(1) as f64, p.hit_ratio))
            .collect();
        chart
            .draw_series(LineSeries::new(xy.clone(), c.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(format!("{name} (simulated)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(
                xy.into_iter()
                    .map(|p| TriangleMarker::new(p, 5, c.filled())),
            )
            .map_err(|e| err(&e))?;
    }
    Ok(())
}
