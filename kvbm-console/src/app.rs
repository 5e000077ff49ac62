//! The console's state and its update step.
//!
//! [`App`] holds the [`Model`] (what the engine did), the [`Source`] it
//! comes from, the chrome's state ([`Ui`]: the view on screen, popups, the
//! prompt, the filter as typed) and the views' state ([`Views`]: each view
//! owns its rows and its selection). It changes only in [`App::key`],
//! [`App::mouse`], [`App::resize`], [`App::pull`] and [`App::tick`]; each
//! of these but `pull` ends by updating the view on screen from the model,
//! so [`App::render`] draws it as it is and changes nothing.
//!
//! The app drives the views through their [`View`] trait and their own
//! methods (sort, follow, the selected breakpoint); it never builds their
//! rows.

use crate::bpspec;
use crate::keys::{self, Action, Context, ViewId};
use crate::model::Model;
pub use crate::source::Source;
pub use crate::ui::chrome::Message;
use crate::ui::chrome::{self, Header, Input, InputKind};
use crate::ui::detail::Detail;
use crate::ui::filter::Filter;
use crate::ui::list::ListState;
use crate::ui::{self, View, Views};
use kvbm_events::RequestId;
use kvbm_events::breakpoint::{BreakpointSpec, RequestMatch};
use kvbm_events::control::{Control, ControlCommand, ControlResult};
use ratatui::Frame;
use ratatui::crossterm::event::{
    KeyCode, KeyEvent, KeyModifiers, MouseButton, MouseEvent, MouseEventKind,
};
use ratatui::layout::Rect;
use std::sync::Arc;
use std::time::Instant;

/// The chrome's state: what is on screen around the views.
#[derive(Debug, Clone)]
pub struct Ui {
    /// The view on screen (under the detail, when one is open).
    pub view: ViewId,
    /// Help popup open.
    pub help: bool,
    /// The help's first line on screen (it scrolls when the terminal is
    /// shorter than it).
    pub help_scroll: u16,
    /// Warnings popup open.
    pub warnings: bool,
    /// The filter as typed; every view that filters holds a copy (see
    /// [`App::set_filter`]).
    pub filter: Option<Filter>,
    /// A prompt being typed.
    pub input: Option<Input>,
    /// The bottom line's message.
    pub message: Option<Message>,
    /// The terminal's size.
    pub size: Rect,
    /// Draw without colour (the `NO_COLOR` convention): emphasis stays
    /// (bold, reverse video for the selection), every colour goes.
    pub no_color: bool,
}

impl Default for Ui {
    fn default() -> Self {
        Ui {
            view: ViewId::Slots,
            help: false,
            help_scroll: 0,
            warnings: false,
            filter: None,
            input: None,
            message: None,
            size: Rect::new(0, 0, 80, 24),
            no_color: false,
        }
    }
}

/// See the module docs.
pub struct App {
    /// What the engine did.
    pub model: Model,
    /// Where it comes from.
    pub source: Source,
    /// The chrome's state.
    pub ui: Ui,
    /// Each view's state.
    pub views: Views,
    /// A name for the header (`demo`, a file name, a URL).
    pub label: String,
    /// Set when the console should exit.
    pub quit: bool,
}

impl App {
    /// A console over `model` fed by `source`.
    pub fn new(model: Model, source: Source, label: impl Into<String>) -> Self {
        let views = Views::new(source.no_slots_reason().map(str::to_string));
        let mut app = App {
            model,
            source,
            ui: Ui::default(),
            views,
            label: label.into(),
            quit: false,
        };
        app.tick();
        app
    }

    /// The key context now.
    pub fn context(&self) -> Context {
        Context {
            view: self.ui.view,
            replay: matches!(self.source, Source::Replay(_)),
            control: self.control().is_some(),
            detail: self.views.detail.is_some(),
        }
    }

    /// The engine's breakpoint control, if any.
    pub fn control(&self) -> Option<&Arc<dyn Control>> {
        self.source.control()
    }

    /// Reads the engine's breakpoints and paused calls for the breakpoints
    /// view, so drawing never calls into the engine.
    fn refresh_control(&mut self) {
        let view = self.control().map(|c| c.view());
        self.views.breakpoints.set_control(view);
    }

    /// Pulls new events from the source.
    pub fn pull(&mut self, now: Instant) -> usize {
        self.source.pull(&mut self.model, now)
    }

    /// The periodic step before drawing: reads the engine's breakpoints,
    /// updates the view on screen and keeps its selection in range.
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

    /// Sets the filter (`None` clears it) and gives every view that
    /// filters a copy.
    pub fn set_filter(&mut self, filter: Option<Filter>) {
        self.views.set_filter(filter.as_ref());
        self.ui.filter = filter;
    }

    /// Opens `request`'s detail over the current view.
    pub fn open(&mut self, request: RequestId) {
        self.views.detail = Some(Detail::new(request));
    }

    /// The view on screen: the open detail, else the selected view.
    pub fn current(&self) -> &dyn View {
        self.views.current(self.ui.view)
    }

    fn current_mut(&mut self) -> &mut dyn View {
        self.views.current_mut(self.ui.view)
    }

    /// Rows in the current view's list.
    pub fn list_len(&self) -> usize {
        self.current().row_count()
    }

    /// The current view's list state.
    pub fn list(&self) -> &ListState {
        self.current().list()
    }

    /// The screen's regions at `size`: the header has a third line while
    /// the source says what the engine runs as.
    fn areas(&self, size: Rect) -> ui::Areas {
        let engine = self.source.engine_summary().is_some();
        ui::areas_with_header(size, chrome::header_lines(engine))
    }

    /// Rows the current view's list has room for.
    fn visible_rows(&self) -> usize {
        self.current().visible_rows(self.areas(self.ui.size).body)
    }

    /// Recomputes the current view's rows from the model.
    fn update_view(&mut self) {
        let view = self.ui.view;
        self.views.current_mut(view).update(&self.model);
    }

    /// Updates the current view and keeps its selection in range (and on
    /// the same slot after re-sorting).
    fn settle(&mut self) {
        self.update_view();
        let visible = self.visible_rows();
        self.current_mut().settle(visible);
    }

    fn move_selection(&mut self, delta: isize) {
        let visible = self.visible_rows();
        self.current_mut().moved(delta, visible);
    }

    /// The request the selection points at, in the slots table or the
    /// event log or the transfers or the detail.
    pub fn selected_request(&self) -> Option<RequestId> {
        self.current().selected_request(&self.model)
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
            // The rows as the model is now: events may have arrived since
            // the last update.
            self.update_view();
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
        // Filter as you type; a regex that does not compile yet keeps the
        // previous filter.
        let typed = self
            .ui
            .input
            .as_ref()
            .filter(|i| i.kind == InputKind::Filter)
            .map(|i| Filter::new(&i.text));
        if let Some(Ok(f)) = typed {
            self.set_filter(f);
        }
        self.settle();
    }

    fn submit(&mut self, input: Input) {
        match input.kind {
            InputKind::Filter => match Filter::new(&input.text) {
                Ok(f) => {
                    let text = f.as_ref().map(|f| f.text.clone());
                    self.set_filter(f);
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

    /// A key while a popup is open: the popup's own (scrolling the help,
    /// closing it), switching views or quitting; nothing reaches the view
    /// hidden behind it. True when the key was the popup's.
    fn popup_key(&mut self, action: Action) -> bool {
        if !(self.ui.help || self.ui.warnings) {
            return false;
        }
        // As the help is drawn: its lines in a popup over the body.
        let lines = chrome::help_lines(self.context());
        let shown = self.areas(self.ui.size).body.height.saturating_sub(2);
        let last = lines.saturating_sub(shown);
        let page = shown.max(1);
        let scroll = &mut self.ui.help_scroll;
        match action {
            Action::Quit
            | Action::Help
            | Action::Warnings
            | Action::Back
            | Action::View(_)
            | Action::NextView
            | Action::PrevView => return false,
            Action::Up if self.ui.help => *scroll = scroll.saturating_sub(1),
            Action::Down if self.ui.help => *scroll = scroll.saturating_add(1).min(last),
            Action::PageUp if self.ui.help => *scroll = scroll.saturating_sub(page),
            Action::PageDown if self.ui.help => *scroll = scroll.saturating_add(page).min(last),
            Action::Top if self.ui.help => *scroll = 0,
            Action::Bottom if self.ui.help => *scroll = last,
            _ => {}
        }
        true
    }

    fn act(&mut self, action: Action) {
        if self.popup_key(action) {
            return;
        }
        let page = self.visible_rows().max(1) as isize;
        match action {
            Action::Quit => self.quit = true,
            Action::Help => {
                self.ui.help = !self.ui.help;
                self.ui.help_scroll = 0;
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
                self.views.detail = None;
                self.ui.help = false;
                self.ui.warnings = false;
            }
            Action::View(v) => {
                self.ui.view = v;
                self.views.detail = None;
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
                    self.views.events.set_follow(true);
                }
            }
            Action::Open => match self.selected_request() {
                Some(r) if self.views.detail.is_none() => self.open(r),
                _ => {}
            },
            Action::Back => {
                if self.ui.help || self.ui.warnings {
                    self.ui.help = false;
                    self.ui.warnings = false;
                } else if self.views.detail.is_some() {
                    self.views.detail = None;
                } else if self.ui.filter.is_some() {
                    self.set_filter(None);
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
                let sort = self.views.slots.next_sort();
                self.say(format!("sorted by {}", sort.name()));
            }
            Action::Reverse => self.views.slots.toggle_reverse(),
            Action::BreakOnSelected => self.toggle_request_breakpoint(),
            Action::AddBreakpoint => {
                self.ui.input = Some(Input {
                    kind: InputKind::Breakpoint,
                    text: String::new(),
                });
            }
            Action::DeleteBreakpoint
            | Action::ClearBreakpoints
            | Action::Resume
            | Action::ResumeAll
            | Action::Step => self.control_action(action),
            Action::PlayPause
            | Action::Faster
            | Action::Slower
            | Action::SeekBack
            | Action::SeekForward
            | Action::JumpStart
            | Action::JumpEnd
            | Action::StepForward
            | Action::StepBack => self.replay_action(action),
            // The fleet console's own: never dispatched here (Scope::Fleet).
            Action::FleetTab(_) | Action::Find => {}
        }
    }

    /// The keys that command the engine's breakpoints and pauses: each
    /// says what it did (or why it could not) and refreshes the list.
    fn control_action(&mut self, action: Action) {
        match action {
            Action::DeleteBreakpoint => {
                let id = self.views.breakpoints.selected_breakpoint();
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
                let pause = self.views.breakpoints.pause_to_resume();
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
            _ => {}
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
        self.update_view();
        match ev.kind {
            MouseEventKind::ScrollDown => self.move_selection(3),
            MouseEventKind::ScrollUp => self.move_selection(-3),
            MouseEventKind::Down(MouseButton::Left) => {
                let areas = self.areas(self.ui.size);
                if ev.row == areas.tabs.y {
                    if let Some(v) = chrome::tab_at(ev.column) {
                        self.ui.view = v;
                        self.views.detail = None;
                    }
                } else if let Some(row) = self.current().row_at(areas.body, ev.column, ev.row) {
                    let before = self.list().selected;
                    let visible = self.visible_rows();
                    self.current_mut().select(row, visible);
                    if self.ui.view == ViewId::Events {
                        self.views.events.set_follow(false);
                    }
                    if before == row && self.views.detail.is_none() {
                        self.act(Action::Open);
                    }
                }
            }
            _ => {}
        }
        self.settle();
    }

    /// Draws the screen as the last update left it.
    pub fn render(&self, f: &mut Frame) {
        self.render_in(f, f.area());
    }

    /// Draws into `area` of the frame (a pane of `compare`); the app's
    /// size ([`App::resize`]) is the area's, its mouse rows and columns
    /// relative to the area's corner.
    pub fn render_in(&self, f: &mut Frame, area: Rect) {
        let engine = self.source.engine_summary();
        let a = ui::areas_with_header(area, chrome::header_lines(engine.is_some()));
        let header = Header {
            badge: self.source.badge(Instant::now()),
            lagged: self.source.lagged(),
            dropped: self.source.dropped(),
            label: &self.label,
            engine: engine.as_deref(),
        };
        chrome::header(f, a.header, &self.model, &header);
        let detail = self.views.detail.as_ref().map(|d| &**d.request());
        chrome::tabs(f, a.tabs, self.ui.view, detail, self.ui.filter.as_ref());
        self.current().draw(&self.model, f, a.body);
        let ctx = self.context();
        chrome::footer(
            f,
            a.footer,
            self.ui.input.as_ref(),
            self.ui.message.as_ref(),
            ctx,
        );
        if self.ui.help {
            chrome::help(f, a.body, ctx, self.ui.help_scroll);
        } else if self.ui.warnings {
            chrome::warnings(f, a.body, &self.model);
        }
        if self.ui.no_color {
            // One pass over the finished frame rather than a condition in
            // every view: a view added later cannot forget it.
            ui::strip_colors(f.buffer_mut());
        }
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
    use crate::model::ModelConfig;
    use crate::source::LiveSource;
    use kvbm_core::hooks::Breakpoints;
    use kvbm_events::ring::RingBuffer;
    use std::time::Duration;

    fn press(app: &mut App, keys: &str) {
        for c in keys.chars() {
            let code = if c == '\n' {
                KeyCode::Enter
            } else {
                KeyCode::Char(c)
            };
            app.key(KeyEvent::new(code, KeyModifiers::NONE));
        }
    }

    /// Keys on the breakpoints view send commands to the engine's own
    /// `Breakpoints` (the embedded engine's control); a refusal is said in
    /// red with the engine's reason.
    #[test]
    fn breakpoint_keys_execute_commands_and_show_refusals() {
        let bps = Arc::new(Breakpoints::new(None, Duration::from_secs(60)).with_max_breakpoints(1));
        let ring = Arc::new(RingBuffer::with_capacity(16).unwrap());
        let control: Arc<dyn Control> = bps.clone();
        let source = LiveSource::new(ring, Some(control));
        let mut app = App::new(
            Model::new(ModelConfig::default()),
            Source::Live(source),
            "test",
        );
        let said = |app: &App| app.ui.message.clone().unwrap();
        press(&mut app, "5astate=Decoding\n");
        assert_eq!(
            said(&app),
            Message {
                text: "breakpoint #1 set: state=Decoding".into(),
                error: false
            }
        );
        assert_eq!(bps.list().len(), 1);
        assert_eq!(
            app.views.breakpoints.control().unwrap().breakpoints.len(),
            1
        );

        press(&mut app, "astate=Prefilling\n");
        let m = said(&app);
        assert!(m.error, "{m:?}");
        assert!(
            m.text
                .starts_with("breakpoint refused: too many breakpoints"),
            "{m:?}"
        );

        press(&mut app, "d");
        assert_eq!(said(&app).text, "breakpoint #1 cleared");
        assert!(bps.list().is_empty());
        assert!(
            app.views
                .breakpoints
                .control()
                .unwrap()
                .breakpoints
                .is_empty()
        );

        press(&mut app, "n");
        assert_eq!(said(&app).text, "step: the next call will pause");
        press(&mut app, "R");
        assert_eq!(said(&app).text, "0 paused calls resumed");
        press(&mut app, "r");
        assert_eq!(
            said(&app),
            Message {
                text: "nothing is paused".into(),
                error: true
            }
        );
    }
}
