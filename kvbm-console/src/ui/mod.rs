//! Drawing. Every function here takes `&App` and a frame; nothing here
//! changes state (see [`crate::app`]). The layout is a pure function of the
//! terminal size, so mouse clicks are mapped with the same arithmetic that
//! drew the screen.

pub mod breakpoints;
pub mod detail;
pub mod events;
pub mod hist;
pub mod pools;
pub mod slots;
pub mod transfers;

use crate::app::{App, InputKind, Source};
use crate::fmt;
use crate::keys::{self, ViewId};
use crate::lints::LintKind;
use crate::source::Tone;
use kvbm_events::slot::SlotState;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style, Stylize};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Clear, Paragraph, Wrap};

/// The screen's regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Areas {
    /// Two header lines.
    pub header: Rect,
    /// The tab bar.
    pub tabs: Rect,
    /// The view.
    pub body: Rect,
    /// The prompt / message / hints line.
    pub footer: Rect,
}

/// Splits the terminal.
pub fn areas(size: Rect) -> Areas {
    let [header, tabs, body, footer] = Layout::vertical([
        Constraint::Length(2),
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

/// Rows a list in the current view has room for (its body height less
/// borders and its header row).
pub fn list_rows(app: &App) -> usize {
    let body = areas(app.ui.size).body;
    if app.ui.detail.is_some() {
        return detail::list_area(body).height.saturating_sub(1) as usize;
    }
    match app.ui.view {
        ViewId::Transfers => transfers::list_area(body).height.saturating_sub(3) as usize,
        _ => body.height.saturating_sub(3) as usize,
    }
}

/// The list row under a click, if any.
pub fn row_at(app: &App, x: u16, y: u16) -> Option<usize> {
    let body = areas(app.ui.size).body;
    let list = if app.ui.detail.is_some() {
        let a = detail::list_area(body);
        Rect::new(a.x, a.y + 1, a.width, a.height.saturating_sub(1))
    } else {
        match app.ui.view {
            // Pools have no list; transfers split theirs over two tables
            // and are selected with the keys.
            ViewId::Pools | ViewId::Transfers => return None,
            _ => Rect::new(
                body.x,
                body.y + 2,
                body.width,
                body.height.saturating_sub(3),
            ),
        }
    };
    if x < list.x || x >= list.right() || y < list.y || y >= list.bottom() {
        return None;
    }
    let l = app.list();
    let off = l.offset_for(app.list_len(), list.height as usize);
    let row = off + (y - list.y) as usize;
    (row < app.list_len()).then_some(row)
}

fn tab_titles() -> Vec<(ViewId, String)> {
    ViewId::ALL
        .iter()
        .enumerate()
        .map(|(i, v)| (*v, format!(" {} {} ", i + 1, v.title())))
        .collect()
}

/// The view whose tab is at column `x`.
pub fn tab_at(x: u16) -> Option<ViewId> {
    let mut col = 0u16;
    for (v, t) in tab_titles() {
        let w = t.chars().count() as u16;
        if x >= col && x < col + w {
            return Some(v);
        }
        col += w + 1;
    }
    None
}

/// Draws the whole screen.
pub fn render(app: &App, f: &mut Frame) {
    let a = areas(f.area());
    header(app, f, a.header);
    tabs(app, f, a.tabs);
    if let Some(r) = &app.ui.detail {
        detail::render(app, r, f, a.body);
    } else {
        match app.ui.view {
            ViewId::Slots => slots::render(app, f, a.body),
            ViewId::Transfers => transfers::render(app, f, a.body),
            ViewId::Pools => pools::render(app, f, a.body),
            ViewId::Histograms => hist::render(app, f, a.body),
            ViewId::Breakpoints => breakpoints::render(app, f, a.body),
            ViewId::Events => events::render(app, f, a.body),
        }
    }
    footer(app, f, a.footer);
    if app.ui.help {
        help(app, f, a.body);
    } else if app.ui.warnings {
        warnings(app, f, a.body);
    }
}

fn counter(name: &str, n: u64) -> Vec<Span<'static>> {
    let style = if n > 0 {
        Style::new().fg(Color::Red).add_modifier(Modifier::BOLD)
    } else {
        Style::new().fg(Color::DarkGray)
    };
    vec![
        Span::raw(format!("{name} ")),
        Span::styled(fmt::count(n), style),
    ]
}

fn sep() -> Span<'static> {
    Span::styled(" │ ", Style::new().fg(Color::DarkGray))
}

fn header(app: &App, f: &mut Frame, area: Rect) {
    let m = &app.model;
    let st = m.state();
    let badge = app.source.badge(std::time::Instant::now());
    let mode = badge.text;
    let mode_style = Style::new().fg(Color::Black).bg(tone_color(badge.tone));
    let (lagged, dropped) = (app.source.lagged(), app.source.dropped());
    let engine = st.engine().map_or("-".to_string(), |e| e.to_string());
    let mut l1 = vec![
        Span::styled(" kvbm ", Style::new().add_modifier(Modifier::BOLD)),
        Span::styled(format!(" {mode} "), mode_style),
        sep(),
        Span::raw(format!("{} ", fmt::clock(m.now_ns()))),
        sep(),
        Span::raw(format!("{} ev/s", fmt::count(m.events_per_s()))),
        sep(),
    ];
    l1.extend(counter("lagged", lagged));
    l1.push(Span::raw("  "));
    l1.extend(counter("dropped", dropped));
    l1.push(Span::raw("  "));
    l1.extend(counter("history-dropped", m.history().dropped()));
    l1.push(sep());
    l1.push(Span::raw(format!(
        "engine {engine} · {} · {} events",
        app.label,
        fmt::count(m.applied())
    )));
    let live = st.slots().filter(|s| !s.is_finished()).count();
    let lints = m.lints();
    let current = lints.current(st, m.now_ns());
    let n_cur = |k: LintKind| current.iter().filter(|l| l.kind == k).count() as u64;
    let warn_total = current.len() as u64 + lints.destination_full() + lints.thrash();
    let mut l2 = vec![
        Span::raw(format!(
            " slots {} live / {} shown · in flight {} · paused {}",
            live,
            st.slot_count(),
            st.in_flight_count(),
            st.paused_count()
        )),
        sep(),
    ];
    let warn_style = if warn_total > 0 {
        Style::new().fg(Color::Yellow)
    } else {
        Style::new().fg(Color::DarkGray)
    };
    l2.push(Span::styled(
        format!(
            "⚠ stuck {} · dest-full {} · thrash {} · near-deadline {} (w)",
            n_cur(LintKind::StuckFinishing),
            lints.destination_full(),
            lints.thrash(),
            n_cur(LintKind::PauseNearDeadline)
        ),
        warn_style,
    ));
    f.render_widget(Paragraph::new(vec![Line::from(l1), Line::from(l2)]), area);
}

fn tabs(app: &App, f: &mut Frame, area: Rect) {
    let mut spans = Vec::new();
    for (v, t) in tab_titles() {
        let style = if v == app.ui.view {
            Style::new()
                .fg(Color::Black)
                .bg(Color::White)
                .add_modifier(Modifier::BOLD)
        } else {
            Style::new().fg(Color::Gray)
        };
        spans.push(Span::styled(t, style));
        spans.push(Span::raw(" "));
    }
    if let Some(d) = &app.ui.detail {
        spans.push(Span::styled(format!("› {d}"), Style::new().fg(Color::Cyan)));
    }
    if let Some(flt) = &app.ui.filter {
        spans.push(Span::styled(
            format!("  filter: {}", flt.text),
            Style::new().fg(Color::Yellow),
        ));
    }
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

fn footer(app: &App, f: &mut Frame, area: Rect) {
    let line = if let Some(i) = &app.ui.input {
        let prompt = match i.kind {
            InputKind::Filter => "filter (text or /regex/): ",
            InputKind::Breakpoint => "breakpoint (state= request= prefix= direction= entry=): ",
        };
        Line::from(vec![
            Span::styled(prompt, Style::new().fg(Color::Yellow)),
            Span::raw(i.text.clone()),
            Span::styled("█", Style::new().fg(Color::Gray)),
        ])
    } else if let Some(m) = &app.ui.message {
        let style = if m.error {
            Style::new().fg(Color::Red)
        } else {
            Style::new().fg(Color::Green)
        };
        Line::from(Span::styled(m.text.clone(), style))
    } else {
        let hints = match (app.ui.detail.is_some(), app.ui.view, &app.source) {
            (true, _, _) => "Esc back · j/k scroll · b break on this request · ? help · q quit",
            (_, _, Source::Replay(_)) => {
                "Space play/pause · +/- speed · ←/→ seek 10s · ,/. step · Home/End · ? help · q quit"
            }
            (_, ViewId::Slots, _) => {
                "Enter detail · / filter · s sort · b break · Space freeze · ? help · q quit"
            }
            (_, ViewId::Breakpoints, _) => {
                "a add · d clear · r resume · R resume all · n step · ? help · q quit"
            }
            _ => "Tab/1-6 views · / filter · Enter detail · Space freeze · ? help · q quit",
        };
        Line::from(Span::styled(hints, Style::new().fg(Color::DarkGray)))
    };
    f.render_widget(Paragraph::new(line), area);
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

fn help(app: &App, f: &mut Frame, area: Rect) {
    let mut lines = Vec::new();
    for (title, rows) in keys::help(app.context()) {
        lines.push(Line::from(Span::styled(title, head().fg(Color::Cyan))));
        for (k, text) in rows {
            lines.push(Line::from(vec![
                Span::styled(format!("  {k:<18}"), Style::new().fg(Color::Yellow)),
                Span::raw(text),
            ]));
        }
    }
    let r = centered(area, 76, lines.len() as u16 + 2);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines)
            .block(panel("Help — keys (Esc or ? closes)"))
            .wrap(Wrap { trim: false }),
        r,
    );
}

fn warnings(app: &App, f: &mut Frame, area: Rect) {
    let m = &app.model;
    let lints = m.lints();
    let mut lines = vec![Line::from(vec![Span::styled("Now", head())])];
    let current = lints.current(m.state(), m.now_ns());
    if current.is_empty() {
        lines.push(Line::from(Span::styled(
            "  nothing",
            Style::new().fg(Color::DarkGray),
        )));
    }
    for l in &current {
        lines.push(Line::from(vec![
            Span::styled(
                format!("  {:<20}", l.kind.name()),
                Style::new().fg(Color::Yellow),
            ),
            Span::raw(l.detail.clone()),
        ]));
    }
    lines.push(Line::from(Span::styled(
        format!(
            "Recent (dest-full {}, thrash {}; {} older dropped, {} evictions untracked)",
            lints.destination_full(),
            lints.thrash(),
            lints.recent_dropped(),
            lints.tracking_dropped()
        ),
        head(),
    )));
    let room = area.height.saturating_sub(lines.len() as u16 + 2) as usize;
    for l in lints.recent().iter().rev().take(room) {
        lines.push(Line::from(vec![
            Span::styled(
                format!("  {} ", fmt::clock(l.ts_ns)),
                Style::new().fg(Color::DarkGray),
            ),
            Span::styled(
                format!("{:<18}", l.kind.name()),
                Style::new().fg(Color::Yellow),
            ),
            Span::raw(l.detail.clone()),
        ]));
    }
    let r = centered(area, area.width.saturating_sub(4), area.height);
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines).block(panel("Warnings (Esc or w closes)")),
        r,
    );
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
