//! The pools view: per tier, a gauge of active / inactive / free blocks,
//! hit rate, evictions per second, and sparklines of the last minutes.

use super::list::ListState;
use super::{View, panel};
use crate::fmt;
use crate::model::Model;
use kvbm_events::tier::Tier;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Chart, Dataset, GraphType, Paragraph, Sparkline};

/// One tier's panel, as of the last update.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct TierRow {
    capacity: u32,
    active: u32,
    inactive: u32,
    empty: u32,
    /// A gauge was seen.
    gauged: bool,
    hit_blocks: u64,
    looked_up_blocks: u64,
    lookups: u64,
    evictions: u64,
    evictions_per_s: u64,
    registrations: u64,
    duplicate_registrations: u64,
    /// Active blocks per closed second, oldest first.
    active_history: Vec<u64>,
    /// Evictions per closed second, oldest first.
    eviction_history: Vec<u64>,
}

/// The pools view's state: one panel per tier. It has no list (no rows
/// to select).
#[derive(Debug, Clone, Default)]
pub struct Pools {
    tiers: [TierRow; 3],
    list: ListState,
}

/// Panels with at least this many inner rows draw charts with axes
/// beneath the figures; smaller ones keep sparklines beside them.
const CHARTS_MIN_ROWS: u16 = 9;

/// One per-second history as bars over the last seconds, with its axes
/// labelled: seconds ago along x, the value up y (0 to `max`).
fn history_chart(f: &mut Frame, area: Rect, what: &str, values: &[u64], max: u64, color: Color) {
    let n = values.len();
    let span = n.max(10) as f64;
    // Enough points per second that each second draws as a solid bar (a
    // zero draws nothing rather than a mark on the axis).
    let per = (2.0 * f64::from(area.width) / span).ceil().max(1.0) as usize;
    let points: Vec<(f64, f64)> = values
        .iter()
        .enumerate()
        .filter(|&(_, &v)| v > 0)
        .flat_map(|(i, &v)| {
            let x = i as f64 - n as f64;
            (0..per).map(move |k| (x + (k as f64 + 0.5) / per as f64, v as f64))
        })
        .collect();
    let data = vec![
        Dataset::default()
            .marker(Marker::HalfBlock)
            .graph_type(GraphType::Bar)
            .style(Style::new().fg(color))
            .data(&points),
    ];
    let axis = Style::new().fg(Color::DarkGray);
    let chart = Chart::new(data)
        .block(Block::new().title(Span::styled(
            format!("{what}, last {n} s"),
            Style::new().fg(Color::DarkGray),
        )))
        .x_axis(
            Axis::default()
                .bounds([-span, 0.0])
                .labels([
                    Span::raw(format!("-{}s", span as u64)),
                    Span::raw(format!("-{}s", (span / 2.0) as u64)),
                    Span::raw("now"),
                ])
                .style(axis),
        )
        .y_axis(
            Axis::default()
                .bounds([0.0, max as f64])
                .labels([Span::raw("0"), Span::raw(fmt::count(max))])
                .style(axis),
        );
    f.render_widget(chart, area);
}

/// Draws one stacked bar: active, inactive, free.
fn gauge(width: usize, capacity: u32, active: u32, inactive: u32) -> Line<'static> {
    if capacity == 0 || width == 0 {
        return Line::from(Span::styled(
            "no capacity",
            Style::new().fg(Color::DarkGray),
        ));
    }
    let cells = |n: u32| ((n as f64 / capacity as f64) * width as f64).round() as usize;
    let a = cells(active).min(width);
    let i = cells(inactive).min(width - a);
    Line::from(vec![
        Span::styled("█".repeat(a), Style::new().fg(Color::Green)),
        Span::styled("▓".repeat(i), Style::new().fg(Color::Yellow)),
        Span::styled("░".repeat(width - a - i), Style::new().fg(Color::DarkGray)),
    ])
}

impl View for Pools {
    fn update(&mut self, model: &Model) {
        let st = model.state();
        let samples = model.samples();
        for (tier, row) in Tier::ALL.into_iter().zip(self.tiers.iter_mut()) {
            let p = st.pool(tier);
            *row = TierRow {
                capacity: p.capacity,
                active: p.active,
                inactive: p.inactive,
                empty: p.empty,
                gauged: p.gauge_ns.is_some(),
                hit_blocks: p.hit_blocks,
                looked_up_blocks: p.looked_up_blocks,
                lookups: p.lookups,
                evictions: p.evictions,
                evictions_per_s: model.evictions_per_s(tier),
                registrations: p.registrations,
                duplicate_registrations: p.duplicate_registrations,
                active_history: samples
                    .iter()
                    .map(|s| u64::from(s.active[tier.index()]))
                    .collect(),
                eviction_history: samples.iter().map(|s| s.evictions[tier.index()]).collect(),
            };
        }
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
        let rows = Layout::vertical([Constraint::Ratio(1, 3); 3]).split(area);
        for ((tier, p), r) in Tier::ALL.into_iter().zip(&self.tiers).zip(rows.iter()) {
            let title = format!(
                "{} {} — {} blocks",
                tier.short_name(),
                match tier {
                    Tier::Device => "device",
                    Tier::Host => "host",
                    Tier::Disk => "disk",
                },
                fmt::count(u64::from(p.capacity))
            );
            let block = panel(title);
            let inner = block.inner(*r);
            f.render_widget(block, *r);
            if p.capacity == 0 && !p.gauged {
                f.render_widget(
                    Paragraph::new(Span::styled(
                        "  no gauge seen (tier disabled or not reported)",
                        Style::new().fg(Color::DarkGray),
                    )),
                    inner,
                );
                continue;
            }
            // A column between the figures and the sparklines, so that a
            // line cut at a narrow width does not run into the labels.
            let [left, right] =
                Layout::horizontal([Constraint::Percentage(55), Constraint::Percentage(45)])
                    .spacing(1)
                    .areas(inner);
            let lines = vec![
                gauge(
                    left.width.saturating_sub(1) as usize,
                    p.capacity,
                    p.active,
                    p.inactive,
                ),
                Line::from(vec![
                    Span::styled("█ active ", Style::new().fg(Color::Green)),
                    Span::raw(format!("{}  ", p.active)),
                    Span::styled("▓ inactive ", Style::new().fg(Color::Yellow)),
                    Span::raw(format!("{}  ", p.inactive)),
                    Span::styled("░ free ", Style::new().fg(Color::DarkGray)),
                    Span::raw(p.empty.to_string()),
                ]),
                Line::from(format!(
                    "hit rate {} ({} of {} blocks looked up, {} lookups)",
                    fmt::pct(p.hit_blocks, p.looked_up_blocks),
                    fmt::count(p.hit_blocks),
                    fmt::count(p.looked_up_blocks),
                    fmt::count(p.lookups)
                )),
                Line::from(format!(
                    "evictions {}/s ({} total) · registered {} ({} duplicates)",
                    p.evictions_per_s,
                    fmt::count(p.evictions),
                    fmt::count(p.registrations),
                    fmt::count(p.duplicate_registrations)
                )),
            ];
            if inner.height >= CHARTS_MIN_ROWS {
                // Tall enough: the figures on top, the two charts side by
                // side across the whole panel, with axes.
                let [text, charts] =
                    Layout::vertical([Constraint::Length(4), Constraint::Min(0)]).areas(inner);
                let mut lines = lines;
                lines[0] = gauge(
                    text.width.saturating_sub(1) as usize,
                    p.capacity,
                    p.active,
                    p.inactive,
                );
                f.render_widget(Paragraph::new(lines), text);
                let [ca, cb] = Layout::horizontal([Constraint::Ratio(1, 2); 2])
                    .spacing(3)
                    .areas(charts);
                history_chart(
                    f,
                    ca,
                    "active blocks",
                    &p.active_history,
                    u64::from(p.capacity).max(1),
                    Color::Green,
                );
                let max_evict = p.eviction_history.iter().copied().max().unwrap_or(0).max(1);
                history_chart(
                    f,
                    cb,
                    "evictions per second",
                    &p.eviction_history,
                    max_evict,
                    Color::Yellow,
                );
                continue;
            }
            f.render_widget(Paragraph::new(lines), left);
            // The newest seconds that fit.
            let width = right.width as usize;
            let take = p.active_history.len().saturating_sub(width);
            let active = &p.active_history[take..];
            let evict = &p.eviction_history[take..];
            let [la, sa, lb, sb] = Layout::vertical([
                Constraint::Length(1),
                Constraint::Fill(1),
                Constraint::Length(1),
                Constraint::Fill(1),
            ])
            .areas(right);
            let label =
                |text: String| Paragraph::new(Span::styled(text, Style::new().fg(Color::DarkGray)));
            f.render_widget(label(format!("active blocks, last {} s", active.len())), la);
            f.render_widget(
                label(format!("evictions per second, last {} s", evict.len())),
                lb,
            );
            let max_active = u64::from(p.capacity).max(1);
            f.render_widget(
                Sparkline::default()
                    .data(active)
                    .max(max_active)
                    .style(Style::new().fg(Color::Green)),
                sa,
            );
            f.render_widget(
                Sparkline::default()
                    .data(evict)
                    .style(Style::new().fg(Color::Yellow)),
                sb,
            );
        }
    }
}
