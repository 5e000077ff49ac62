//! The event log: every event, newest at the bottom, filterable; it
//! follows the newest event until scrolled away from it.

use super::columns::{self, Col, GridRow};
use super::filter::Filter;
use super::list::ListState;
use super::{View, head, panel, selected};
use crate::fmt;
use crate::model::Model;
use kvbm_events::{Category, EventKind, RequestId};
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::style::{Color, Style};
use ratatui::widgets::Paragraph;

/// A short description of an event's payload.
pub fn describe(kind: &EventKind) -> String {
    match kind {
        EventKind::SlotCreated {
            prompt_tokens,
            max_output_tokens,
        } => format!("prompt {prompt_tokens} max_out {max_output_tokens}"),
        EventKind::SlotTransition { from, to } => format!("{from} → {to}"),
        EventKind::MatchResult {
            tier,
            looked_up,
            hit_blocks,
            hit_tokens,
        } => format!(
            "{} {hit_blocks}/{looked_up} blocks hit ({hit_tokens} tokens)",
            tier.short_name()
        ),
        EventKind::BlocksAllocated { tier, blocks } => {
            format!("{} {} blocks", tier.short_name(), blocks.len())
        }
        EventKind::BlocksReleased { tier, count } => {
            format!("{} {count} blocks", tier.short_name())
        }
        EventKind::BlockRegistered {
            tier,
            block,
            sequence_hash,
            duplicate_of,
        } => format!(
            "{} block {block} hash {sequence_hash}{}",
            tier.short_name(),
            duplicate_of.map_or(String::new(), |d| format!(" dup of {d}"))
        ),
        EventKind::BlockEvicted {
            tier,
            block,
            sequence_hash,
        } => format!("{} block {block} hash {sequence_hash}", tier.short_name()),
        EventKind::TransferPlanned {
            transfer,
            direction,
            blocks,
        }
        | EventKind::TransferPromoted {
            transfer,
            direction,
            blocks,
        }
        | EventKind::TransferCompleted {
            transfer,
            direction,
            blocks,
        } => format!("#{transfer} {direction} {blocks} blocks"),
        EventKind::TransferSkipped {
            transfer,
            direction,
            reason,
        } => format!("#{transfer} {direction} {reason}"),
        EventKind::TransferCancelled {
            transfer,
            direction,
        } => format!("#{transfer} {direction}"),
        EventKind::TransferFailed {
            transfer,
            direction,
            error,
        } => format!("#{transfer} {direction} {error}"),
        EventKind::BatchDispatched {
            batch,
            direction,
            transfers,
            blocks,
        } => format!(
            "batch {batch} {direction} {} candidates {blocks} blocks",
            transfers.len()
        ),
        EventKind::BatchCompleted {
            batch,
            direction,
            ok,
            blocks,
            bytes,
            elapsed_ns,
        } => format!(
            "batch {batch} {direction} {} {blocks} blocks {} in {}",
            if *ok { "ok" } else { "FAILED" },
            fmt::bytes(*bytes),
            fmt::dur(*elapsed_ns)
        ),
        EventKind::PoolGauge {
            tier,
            capacity,
            active,
            inactive,
            empty,
        } => format!(
            "{} active {active} inactive {inactive} free {empty} of {capacity}",
            tier.short_name()
        ),
        EventKind::HookCall { entry, phase } => format!("{} {phase:?}", entry.name()),
        EventKind::BreakpointHit {
            breakpoint,
            entry,
            deadline_ns,
        } => format!(
            "bp #{breakpoint} at {} until {}",
            entry.name(),
            fmt::clock(*deadline_ns)
        ),
        EventKind::Resumed { breakpoint, cause } => format!("bp #{breakpoint} {cause:?}"),
        EventKind::TokensScheduled {
            prefill,
            decode,
            computed,
        } => format!("prefill {prefill} decode {decode} computed {computed}"),
        EventKind::PrefixLookup {
            tokens,
            block_size,
            computed_blocks,
            hashes,
        } => format!(
            "{tokens} tokens, {} full blocks of {block_size}, {computed_blocks} on G1{}",
            hashes.len(),
            hashes
                .first()
                .map_or(String::new(), |h| format!(" from {h}"))
        ),
        EventKind::ExternalHit { from_token, tokens } => {
            format!("{tokens} tokens external (other connector) from token {from_token}")
        }
    }
}

fn kind_color(kind: &EventKind) -> Color {
    match kind {
        EventKind::BlockEvicted { .. } => Color::Yellow,
        EventKind::TransferFailed { .. } => Color::Red,
        _ => match kind.tag().category() {
            Category::Slot => Color::Green,
            Category::Transfer | Category::Batch => Color::Cyan,
            Category::Breakpoint => Color::Magenta,
            Category::Block | Category::Pool | Category::Hook => Color::Gray,
        },
    }
}

const COLS: [Col; 6] = [
    Col::num("Seq", 3, 12),
    Col::text("Time", 4, 24),
    Col::num("Iter", 4, 10),
    Col::text("Request", 7, 40),
    Col::text("Kind", 4, 24),
    Col::text("Detail", 6, u16::MAX),
];

/// The event log's state. Its rows are indices into the model's history
/// (oldest first) of the events that pass the filter.
#[derive(Debug, Clone)]
pub struct EventLog {
    rows: Vec<usize>,
    list: ListState,
    filter: Option<Filter>,
    /// The selection sticks to the newest row.
    follow: bool,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog {
            rows: Vec::new(),
            list: ListState::default(),
            filter: None,
            follow: true,
        }
    }
}

impl EventLog {
    /// Filters the rows from the next update on.
    pub fn set_filter(&mut self, filter: Option<Filter>) {
        self.filter = filter;
    }

    /// Follows the newest row (or stops).
    pub fn set_follow(&mut self, follow: bool) {
        self.follow = follow;
    }

    /// Whether it follows the newest row.
    pub fn follows(&self) -> bool {
        self.follow
    }
}

impl View for EventLog {
    fn update(&mut self, model: &Model) {
        let h = model.history();
        self.rows.clear();
        match &self.filter {
            None => self.rows.extend(0..h.len()),
            Some(f) => self.rows.extend((0..h.len()).filter(|&i| {
                h.get(i).is_some_and(|e| {
                    f.matches(&[
                        e.request.as_deref().unwrap_or(""),
                        e.kind.name(),
                        &describe(&e.kind),
                    ])
                })
            })),
        }
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

    /// Moving onto the last row follows new rows; moving off it stops.
    fn moved(&mut self, delta: isize, visible: usize) {
        let len = self.rows.len();
        self.list.moved(delta, len, visible);
        self.follow = self.list.selected + 1 >= len;
    }

    fn settle(&mut self, visible: usize) {
        let len = self.rows.len();
        if self.follow {
            self.list.selected = len.saturating_sub(1);
        }
        self.list.clamp(len, visible);
    }

    fn selected_request(&self, model: &Model) -> Option<RequestId> {
        let i = *self.rows.get(self.list.selected)?;
        model.history().get(i)?.request.clone()
    }

    fn draw(&self, model: &Model, f: &mut Frame, area: Rect) {
        let rows = &self.rows;
        let visible = area.height.saturating_sub(3) as usize;
        let list = &self.list;
        let off = list.offset_for(rows.len(), visible);
        let h = model.history();
        let title = format!(
            "Events — {} shown of {} kept{}{}{}",
            fmt::count(rows.len() as u64),
            fmt::count(h.len() as u64),
            if h.dropped() > 0 {
                format!(" ({} older dropped)", fmt::count(h.dropped()))
            } else {
                String::new()
            },
            self.filter
                .as_ref()
                .map_or(String::new(), |f| format!(" · filter `{}`", f.text)),
            if self.follow { " · following" } else { "" },
        );
        if rows.is_empty() {
            f.render_widget(Paragraph::new("  no events").block(panel(title)), area);
            return;
        }
        let body: Vec<GridRow> = rows
            .iter()
            .enumerate()
            .skip(off)
            .take(visible)
            .filter_map(|(i, &idx)| {
                let e = h.get(idx)?;
                let plain = |s: String| (s, Style::new());
                let r = GridRow {
                    cells: vec![
                        plain(e.seq.to_string()),
                        plain(fmt::clock(e.ts_ns)),
                        plain(e.iteration.to_string()),
                        plain(e.request.as_deref().unwrap_or("-").to_string()),
                        (
                            e.kind.name().to_string(),
                            Style::new().fg(kind_color(&e.kind)),
                        ),
                        plain(describe(&e.kind)),
                    ],
                    style: Style::new(),
                };
                Some(if i == list.selected {
                    r.style(selected())
                } else {
                    r
                })
            })
            .collect();
        // Sized to what is on screen: a wall-clock time of day is longer
        // than engine time, a vLLM request id than a simulated one.
        let widths = columns::fit(&COLS, &body, area.width.saturating_sub(2));
        let table = columns::table(&COLS, &widths, body, head(), panel(title));
        f.render_widget(table, area);
    }
}
