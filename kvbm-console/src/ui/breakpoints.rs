//! The breakpoints view: the breakpoints set, and the calls paused now
//! with how long each has waited and when it resumes by itself.
//!
//! Live, both come from the engine's control (read in the update step and
//! handed over with [`Breakpoints::set_control`]). In a replay there is
//! nothing to control; the paused calls are the reducer's, at the replay's
//! position, in engine time.

use super::columns::{self, Col, GridRow};
use super::list::ListState;
use super::{View, head, panel, selected};
use crate::bpspec;
use crate::fmt;
use crate::model::Model;
use kvbm_events::control::BreakpointsView;
use kvbm_events::reducer::PausedCall;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;

/// The breakpoints view's state. Its rows (one selection) are the
/// breakpoints, then the paused calls.
#[derive(Debug, Clone, Default)]
pub struct Breakpoints {
    /// The engine's breakpoints and paused calls, when it takes commands.
    control: Option<BreakpointsView>,
    /// Without control (a replay): the calls paused at this point of the
    /// log.
    replay_paused: Vec<PausedCall>,
    list: ListState,
}

impl Breakpoints {
    /// What the engine's control said in this update step (`None`: the
    /// source takes no commands).
    pub fn set_control(&mut self, control: Option<BreakpointsView>) {
        self.control = control;
    }

    /// What the engine's control said last.
    pub fn control(&self) -> Option<&BreakpointsView> {
        self.control.as_ref()
    }

    /// The id of the selected breakpoint, if a breakpoint is selected.
    pub fn selected_breakpoint(&self) -> Option<u64> {
        let c = self.control.as_ref()?;
        c.breakpoints.get(self.list.selected).map(|b| b.id)
    }

    /// The pause to resume: the selected paused call, else the first.
    pub fn pause_to_resume(&self) -> Option<u64> {
        let c = self.control.as_ref()?;
        let sel = self.list.selected;
        sel.checked_sub(c.breakpoints.len())
            .and_then(|i| c.paused.get(i))
            .or(c.paused.first())
            .map(|p| p.pause_id)
    }
}

impl View for Breakpoints {
    fn update(&mut self, model: &Model) {
        self.replay_paused.clear();
        if self.control.is_none() {
            self.replay_paused.extend(model.state().paused().cloned());
        }
    }

    fn row_count(&self) -> usize {
        match &self.control {
            Some(c) => c.breakpoints.len() + c.paused.len(),
            None => self.replay_paused.len(),
        }
    }

    fn list(&self) -> &ListState {
        &self.list
    }

    fn list_mut(&mut self) -> &mut ListState {
        &mut self.list
    }

    fn draw(&self, model: &Model, f: &mut Frame, area: Rect) {
        let [top, bottom, note] = Layout::vertical([
            Constraint::Percentage(45),
            Constraint::Min(4),
            Constraint::Length(1),
        ])
        .areas(area);
        let sel = self.list.selected;
        let st = model.state();
        let now = model.now_ns();
        let stats = st.breakpoints();
        match &self.control {
            Some(c) => {
                let rows: Vec<GridRow> = c
                    .breakpoints
                    .iter()
                    .enumerate()
                    .map(|(i, b)| {
                        let r = GridRow::plain([
                            format!("#{}", b.id),
                            bpspec::describe(&b.spec),
                            b.hits.to_string(),
                        ]);
                        if i == sel { r.style(selected()) } else { r }
                    })
                    .collect();
                let title = if rows.is_empty() {
                    "Breakpoints — none (a to add, or b on a request)".to_string()
                } else {
                    format!("Breakpoints — {}", c.breakpoints.len())
                };
                let widths = columns::fit(&BP_COLS, &rows, top.width.saturating_sub(2));
                f.render_widget(
                    columns::table(&BP_COLS, &widths, rows, head(), panel(title)),
                    top,
                );
                let n = c.breakpoints.len();
                let rows: Vec<GridRow> = c
                    .paused
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let warn = p.deadline_in.as_secs() < 5;
                        let r = GridRow::plain([
                            p.pause_id.to_string(),
                            if p.breakpoint == 0 {
                                "step".into()
                            } else {
                                format!("#{}", p.breakpoint)
                            },
                            p.call.entry.name().to_string(),
                            p.call.request.as_deref().unwrap_or("-").to_string(),
                            p.call.state.map_or("-".into(), |s| s.to_string()),
                            fmt::dur(p.waited.as_nanos() as u64),
                            fmt::dur(p.deadline_in.as_nanos() as u64),
                        ]);
                        let r = if warn {
                            r.style(Style::new().fg(Color::Yellow))
                        } else {
                            r
                        };
                        if i + n == sel { r.style(selected()) } else { r }
                    })
                    .collect();
                let title = format!("Paused calls — {}", c.paused.len());
                let widths = columns::fit(&PAUSED_COLS, &rows, bottom.width.saturating_sub(2));
                f.render_widget(
                    columns::table(&PAUSED_COLS, &widths, rows, head(), panel(title)),
                    bottom,
                );
            }
            None => {
                f.render_widget(
                    Paragraph::new(Line::from(Span::styled(
                        "  replay: breakpoints are read-only; below, the calls paused at this point of the log",
                        Style::new().fg(Color::DarkGray),
                    )))
                    .block(panel("Breakpoints")),
                    top,
                );
                let rows: Vec<GridRow> = self
                    .replay_paused
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let r = GridRow::plain([
                            p.seq.to_string(),
                            format!("#{}", p.breakpoint),
                            p.entry.name().to_string(),
                            p.request.as_deref().unwrap_or("-").to_string(),
                            fmt::dur(now.saturating_sub(p.hit_ns)),
                            fmt::dur(p.deadline_ns.saturating_sub(now)),
                        ]);
                        if i == sel { r.style(selected()) } else { r }
                    })
                    .collect();
                let title = format!("Paused calls — {}", self.replay_paused.len());
                let widths =
                    columns::fit(&REPLAY_PAUSED_COLS, &rows, bottom.width.saturating_sub(2));
                f.render_widget(
                    columns::table(&REPLAY_PAUSED_COLS, &widths, rows, head(), panel(title)),
                    bottom,
                );
            }
        }
        let causes: Vec<String> = kvbm_events::reducer::BreakpointStats::CAUSES
            .iter()
            .zip(stats.resumed_by_cause)
            .map(|(c, n)| format!("{c:?} {n}"))
            .collect();
        f.render_widget(
            Paragraph::new(Span::styled(
                format!(
                    " hits {} · resumed {} ({})",
                    stats.hits,
                    stats.resumed,
                    causes.join(", ")
                ),
                Style::new().fg(Color::DarkGray),
            )),
            note,
        );
    }
}

const BP_COLS: [Col; 3] = [
    Col::text("Id", 2, 8),
    Col::text("Matches", 7, u16::MAX),
    Col::num("Hits", 4, 10),
];

const PAUSED_COLS: [Col; 7] = [
    Col::num("Pause", 5, 8),
    Col::text("Bp", 2, 8),
    Col::text("Entry", 5, 32),
    Col::text("Request", 7, 40),
    Col::text("State", 5, 17),
    Col::num("Waited", 6, 10),
    Col::num("Resumes in", 10, 10),
];

const REPLAY_PAUSED_COLS: [Col; 6] = [
    Col::num("Seq", 3, 12),
    Col::text("Bp", 2, 8),
    Col::text("Entry", 5, 32),
    Col::text("Request", 7, 40),
    Col::num("Waited", 6, 10),
    Col::num("Resumes in", 10, 10),
];
