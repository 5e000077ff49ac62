//! The key table: one list that both dispatches keys and writes the help
//! screen, so the help can never disagree with what the keys do.

use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

/// The console's views, in tab order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ViewId {
    /// One row per request.
    Slots,
    /// Candidates, batches, recent completions.
    Transfers,
    /// Per-tier gauges.
    Pools,
    /// Distributions.
    Histograms,
    /// Breakpoints and paused calls.
    Breakpoints,
    /// The event log.
    Events,
    /// Hit ratio by cache capacity, and why misses missed.
    Capacity,
}

impl ViewId {
    /// Every view, in tab order.
    pub const ALL: [ViewId; 7] = [
        ViewId::Slots,
        ViewId::Transfers,
        ViewId::Pools,
        ViewId::Histograms,
        ViewId::Breakpoints,
        ViewId::Events,
        ViewId::Capacity,
    ];

    /// The tab title.
    pub fn title(self) -> &'static str {
        match self {
            ViewId::Slots => "Slots",
            ViewId::Transfers => "Transfers",
            ViewId::Pools => "Pools",
            ViewId::Histograms => "Histograms",
            ViewId::Breakpoints => "Breakpoints",
            ViewId::Events => "Events",
            ViewId::Capacity => "Capacity",
        }
    }

    /// Position in [`ALL`](Self::ALL).
    pub fn index(self) -> usize {
        ViewId::ALL.iter().position(|v| *v == self).unwrap_or(0)
    }
}

/// What a key does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Leave the console.
    Quit,
    /// Show or hide the help.
    Help,
    /// Show or hide the warnings list.
    Warnings,
    /// Next view.
    NextView,
    /// Previous view.
    PrevView,
    /// A given view.
    View(ViewId),
    /// Selection up one row.
    Up,
    /// Selection down one row.
    Down,
    /// Selection up a page.
    PageUp,
    /// Selection down a page.
    PageDown,
    /// First row.
    Top,
    /// Last row (and follow new rows in the event log).
    Bottom,
    /// Open the selected request's detail.
    Open,
    /// Close the detail, a popup or the filter.
    Back,
    /// Freeze or unfreeze the live view.
    Freeze,
    /// Type a filter.
    Filter,
    /// Next sort column.
    Sort,
    /// Reverse the sort.
    Reverse,
    /// Break on the selected request's next entry point.
    BreakOnSelected,
    /// Type a new breakpoint.
    AddBreakpoint,
    /// Clear the selected breakpoint.
    DeleteBreakpoint,
    /// Clear every breakpoint.
    ClearBreakpoints,
    /// Resume the selected paused call.
    Resume,
    /// Resume every paused call.
    ResumeAll,
    /// Resume and pause again at the very next call.
    Step,
    /// Replay: play or pause.
    PlayPause,
    /// Replay: twice as fast.
    Faster,
    /// Replay: half as fast.
    Slower,
    /// Replay: back 10 s.
    SeekBack,
    /// Replay: forward 10 s.
    SeekForward,
    /// Replay: to the start.
    JumpStart,
    /// Replay: to the end.
    JumpEnd,
    /// Replay: one event forward.
    StepForward,
    /// Replay: one event back.
    StepBack,
    /// Fleet: a given view (0: the fleet, 1: prefixes, 2: where is).
    FleetTab(usize),
    /// Fleet: type a request id or hash to locate.
    Find,
}

/// When a binding applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Always.
    Global,
    /// In lists (every view).
    List,
    /// Live source only.
    Live,
    /// Replay only.
    Replay,
    /// The slots view (and the request detail).
    Slots,
    /// The breakpoints view, with an engine to control.
    Breakpoints,
    /// The fleet console (`kvbm-console fleet`), which has only these.
    Fleet,
}

impl Scope {
    /// The help section's title.
    pub fn title(self) -> &'static str {
        match self {
            Scope::Global => "Anywhere",
            Scope::List => "Lists",
            Scope::Live => "Live",
            Scope::Replay => "Replay",
            Scope::Slots => "Slots",
            Scope::Breakpoints => "Breakpoints",
            Scope::Fleet => "Fleet",
        }
    }
}

/// One key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// The key.
    pub code: KeyCode,
    /// With Ctrl.
    pub ctrl: bool,
}

const fn k(c: char) -> Key {
    Key {
        code: KeyCode::Char(c),
        ctrl: false,
    }
}

const fn ctrl(c: char) -> Key {
    Key {
        code: KeyCode::Char(c),
        ctrl: true,
    }
}

const fn code(code: KeyCode) -> Key {
    Key { code, ctrl: false }
}

impl Key {
    /// Whether a terminal key event is this key. Shift is part of the
    /// character (`G` vs `g`), so only Ctrl is compared.
    pub fn matches(&self, ev: &KeyEvent) -> bool {
        let ev_ctrl = ev.modifiers.contains(KeyModifiers::CONTROL);
        let code_eq = match (self.code, ev.code) {
            (KeyCode::Char(a), KeyCode::Char(b)) => {
                a == b || (self.ctrl && a.eq_ignore_ascii_case(&b))
            }
            (a, b) => a == b,
        };
        code_eq && ev_ctrl == self.ctrl
    }

    /// The terminal event this key sends.
    pub fn event(&self) -> KeyEvent {
        let mods = if self.ctrl {
            KeyModifiers::CONTROL
        } else {
            KeyModifiers::NONE
        };
        KeyEvent::new(self.code, mods)
    }

    /// How the help writes it.
    pub fn label(&self) -> String {
        let base = match self.code {
            KeyCode::Char(' ') => "Space".to_string(),
            KeyCode::Char(c) => c.to_string(),
            KeyCode::Up => "↑".into(),
            KeyCode::Down => "↓".into(),
            KeyCode::Left => "←".into(),
            KeyCode::Right => "→".into(),
            KeyCode::PageUp => "PgUp".into(),
            KeyCode::PageDown => "PgDn".into(),
            KeyCode::Home => "Home".into(),
            KeyCode::End => "End".into(),
            KeyCode::Enter => "Enter".into(),
            KeyCode::Esc => "Esc".into(),
            KeyCode::Tab => "Tab".into(),
            KeyCode::BackTab => "Shift-Tab".into(),
            other => format!("{other:?}"),
        };
        if self.ctrl {
            format!("Ctrl-{base}")
        } else {
            base
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Copy)]
pub struct Binding {
    /// The keys (any of them).
    pub keys: &'static [Key],
    /// What they do.
    pub action: Action,
    /// When.
    pub scope: Scope,
    /// The help text.
    pub help: &'static str,
}

const fn b(keys: &'static [Key], action: Action, scope: Scope, help: &'static str) -> Binding {
    Binding {
        keys,
        action,
        scope,
        help,
    }
}

/// The table. Earlier rows win when two could match, so scoped rows come
/// before the global ones they shadow.
#[rustfmt::skip]
pub const BINDINGS: &[Binding] = &[
    // Replay first: Space plays there and freezes live.
    b(&[k(' ')], Action::PlayPause, Scope::Replay, "play / pause"),
    b(&[k('+'), k(']')], Action::Faster, Scope::Replay, "faster (up to 64×)"),
    b(&[k('-'), k('[')], Action::Slower, Scope::Replay, "slower (down to 0.25×)"),
    b(&[code(KeyCode::Left), k('H')], Action::SeekBack, Scope::Replay, "seek back 10 s"),
    b(&[code(KeyCode::Right), k('L')], Action::SeekForward, Scope::Replay, "seek forward 10 s"),
    b(&[code(KeyCode::Home)], Action::JumpStart, Scope::Replay, "jump to the start"),
    b(&[code(KeyCode::End)], Action::JumpEnd, Scope::Replay, "jump to the end"),
    b(&[k('.')], Action::StepForward, Scope::Replay, "one event forward"),
    b(&[k(',')], Action::StepBack, Scope::Replay, "one event back"),
    b(&[k(' ')], Action::Freeze, Scope::Live, "freeze / unfreeze the view (the engine runs on)"),
    b(&[k('s')], Action::Sort, Scope::Slots, "sort by the next column"),
    b(&[k('r')], Action::Reverse, Scope::Slots, "reverse the sort"),
    b(&[k('b')], Action::BreakOnSelected, Scope::Slots, "break on the selected request (again: clear)"),
    b(&[k('a')], Action::AddBreakpoint, Scope::Breakpoints, "add a breakpoint (type a spec)"),
    b(&[k('d'), code(KeyCode::Delete)], Action::DeleteBreakpoint, Scope::Breakpoints, "clear the selected breakpoint"),
    b(&[k('D')], Action::ClearBreakpoints, Scope::Breakpoints, "clear every breakpoint"),
    b(&[k('r')], Action::Resume, Scope::Breakpoints, "resume the first (or selected) paused call"),
    b(&[k('R')], Action::ResumeAll, Scope::Breakpoints, "resume every paused call"),
    b(&[k('n')], Action::Step, Scope::Breakpoints, "step: resume, pause at the next call"),
    b(&[k('j'), code(KeyCode::Down)], Action::Down, Scope::List, "down"),
    b(&[k('k'), code(KeyCode::Up)], Action::Up, Scope::List, "up"),
    b(&[ctrl('d'), code(KeyCode::PageDown)], Action::PageDown, Scope::List, "page down"),
    b(&[ctrl('u'), code(KeyCode::PageUp)], Action::PageUp, Scope::List, "page up"),
    b(&[k('g'), code(KeyCode::Home)], Action::Top, Scope::List, "first row"),
    b(&[k('G'), code(KeyCode::End)], Action::Bottom, Scope::List, "last row (the event log follows)"),
    b(&[code(KeyCode::Enter)], Action::Open, Scope::List, "open the selected request"),
    b(&[k('/')], Action::Filter, Scope::List, "filter by substring or /regex/"),
    b(&[code(KeyCode::Tab), k('l')], Action::NextView, Scope::Global, "next view"),
    b(&[code(KeyCode::BackTab), k('h')], Action::PrevView, Scope::Global, "previous view"),
    b(&[k('1')], Action::View(ViewId::Slots), Scope::Global, "slots"),
    b(&[k('2')], Action::View(ViewId::Transfers), Scope::Global, "transfers"),
    b(&[k('3')], Action::View(ViewId::Pools), Scope::Global, "pools"),
    b(&[k('4')], Action::View(ViewId::Histograms), Scope::Global, "histograms"),
    b(&[k('5')], Action::View(ViewId::Breakpoints), Scope::Global, "breakpoints"),
    b(&[k('6')], Action::View(ViewId::Events), Scope::Global, "event log"),
    b(&[k('7')], Action::View(ViewId::Capacity), Scope::Global, "capacity: hit ratio by cache size, miss reasons"),
    b(&[code(KeyCode::Esc)], Action::Back, Scope::Global, "back: close the detail, a popup or the filter"),
    b(&[k('w')], Action::Warnings, Scope::Global, "warnings (lints)"),
    b(&[k('?')], Action::Help, Scope::Global, "this help"),
    b(&[k('q'), ctrl('c')], Action::Quit, Scope::Global, "quit"),
    // The fleet console: its own keys, in its help's order.
    b(&[code(KeyCode::Enter)], Action::Open, Scope::Fleet, "drill into the engine (Fleet) / locate the prefix (Prefixes)"),
    b(&[k('j'), code(KeyCode::Down)], Action::Down, Scope::Fleet, "down"),
    b(&[k('k'), code(KeyCode::Up)], Action::Up, Scope::Fleet, "up"),
    b(&[k('g'), code(KeyCode::Home)], Action::Top, Scope::Fleet, "first row"),
    b(&[k('G'), code(KeyCode::End)], Action::Bottom, Scope::Fleet, "last row"),
    b(&[k('s')], Action::Sort, Scope::Fleet, "sort engines by the next column"),
    b(&[k('r')], Action::Reverse, Scope::Fleet, "reverse the sort"),
    b(&[k('/')], Action::Filter, Scope::Fleet, "filter engines by name or state (text or /regex/)"),
    b(&[k('f')], Action::Find, Scope::Fleet, "where is this prefix: type a request id or a hash"),
    b(&[code(KeyCode::Tab), k('l')], Action::NextView, Scope::Fleet, "next view"),
    b(&[code(KeyCode::BackTab), k('h')], Action::PrevView, Scope::Fleet, "previous view"),
    b(&[k('1')], Action::FleetTab(0), Scope::Fleet, "fleet"),
    b(&[k('2')], Action::FleetTab(1), Scope::Fleet, "prefixes on several engines"),
    b(&[k('3')], Action::FleetTab(2), Scope::Fleet, "where is this prefix"),
    b(&[code(KeyCode::Esc)], Action::Back, Scope::Fleet, "back: close the help, clear the filter (drilled in: back to the fleet)"),
    b(&[k('?')], Action::Help, Scope::Fleet, "this help"),
    b(&[k('q'), ctrl('c')], Action::Quit, Scope::Fleet, "quit"),
];

/// Which scopes are on now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Context {
    /// The view on screen.
    pub view: ViewId,
    /// A replay rather than a live source.
    pub replay: bool,
    /// An engine that takes breakpoint commands.
    pub control: bool,
    /// The request detail is open.
    pub detail: bool,
}

impl Context {
    /// Whether `scope` applies.
    pub fn has(&self, scope: Scope) -> bool {
        match scope {
            Scope::Global | Scope::List => true,
            Scope::Live => !self.replay,
            Scope::Replay => self.replay,
            Scope::Slots => self.view == ViewId::Slots || self.detail,
            Scope::Breakpoints => self.view == ViewId::Breakpoints && !self.detail && self.control,
            Scope::Fleet => false,
        }
    }
}

/// The action for a key in this context, if any.
pub fn dispatch(ev: &KeyEvent, ctx: Context) -> Option<Action> {
    BINDINGS
        .iter()
        .filter(|b| ctx.has(b.scope))
        .find(|b| b.keys.iter().any(|k| k.matches(ev)))
        .map(|b| b.action)
}

/// The fleet console's rows of the table, in order.
pub fn fleet_bindings() -> impl Iterator<Item = &'static Binding> {
    BINDINGS.iter().filter(|b| b.scope == Scope::Fleet)
}

/// The action for a key in the fleet console, if any.
pub fn dispatch_fleet(ev: &KeyEvent) -> Option<Action> {
    fleet_bindings()
        .find(|b| b.keys.iter().any(|k| k.matches(ev)))
        .map(|b| b.action)
}

/// The help's lines: `(section title, [(keys, text)])`, for the scopes on
/// now, in table order. A binding shadowed by an earlier one in this
/// context is left out, so the help shows what the keys really do.
pub fn help(ctx: Context) -> Vec<(&'static str, Vec<(String, &'static str)>)> {
    let order = [
        Scope::Global,
        Scope::List,
        Scope::Slots,
        Scope::Breakpoints,
        Scope::Live,
        Scope::Replay,
    ];
    let mut out = Vec::new();
    for scope in order {
        if !ctx.has(scope) {
            continue;
        }
        let mut rows = Vec::new();
        for (i, bnd) in BINDINGS.iter().enumerate() {
            if bnd.scope != scope {
                continue;
            }
            let live_keys: Vec<String> = bnd
                .keys
                .iter()
                .filter(|key| {
                    let ev = key.event();
                    // Shadowed by an earlier binding that is on now?
                    !BINDINGS[..i]
                        .iter()
                        .any(|e| ctx.has(e.scope) && e.keys.iter().any(|k2| k2.matches(&ev)))
                })
                .map(Key::label)
                .collect();
            if !live_keys.is_empty() {
                rows.push((live_keys.join(" "), bnd.help));
            }
        }
        if !rows.is_empty() {
            out.push((scope.title(), rows));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(c: char) -> KeyEvent {
        KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE)
    }

    fn ctx(view: ViewId, replay: bool) -> Context {
        Context {
            view,
            replay,
            control: !replay,
            detail: false,
        }
    }

    #[test]
    fn space_freezes_live_and_plays_replay() {
        assert_eq!(
            dispatch(&key(' '), ctx(ViewId::Slots, false)),
            Some(Action::Freeze)
        );
        assert_eq!(
            dispatch(&key(' '), ctx(ViewId::Slots, true)),
            Some(Action::PlayPause)
        );
    }

    #[test]
    fn r_reverses_in_slots_and_resumes_in_breakpoints() {
        assert_eq!(
            dispatch(&key('r'), ctx(ViewId::Slots, false)),
            Some(Action::Reverse)
        );
        assert_eq!(
            dispatch(&key('r'), ctx(ViewId::Breakpoints, false)),
            Some(Action::Resume)
        );
        // No engine to resume in a replay.
        assert_eq!(dispatch(&key('r'), ctx(ViewId::Breakpoints, true)), None);
    }

    #[test]
    fn ctrl_c_quits_and_plain_c_does_not() {
        let ev = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
        assert_eq!(dispatch(&ev, ctx(ViewId::Events, true)), Some(Action::Quit));
        assert_eq!(dispatch(&key('c'), ctx(ViewId::Events, true)), None);
        assert_eq!(
            dispatch(&key('q'), ctx(ViewId::Events, true)),
            Some(Action::Quit)
        );
    }

    #[test]
    fn home_jumps_in_replay_and_goes_to_the_top_live() {
        let home = KeyEvent::new(KeyCode::Home, KeyModifiers::NONE);
        assert_eq!(
            dispatch(&home, ctx(ViewId::Slots, true)),
            Some(Action::JumpStart)
        );
        assert_eq!(
            dispatch(&home, ctx(ViewId::Slots, false)),
            Some(Action::Top)
        );
    }

    #[test]
    fn help_lists_every_action_reachable_in_its_context_and_only_those() {
        for view in ViewId::ALL {
            for replay in [false, true] {
                let c = ctx(view, replay);
                let help = help(c);
                let listed: Vec<&str> = help
                    .iter()
                    .flat_map(|(_, r)| r.iter().map(|(_, h)| *h))
                    .collect();
                for bnd in BINDINGS.iter().filter(|b| c.has(b.scope)) {
                    let reachable = bnd
                        .keys
                        .iter()
                        .any(|key| dispatch(&key.event(), c) == Some(bnd.action));
                    assert_eq!(
                        listed.contains(&bnd.help),
                        reachable,
                        "{:?} in {view:?} replay={replay}",
                        bnd.action
                    );
                }
            }
        }
    }
}
