//! The histograms view: p50 … p99 and max with a small histogram, for time
//! in each slot state, TTFT, and transfer latency by direction.

use super::list::ListState;
use super::{View, bars, head, panel, selected};
use crate::fmt;
use crate::model::Model;
use kvbm_recorder::analysis::stats::{Percentiles, Series};
use ratatui::Frame;
use ratatui::layout::{Constraint, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::Span;
use ratatui::widgets::{Cell, Paragraph, Row, Table};

/// Buckets in the small histogram.
const BUCKETS: usize = 16;

/// One series, summarised.
#[derive(Debug, Clone, PartialEq)]
struct HistRow {
    name: String,
    p: Percentiles,
    /// Counts in [`BUCKETS`] log-spaced buckets.
    buckets: Vec<u64>,
}

/// The histograms view's state: one row per series (TTFT, time in each
/// state, transfer latency per direction), summarised in the update step.
#[derive(Debug, Clone, Default)]
pub struct Histograms {
    rows: Vec<HistRow>,
    requests: u64,
    finished: u64,
    list: ListState,
}

impl View for Histograms {
    fn update(&mut self, model: &Model) {
        let s = model.stats();
        let row = |name: String, series: &Series| HistRow {
            name,
            p: series.percentiles(),
            buckets: series
                .log_buckets(BUCKETS)
                .iter()
                .map(|(_, c)| *c)
                .collect(),
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
        let visible = area.height.saturating_sub(3) as usize;
        let list = &self.list;
        let off = list.offset_for(all.len(), visible);
        let rows: Vec<Row> = all
            .iter()
            .enumerate()
            .skip(off)
            .take(visible)
            .map(|(i, HistRow { name, p, buckets })| {
                let r = Row::new(vec![
                    Cell::from(name.clone()),
                    Cell::from(fmt::count(p.count)),
                    Cell::from(if p.count > 0 {
                        fmt::dur(p.p50)
                    } else {
                        "-".into()
                    }),
                    Cell::from(if p.count > 0 {
                        fmt::dur(p.p90)
                    } else {
                        "-".into()
                    }),
                    Cell::from(if p.count > 0 {
                        fmt::dur(p.p99)
                    } else {
                        "-".into()
                    }),
                    Cell::from(if p.count > 0 {
                        fmt::dur(p.max)
                    } else {
                        "-".into()
                    }),
                    Cell::from(Span::styled(bars(buckets), Style::new().fg(Color::Cyan))),
                ]);
                if i == list.selected {
                    r.style(selected())
                } else {
                    r
                }
            })
            .collect();
        let table = Table::new(
            rows,
            [
                Constraint::Length(22),
                Constraint::Length(8),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Length(9),
                Constraint::Min(BUCKETS as u16),
            ],
        )
        .header(
            Row::new(vec![
                "Series",
                "Count",
                "p50",
                "p90",
                "p99",
                "Max",
                "min → max (log)",
            ])
            .style(head()),
        )
        .block(block);
        f.render_widget(table, area);
    }
}
