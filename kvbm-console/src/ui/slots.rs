//! The slots view: one row per request.

use super::{dim, head, panel, selected, state_color};
use crate::app::App;
use crate::fmt;
use kvbm_events::reducer::SlotView;
use ratatui::Frame;
use ratatui::layout::{Constraint, Rect};
use ratatui::style::Style;
use ratatui::text::Span;
use ratatui::widgets::{Cell, Paragraph, Row, Table};

/// Terminals at least this wide get a column per tier.
const WIDE: u16 = 120;

fn row<'a>(s: &'a SlotView, now: u64, wide: bool) -> Row<'a> {
    let age = now.saturating_sub(s.created_ns);
    let state = Span::styled(s.state.to_string(), Style::new().fg(state_color(&s.state)));
    let mut cells: Vec<Cell> = vec![
        Cell::from(s.request.as_ref()),
        Cell::from(state),
        Cell::from(fmt::dur(age)),
        Cell::from(s.prompt_tokens.to_string()),
        Cell::from(s.generated.to_string()),
    ];
    if wide {
        for b in s.blocks {
            cells.push(Cell::from(b.to_string()));
        }
        for h in s.hit_tokens {
            cells.push(Cell::from(h.to_string()));
        }
        cells.push(Cell::from(s.outstanding.to_string()));
        cells.push(Cell::from(s.ttft_ns().map_or("-".into(), fmt::dur)));
    } else {
        cells.push(Cell::from(format!(
            "{}/{}/{}",
            s.blocks[0], s.blocks[1], s.blocks[2]
        )));
        cells.push(Cell::from(s.total_hit_tokens().to_string()));
        cells.push(Cell::from(s.outstanding.to_string()));
    }
    let r = Row::new(cells);
    if s.is_finished() {
        r.style(dim(Style::new()))
    } else {
        r
    }
}

/// Draws the view.
pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let rows = app.slot_rows();
    let wide = area.width >= WIDE;
    let visible = area.height.saturating_sub(3) as usize;
    let list = app.list();
    let off = list.offset_for(rows.len(), visible);
    let now = app.model.now_ns();
    let sort = format!(
        "sorted by {}{}",
        app.ui.sort.name(),
        if app.ui.reverse { " (reversed)" } else { "" }
    );
    let title = format!(
        "Slots — {} shown{} · {} · pruned {}",
        rows.len(),
        app.ui
            .filter
            .as_ref()
            .map_or(String::new(), |f| format!(" matching `{}`", f.text)),
        sort,
        app.model.state().pruned_slots()
    );
    let block = panel(title);
    if rows.is_empty() {
        let msg = if let Some(why) = &app.ui.no_slots_reason {
            why.as_str()
        } else if app.ui.filter.is_some() {
            "no request matches the filter (Esc clears it)"
        } else {
            "no requests yet"
        };
        f.render_widget(Paragraph::new(format!("  {msg}")).block(block), area);
        return;
    }
    let body: Vec<Row> = rows
        .iter()
        .enumerate()
        .skip(off)
        .take(visible)
        .map(|(i, s)| {
            let r = row(s, now, wide);
            if i == list.selected {
                r.style(selected())
            } else {
                r
            }
        })
        .collect();
    let (header, widths): (Vec<&str>, Vec<Constraint>) = if wide {
        let h = vec![
            "Request", "State", "Age", "Prompt", "Gen", "G1", "G2", "G3", "Hit G1", "Hit G2",
            "Hit G3", "Xfer", "TTFT",
        ];
        let w = vec![
            Constraint::Min(14),
            Constraint::Length(17),
            Constraint::Length(8),
            Constraint::Length(6),
            Constraint::Length(5),
            Constraint::Length(5),
            Constraint::Length(5),
            Constraint::Length(5),
            Constraint::Length(7),
            Constraint::Length(7),
            Constraint::Length(7),
            Constraint::Length(4),
            Constraint::Length(8),
        ];
        (h, w)
    } else {
        let h = vec![
            "Request", "State", "Age", "Prompt", "Gen", "G1/G2/G3", "Hit", "Xfer",
        ];
        let w = vec![
            Constraint::Min(8),
            Constraint::Length(14),
            Constraint::Length(8),
            Constraint::Length(6),
            Constraint::Length(4),
            Constraint::Length(9),
            Constraint::Length(6),
            Constraint::Length(4),
        ];
        (h, w)
    };
    let table = Table::new(body, widths)
        .header(Row::new(header).style(head()))
        .block(block);
    f.render_widget(table, area);
}
