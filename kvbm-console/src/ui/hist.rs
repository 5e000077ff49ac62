//! The histograms view: a table of every series (time in each slot state,
//! TTFT, transfer latency by direction) with p50 … p99, max and a small
//! histogram, and below it a large histogram of the selected series with
//! labelled axes.

use super::columns::{self, Col, GridRow};
use super::list::ListState;
use super::{View, bars, head, panel, selected};
use crate::fmt;
use crate::model::Model;
use kvbm_recorder::analysis::stats::{Percentiles, Series};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::Span;
use ratatui::widgets::{Axis, Chart, Dataset, GraphType, Paragraph};

/// Buckets each series is counted in (the large histogram's resolution).
const BUCKETS: usize = 64;

/// Buckets in the table's small histogram (each merges several).
const SMALL: usize = 16;

/// Bodies shorter than this show the table alone (every series in view
/// matters more than a chart of one).
const CHART_MIN_BODY: u16 = 30;

/// One series, summarised.
#[derive(Debug, Clone, PartialEq)]
struct HistRow {
    name: String,
    p: Percentiles,
    /// The smallest value, where the buckets start.
    low: u64,
    /// `(upper bound, count)` in [`BUCKETS`] log-spaced buckets.
    buckets: Vec<(u64, u64)>,
}

impl HistRow {
    /// The counts merged into `n` buckets.
    fn merged(&self, n: usize) -> Vec<u64> {
        let per = self.buckets.len().div_ceil(n.max(1)).max(1);
        self.buckets
            .chunks(per)
            .map(|c| c.iter().map(|(_, n)| n).sum())
            .collect()
    }
}

/// The histograms view's state: one row per series, summarised in the
/// update step.
#[derive(Debug, Clone, Default)]
pub struct Histograms {
    rows: Vec<HistRow>,
    requests: u64,
    finished: u64,
    list: ListState,
}

const COLS: [Col; 7] = [
    Col::text("Series", 6, 28),
    Col::num("Count", 5, 10),
    Col::num("p50", 3, 9),
    Col::num("p90", 3, 9),
    Col::num("p99", 3, 9),
    Col::num("Max", 3, 9),
    Col::text("min → max (log)", SMALL as u16, SMALL as u16),
];

/// Splits the body: the table on top (as tall as its rows, at most half
/// the body when the chart fits), the chart below.
fn split(body: Rect, rows: usize) -> (Rect, Option<Rect>) {
    if body.height < CHART_MIN_BODY {
        return (body, None);
    }
    let table = (rows as u16).saturating_add(3).min(body.height / 2);
    let [t, c] = Layout::vertical([Constraint::Length(table), Constraint::Min(0)]).areas(body);
    (t, Some(c))
}

impl View for Histograms {
    fn update(&mut self, model: &Model) {
        let s = model.stats();
        let row = |name: String, series: &Series| HistRow {
            name,
            p: series.percentiles(),
            low: series.low().unwrap_or(0),
            buckets: series.log_buckets(BUCKETS),
        };
        let mut rows = vec![row("TTFT".to_string(), s.ttft())];
        rows.extend(s.time_in_state().map(|(k, v)| row(format!("in {k}"), v)));
        rows.extend(
            s.transfer_latency()
                .map(|(k, v)| row(format!("transfer {k}"), v)),
        );
        self.rows = rows;
        self.requests = s.requests();
        self.finished = s.finished();
    }

    fn row_count(&self) -> usize {
        self.rows.len()
    }

    fn list(&self) -> &ListState {
        &self.list
    }

    fn list_mut(&mut self) -> &mut ListState {
        &mut self.list
    }

    fn visible_rows(&self, body: Rect) -> usize {
        columns::body_rows(split(body, self.rows.len()).0)
    }

    fn rows_area(&self, body: Rect) -> Option<Rect> {
        let t = split(body, self.rows.len()).0;
        Some(Rect::new(t.x, t.y + 2, t.width, t.height.saturating_sub(3)))
    }

    fn draw(&self, _model: &Model, f: &mut Frame, area: Rect) {
        let all = &self.rows;
        let block = panel(format!(
            "Histograms — {} requests, {} finished (times are engine time)",
            fmt::count(self.requests),
            fmt::count(self.finished)
        ));
        if all.iter().all(|r| r.p.count == 0) {
            f.render_widget(Paragraph::new("  nothing measured yet").block(block), area);
            return;
        }
        let (table_a, chart_a) = split(area, all.len());
        let visible = columns::body_rows(table_a);
        let list = &self.list;
        let off = list.offset_for(all.len(), visible);
        let or_dash = |p: &Percentiles, v: u64| {
            if p.count > 0 { fmt::dur(v) } else { "-".into() }
        };
        let rows: Vec<GridRow> = all
            .iter()
            .enumerate()
            .skip(off)
            .take(visible)
            .map(|(i, r)| {
                let p = &r.p;
                let plain = |s: String| (s, Style::new());
                let row = GridRow {
                    cells: vec![
                        plain(r.name.clone()),
                        plain(fmt::count(p.count)),
                        plain(or_dash(p, p.p50)),
                        plain(or_dash(p, p.p90)),
                        plain(or_dash(p, p.p99)),
                        plain(or_dash(p, p.max)),
                        (bars(&r.merged(SMALL)), Style::new().fg(Color::Cyan)),
                    ],
                    style: Style::new(),
                };
                if i == list.selected {
                    row.style(selected())
                } else {
                    row
                }
            })
            .collect();
        let widths = columns::fit(&COLS, &rows, table_a.width.saturating_sub(2));
        f.render_widget(columns::table(&COLS, &widths, rows, head(), block), table_a);
        if let (Some(chart_a), Some(r)) = (chart_a, all.get(list.selected)) {
            chart(f, chart_a, r);
        }
    }
}

/// The selected series as a large histogram: log-spaced buckets along x
/// (labelled with their bounds), counts up y.
fn chart(f: &mut Frame, area: Rect, r: &HistRow) {
    let title = format!(
        "{} — {} values · p50 {} · p99 {} · max {} · x: value (log scale), y: count",
        r.name,
        fmt::count(r.p.count),
        fmt::dur(r.p.p50),
        fmt::dur(r.p.p99),
        fmt::dur(r.p.max)
    );
    let block = panel(title);
    if r.p.count == 0 || r.buckets.is_empty() {
        f.render_widget(
            Paragraph::new("  nothing recorded in this series yet").block(block),
            area,
        );
        return;
    }
    let n = r.buckets.len();
    // Enough points per bucket that each draws as a solid bar (an empty
    // bucket draws nothing rather than a mark on the axis).
    let per = (2 * area.width as usize).div_ceil(n).max(1);
    let points: Vec<(f64, f64)> = r
        .buckets
        .iter()
        .enumerate()
        .filter(|&(_, &(_, c))| c > 0)
        .flat_map(|(i, &(_, c))| {
            (0..per).map(move |k| (i as f64 + (k as f64 + 0.5) / per as f64, c as f64))
        })
        .collect();
    let max = r.buckets.iter().map(|&(_, c)| c).max().unwrap_or(0).max(1);
    // Bounds at 0, ¼, ½, ¾ and the end of the log axis.
    let bound = |i: usize| {
        if i == 0 {
            r.low
        } else {
            r.buckets[(i - 1).min(n - 1)].0
        }
    };
    let x_labels: Vec<Span> = (0..=4)
        .map(|q| Span::raw(fmt::dur(bound(q * n / 4))))
        .collect();
    let y_labels: Vec<Span> = [0, max / 2, max]
        .iter()
        .map(|&v| Span::raw(fmt::count(v)))
        .collect();
    let data = [Dataset::default()
        .marker(Marker::HalfBlock)
        .graph_type(GraphType::Bar)
        .style(Style::new().fg(Color::Cyan))
        .data(&points)];
    let chart = Chart::new(data.to_vec())
        .block(block)
        .x_axis(
            Axis::default()
                .bounds([0.0, n as f64])
                .labels(x_labels)
                .style(Style::new().fg(Color::DarkGray)),
        )
        .y_axis(
            Axis::default()
                .bounds([0.0, max as f64])
                .labels(y_labels)
                .style(Style::new().fg(Color::DarkGray)),
        );
    f.render_widget(chart, area);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_keeps_every_count() {
        let r = HistRow {
            name: "x".into(),
            p: Percentiles::default(),
            low: 1,
            buckets: (0..64).map(|i| (i + 1, i)).collect(),
        };
        let m = r.merged(16);
        assert_eq!(m.len(), 16);
        assert_eq!(m.iter().sum::<u64>(), (0..64).sum::<u64>());
        assert_eq!(m[0], 1 + 2 + 3);
    }

    #[test]
    fn the_chart_takes_the_space_the_table_leaves() {
        let body = Rect::new(0, 0, 160, 43);
        let (t, c) = split(body, 12);
        assert_eq!(t.height, 15);
        assert_eq!(c.unwrap().height, 28);
        // Many series: the table gets half.
        let (t, c) = split(body, 60);
        assert_eq!(t.height, 21);
        assert_eq!(c.unwrap().height, 22);
        // Too short for a chart: the table only.
        let (t, c) = split(Rect::new(0, 0, 80, 20), 12);
        assert_eq!(t.height, 20);
        assert!(c.is_none());
    }
}
