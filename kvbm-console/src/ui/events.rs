//! The event log: every event, newest at the bottom, filterable.

use super::{head, panel, selected};
use crate::app::App;
use crate::fmt;
use kvbm_events::{Category, EventKind};
use ratatui::Frame;
use ratatui::layout::{Constraint, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::Span;
use ratatui::widgets::{Cell, Paragraph, Row, Table};

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

/// Draws the view.
pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let rows = app.event_rows();
    let visible = area.height.saturating_sub(3) as usize;
    let list = app.list();
    let off = list.offset_for(rows.len(), visible);
    let h = app.model.history();
    let title = format!(
        "Events — {} shown of {} kept{}{}{}",
        fmt::count(rows.len() as u64),
        fmt::count(h.len() as u64),
        if h.dropped() > 0 {
            format!(" ({} older dropped)", fmt::count(h.dropped()))
        } else {
            String::new()
        },
        app.ui
            .filter
            .as_ref()
            .map_or(String::new(), |f| format!(" · filter `{}`", f.text)),
        if app.ui.follow { " · following" } else { "" },
    );
    if rows.is_empty() {
        f.render_widget(Paragraph::new("  no events").block(panel(title)), area);
        return;
    }
    let body: Vec<Row> = rows
        .iter()
        .enumerate()
        .skip(off)
        .take(visible)
        .filter_map(|(i, &idx)| {
            let e = h.get(idx)?;
            let r = Row::new(vec![
                Cell::from(e.seq.to_string()),
                Cell::from(fmt::clock(e.ts_ns)),
                Cell::from(e.iteration.to_string()),
                Cell::from(e.request.as_deref().unwrap_or("-")),
                Cell::from(Span::styled(
                    e.kind.name(),
                    Style::new().fg(kind_color(&e.kind)),
                )),
                Cell::from(describe(&e.kind)),
            ]);
            Some(if i == list.selected {
                r.style(selected())
            } else {
                r
            })
        })
        .collect();
    let table = Table::new(
        body,
        [
            Constraint::Length(8),
            Constraint::Length(10),
            Constraint::Length(6),
            Constraint::Length(12),
            Constraint::Length(17),
            Constraint::Min(10),
        ],
    )
    .header(Row::new(vec!["Seq", "Time", "Iter", "Request", "Kind", "Detail"]).style(head()))
    .block(panel(title));
    f.render_widget(table, area);
}
