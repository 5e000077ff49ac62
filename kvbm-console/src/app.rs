//! The console's state and its update step.
//!
//! [`App`] holds the [`Model`] (what the engine did), the source it comes
//! from, and the UI state (view, selection, filter, popups). It changes
//! only in [`App::key`], [`App::mouse`], [`App::pull`] and [`App::tick`];
//! the views in [`crate::ui`] draw from `&App`.

use crate::bpspec;
use crate::keys::{self, Action, Context, ViewId};
use crate::model::Model;
pub use crate::source::Source;
use crate::ui;
use kvbm_events::RequestId;
use kvbm_events::breakpoint::{BreakpointSpec, RequestMatch};
use kvbm_events::control::{BreakpointsView, Control, ControlCommand, ControlResult};
use kvbm_events::reducer::SlotView;
use ratatui::crossterm::event::{
    KeyCode, KeyEvent, KeyModifiers, MouseButton, MouseEvent, MouseEventKind,
};
use ratatui::layout::Rect;
use regex::Regex;
use std::sync::Arc;
use std::time::Instant;

/// A list's selection and scroll position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListState {
    /// Selected row.
    pub selected: usize,
    /// First row shown.
    pub offset: usize,
}

impl ListState {
    /// The first row to show so that `selected` is visible among `visible`
    /// rows of a `len`-row list. Pure, so drawing and updating agree.
    pub fn offset_for(&self, len: usize, visible: usize) -> usize {
        let visible = visible.max(1);
        let sel = self.selected.min(len.saturating_sub(1));
        let mut off = self.offset.min(len.saturating_sub(visible));
        if sel < off {
            off = sel;
        } else if sel >= off + visible {
            off = sel + 1 - visible;
        }
        off
    }

    fn moved(&mut self, delta: isize, len: usize, visible: usize) {
        let max = len.saturating_sub(1);
        self.selected = self.selected.min(max).saturating_add_signed(delta).min(max);
        self.offset = self.offset_for(len, visible);
    }
}

/// Columns the slots table sorts by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotSort {
    /// Lifecycle order of the state, finished last.
    State,
    /// Request id.
    Request,
    /// Age (oldest first).
    Age,
    /// Prompt tokens.
    Prompt,
    /// Generated tokens.
    Generated,
    /// Blocks on G1.
    Blocks,
    /// Tokens hit in the caches.
    Hits,
    /// Outstanding transfers.
    Outstanding,
}

impl SlotSort {
    const ALL: [SlotSort; 8] = [
        SlotSort::State,
        SlotSort::Request,
        SlotSort::Age,
        SlotSort::Prompt,
        SlotSort::Generated,
        SlotSort::Blocks,
        SlotSort::Hits,
        SlotSort::Outstanding,
    ];

    /// Column name.
    pub fn name(self) -> &'static str {
        match self {
            SlotSort::State => "state",
            SlotSort::Request => "request",
            SlotSort::Age => "age",
            SlotSort::Prompt => "prompt",
            SlotSort::Generated => "generated",
            SlotSort::Blocks => "G1 blocks",
            SlotSort::Hits => "hits",
            SlotSort::Outstanding => "outstanding",
        }
    }

    fn next(self) -> Self {
        let i = SlotSort::ALL.iter().position(|s| *s == self).unwrap_or(0);
        SlotSort::ALL[(i + 1) % SlotSort::ALL.len()]
    }
}

/// A filter typed after `/`: a substring (case-insensitive), or a regex
/// written between slashes (`/^req-1[0-9]$/`).
#[derive(Debug, Clone)]
pub struct Filter {
    /// As typed.
    pub text: String,
    lower: String,
    re: Option<Regex>,
}

impl Filter {
    /// Reads a filter; the error says why a regex did not compile.
    pub fn new(text: &str) -> Result<Option<Filter>, String> {
        let t = text.trim();
        if t.is_empty() {
            return Ok(None);
        }
        let re = match t.strip_prefix('/').and_then(|r| r.strip_suffix('/')) {
            Some(pattern) if !pattern.is_empty() => Some(
                regex::RegexBuilder::new(pattern)
                    .size_limit(1 << 20)
                    .build()
                    .map_err(|e| format!("bad regex: {e}"))?,
            ),
            _ => None,
        };
        Ok(Some(Filter {
            text: t.to_string(),
            lower: t.to_lowercase(),
            re,
        }))
    }

    /// Whether any of `fields` matches.
    pub fn matches(&self, fields: &[&str]) -> bool {
        match &self.re {
            Some(re) => fields.iter().any(|f| re.is_match(f)),
            None => fields.iter().any(|f| {
                // Most fields are ASCII; avoid an allocation for them.
                if f.is_ascii() && self.lower.is_ascii() {
                    f.as_bytes()
                        .windows(self.lower.len().max(1))
                        .any(|w| w.eq_ignore_ascii_case(self.lower.as_bytes()))
                        || self.lower.is_empty()
                } else {
                    f.to_lowercase().contains(&self.lower)
                }
            }),
        }
    }
}

/// What a prompt at the bottom line is typing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    /// A filter.
    Filter,
    /// A breakpoint spec.
    Breakpoint,
}

/// A line being typed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Input {
    /// What for.
    pub kind: InputKind,
    /// The text so far.
    pub text: String,
}

/// A short message on the bottom line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The text.
    pub text: String,
    /// An error (drawn red) rather than a confirmation.
    pub error: bool,
}

/// The UI state.
#[derive(Debug, Clone)]
pub struct Ui {
    /// The view on screen.
    pub view: ViewId,
    /// The request whose detail is open.
    pub detail: Option<RequestId>,
    /// Help popup open.
    pub help: bool,
    /// Warnings popup open.
    pub warnings: bool,
    /// Per-view selection.
    pub lists: [ListState; 6],
    /// The detail's event list.
    pub detail_list: ListState,
    /// The selected slot, followed across re-sorts.
    pub selected_slot: Option<RequestId>,
    /// The event log sticks to its newest row.
    pub follow: bool,
    /// Slots sort column.
    pub sort: SlotSort,
    /// Reverse the sort.
    pub reverse: bool,
    /// The active filter.
    pub filter: Option<Filter>,
    /// A prompt being typed.
    pub input: Option<Input>,
    /// The bottom line's message.
    pub message: Option<Message>,
    /// The terminal's size.
    pub size: Rect,
    /// The engine's breakpoints and paused calls, if it takes commands;
    /// read in the update step so drawing never calls into the engine.
    pub control: Option<BreakpointsView>,
    /// Set when the source has no per-request slots (vLLM KV events): the
    /// Slots view says so instead of "no requests yet".
    pub no_slots_reason: Option<String>,
}

impl Default for Ui {
    fn default() -> Self {
        Ui {
            view: ViewId::Slots,
            detail: None,
            help: false,
            warnings: false,
            lists: [ListState::default(); 6],
            detail_list: ListState::default(),
            selected_slot: None,
            follow: true,
            sort: SlotSort::State,
            reverse: false,
            filter: None,
            input: None,
            message: None,
            size: Rect::new(0, 0, 80, 24),
            control: None,
            no_slots_reason: None,
        }
    }
}

/// The open request's events, kept up to date in the update step so that
/// drawing the detail does not scan the whole history (twice) per frame.
/// Positions are absolute (events dropped from the history's front before
/// them + their index), so drops do not shift them.
#[derive(Debug, Clone)]
pub struct DetailCache {
    /// The request.
    pub request: RequestId,
    /// Absolute position the last scan reached.
    pub end: u64,
    /// Absolute positions of the request's events, oldest first.
    pub positions: std::collections::VecDeque<u64>,
}

impl DetailCache {
    /// Indices into `history` of the cached events still held.
    pub fn indices(&self, history: &crate::model::History) -> Vec<usize> {
        let base = history.dropped();
        self.positions
            .iter()
            .filter(|&&p| p >= base)
            .map(|&p| (p - base) as usize)
            .collect()
    }

    /// Whether the cache is for `request` and current for `history`.
    pub fn is_current(&self, request: &str, history: &crate::model::History) -> bool {
        &*self.request == request && self.end == history.dropped() + history.len() as u64
    }
}

/// See the module docs.
pub struct App {
    /// What the engine did.
    pub model: Model,
    /// Where it comes from.
    pub source: Source,
    /// The UI state.
    pub ui: Ui,
    /// A name for the header (`demo`, a file name, a URL).
    pub label: String,
    /// Set when the console should exit.
    pub quit: bool,
    /// The open request's events (see [`DetailCache`]).
    pub detail_cache: Option<DetailCache>,
}

impl App {
    /// A console over `model` fed by `source`.
    pub fn new(model: Model, source: Source, label: impl Into<String>) -> Self {
        let ui = Ui {
            no_slots_reason: source.no_slots_reason().map(str::to_string),
            ..Ui::default()
        };
        let mut app = App {
            model,
            source,
            ui,
            label: label.into(),
            quit: false,
            detail_cache: None,
        };
        app.refresh_control();
        app
    }

    /// The key context now.
    pub fn context(&self) -> Context {
        Context {
            view: self.ui.view,
            replay: matches!(self.source, Source::Replay(_)),
            control: self.control().is_some(),
            detail: self.ui.detail.is_some(),
        }
    }

    /// The engine's breakpoint control, if any.
    pub fn control(&self) -> Option<&Arc<dyn Control>> {
        self.source.control()
    }

    fn refresh_control(&mut self) {
        self.ui.control = self.control().map(|c| c.view());
    }

    /// Pulls new events from the source.
    pub fn pull(&mut self, now: Instant) -> usize {
        self.source.pull(&mut self.model, now)
    }

    /// The periodic step before drawing: reads the engine's breakpoints
    /// and keeps selections in range.
    pub fn tick(&mut self) {
        self.refresh_control();
        self.settle();
    }

    /// Sets the terminal size.
    pub fn resize(&mut self, width: u16, height: u16) {
        self.ui.size = Rect::new(0, 0, width, height);
        self.settle();
    }

    fn say(&mut self, text: impl Into<String>) {
        self.ui.message = Some(Message {
            text: text.into(),
            error: false,
        });
    }

    fn err(&mut self, text: impl Into<String>) {
        self.ui.message = Some(Message {
            text: text.into(),
            error: true,
        });
    }

    /// The slots the table shows, filtered and sorted.
    pub fn slot_rows(&self) -> Vec<&SlotView> {
        let state = self.model.state();
        let mut rows: Vec<&SlotView> = state
            .slots()
            .filter(|s| {
                self.ui
                    .filter
                    .as_ref()
                    .is_none_or(|f| f.matches(&[&s.request, s.state.name()]))
            })
            .collect();
        let state_rank = |s: &SlotView| {
            kvbm_events::slot::SlotState::NAMES
                .iter()
                .position(|n| *n == s.state.name())
                .unwrap_or(0)
        };
        match self.ui.sort {
            SlotSort::State => rows.sort_by_key(|s| (state_rank(s), s.created_ns)),
            SlotSort::Request => rows.sort_by(|a, b| a.request.cmp(&b.request)),
            SlotSort::Age => rows.sort_by_key(|s| s.created_ns),
            SlotSort::Prompt => rows.sort_by_key(|s| std::cmp::Reverse(s.prompt_tokens)),
            SlotSort::Generated => rows.sort_by_key(|s| std::cmp::Reverse(s.generated)),
            SlotSort::Blocks => rows.sort_by_key(|s| std::cmp::Reverse(s.blocks[0])),
            SlotSort::Hits => rows.sort_by_key(|s| std::cmp::Reverse(s.total_hit_tokens())),
            SlotSort::Outstanding => rows.sort_by_key(|s| std::cmp::Reverse(s.outstanding)),
        }
        if self.ui.reverse {
            rows.reverse();
        }
        rows
    }

    /// Indices into the history of the events the log shows (filtered),
    /// oldest first.
    pub fn event_rows(&self) -> Vec<usize> {
        let h = self.model.history();
        match &self.ui.filter {
            None => (0..h.len()).collect(),
            Some(f) => (0..h.len())
                .filter(|&i| {
                    h.get(i).is_some_and(|e| {
                        f.matches(&[
                            e.request.as_deref().unwrap_or(""),
                            e.kind.name(),
                            &ui::events::describe(&e.kind),
                        ])
                    })
                })
                .collect(),
        }
    }

    /// Rows in the current view's list.
    pub fn list_len(&self) -> usize {
        if self.ui.detail.is_some() {
            return ui::detail::event_count(self);
        }
        match self.ui.view {
            ViewId::Slots => self.slot_rows().len(),
            ViewId::Transfers => ui::transfers::row_count(self),
            ViewId::Pools => 0,
            ViewId::Histograms => ui::hist::row_count(self),
            ViewId::Breakpoints => ui::breakpoints::row_count(self),
            ViewId::Events => self.event_rows().len(),
        }
    }

    fn list_mut(&mut self) -> &mut ListState {
        if self.ui.detail.is_some() {
            return &mut self.ui.detail_list;
        }
        &mut self.ui.lists[self.ui.view.index()]
    }

    /// The current view's list state.
    pub fn list(&self) -> &ListState {
        if self.ui.detail.is_some() {
            return &self.ui.detail_list;
        }
        &self.ui.lists[self.ui.view.index()]
    }

    /// Brings the detail's event indices up to date: only the new events
    /// are scanned while the history just grew.
    fn refresh_detail(&mut self) {
        let Some(request) = self.ui.detail.clone() else {
            self.detail_cache = None;
            return;
        };
        let h = self.model.history();
        let (base, end) = (h.dropped(), h.dropped() + h.len() as u64);
        let mut cache = match self.detail_cache.take() {
            // The history only moved forward: keep what is still held and
            // scan the new events.
            Some(mut c) if c.request == request && c.end <= end && c.end >= base => {
                while c.positions.front().is_some_and(|&p| p < base) {
                    c.positions.pop_front();
                }
                c
            }
            _ => DetailCache {
                request: request.clone(),
                end: base,
                positions: Default::default(),
            },
        };
        let from = (cache.end - base) as usize;
        cache.positions.extend(
            ui::detail::scan_events_of(self, &request, from)
                .into_iter()
                .map(|i| base + i as u64),
        );
        cache.end = end;
        self.detail_cache = Some(cache);
    }

    /// Keeps the selection in range and on the same slot after re-sorting.
    fn settle(&mut self) {
        self.refresh_detail();
        let visible = ui::list_rows(self);
        if self.ui.detail.is_none() && self.ui.view == ViewId::Slots {
            let rows = self.slot_rows();
            let pos = self
                .ui
                .selected_slot
                .as_ref()
                .and_then(|id| rows.iter().position(|s| &s.request == id));
            let len = rows.len();
            let sel = match pos {
                Some(p) => p,
                None => self.ui.lists[0].selected.min(len.saturating_sub(1)),
            };
            let id = rows.get(sel).map(|s| s.request.clone());
            self.ui.lists[0].selected = sel;
            self.ui.lists[0].offset = self.ui.lists[0].offset_for(len, visible);
            self.ui.selected_slot = id;
            return;
        }
        let len = self.list_len();
        let follow = self.ui.detail.is_none() && self.ui.view == ViewId::Events && self.ui.follow;
        let l = self.list_mut();
        if follow {
            l.selected = len.saturating_sub(1);
        }
        l.selected = l.selected.min(len.saturating_sub(1));
        l.offset = l.offset_for(len, visible);
    }

    fn move_selection(&mut self, delta: isize) {
        let len = self.list_len();
        let visible = ui::list_rows(self);
        self.list_mut().moved(delta, len, visible);
        if self.ui.view == ViewId::Events && self.ui.detail.is_none() {
            self.ui.follow = self.ui.lists[5].selected + 1 >= len;
        }
        self.after_move();
    }

    fn after_move(&mut self) {
        if self.ui.view == ViewId::Slots && self.ui.detail.is_none() {
            let sel = self.ui.lists[0].selected;
            self.ui.selected_slot = self.slot_rows().get(sel).map(|s| s.request.clone());
        }
    }

    /// The request the selection points at, in the slots table or the
    /// event log or the detail.
    pub fn selected_request(&self) -> Option<RequestId> {
        if let Some(d) = &self.ui.detail {
            return Some(d.clone());
        }
        match self.ui.view {
            ViewId::Slots => self.ui.selected_slot.clone(),
            ViewId::Events => {
                let rows = self.event_rows();
                let i = *rows.get(self.ui.lists[5].selected)?;
                self.model.history().get(i)?.request.clone()
            }
            ViewId::Transfers => ui::transfers::selected_request(self),
            _ => None,
        }
    }

    /// Handles one key.
    pub fn key(&mut self, ev: KeyEvent) {
        if ev.kind != ratatui::crossterm::event::KeyEventKind::Press {
            return;
        }
        if self.ui.input.is_some() {
            self.type_key(ev);
            return;
        }
        // Any popup closes on its own key or Esc; q still quits.
        if let Some(action) = keys::dispatch(&ev, self.context()) {
            self.ui.message = None;
            self.act(action);
        }
        self.settle();
    }

    fn type_key(&mut self, ev: KeyEvent) {
        let Some(input) = self.ui.input.as_mut() else {
            return;
        };
        match ev.code {
            KeyCode::Esc => {
                self.ui.input = None;
            }
            KeyCode::Enter => {
                let input = self.ui.input.take().unwrap_or(Input {
                    kind: InputKind::Filter,
                    text: String::new(),
                });
                self.submit(input);
            }
            KeyCode::Backspace => {
                input.text.pop();
            }
            KeyCode::Char('c') if ev.modifiers.contains(KeyModifiers::CONTROL) => {
                self.quit = true;
            }
            KeyCode::Char('u') if ev.modifiers.contains(KeyModifiers::CONTROL) => {
                input.text.clear();
            }
            // Bounded: a prompt line, not a document.
            KeyCode::Char(c)
                if !ev.modifiers.contains(KeyModifiers::CONTROL) && input.text.len() < 256 =>
            {
                input.text.push(c);
            }
            _ => {}
        }
        if let Some(i) = &self.ui.input
            && i.kind == InputKind::Filter
        {
            // Filter as you type; a regex that does not compile yet keeps
            // the previous filter.
            if let Ok(f) = Filter::new(&i.text) {
                self.ui.filter = f;
            }
        }
        self.settle();
    }

    fn submit(&mut self, input: Input) {
        match input.kind {
            InputKind::Filter => match Filter::new(&input.text) {
                Ok(f) => {
                    let text = f.as_ref().map(|f| f.text.clone());
                    self.ui.filter = f;
                    match text {
                        Some(t) => self.say(format!("filter: {t}  (Esc clears)")),
                        None => self.say("filter cleared"),
                    }
                }
                Err(e) => self.err(e),
            },
            InputKind::Breakpoint => match bpspec::parse(&input.text) {
                Ok(spec) => self.add_breakpoint(spec),
                Err(e) => self.err(e.to_string()),
            },
        }
    }

    fn add_breakpoint(&mut self, spec: BreakpointSpec) {
        let Some(c) = self.control().cloned() else {
            self.err("this source takes no breakpoints (replay)");
            return;
        };
        let text = bpspec::describe(&spec);
        match c.execute(ControlCommand::Add { spec }, None) {
            Ok(ControlResult::Added(id)) => self.say(format!("breakpoint #{id} set: {text}")),
            Ok(other) => self.err(format!("breakpoint refused: unexpected reply {other:?}")),
            Err(e) => self.err(format!("breakpoint refused: {e}")),
        }
        self.refresh_control();
    }

    /// Carries out `command` on `control`; a failure (a refused command, a
    /// remote engine out of reach) is said on the bottom line.
    fn command(
        &mut self,
        control: &Arc<dyn Control>,
        command: ControlCommand,
    ) -> Option<ControlResult> {
        match control.execute(command, None) {
            Ok(r) => Some(r),
            Err(e) => {
                self.err(e.to_string());
                None
            }
        }
    }

    fn act(&mut self, action: Action) {
        let page = ui::list_rows(self).max(1) as isize;
        match action {
            Action::Quit => self.quit = true,
            Action::Help => {
                self.ui.help = !self.ui.help;
                self.ui.warnings = false;
            }
            Action::Warnings => {
                self.ui.warnings = !self.ui.warnings;
                self.ui.help = false;
            }
            Action::NextView | Action::PrevView => {
                let n = ViewId::ALL.len();
                let i = self.ui.view.index();
                let j = if action == Action::NextView {
                    (i + 1) % n
                } else {
                    (i + n - 1) % n
                };
                self.ui.view = ViewId::ALL[j];
                self.ui.detail = None;
                self.ui.help = false;
                self.ui.warnings = false;
            }
            Action::View(v) => {
                self.ui.view = v;
                self.ui.detail = None;
                self.ui.help = false;
                self.ui.warnings = false;
            }
            Action::Up => self.move_selection(-1),
            Action::Down => self.move_selection(1),
            Action::PageUp => self.move_selection(-page),
            Action::PageDown => self.move_selection(page),
            Action::Top => self.move_selection(isize::MIN / 2),
            Action::Bottom => {
                self.move_selection(isize::MAX / 2);
                if self.ui.view == ViewId::Events {
                    self.ui.follow = true;
                }
            }
            Action::Open => match self.selected_request() {
                Some(r) if self.ui.detail.is_none() => {
                    self.ui.detail = Some(r);
                    self.ui.detail_list = ListState::default();
                }
                _ => {}
            },
            Action::Back => {
                if self.ui.help || self.ui.warnings {
                    self.ui.help = false;
                    self.ui.warnings = false;
                } else if self.ui.detail.is_some() {
                    self.ui.detail = None;
                } else if self.ui.filter.is_some() {
                    self.ui.filter = None;
                    self.say("filter cleared");
                }
            }
            Action::Freeze => {
                if let Source::Live(l) = &mut self.source {
                    let f = !l.frozen();
                    l.set_frozen(f);
                    self.say(if f {
                        "frozen: the engine runs on; Space to catch up"
                    } else {
                        "live"
                    });
                }
            }
            Action::Filter => {
                self.ui.input = Some(Input {
                    kind: InputKind::Filter,
                    text: self
                        .ui
                        .filter
                        .as_ref()
                        .map(|f| f.text.clone())
                        .unwrap_or_default(),
                });
            }
            Action::Sort => {
                self.ui.sort = self.ui.sort.next();
                self.say(format!("sorted by {}", self.ui.sort.name()));
            }
            Action::Reverse => self.ui.reverse = !self.ui.reverse,
            Action::BreakOnSelected => self.toggle_request_breakpoint(),
            Action::AddBreakpoint => {
                self.ui.input = Some(Input {
                    kind: InputKind::Breakpoint,
                    text: String::new(),
                });
            }
            Action::DeleteBreakpoint => {
                let sel = self.ui.lists[ViewId::Breakpoints.index()].selected;
                let id = self
                    .ui
                    .control
                    .as_ref()
                    .and_then(|c| c.breakpoints.get(sel))
                    .map(|b| b.id);
                match (id, self.control().cloned()) {
                    (Some(id), Some(c)) => {
                        if self.command(&c, ControlCommand::Clear { id }).is_some() {
                            self.say(format!("breakpoint #{id} cleared"));
                        }
                    }
                    _ => self.err("select a breakpoint first"),
                }
                self.refresh_control();
            }
            Action::ClearBreakpoints => {
                if let Some(c) = self.control().cloned()
                    && let Some(r) = self.command(&c, ControlCommand::ClearAll)
                {
                    self.say(format!("{} breakpoints cleared", count(&r)));
                }
                self.refresh_control();
            }
            Action::Resume => {
                let pause = self.ui.control.as_ref().and_then(|c| {
                    let sel = self.ui.lists[ViewId::Breakpoints.index()].selected;
                    sel.checked_sub(c.breakpoints.len())
                        .and_then(|i| c.paused.get(i))
                        .or(c.paused.first())
                        .map(|p| p.pause_id)
                });
                match (pause, self.control().cloned()) {
                    (Some(id), Some(c)) => {
                        let resume = ControlCommand::Resume { pause_id: Some(id) };
                        if self.command(&c, resume).is_some() {
                            self.say(format!("pause {id} resumed"));
                        }
                    }
                    _ => self.err("nothing is paused"),
                }
                self.refresh_control();
            }
            Action::ResumeAll => {
                if let Some(c) = self.control().cloned()
                    && let Some(r) = self.command(&c, ControlCommand::Resume { pause_id: None })
                {
                    self.say(format!("{} paused calls resumed", count(&r)));
                }
                self.refresh_control();
            }
            Action::Step => {
                if let Some(c) = self.control().cloned()
                    && self.command(&c, ControlCommand::Step).is_some()
                {
                    self.say("step: the next call will pause");
                }
                self.refresh_control();
            }
            Action::PlayPause
            | Action::Faster
            | Action::Slower
            | Action::SeekBack
            | Action::SeekForward
            | Action::JumpStart
            | Action::JumpEnd
            | Action::StepForward
            | Action::StepBack => self.replay_action(action),
        }
    }

    fn toggle_request_breakpoint(&mut self) {
        let Some(request) = self.selected_request() else {
            self.err("select a request first");
            return;
        };
        let Some(c) = self.control().cloned() else {
            self.err("this source takes no breakpoints (replay)");
            return;
        };
        let existing = c.view().breakpoints.into_iter().find(|b| {
            b.spec.request == Some(RequestMatch::Exact(request.to_string()))
                && b.spec.state.is_none()
                && b.spec.direction.is_none()
                && b.spec.entry.is_none()
        });
        match existing {
            Some(b) => {
                if self
                    .command(&c, ControlCommand::Clear { id: b.id })
                    .is_some()
                {
                    self.say(format!(
                        "breakpoint #{} on {request} cleared (its pauses resume)",
                        b.id
                    ));
                }
                self.refresh_control();
            }
            None => {
                self.add_breakpoint(BreakpointSpec::default().with_request(request.to_string()))
            }
        }
    }

    fn replay_action(&mut self, action: Action) {
        let Source::Replay(r) = &mut self.source else {
            return;
        };
        let m = &mut self.model;
        match action {
            Action::PlayPause => r.toggle_play(),
            Action::Faster => r.change_speed(true),
            Action::Slower => r.change_speed(false),
            Action::SeekBack => r.seek_time(m, false),
            Action::SeekForward => r.seek_time(m, true),
            Action::JumpStart => r.seek_to(m, 0),
            Action::JumpEnd => {
                let n = r.len();
                r.seek_to(m, n);
            }
            Action::StepForward => r.step(m, true),
            Action::StepBack => r.step(m, false),
            _ => {}
        }
    }

    /// Handles the mouse: the wheel scrolls, a click on a tab switches
    /// view, a click on a row selects it and a click on the selected row
    /// opens it.
    pub fn mouse(&mut self, ev: MouseEvent) {
        match ev.kind {
            MouseEventKind::ScrollDown => self.move_selection(3),
            MouseEventKind::ScrollUp => self.move_selection(-3),
            MouseEventKind::Down(MouseButton::Left) => {
                let areas = ui::areas(self.ui.size);
                if ev.row == areas.tabs.y {
                    if let Some(v) = ui::tab_at(ev.column) {
                        self.ui.view = v;
                        self.ui.detail = None;
                    }
                } else if let Some(row) = ui::row_at(self, ev.column, ev.row) {
                    let before = self.list().selected;
                    let len = self.list_len();
                    let visible = ui::list_rows(self);
                    let l = self.list_mut();
                    l.selected = row.min(len.saturating_sub(1));
                    l.offset = l.offset_for(len, visible);
                    self.after_move();
                    if self.ui.view == ViewId::Events {
                        self.ui.follow = false;
                    }
                    if before == row && self.ui.detail.is_none() {
                        self.act(Action::Open);
                    }
                }
            }
            _ => {}
        }
        self.settle();
    }
}

/// How many a command did (`Count`), for the confirmations.
fn count(r: &ControlResult) -> u64 {
    match r {
        ControlResult::Count(n) => *n,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_offsets_keep_the_selection_visible() {
        let l = ListState {
            selected: 15,
            offset: 0,
        };
        assert_eq!(l.offset_for(100, 10), 6);
        let l = ListState {
            selected: 3,
            offset: 6,
        };
        assert_eq!(l.offset_for(100, 10), 3);
        let l = ListState {
            selected: 0,
            offset: 50,
        };
        assert_eq!(l.offset_for(5, 10), 0);
        let mut l = ListState::default();
        l.moved(-5, 10, 4);
        assert_eq!(l.selected, 0);
        l.moved(100, 10, 4);
        assert_eq!((l.selected, l.offset), (9, 6));
        l.moved(1, 0, 4);
        assert_eq!(l.selected, 0);
    }

    #[test]
    fn filters_by_substring_or_regex() {
        let f = Filter::new("DECOD").unwrap().unwrap();
        assert!(f.matches(&["req-1", "Decoding"]));
        assert!(!f.matches(&["req-1", "Prefilling"]));
        let f = Filter::new("/^req-1[0-9]$/").unwrap().unwrap();
        assert!(f.matches(&["req-12"]));
        assert!(!f.matches(&["req-123", "req-1"]));
        assert!(Filter::new("/(/").unwrap_err().contains("bad regex"));
        assert!(Filter::new("  ").unwrap().is_none());
        let f = Filter::new("é").unwrap().unwrap();
        assert!(f.matches(&["cafÉ"]));
    }
}
