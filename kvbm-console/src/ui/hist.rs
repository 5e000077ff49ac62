//! The histograms view: p50 … p99 and max with a small histogram, for time
//! in each slot state, TTFT, and transfer latency by direction.

use super::{bars, head, panel, selected};
use crate::app::App;
use crate::fmt;
use kvbm_recorder::analysis::stats::Series;
use ratatui::Frame;
use ratatui::layout::{Constraint, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::Span;
use ratatui::widgets::{Cell, Paragraph, Row, Table};

/// Buckets in the small histogram.
const BUCKETS: usize = 16;

fn series(app: &App) -> Vec<(String, &Series)> {
    let s = app.model.stats();
    let mut out = vec![("TTFT".to_string(), s.ttft())];
    out.extend(s.time_in_state().map(|(k, v)| (format!("in {k}"), v)));
    out.extend(
        s.transfer_latency()
            .map(|(k, v)| (format!("transfer {k}"), v)),
    );
    out
}

/// Rows in the table.
pub fn row_count(app: &App) -> usize {
    series(app).len()
}

/// Draws the view.
pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let all = series(app);
    let block = panel(format!(
        "Histograms — {} requests, {} finished (times are engine time)",
        fmt::count(app.model.stats().requests()),
        fmt::count(app.model.stats().finished())
    ));
    if all.iter().all(|(_, s)| s.count() == 0) {
        f.render_widget(Paragraph::new("  nothing measured yet").block(block), area);
        return;
    }
    let visible = area.height.saturating_sub(3) as usize;
    let list = app.list();
    let off = list.offset_for(all.len(), visible);
    let rows: Vec<Row> = all
        .iter()
        .enumerate()
        .skip(off)
        .take(visible)
        .map(|(i, (name, s))| {
            let p = s.percentiles();
            let b: Vec<u64> = s.log_buckets(BUCKETS).iter().map(|(_, c)| *c).collect();
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
                Cell::from(Span::styled(bars(&b), Style::new().fg(Color::Cyan))),
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
