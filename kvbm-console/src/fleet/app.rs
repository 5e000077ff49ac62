//! The fleet console: the Fleet view (one row per engine), the Prefixes
//! view (prefixes cached on several engines) and the Where view ("where is
//! this prefix"), with its own key table; `Enter` on an engine drills into
//! it — the ordinary single-engine [`App`] with every existing view, on
//! that engine's subject and control — and `Esc` comes back.

use super::model::{FleetModel, Located};
use crate::app::{App, Message};
use crate::keys::{Action, Key, dispatch_fleet as dispatch, fleet_bindings};
use crate::run::Screen;
use crate::ui::filter::{Filter, passes};
use crate::ui::list::ListState;
use crate::ui::{head, panel, selected};
use kvbm_events::Tier;
use ratatui::Frame;
use ratatui::crossterm::event::{
    KeyCode, KeyEvent, KeyEventKind, KeyModifiers, MouseEvent, MouseEventKind,
};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Cell, Paragraph, Row, Table};
use std::time::{Duration, Instant};

/// The fleet's views.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tab {
    /// One row per engine.
    Engines,
    /// Prefixes cached on several engines.
    Prefixes,
    /// Where a prefix lives.
    Where,
}

impl Tab {
    const ALL: [Tab; 3] = [Tab::Engines, Tab::Prefixes, Tab::Where];

    fn title(self) -> &'static str {
        match self {
            Tab::Engines => "Fleet",
            Tab::Prefixes => "Prefixes",
            Tab::Where => "Where",
        }
    }
}

/// Columns the engines sort by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineSort {
    /// Name.
    Name,
    /// Live, paused, stale, gone.
    State,
    /// Events per second.
    Rate,
    /// Lag.
    Lag,
    /// Requests live.
    Requests,
    /// G1 occupancy.
    Occupancy,
    /// Transfers in flight.
    InFlight,
    /// Paused calls.
    Paused,
    /// Losses.
    Losses,
}

impl EngineSort {
    const ALL: [EngineSort; 9] = [
        EngineSort::Name,
        EngineSort::State,
        EngineSort::Rate,
        EngineSort::Lag,
        EngineSort::Requests,
        EngineSort::Occupancy,
        EngineSort::InFlight,
        EngineSort::Paused,
        EngineSort::Losses,
    ];

    fn name(self) -> &'static str {
        match self {
            EngineSort::Name => "engine",
            EngineSort::State => "state",
            EngineSort::Rate => "events/s",
            EngineSort::Lag => "lag",
            EngineSort::Requests => "requests",
            EngineSort::Occupancy => "G1 occupancy",
            EngineSort::InFlight => "transfers in flight",
            EngineSort::Paused => "paused calls",
            EngineSort::Losses => "losses",
        }
    }
}

/// Where the fleet's batches come from.
pub enum FleetSource {
    /// NATS, live.
    Live(super::nats::FleetFollower),
    /// A fleet recording, already applied.
    Recorded {
        /// Its directory, for the header.
        label: String,
    },
    /// Fed by the caller (tests).
    Fixed,
}

/// Most engine consoles kept after `Esc`.
pub const MAX_PARKED: usize = 8;

/// Builds the console of one engine when the operator drills in; what it
/// returns besides the app (a live engine's follower and control session)
/// lives as long as the app.
pub type Opener = Box<dyn FnMut(&str) -> anyhow::Result<(App, Box<dyn std::any::Any>)>>;

enum Input {
    Filter(String),
    Find(String),
}

/// See the module docs.
pub struct FleetApp {
    /// The fleet.
    pub model: FleetModel,
    source: FleetSource,
    /// The view on screen.
    pub tab: Tab,
    list: ListState,
    sort: EngineSort,
    reverse: bool,
    filter: Option<Filter>,
    rows: Vec<String>,
    input: Option<Input>,
    /// The last "where is this prefix" answer.
    pub located: Option<Located>,
    /// The bottom line.
    pub message: Option<Message>,
    help: bool,
    /// The help's first line on screen.
    help_scroll: u16,
    drilled: Option<(String, App, Box<dyn std::any::Any>)>,
    /// Engines drilled into and left with `Esc`, kept (with their control
    /// sessions, so breakpoints set there stay) until the console exits;
    /// the oldest beyond [`MAX_PARKED`] is closed.
    parked: Vec<(String, App, Box<dyn std::any::Any>)>,
    opener: Opener,
    size: Rect,
    last_tick: Instant,
    /// Set to leave.
    pub quit: bool,
}

impl FleetApp {
    /// A fleet console over `model` fed by `source`; `opener` builds an
    /// engine's console on `Enter`.
    pub fn new(model: FleetModel, source: FleetSource, opener: Opener) -> Self {
        let mut a = FleetApp {
            model,
            source,
            tab: Tab::Engines,
            list: ListState::default(),
            sort: EngineSort::Name,
            reverse: false,
            filter: None,
            rows: Vec::new(),
            input: None,
            located: None,
            message: None,
            help: false,
            help_scroll: 0,
            drilled: None,
            parked: Vec::new(),
            opener,
            size: Rect::new(0, 0, 80, 24),
            last_tick: Instant::now(),
            quit: false,
        };
        a.model.tick(Instant::now());
        a.update();
        a
    }

    /// The engine console drilled into, if any.
    pub fn drilled(&self) -> Option<&App> {
        self.drilled.as_ref().map(|(_, a, _)| a)
    }

    /// The engine names in display order (filtered, sorted).
    pub fn rows(&self) -> &[String] {
        &self.rows
    }

    /// Selects the row of `engine`, if shown.
    pub fn select(&mut self, engine: &str) {
        if let Some(i) = self.rows.iter().position(|r| r == engine) {
            self.list.selected = i;
        }
    }

    fn say(&mut self, text: impl Into<String>, error: bool) {
        self.message = Some(Message {
            text: text.into(),
            error,
        });
    }

    /// Recomputes the engine rows from the model.
    fn update(&mut self) {
        let now = Instant::now();
        let selected = self.rows.get(self.list.selected).cloned();
        let mut v: Vec<&super::model::EngineEntry> = self
            .model
            .engines()
            .filter(|e| passes(self.filter.as_ref(), &[&e.name, e.liveness(now).name()]))
            .collect();
        let key = |e: &super::model::EngineEntry| -> (i64, i64) {
            match self.sort {
                EngineSort::Name => (0, 0),
                EngineSort::State => (e.liveness(now) as i64, 0),
                EngineSort::Rate => (-(e.rate as i64), 0),
                EngineSort::Lag => (-(e.lag.as_millis() as i64), 0),
                EngineSort::Requests => (-(e.requests_live() as i64), 0),
                EngineSort::Occupancy => {
                    (-(e.occupancy(Tier::Device).unwrap_or(0.0) * 1e6) as i64, 0)
                }
                EngineSort::InFlight => (-(e.state.in_flight_count() as i64), 0),
                EngineSort::Paused => (-(e.state.paused_count() as i64), 0),
                EngineSort::Losses => (-(e.losses() as i64), 0),
            }
        };
        v.sort_by(|a, b| key(a).cmp(&key(b)).then(a.name.cmp(&b.name)));
        if self.reverse {
            v.reverse();
        }
        self.rows = v.into_iter().map(|e| e.name.clone()).collect();
        if let Some(s) = selected
            && let Some(i) = self.rows.iter().position(|r| *r == s)
        {
            self.list.selected = i;
        }
        let len = self.row_count();
        self.list.clamp(len, self.visible());
    }

    fn row_count(&self) -> usize {
        match self.tab {
            Tab::Engines => self.rows.len(),
            Tab::Prefixes => self.model.prefixes().top.len(),
            Tab::Where => self.located.as_ref().map_or(0, |l| l.rows.len()),
        }
    }

    fn visible(&self) -> usize {
        areas(self.size).2.height.saturating_sub(3) as usize
    }

    fn act(&mut self, a: Action) {
        // While the help is open, keys scroll or close it; none reaches
        // the table behind it.
        if self.help
            && !matches!(
                a,
                Action::Quit
                    | Action::Help
                    | Action::Back
                    | Action::NextView
                    | Action::PrevView
                    | Action::FleetTab(_)
            )
        {
            let shown = areas(self.size).2.height.saturating_sub(2);
            let last = (fleet_bindings().count() as u16 + 1).saturating_sub(shown);
            match a {
                Action::Up => self.help_scroll = self.help_scroll.saturating_sub(1),
                Action::Down => self.help_scroll = (self.help_scroll + 1).min(last),
                Action::Top => self.help_scroll = 0,
                Action::Bottom => self.help_scroll = last,
                _ => {}
            }
            return;
        }
        let len = self.row_count();
        let vis = self.visible();
        match a {
            Action::Quit => self.quit = true,
            Action::Help => {
                self.help = !self.help;
                self.help_scroll = 0;
            }
            Action::NextView | Action::PrevView | Action::FleetTab(_) => {
                let i = Tab::ALL.iter().position(|t| *t == self.tab).unwrap_or(0);
                let j = match a {
                    Action::NextView => (i + 1) % 3,
                    Action::PrevView => (i + 2) % 3,
                    Action::FleetTab(n) => n.min(2),
                    _ => i,
                };
                self.tab = Tab::ALL[j];
                self.list = ListState::default();
                self.help = false;
            }
            Action::Up => self.list.moved(-1, len, vis),
            Action::Down => self.list.moved(1, len, vis),
            Action::Top => self.list.moved(isize::MIN / 2, len, vis),
            Action::Bottom => self.list.moved(isize::MAX / 2, len, vis),
            Action::Back => {
                if self.help {
                    self.help = false;
                } else if self.filter.is_some() {
                    self.filter = None;
                    self.say("filter cleared", false);
                }
            }
            Action::Filter => {
                let t = self
                    .filter
                    .as_ref()
                    .map(|f| f.text.clone())
                    .unwrap_or_default();
                self.input = Some(Input::Filter(t));
            }
            Action::Find => self.input = Some(Input::Find(String::new())),
            Action::Sort => {
                let i = EngineSort::ALL
                    .iter()
                    .position(|s| *s == self.sort)
                    .unwrap_or(0);
                self.sort = EngineSort::ALL[(i + 1) % EngineSort::ALL.len()];
                self.say(format!("engines sorted by {}", self.sort.name()), false);
            }
            Action::Reverse => self.reverse = !self.reverse,
            Action::Open => match self.tab {
                Tab::Engines => {
                    if let Some(name) = self.rows.get(self.list.selected).cloned() {
                        self.drill(&name);
                    }
                }
                Tab::Prefixes => {
                    if let Some(d) = self.model.prefixes().top.get(self.list.selected) {
                        let q = format!("{:#x}", d.hash.0);
                        self.locate(&q);
                    }
                }
                Tab::Where => {
                    let name = self
                        .located
                        .as_ref()
                        .and_then(|l| l.rows.get(self.list.selected))
                        .map(|r| r.engine.clone());
                    if let Some(name) = name {
                        self.drill(&name);
                    }
                }
            },
            // The engine console's own: never dispatched here.
            _ => {}
        }
    }

    /// Drills into `engine`: its own console, every view.
    pub fn drill(&mut self, engine: &str) {
        if let Some(i) = self.parked.iter().position(|(n, _, _)| n == engine) {
            let (name, mut app, keep) = self.parked.remove(i);
            app.resize(self.size.width, self.size.height);
            self.drilled = Some((name, app, keep));
            self.message = None;
            return;
        }
        match (self.opener)(engine) {
            Ok((mut app, keep)) => {
                app.resize(self.size.width, self.size.height);
                self.drilled = Some((engine.to_string(), app, keep));
                self.message = None;
            }
            Err(e) => self.say(format!("cannot open {engine}: {e:#}"), true),
        }
    }

    /// Answers "where is this prefix" for `query` on the Where view.
    pub fn locate(&mut self, query: &str) {
        let l = self.model.locate(query);
        let text = if l.prefix_blocks == 0 {
            format!("{query}: no engine knows this request or hash")
        } else {
            format!(
                "{query}: {} block(s), held by {} engine(s)",
                l.prefix_blocks,
                l.rows.len()
            )
        };
        self.say(text, l.prefix_blocks == 0);
        self.located = Some(l);
        self.tab = Tab::Where;
        self.list = ListState::default();
    }

    fn type_key(&mut self, ev: KeyEvent) {
        let Some(input) = self.input.as_mut() else {
            return;
        };
        let text = match input {
            Input::Filter(t) | Input::Find(t) => t,
        };
        match ev.code {
            KeyCode::Esc => self.input = None,
            KeyCode::Enter => match self.input.take() {
                Some(Input::Filter(t)) => match Filter::new(&t) {
                    Ok(f) => {
                        self.filter = f;
                        self.list = ListState::default();
                    }
                    Err(e) => self.say(e, true),
                },
                Some(Input::Find(t)) if !t.trim().is_empty() => self.locate(&t),
                _ => {}
            },
            KeyCode::Backspace => {
                text.pop();
            }
            KeyCode::Char('c') if ev.modifiers.contains(KeyModifiers::CONTROL) => self.quit = true,
            KeyCode::Char(c)
                if !ev.modifiers.contains(KeyModifiers::CONTROL) && text.len() < 256 =>
            {
                text.push(c)
            }
            _ => {}
        }
    }
}

impl Screen for FleetApp {
    fn key(&mut self, ev: KeyEvent) {
        if ev.kind != KeyEventKind::Press {
            return;
        }
        if let Some((_, app, _)) = self.drilled.as_mut() {
            // Esc with nothing of the engine's console left to close
            // comes back to the fleet.
            let at_top = app.ui.input.is_none()
                && !app.ui.help
                && !app.ui.warnings
                && app.views.detail.is_none()
                && app.ui.filter.is_none();
            if ev.code == KeyCode::Esc && at_top {
                if let Some(d) = self.drilled.take() {
                    self.parked.push(d);
                    if self.parked.len() > MAX_PARKED {
                        self.parked.remove(0);
                    }
                }
                self.update();
                return;
            }
            app.key(ev);
            if app.quit {
                self.quit = true;
            }
            return;
        }
        if self.input.is_some() {
            self.type_key(ev);
        } else if let Some(a) = dispatch(&ev) {
            self.message = None;
            self.act(a);
        }
        self.update();
    }

    fn mouse(&mut self, ev: MouseEvent) {
        if let Some((_, app, _)) = self.drilled.as_mut() {
            app.mouse(ev);
            return;
        }
        let (len, vis) = (self.row_count(), self.visible());
        match ev.kind {
            MouseEventKind::ScrollDown => self.list.moved(3, len, vis),
            MouseEventKind::ScrollUp => self.list.moved(-3, len, vis),
            _ => {}
        }
    }

    fn resize(&mut self, w: u16, h: u16) {
        self.size = Rect::new(0, 0, w, h);
        if let Some((_, app, _)) = self.drilled.as_mut() {
            app.resize(w, h);
        }
        self.update();
    }

    fn pull(&mut self, now: Instant) -> usize {
        let mut n = 0;
        if let FleetSource::Live(f) = &mut self.source {
            // Bounded per pull, so input and drawing never wait long.
            while n < crate::source::MAX_PULL {
                match f.try_next() {
                    Some(super::nats::FleetItem::Batch {
                        engine,
                        header,
                        events,
                        lag,
                    }) => {
                        n += events.len().max(1);
                        self.model.apply(&engine, &header, &events, now, lag);
                    }
                    Some(super::nats::FleetItem::Refused { engine, error }) => {
                        n += 1;
                        self.model.refused(engine.as_deref(), error);
                    }
                    None => break,
                }
            }
        }
        if let Some((_, app, _)) = self.drilled.as_mut() {
            n += app.pull(now);
        }
        n
    }

    fn tick(&mut self) {
        let now = Instant::now();
        if now.duration_since(self.last_tick) >= Duration::from_millis(500) {
            self.last_tick = now;
            self.model.tick(now);
        }
        if let Some((_, app, _)) = self.drilled.as_mut() {
            app.tick();
        }
        self.update();
    }

    fn render(&self, f: &mut Frame) {
        if let Some((_, app, _)) = &self.drilled {
            app.render(f);
            return;
        }
        let (header, tabs, body, footer) = areas(f.area());
        self.draw_header(f, header);
        let mut spans = Vec::new();
        for (i, t) in Tab::ALL.iter().enumerate() {
            let s = format!(" {} {} ", i + 1, t.title());
            spans.push(if *t == self.tab {
                Span::styled(s, selected())
            } else {
                Span::raw(s)
            });
        }
        if let Some(flt) = &self.filter {
            spans.push(Span::styled(
                format!("  filter: {}", flt.text),
                Style::new().fg(Color::Yellow),
            ));
        }
        f.render_widget(Paragraph::new(Line::from(spans)), tabs);
        match self.tab {
            Tab::Engines => self.draw_engines(f, body),
            Tab::Prefixes => self.draw_prefixes(f, body),
            Tab::Where => self.draw_where(f, body),
        }
        let line = match &self.input {
            Some(Input::Filter(t)) => prompt("filter engines (text or /regex/): ", t),
            Some(Input::Find(t)) => prompt("where is (request id or 0xHASH): ", t),
            None => match &self.message {
                Some(m) => Line::from(Span::styled(
                    m.text.clone(),
                    Style::new().fg(if m.error { Color::Red } else { Color::Green }),
                )),
                None => Line::from(Span::styled(
                    "Enter drill in · s sort · / filter · f where is · Tab views · ? help · q quit",
                    Style::new().fg(Color::DarkGray),
                )),
            },
        };
        f.render_widget(Paragraph::new(line), footer);
        if self.help {
            let mut lines = vec![Line::from(Span::styled("Fleet", head().fg(Color::Cyan)))];
            for bnd in fleet_bindings() {
                let k: Vec<String> = bnd.keys.iter().map(Key::label).collect();
                lines.push(Line::from(vec![
                    Span::styled(
                        format!("  {:<14}", k.join(" ")),
                        Style::new().fg(Color::Yellow),
                    ),
                    Span::raw(bnd.help),
                ]));
            }
            crate::ui::chrome::scrolled_popup(
                f,
                body,
                90,
                lines,
                self.help_scroll,
                "Help (Esc or ? closes",
            );
        }
    }

    fn quitting(&self) -> bool {
        self.quit
    }

    fn quit(&mut self) {
        self.quit = true;
    }
}

fn prompt(p: &str, t: &str) -> Line<'static> {
    Line::from(vec![
        Span::styled(p.to_string(), Style::new().fg(Color::Yellow)),
        Span::raw(t.to_string()),
        Span::styled("█", Style::new().fg(Color::Gray)),
    ])
}

fn areas(size: Rect) -> (Rect, Rect, Rect, Rect) {
    let [h, t, b, f] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(1),
        Constraint::Min(0),
        Constraint::Length(1),
    ])
    .areas(size);
    (h, t, b, f)
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{:.0}%", v * 100.0))
}

impl FleetApp {
    fn draw_header(&self, f: &mut Frame, area: Rect) {
        let now = Instant::now();
        let (mut live, mut paused, mut stale, mut gone) = (0, 0, 0, 0);
        let (mut rate, mut losses) = (0.0, 0u64);
        for e in self.model.engines() {
            match e.liveness(now) {
                super::model::Liveness::Live => live += 1,
                super::model::Liveness::Paused => paused += 1,
                super::model::Liveness::Stale => stale += 1,
                super::model::Liveness::Gone => gone += 1,
            }
            rate += e.rate;
            losses += e.losses();
        }
        let (badge, tone, label) = match &self.source {
            FleetSource::Live(fl) => {
                let s = fl.status();
                let ok = s.ends_with("FOLLOWING");
                (
                    s,
                    if ok { Color::Green } else { Color::Yellow },
                    fl.url().to_string(),
                )
            }
            FleetSource::Recorded { label } => {
                ("FLEET RECORDING".into(), Color::Cyan, label.clone())
            }
            FleetSource::Fixed => ("SNAPSHOT".into(), Color::Gray, String::new()),
        };
        let lost_style = if losses > 0 || self.model.refused_unattributed > 0 {
            Style::new().fg(Color::Red).bold()
        } else {
            Style::new()
        };
        let l1 = Line::from(vec![
            Span::styled(" kvbm fleet ", Style::new().bold()),
            Span::styled(format!(" {badge} "), Style::new().bg(tone).fg(Color::Black)),
            Span::raw(format!(
                " {label}  engines {} (live {live}, paused {paused}, stale {stale}, gone {gone})  {:.0} ev/s  ",
                self.model.len(),
                rate
            )),
            Span::styled(
                format!("lost {losses}  refused {}", self.model.refused_unattributed),
                lost_style,
            ),
        ]);
        let p = self.model.prefixes();
        let mut l2 = format!(
            " prefixes: {} distinct, {} on 2+ engines, {} extra copies ({})",
            p.distinct,
            p.duplicated,
            p.extra_copies,
            crate::fmt::bytes(p.extra_bytes)
        );
        if p.not_indexed > 0 {
            l2.push_str(&format!(", {} not indexed", p.not_indexed));
        }
        if self.model.engines_forgotten > 0 {
            l2.push_str(&format!(
                "; {} gone engines forgotten to keep {}",
                self.model.engines_forgotten,
                self.model.max_engines()
            ));
        }
        if self.model.batches_over_limit > 0 {
            l2.push_str(&format!(
                "; {} batches of new engines not shown ({} engines, none gone)",
                self.model.batches_over_limit,
                self.model.len()
            ));
        }
        f.render_widget(Paragraph::new(vec![l1, Line::from(l2)]), area);
    }

    fn draw_engines(&self, f: &mut Frame, area: Rect) {
        let now = Instant::now();
        let title = format!(
            "Fleet — {} engines, sorted by {}{}",
            self.rows.len(),
            self.sort.name(),
            if self.reverse { " (reversed)" } else { "" }
        );
        if self.rows.is_empty() {
            let msg = if self.model.is_empty() {
                "no engine has published yet (kvbm-sim --publish nats://… --engine-id NAME)"
            } else {
                "no engine matches the filter"
            };
            f.render_widget(Paragraph::new(msg).block(panel(title)), area);
            return;
        }
        let header = Row::new(
            [
                "ENGINE", "STATE", "EV/S", "LAG", "REQS", "G1 OCC", "G1 HIT", "G2 OCC", "G2 HIT",
                "G3 OCC", "G3 HIT", "XFERS", "PAUSED", "LOST",
            ]
            .map(|h| {
                // Numbers right-aligned, under headers that are too.
                let l = Line::from(h);
                Cell::from(if matches!(h, "ENGINE" | "STATE") {
                    l
                } else {
                    l.right_aligned()
                })
                .style(head())
            }),
        );
        let num = |s: String| Cell::from(Line::from(s).right_aligned());
        let off = self.list.offset_for(self.rows.len(), self.visible());
        let rows = self
            .rows
            .iter()
            .enumerate()
            .skip(off)
            .take(self.visible())
            .filter_map(|(i, name)| {
                let e = self.model.engine(name)?;
                let live = e.liveness(now);
                let st = match live {
                    super::model::Liveness::Live => Style::new().fg(Color::Green),
                    super::model::Liveness::Paused => Style::new().fg(Color::Magenta),
                    super::model::Liveness::Stale => Style::new().fg(Color::Yellow),
                    super::model::Liveness::Gone => Style::new().fg(Color::DarkGray),
                };
                let lost = e.losses();
                let cells = vec![
                    Cell::from(e.name.clone()),
                    Cell::from(live.name()).style(st),
                    num(format!("{:.0}", e.rate)),
                    num(format!("{:.0}ms", e.lag.as_secs_f64() * 1e3)),
                    num(e.requests_live().to_string()),
                    num(pct(e.occupancy(Tier::Device))),
                    num(pct(e.hit_ratio(Tier::Device))),
                    num(pct(e.occupancy(Tier::Host))),
                    num(pct(e.hit_ratio(Tier::Host))),
                    num(pct(e.occupancy(Tier::Disk))),
                    num(pct(e.hit_ratio(Tier::Disk))),
                    num(e.state.in_flight_count().to_string()),
                    num(e.state.paused_count().to_string()),
                    num(lost.to_string()).style(if lost > 0 {
                        Style::new().fg(Color::Red)
                    } else {
                        Style::new()
                    }),
                ];
                let row = Row::new(cells);
                Some(if i == self.list.selected {
                    row.style(selected())
                } else {
                    row
                })
            });
        let widths = [
            Constraint::Min(10),
            Constraint::Length(6),
            Constraint::Length(7),
            Constraint::Length(7),
            Constraint::Length(5),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(5),
            Constraint::Length(6),
            Constraint::Length(6),
        ];
        f.render_widget(
            Table::new(rows, widths).header(header).block(panel(title)),
            area,
        );
    }

    fn draw_prefixes(&self, f: &mut Frame, area: Rect) {
        let p = self.model.prefixes();
        let title = format!(
            "Prefixes cached on several engines — {} of {} ({} extra copies, {})",
            p.duplicated,
            p.distinct,
            p.extra_copies,
            crate::fmt::bytes(p.extra_bytes)
        );
        if p.top.is_empty() {
            f.render_widget(
                Paragraph::new("no prefix is cached on more than one engine").block(panel(title)),
                area,
            );
            return;
        }
        let header =
            Row::new(["SEQUENCE HASH", "ENGINES", "ON"].map(|h| Cell::from(h).style(head())));
        let off = self.list.offset_for(p.top.len(), self.visible());
        let rows = p
            .top
            .iter()
            .enumerate()
            .skip(off)
            .take(self.visible())
            .map(|(i, d)| {
                let more = d.engines.saturating_sub(d.names.len());
                let on = if more > 0 {
                    format!("{} +{more}", d.names.join(" "))
                } else {
                    d.names.join(" ")
                };
                let r = Row::new([format!("{:#018x}", d.hash.0), d.engines.to_string(), on]);
                if i == self.list.selected {
                    r.style(selected())
                } else {
                    r
                }
            });
        let widths = [
            Constraint::Length(20),
            Constraint::Length(8),
            Constraint::Min(10),
        ];
        f.render_widget(
            Table::new(rows, widths).header(header).block(panel(title)),
            area,
        );
    }

    fn draw_where(&self, f: &mut Frame, area: Rect) {
        let Some(l) = &self.located else {
            f.render_widget(
                Paragraph::new(
                    "f: type a request id (ENGINE/REQUEST for one engine's) or a sequence hash (0x…) to see which engines hold it",
                )
                .block(panel("Where is this prefix")),
                area,
            );
            return;
        };
        let served = if l.served_by.len() > 1 {
            // Engines name requests on their own: one id, several requests.
            let mine = l.prefix_of.as_deref().unwrap_or("?");
            let other = l.served_by.iter().find(|e| *e != mine).map_or("", |e| e);
            format!(
                ", {mine}'s request of that id (also served by {}: ask {other}/{} for another's)",
                l.served_by
                    .iter()
                    .filter(|e| *e != mine)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(" "),
                l.query
            )
        } else if !l.served_by.is_empty() {
            format!(", served by {}", l.served_by.join(" "))
        } else if l.prefix_blocks == 0 && l.requests_forgotten > 0 {
            // Not found: it may be older than what the engines remember.
            format!(
                ", not found; {} older requests forgotten (the newest {} an engine are kept)",
                l.requests_forgotten,
                super::model::MAX_REQUESTS_REMEMBERED
            )
        } else {
            String::new()
        };
        let title = format!(
            "Where is {} — {} block(s){served}",
            l.query, l.prefix_blocks
        );
        let header = Row::new(
            ["ENGINE", "BLOCKS", "OF PREFIX", "G1", "G2", "G3", "BYTES"]
                .map(|h| Cell::from(h).style(head())),
        );
        let off = self.list.offset_for(l.rows.len(), self.visible());
        let rows = l
            .rows
            .iter()
            .enumerate()
            .skip(off)
            .take(self.visible())
            .map(|(i, r)| {
                let row = Row::new([
                    r.engine.clone(),
                    r.blocks.to_string(),
                    crate::fmt::pct(r.blocks, l.prefix_blocks),
                    r.per_tier[0].to_string(),
                    r.per_tier[1].to_string(),
                    r.per_tier[2].to_string(),
                    crate::fmt::bytes(r.bytes),
                ]);
                if i == self.list.selected {
                    row.style(selected())
                } else {
                    row
                }
            });
        let widths = [
            Constraint::Min(10),
            Constraint::Length(7),
            Constraint::Length(10),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(6),
            Constraint::Length(10),
        ];
        f.render_widget(
            Table::new(rows, widths).header(header).block(panel(title)),
            area,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `app` drawn on a `w`×`h` test terminal, a line of text a row.
    fn screen(app: &FleetApp, w: u16, h: u16) -> Vec<String> {
        let mut t = ratatui::Terminal::new(ratatui::backend::TestBackend::new(w, h)).unwrap();
        t.draw(|f| app.render(f)).unwrap();
        let buf = t.backend().buffer();
        (0..h)
            .map(|y| (0..w).map(|x| buf[(x, y)].symbol()).collect())
            .collect()
    }

    #[test]
    fn the_where_view_says_when_a_request_may_have_been_forgotten() {
        use kvbm_attach::nats::wire::BatchHeader;
        use kvbm_events::{Event, EventKind};
        let n = super::super::model::MAX_REQUESTS_REMEMBERED + 5;
        let evs: Vec<Event> = (0..n as u64)
            .map(|i| Event {
                engine: 0,
                seq: i,
                ts_ns: i,
                iteration: 0,
                request: Some(format!("r{i}").into()),
                kind: EventKind::BlocksAllocated {
                    tier: Tier::Device,
                    blocks: vec![1],
                },
            })
            .collect();
        let h = BatchHeader {
            run: 1,
            first_seq: 0,
            last_seq: n as u64 - 1,
            count: n as u32,
            dropped_before: 0,
        };
        let mut model = FleetModel::new();
        model.apply("a", &h, &evs, Instant::now(), Duration::ZERO);
        let mut app = FleetApp::new(
            model,
            FleetSource::Fixed,
            Box::new(|_: &str| anyhow::bail!("no engine consoles here")),
        );
        app.locate("r0");
        let text = screen(&app, 140, 12).join("\n");
        assert!(
            text.contains(
                "not found; 5 older requests forgotten (the newest 20000 an engine are kept)"
            ),
            "{text}"
        );
        // A request it still remembers is found, and says nothing of them.
        app.locate(&format!("r{}", n - 1));
        let text = screen(&app, 140, 12).join("\n");
        assert!(
            text.contains("served by a") && !text.contains("forgotten"),
            "{text}"
        );
    }

    #[test]
    fn the_header_counts_batches_of_engines_past_the_limit() {
        use kvbm_attach::nats::wire::BatchHeader;
        use kvbm_events::{Event, EventKind, SequenceHash};
        let ev = Event {
            engine: 0,
            seq: 0,
            ts_ns: 0,
            iteration: 0,
            request: None,
            kind: EventKind::BlockRegistered {
                tier: Tier::Device,
                block: 1,
                sequence_hash: SequenceHash(7),
                duplicate_of: None,
            },
        };
        let h = BatchHeader {
            run: 1,
            first_seq: 0,
            last_seq: 0,
            count: 1,
            dropped_before: 0,
        };
        let mut model = FleetModel::with_max_engines(1);
        let now = Instant::now();
        for name in ["a", "b", "b"] {
            model.apply(name, &h, std::slice::from_ref(&ev), now, Duration::ZERO);
        }
        let app = FleetApp::new(
            model,
            FleetSource::Fixed,
            Box::new(|_: &str| anyhow::bail!("no engine consoles here")),
        );
        let line = &screen(&app, 160, 6)[1];
        assert!(
            line.contains("2 batches of new engines not shown (1 engines, none gone)"),
            "{line}"
        );
    }

    #[test]
    fn every_fleet_key_dispatches_to_its_own_action() {
        for bnd in fleet_bindings() {
            for key in bnd.keys {
                assert_eq!(dispatch(&key.event()), Some(bnd.action), "{key:?}");
            }
        }
    }
}
