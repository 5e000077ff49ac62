//! Drawing, one type per view.
//!
//! Each view ([`slots::Slots`], [`detail::Detail`],
//! [`transfers::Transfers`], [`pools::Pools`], [`hist::Histograms`],
//! [`breakpoints::Breakpoints`], [`events::EventLog`],
//! [`capacity::Capacity`]) owns its rows, its
//! selection and, where it has one, its filter. It implements [`View`]:
//! [`View::update`] computes the rows from the [`Model`] in the update
//! step, and [`View::draw`] takes `&self`, so drawing cannot change state.
//! [`chrome`] draws what surrounds the views (header, tabs, footer,
//! popups) from plain values.
//!
//! Nothing here knows the app: the app drives these types, never the
//! reverse. The layout is a pure function of the terminal size, so
//! mouse clicks are mapped with the same arithmetic that drew the screen.

pub mod breakpoints;
pub mod capacity;
pub mod chrome;
pub mod columns;
pub mod detail;
pub mod events;
pub mod filter;
pub mod hist;
pub mod list;
pub mod pools;
pub mod slots;
pub mod transfers;

use crate::keys::ViewId;
use crate::model::Model;
use crate::source::Tone;
use filter::Filter;
use kvbm_events::RequestId;
use kvbm_events::slot::SlotState;
use list::ListState;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::Span;
use ratatui::widgets::Block;

/// What every view does. Its rows are computed in [`update`](Self::update)
/// (the update step); the list methods keep its selection in range; only
/// [`draw`](Self::draw) touches the frame, and it cannot change the view.
pub trait View {
    /// Recomputes the rows from `model`.
    fn update(&mut self, model: &Model);

    /// Rows in its list (0 for a view without one).
    fn row_count(&self) -> usize;

    /// Its selection and scroll position.
    fn list(&self) -> &ListState;

    /// Its selection and scroll position, to change.
    fn list_mut(&mut self) -> &mut ListState;

    /// Rows of its list that fit in `body` (its area less borders and the
    /// header row).
    fn visible_rows(&self, body: Rect) -> usize {
        body.height.saturating_sub(3) as usize
    }

    /// Where its list's rows are on screen, for clicks; `None` when a click
    /// selects nothing.
    fn rows_area(&self, body: Rect) -> Option<Rect> {
        Some(Rect::new(
            body.x,
            body.y + 2,
            body.width,
            body.height.saturating_sub(3),
        ))
    }

    /// Moves the selection by `delta` rows (`visible` show).
    fn moved(&mut self, delta: isize, visible: usize) {
        let len = self.row_count();
        self.list_mut().moved(delta, len, visible);
    }

    /// Selects `row` (a click).
    fn select(&mut self, row: usize, visible: usize) {
        let len = self.row_count();
        self.list_mut().select(row, len, visible);
    }

    /// Keeps the selection in range after [`update`](Self::update).
    fn settle(&mut self, visible: usize) {
        let len = self.row_count();
        self.list_mut().clamp(len, visible);
    }

    /// The request of the selected row, if it has one.
    fn selected_request(&self, model: &Model) -> Option<RequestId> {
        let _ = model;
        None
    }

    /// The list row under a click at `(x, y)` with the view drawn in
    /// `body`, if any.
    fn row_at(&self, body: Rect, x: u16, y: u16) -> Option<usize> {
        let list = self.rows_area(body)?;
        if x < list.x || x >= list.right() || y < list.y || y >= list.bottom() {
            return None;
        }
        let len = self.row_count();
        let off = self.list().offset_for(len, list.height as usize);
        let row = off + (y - list.y) as usize;
        (row < len).then_some(row)
    }

    /// Draws it into `area`.
    fn draw(&self, model: &Model, f: &mut Frame, area: Rect);
}

/// Every view's state, each owning its rows. Only the view on screen (the
/// detail, when one is open) is updated, so a view that comes on screen is
/// updated before it is drawn.
pub struct Views {
    /// One row per request.
    pub slots: slots::Slots,
    /// Candidates, batches, recent ends.
    pub transfers: transfers::Transfers,
    /// Per-tier gauges.
    pub pools: pools::Pools,
    /// Distributions.
    pub histograms: hist::Histograms,
    /// Breakpoints and paused calls.
    pub breakpoints: breakpoints::Breakpoints,
    /// The event log.
    pub events: events::EventLog,
    /// Hit ratio by capacity, miss reasons.
    pub capacity: capacity::Capacity,
    /// The open request's detail, over whichever view is selected.
    pub detail: Option<detail::Detail>,
}

impl Views {
    /// Every view empty; the slots view says `no_slots_reason` (when
    /// given) instead of "no requests yet".
    pub fn new(no_slots_reason: Option<String>) -> Self {
        Views {
            slots: slots::Slots::new(no_slots_reason),
            transfers: transfers::Transfers::default(),
            pools: pools::Pools::default(),
            histograms: hist::Histograms::default(),
            breakpoints: breakpoints::Breakpoints::default(),
            events: events::EventLog::default(),
            capacity: capacity::Capacity::default(),
            detail: None,
        }
    }

    /// The view on screen: the detail when one is open, else `view`.
    pub fn current(&self, view: ViewId) -> &dyn View {
        match &self.detail {
            Some(d) => d,
            None => match view {
                ViewId::Slots => &self.slots,
                ViewId::Transfers => &self.transfers,
                ViewId::Pools => &self.pools,
                ViewId::Histograms => &self.histograms,
                ViewId::Breakpoints => &self.breakpoints,
                ViewId::Events => &self.events,
                ViewId::Capacity => &self.capacity,
            },
        }
    }

    /// [`current`](Self::current), to change.
    pub fn current_mut(&mut self, view: ViewId) -> &mut dyn View {
        match &mut self.detail {
            Some(d) => d,
            None => match view {
                ViewId::Slots => &mut self.slots,
                ViewId::Transfers => &mut self.transfers,
                ViewId::Pools => &mut self.pools,
                ViewId::Histograms => &mut self.histograms,
                ViewId::Breakpoints => &mut self.breakpoints,
                ViewId::Events => &mut self.events,
                ViewId::Capacity => &mut self.capacity,
            },
        }
    }

    /// Gives every view that filters a copy of `filter`.
    pub fn set_filter(&mut self, filter: Option<&Filter>) {
        self.slots.set_filter(filter.cloned());
        self.transfers.set_filter(filter.cloned());
        self.events.set_filter(filter.cloned());
    }
}

/// The screen's regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Areas {
    /// The header lines ([`chrome::header_lines`]).
    pub header: Rect,
    /// The tab bar.
    pub tabs: Rect,
    /// The view.
    pub body: Rect,
    /// The prompt / message / hints line.
    pub footer: Rect,
}

/// Takes every colour out of a drawn frame, keeping emphasis (bold,
/// reverse, underline), for `NO_COLOR`.
pub fn strip_colors(buf: &mut ratatui::buffer::Buffer) {
    for cell in buf.content.iter_mut() {
        cell.fg = Color::Reset;
        cell.bg = Color::Reset;
        cell.underline_color = Color::Reset;
    }
}

/// Splits the terminal, with a header of two lines.
pub fn areas(size: Rect) -> Areas {
    areas_with_header(size, 2)
}

/// Splits the terminal, with a header of `header_lines` lines.
pub fn areas_with_header(size: Rect, header_lines: u16) -> Areas {
    let [header, tabs, body, footer] = Layout::vertical([
        Constraint::Length(header_lines),
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(size);
    Areas {
        header,
        tabs,
        body,
        footer,
    }
}

/// The colour of a slot state.
pub fn state_color(s: &SlotState) -> Color {
    match s {
        SlotState::Initialized => Color::Gray,
        SlotState::OnboardStaged(_) | SlotState::Onboarding(_) => Color::Cyan,
        SlotState::Prefilling => Color::Yellow,
        SlotState::Decoding => Color::Green,
        SlotState::SkippedPrefill | SlotState::SkippedDecode => Color::Blue,
        SlotState::Preempted => Color::Red,
        SlotState::Finishing => Color::Magenta,
        SlotState::Finished => Color::DarkGray,
    }
}

/// The background of a badge of `tone`.
pub fn tone_color(tone: Tone) -> Color {
    match tone {
        Tone::Ok => Color::Green,
        Tone::Caution => Color::Yellow,
        Tone::Down => Color::Red,
        Tone::Replay => Color::Cyan,
        Tone::Still => Color::Gray,
    }
}

/// A bordered block with a title.
pub fn panel(title: impl Into<String>) -> Block<'static> {
    Block::bordered().title(Span::styled(
        format!(" {} ", title.into()),
        Style::new().add_modifier(Modifier::BOLD),
    ))
}

/// Header style: bold.
pub fn head() -> Style {
    Style::new().add_modifier(Modifier::BOLD).fg(Color::White)
}

/// The selected row's style.
pub fn selected() -> Style {
    Style::new().add_modifier(Modifier::REVERSED)
}

/// A rectangle of at most `w`×`h` centred in `area`.
pub fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let w = w.min(area.width);
    let h = h.min(area.height);
    Rect::new(
        area.x + (area.width - w) / 2,
        area.y + (area.height - h) / 2,
        w,
        h,
    )
}

/// Dims a style (finished rows).
pub fn dim(s: Style) -> Style {
    s.add_modifier(Modifier::DIM).fg(Color::DarkGray)
}

/// A line of unicode bars for counts (`▁▂▃▄▅▆▇█`), scaled to the largest.
pub fn bars(counts: &[u64]) -> String {
    const B: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let max = counts.iter().copied().max().unwrap_or(0);
    counts
        .iter()
        .map(|&c| {
            if c == 0 || max == 0 {
                ' '
            } else {
                B[((c * 7).div_ceil(max)).min(7) as usize]
            }
        })
        .collect()
}

/// Bold text.
pub fn bold(s: impl Into<String>) -> Span<'static> {
    Span::raw(s.into()).bold()
}
