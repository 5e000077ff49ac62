//! The transfers view: totals per direction, in-flight candidates and
//! batches, and recent ends (completions with latency; skips, cancels and
//! failures with their reasons).

use super::columns::{self, Col, GridRow};
use super::filter::{Filter, passes};
use super::list::ListState;
use super::{View, head, panel, selected};
use crate::fmt;
use crate::model::Model;
use kvbm_events::reducer::{EngineState, TransferState, TransferView};
use kvbm_events::{Direction, RequestId};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};

/// Rows of the totals table at most (one per direction).
const TOTALS: u16 = 4;

fn split(body: Rect) -> [Rect; 3] {
    Layout::vertical([
        Constraint::Length(TOTALS + 3),
        Constraint::Percentage(40),
        Constraint::Min(4),
    ])
    .areas(body)
}

/// The selectable list (in flight, then recent): the middle and bottom
/// tables share one selection, in flight first.
pub fn list_area(body: Rect) -> Rect {
    let [_, mid, bottom] = split(body);
    Rect::new(mid.x, mid.y, mid.width, mid.height + bottom.height)
}

/// The transfers view's state. Its rows (one selection over two tables)
/// are the in-flight candidates (oldest first), then the recent ends
/// (newest first), filtered; the totals and batches are drawn from the
/// model.
#[derive(Debug, Clone, Default)]
pub struct Transfers {
    rows: Vec<TransferView>,
    /// How many of `rows` are in flight.
    in_flight: usize,
    list: ListState,
    filter: Option<Filter>,
    bytes_note: Option<String>,
}

impl Transfers {
    /// What the byte figures stand for, when the source knows (the demo's
    /// simulator: the model's bytes, not the few really copied), shown in
    /// the totals' title.
    pub fn set_bytes_note(&mut self, note: Option<String>) {
        self.bytes_note = note;
    }

    /// Filters the rows from the next update on.
    pub fn set_filter(&mut self, filter: Option<Filter>) {
        self.filter = filter;
    }

    fn passes(&self, t: &TransferView) -> bool {
        passes(
            self.filter.as_ref(),
            &[
                t.request.as_deref().unwrap_or(""),
                &t.direction.to_string(),
                &t.status.to_string(),
            ],
        )
    }
}

impl View for Transfers {
    fn update(&mut self, model: &Model) {
        let st = model.state();
        let mut rows: Vec<TransferView> =
            st.in_flight().filter(|t| self.passes(t)).cloned().collect();
        self.in_flight = rows.len();
        rows.extend(st.recent().rev().filter(|t| self.passes(t)).cloned());
        self.rows = rows;
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
        list_area(body).height.saturating_sub(3) as usize
    }

    /// Split over two tables: selected with the keys only.
    fn rows_area(&self, _body: Rect) -> Option<Rect> {
        None
    }

    fn selected_request(&self, _model: &Model) -> Option<RequestId> {
        self.rows.get(self.list.selected)?.request.clone()
    }

    fn draw(&self, model: &Model, f: &mut Frame, area: Rect) {
        let st = model.state();
        let now = model.now_ns();
        let [tot_a, mid_a, bot_a] = split(area);

        // Totals per direction.
        self.draw_totals(f, tot_a, st);

        // One selection over in flight + recent.
        let all = &self.rows;
        let n_flight = self.in_flight;
        let list = &self.list;
        let mid_rows = columns::body_rows(mid_a);
        let bot_rows = columns::body_rows(bot_a);
        // The selection scrolls the table it is in; the other keeps its top.
        let sel = list.selected;
        let mk = |i: usize, t: &TransferView, in_flight: bool| {
            let bytes = bytes_per_block(st, t.direction).map_or("-".into(), |b| {
                format!("~{}", fmt::bytes(b * u64::from(t.blocks)))
            });
            let when = if in_flight {
                fmt::dur(now.saturating_sub(t.planned_ns))
            } else {
                fmt::dur(t.latency_ns())
            };
            let plain = |s: String| (s, Style::new());
            let r = GridRow {
                cells: vec![
                    plain(format!("#{}", t.id)),
                    plain(t.request.as_deref().unwrap_or("-").to_string()),
                    (
                        t.status.to_string(),
                        Style::new().fg(status_color(&t.status)),
                    ),
                    plain(t.direction.to_string()),
                    plain(t.blocks.to_string()),
                    plain(bytes),
                    plain(when),
                    plain(t.batch.map_or("-".into(), |b| b.to_string())),
                ],
                style: Style::new(),
            };
            if i == sel { r.style(selected()) } else { r }
        };
        let mid_off = if sel < n_flight {
            sel.saturating_sub(mid_rows.saturating_sub(1))
        } else {
            0
        };
        let flight: Vec<GridRow> = all[..n_flight]
            .iter()
            .enumerate()
            .skip(mid_off)
            .take(mid_rows)
            .map(|(i, t)| mk(i, t, true))
            .collect();
        let bot_sel = sel.saturating_sub(n_flight);
        let bot_off = if sel >= n_flight {
            bot_sel.saturating_sub(bot_rows.saturating_sub(1))
        } else {
            0
        };
        let recent: Vec<GridRow> = all[n_flight..]
            .iter()
            .enumerate()
            .skip(bot_off)
            .take(bot_rows)
            .map(|(i, t)| mk(i + n_flight, t, false))
            .collect();
        // Both tables share their widths so their columns line up.
        let widths = columns::fit(
            &RECENT_COLS,
            flight.iter().chain(&recent),
            mid_a.width.saturating_sub(2),
        );
        let batches: Vec<String> = st
            .batches_in_flight()
            .take(4)
            .map(|b| {
                format!(
                    "batch {} {} {}×{} blk {}",
                    b.id,
                    b.direction,
                    b.transfers.len(),
                    b.blocks,
                    fmt::dur(now.saturating_sub(b.dispatched_ns))
                )
            })
            .collect();
        let mid_title = format!(
            "In flight — {} candidates · {} batches{}",
            n_flight,
            st.batches_in_flight().count(),
            if batches.is_empty() {
                String::new()
            } else {
                format!(": {}", batches.join(" · "))
            }
        );
        f.render_widget(
            columns::table(&FLIGHT_COLS, &widths, flight, head(), panel(mid_title)),
            mid_a,
        );
        let bot_title = format!(
            "Recent — {} kept{} (latency = planned → end)",
            all.len() - n_flight,
            if st.recent_dropped() > 0 {
                format!(", {} older dropped", fmt::count(st.recent_dropped()))
            } else {
                String::new()
            }
        );
        f.render_widget(
            columns::table(&RECENT_COLS, &widths, recent, head(), panel(bot_title)),
            bot_a,
        );
    }
}

impl Transfers {
    /// The totals table: per direction, each outcome's count, the blocks
    /// and bytes moved and the rate; the title carries the bytes note.
    fn draw_totals(&self, f: &mut Frame, tot_a: Rect, st: &EngineState) {
        let totals: Vec<GridRow> = st
            .direction_totals()
            .iter()
            .map(|t| {
                let rate = if t.elapsed_ns > 0 {
                    format!(
                        "{}/s",
                        fmt::bytes((t.bytes as f64 / (t.elapsed_ns as f64 / 1e9)) as u64)
                    )
                } else {
                    "-".into()
                };
                GridRow::plain([
                    t.direction.to_string(),
                    fmt::count(t.planned),
                    fmt::count(t.completed),
                    fmt::count(t.skipped),
                    fmt::count(t.cancelled),
                    fmt::count(t.failed),
                    fmt::count(t.blocks),
                    fmt::bytes(t.bytes),
                    rate,
                ])
            })
            .collect();
        let title = match (&self.bytes_note, totals.is_empty()) {
            (None, true) => "Totals — no transfers yet".to_string(),
            (None, false) => "Totals by direction".to_string(),
            (Some(n), true) => format!("Totals — no transfers yet · {n}"),
            (Some(n), false) => format!("Totals by direction · {n}"),
        };
        let widths = columns::fit(&TOTAL_COLS, &totals, tot_a.width.saturating_sub(2));
        f.render_widget(
            columns::table(&TOTAL_COLS, &widths, totals, head(), panel(title)),
            tot_a,
        );
    }
}

/// Minimums below the headers' widths: at 60 columns the headers alone
/// (61 with their gaps) did not fit, and the table cut its right-aligned
/// headers from the left ("anned"); now `fit` narrows them, each cut
/// ending in `…` ("Can…"), down to 45 columns.
const TOTAL_COLS: [Col; 9] = [
    Col::text("Dir", 3, 7),
    Col::num("Planned", 4, 12),
    Col::num("Done", 4, 12),
    Col::num("Skipped", 4, 12),
    Col::num("Cancelled", 4, 12),
    Col::num("Failed", 4, 12),
    Col::num("Blocks", 4, 14),
    Col::num("Bytes", 4, 10),
    Col::num("Rate", 4, 12),
];

/// The in-flight table's columns; the recent table's are the same but
/// for two headers, and both share their widths.
const FLIGHT_COLS: [Col; 8] = [
    Col::text("Id", 2, 9),
    Col::text("Request", 7, 32),
    Col::text("Status", 6, 40),
    Col::text("Dir", 5, 7),
    Col::num("Blocks", 6, 7),
    Col::num("Bytes", 5, 11),
    Col::num("Age", 3, 9),
    Col::num("Batch", 5, 8),
];

const RECENT_COLS: [Col; 8] = [
    FLIGHT_COLS[0],
    FLIGHT_COLS[1],
    Col::text("Status / reason", 6, 40),
    FLIGHT_COLS[3],
    FLIGHT_COLS[4],
    FLIGHT_COLS[5],
    Col::num("Latency", 3, 9),
    FLIGHT_COLS[7],
];

fn bytes_per_block(state: &EngineState, d: Direction) -> Option<u64> {
    state
        .direction(d)
        .filter(|t| t.completed_blocks > 0 && t.bytes > 0)
        .map(|t| t.bytes / t.blocks.max(1))
}

fn status_color(s: &TransferState) -> Color {
    match s {
        TransferState::PendingEvaluation => Color::Yellow,
        TransferState::Promoted => Color::Cyan,
        TransferState::Completed => Color::Green,
        TransferState::Skipped(_) | TransferState::Cancelled => Color::DarkGray,
        TransferState::Failed(_) => Color::Red,
    }
}
