//! The capacity view: the prefix-hit ratio an LRU cache of every size
//! would have had on the requests so far (a chart on a log axis), its
//! ceiling, each tier's capacity marked on it with what the run measured
//! there and what doubling it would give, and why the misses missed.
//! Everything comes from the model's capacity analysis, so it updates as
//! events arrive, live and in replay alike.

use super::list::ListState;
use super::{View, head, panel};
use crate::model::Model;
use kvbm_events::tier::Tier;
use kvbm_recorder::analysis::capacity::CapacityReport;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Chart, Dataset, GraphType, Paragraph, Wrap};

/// The view's state: the last report and the chart's series, recomputed
/// when a lookup arrives. It has no list.
#[derive(Debug, Clone, Default)]
pub struct Capacity {
    /// Lookups the report was computed at (recomputed when this changes).
    lookups: Option<u64>,
    /// Events the analysis had seen then (for a stream without lookups).
    applied: u64,
    report: Option<CapacityReport>,
    /// (log10 capacity in tokens, hit ratio).
    curve: Vec<(f64, f64)>,
    ceiling: Vec<(f64, f64)>,
    /// A vertical line per tier with a capacity.
    tiers: Vec<(Tier, Vec<(f64, f64)>)>,
    /// The x range.
    bounds: [f64; 2],
    list: ListState,
}

/// Tokens with a K/M/G suffix (powers of 1024).
fn tokens(t: u64) -> String {
    const K: f64 = 1024.0;
    let t = t as f64;
    if t >= K * K * K {
        format!("{:.1}G", t / (K * K * K))
    } else if t >= K * K {
        format!("{:.1}M", t / (K * K))
    } else if t >= K {
        format!("{:.0}K", t / K)
    } else {
        format!("{t:.0}")
    }
}

fn tier_color(t: Tier) -> Color {
    match t {
        Tier::Device => Color::Green,
        Tier::Host => Color::Magenta,
        Tier::Disk => Color::Cyan,
    }
}

impl View for Capacity {
    fn update(&mut self, model: &Model) {
        let an = model.capacity();
        let lookups = an.lookups();
        // A stream without lookups (vLLM's events) still changes its
        // re-store figures: recompute then on every new second of events.
        let stale = self.lookups != Some(lookups)
            || (lookups == 0 && model.applied() / 4096 != self.applied / 4096);
        if !stale {
            return;
        }
        self.lookups = Some(lookups);
        self.applied = model.applied();
        let caps: Vec<u64> = an
            .tier_capacity_tokens()
            .iter()
            .flatten()
            .copied()
            .collect();
        let rep = an.report(&caps, None);
        self.curve = rep
            .grid
            .iter()
            .map(|p| ((p.capacity_tokens.max(1) as f64).log10(), p.hit_ratio))
            .collect();
        let mut lo = self.curve.first().map_or(0.0, |p| p.0);
        let mut hi = self.curve.last().map_or(1.0, |p| p.0);
        self.tiers = Vec::new();
        if let Some(run) = &rep.run {
            for t in &run.tiers {
                let x = (t.capacity_tokens.max(1) as f64).log10();
                lo = lo.min(x);
                hi = hi.max(x + 0.1);
                self.tiers.push((t.tier, vec![(x, 0.0), (x, 1.0)]));
            }
        }
        if hi <= lo {
            hi = lo + 1.0;
        }
        if let Some(last) = self.curve.last().copied() {
            self.curve.push((hi, last.1.max(rep.ceiling)));
        }
        self.bounds = [lo, hi];
        self.ceiling = vec![(lo, rep.ceiling), (hi, rep.ceiling)];
        self.report = Some(rep);
    }

    fn row_count(&self) -> usize {
        0
    }

    fn list(&self) -> &ListState {
        &self.list
    }

    fn list_mut(&mut self) -> &mut ListState {
        &mut self.list
    }

    fn rows_area(&self, _body: Rect) -> Option<Rect> {
        None
    }

    fn draw(&self, _model: &Model, f: &mut Frame, area: Rect) {
        let Some(rep) = &self.report else {
            f.render_widget(
                Paragraph::new("no events yet").block(panel("Capacity")),
                area,
            );
            return;
        };
        let wide = area.width >= 120;
        let [chart_a, text_a] = if wide {
            Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(area)
        } else {
            Layout::vertical([Constraint::Percentage(55), Constraint::Percentage(45)]).areas(area)
        };
        if rep.requests == 0 {
            f.render_widget(
                Paragraph::new(no_lookups(rep))
                    .wrap(Wrap { trim: true })
                    .block(panel("Capacity")),
                area,
            );
            return;
        }
        self.draw_chart(rep, f, chart_a);
        f.render_widget(
            Paragraph::new(summary(rep))
                .wrap(Wrap { trim: false })
                .block(panel("What capacity buys · why misses missed")),
            text_a,
        );
    }
}

impl Capacity {
    fn draw_chart(&self, rep: &CapacityReport, f: &mut Frame, area: Rect) {
        let mut sets = vec![
            Dataset::default()
                .name("LRU")
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(Style::new().fg(Color::Yellow))
                .data(&self.curve),
            Dataset::default()
                .name(format!("ceiling {:.3}", rep.ceiling))
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(Style::new().fg(Color::Red))
                .data(&self.ceiling),
        ];
        for (t, line) in &self.tiers {
            sets.push(
                Dataset::default()
                    .name(t.short_name())
                    .marker(Marker::Braille)
                    .graph_type(GraphType::Line)
                    .style(Style::new().fg(tier_color(*t)))
                    .data(line),
            );
        }
        let [lo, hi] = self.bounds;
        let labels: Vec<Span> = (0..4)
            .map(|i| {
                let x = lo + (hi - lo) * f64::from(i) / 3.0;
                Span::raw(tokens(10f64.powf(x) as u64))
            })
            .collect();
        let title = if rep.method.method == "exact" {
            "Hit ratio by LRU capacity (tokens, log scale)".to_string()
        } else {
            format!(
                "Hit ratio by LRU capacity (sampled at {:.4})",
                rep.method.rate
            )
        };
        let chart = Chart::new(sets)
            .block(panel(title))
            .x_axis(
                Axis::default()
                    .bounds([lo, hi])
                    .labels(labels)
                    .style(Style::new().fg(Color::Gray)),
            )
            .y_axis(
                Axis::default()
                    .bounds([0.0, 1.0])
                    // Too short for a middle label, the chart draws the
                    // labels over one another ("1.5").
                    .labels(if area.height >= 8 {
                        vec!["0", "0.5", "1"]
                    } else {
                        vec!["0", "1"]
                    })
                    .style(Style::new().fg(Color::Gray)),
            );
        f.render_widget(chart, area);
    }
}

fn no_lookups(rep: &CapacityReport) -> Vec<Line<'static>> {
    let mut lines = vec![Line::from(
        "No lookups recorded in this stream (a log from before schema version 2, or vLLM's \
         KV events, which carry stores and removals only): no curve.",
    )];
    for t in &rep.restores {
        lines.push(Line::from(format!(
            "{}: {} stores, {} removals, {} blocks stored again after removal (misses more \
             capacity would have avoided); most held {} blocks",
            t.tier.short_name(),
            t.stores,
            t.removals,
            t.restores,
            t.max_live_blocks
        )));
    }
    lines
}

fn summary(rep: &CapacityReport) -> Vec<Line<'static>> {
    let mut l = Vec::new();
    l.push(Line::from(vec![
        Span::styled("ceiling ", head()),
        Span::raw(format!(
            "{:.3} of {} prompt tokens ({} requests) with an unbounded cache",
            rep.ceiling,
            tokens(rep.prompt_tokens),
            rep.requests
        )),
    ]));
    if rep.method.method != "exact" {
        l.push(Line::from(Span::styled(
            format!(
                "sampled at {:.4} (over {} blocks held), standard error about {:.3}",
                rep.method.rate,
                rep.method.max_blocks.unwrap_or(0),
                rep.error_estimate
            ),
            Style::new().fg(Color::Yellow),
        )));
    }
    if let Some(run) = &rep.run {
        l.push(Line::from(vec![
            Span::styled("this run ", head()),
            Span::raw(format!(
                "measured {:.3}; the curve at its capacity {}: {}",
                run.measured_hit_ratio,
                run.capacity_tokens.map_or("?".into(), tokens),
                run.curve_hit_ratio
                    .map_or("-".into(), |v| format!("{v:.3}"))
            )),
        ]));
        for t in &run.tiers {
            l.push(Line::from(vec![
                Span::styled(
                    format!("{} {:>6} ", t.tier.short_name(), tokens(t.capacity_tokens)),
                    Style::new().fg(tier_color(t.tier)),
                ),
                Span::raw(format!(
                    "served {:.3}; ×2 → {:.3} (now {:.3})",
                    t.measured_hit_ratio, t.curve_hit_ratio_doubled, t.curve_hit_ratio_now
                )),
            ]));
        }
    }
    if let Some(mr) = &rep.miss_reasons {
        let misses: Vec<String> = mr
            .shares
            .iter()
            .filter(|(_, v)| *v > 0.0)
            .map(|(n, v)| format!("{n} {:.3}", v))
            .collect();
        l.push(Line::from(vec![
            Span::styled("misses ", head()),
            Span::raw(if misses.is_empty() {
                "none".to_string()
            } else {
                misses.join(" · ")
            }),
        ]));
        if mr.later_lookups > 0 {
            l.push(Line::from(format!(
                "{} later lookups (asked again while waiting, or after a preemption) not counted",
                mr.later_lookups
            )));
        }
    }
    if rep.untracked_blocks > 0 {
        l.push(Line::from(Span::styled(
            format!(
                "{} block events not followed for miss reasons (memory cap)",
                rep.untracked_blocks
            ),
            Style::new().fg(Color::Red),
        )));
    }
    l
}
