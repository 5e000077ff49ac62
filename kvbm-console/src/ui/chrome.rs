//! What surrounds the views: the header lines (two, or three with what
//! the engine runs as), the tab bar, the bottom line (a prompt, a message
//! or key hints) and the help and warnings popups. Drawn from plain
//! values the app hands over; nothing here keeps or changes state.

use super::filter::Filter;
use super::{centered, head, panel, tone_color};
use crate::fmt;
use crate::keys::{self, Context, ViewId};
use crate::lints::LintKind;
use crate::model::Model;
use crate::source::{Badge, Tone};
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Clear, Paragraph};

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

/// What the header says about the source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header<'a> {
    /// The mode badge.
    pub badge: Badge,
    /// Events the console missed.
    pub lagged: u64,
    /// Events lost before the console could see them.
    pub dropped: u64,
    /// A name for the source (`demo`, a file name, a URL).
    pub label: &'a str,
    /// What the engine runs as, in one line (`vLLM · tp 2 · async
    /// scheduling · …`), when known: a third line.
    pub engine: Option<&'a str>,
}

/// Lines the header takes: two, and one more for what the engine runs as
/// when that is known.
pub fn header_lines(engine_known: bool) -> u16 {
    if engine_known { 3 } else { 2 }
}

/// Blank columns between two tabs.
const TAB_GAP: u16 = 2;

/// The tabs' titles: seven views fit in 80 columns.
fn tab_titles() -> Vec<(ViewId, String)> {
    ViewId::ALL
        .iter()
        .enumerate()
        .map(|(i, v)| (*v, format!("{} {}", i + 1, v.title())))
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
        col += w + TAB_GAP;
    }
    None
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

/// Draws the header lines: the source and its losses, then the slots and
/// the warnings, then (when known) what the engine runs as, cut with `…`
/// at the screen's edge.
pub fn header(f: &mut Frame, area: Rect, model: &Model, h: &Header) {
    let m = model;
    let st = m.state();
    let mode_style = Style::new().fg(Color::Black).bg(tone_color(h.badge.tone));
    let engine = st.engine().map_or("-".to_string(), |e| e.to_string());
    let mut l1 = vec![
        Span::styled(" kvbm ", Style::new().add_modifier(Modifier::BOLD)),
        Span::styled(format!(" {} ", h.badge.text), mode_style),
        sep(),
        Span::raw(format!("{} ", fmt::clock(m.now_ns()))),
        sep(),
        Span::raw(format!("{} ev/s", fmt::count(m.events_per_s()))),
        sep(),
    ];
    l1.extend(counter("lagged", h.lagged));
    l1.push(Span::raw("  "));
    l1.extend(counter("dropped", h.dropped));
    l1.push(Span::raw("  "));
    l1.extend(counter("history-dropped", m.history().dropped()));
    l1.push(sep());
    l1.push(Span::raw(format!(
        "engine {engine} · {} · {} events",
        h.label,
        fmt::count(m.applied())
    )));
    let live = st.slots().filter(|s| !s.is_finished()).count();
    let lints = m.lints();
    let current = lints.current(st, m.now_ns());
    let n_cur = |k: LintKind| current.iter().filter(|l| l.kind == k).count() as u64;
    let warn_total = current.len() as u64 + lints.destination_full() + lints.thrash();
    // With the link down (or the view frozen) the events stop where they
    // were: a call paused then may be gone (the engine died, its
    // breakpoints were released) while the Breakpoints view, which asks
    // the engine, lists none. Say that this count is the last one seen.
    let paused = st.paused_count();
    let last_seen = if paused > 0 && matches!(h.badge.tone, Tone::Caution | Tone::Down) {
        " (last seen)"
    } else {
        ""
    };
    let mut l2 = vec![
        Span::raw(format!(
            " slots {} live / {} shown · in flight {} · paused {paused}{last_seen}",
            live,
            st.slot_count(),
            st.in_flight_count(),
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
    let mut lines = vec![Line::from(l1), Line::from(l2)];
    if let Some(engine) = h.engine {
        let text = format!(" runs as {engine}");
        lines.push(Line::from(Span::styled(
            super::columns::clip(&text, area.width),
            Style::new().fg(Color::Cyan),
        )));
    }
    f.render_widget(Paragraph::new(lines), area);
}

/// Draws the tab bar: `view` highlighted, then the open request and the
/// filter, if any.
pub fn tabs(
    f: &mut Frame,
    area: Rect,
    view: ViewId,
    detail: Option<&str>,
    filter: Option<&Filter>,
) {
    let mut spans = Vec::new();
    for (v, t) in tab_titles() {
        let style = if v == view {
            Style::new()
                .fg(Color::Black)
                .bg(Color::White)
                .add_modifier(Modifier::BOLD)
        } else {
            Style::new().fg(Color::Gray)
        };
        spans.push(Span::styled(t, style));
        spans.push(Span::raw(" ".repeat(TAB_GAP as usize)));
    }
    if let Some(d) = detail {
        spans.push(Span::styled(format!("› {d}"), Style::new().fg(Color::Cyan)));
    }
    if let Some(flt) = filter {
        spans.push(Span::styled(
            format!("  filter: {}", flt.text),
            Style::new().fg(Color::Yellow),
        ));
    }
    f.render_widget(Paragraph::new(Line::from(spans)), area);
}

/// Draws the bottom line: the prompt being typed, else the message, else
/// the hints for `ctx`.
pub fn footer(
    f: &mut Frame,
    area: Rect,
    input: Option<&Input>,
    message: Option<&Message>,
    ctx: Context,
) {
    let line = if let Some(i) = input {
        let prompt = match i.kind {
            InputKind::Filter => "filter (text or /regex/): ",
            InputKind::Breakpoint => "breakpoint (state= request= prefix= direction= entry=): ",
        };
        Line::from(vec![
            Span::styled(prompt, Style::new().fg(Color::Yellow)),
            Span::raw(i.text.clone()),
            Span::styled("█", Style::new().fg(Color::Gray)),
        ])
    } else if let Some(m) = message {
        let style = if m.error {
            Style::new().fg(Color::Red)
        } else {
            Style::new().fg(Color::Green)
        };
        Line::from(Span::styled(m.text.clone(), style))
    } else {
        let hints = match (ctx.detail, ctx.view, ctx.replay) {
            (true, _, _) => "Esc back · j/k scroll · b break on this request · ? help · q quit",
            (_, _, true) => {
                "Space play/pause · +/- speed · ←/→ seek 10s · ,/. step · Home/End · ? help · q quit"
            }
            (_, ViewId::Slots, _) => {
                "Enter detail · / filter · s sort · b break · Space freeze · ? help · q quit"
            }
            (_, ViewId::Breakpoints, _) => {
                "a add · d clear · r resume · R resume all · n step · ? help · q quit"
            }
            _ => "Tab/1-7 views · / filter · Enter detail · Space freeze · ? help · q quit",
        };
        Line::from(Span::styled(hints, Style::new().fg(Color::DarkGray)))
    };
    f.render_widget(Paragraph::new(line), area);
}

/// How many lines the help has in `ctx`.
pub fn help_lines(ctx: Context) -> u16 {
    keys::help(ctx)
        .iter()
        .map(|(_, rows)| rows.len() + 1)
        .sum::<usize>() as u16
}

/// Draws the help popup: the key table's bindings on in `ctx`, from line
/// `scroll` on when the terminal is too short for all of them.
pub fn help(f: &mut Frame, area: Rect, ctx: Context, scroll: u16) {
    let mut lines = Vec::new();
    for (title, rows) in keys::help(ctx) {
        lines.push(Line::from(Span::styled(title, head().fg(Color::Cyan))));
        for (k, text) in rows {
            lines.push(Line::from(vec![
                Span::styled(format!("  {k:<18}"), Style::new().fg(Color::Yellow)),
                Span::raw(text),
            ]));
        }
    }
    scrolled_popup(f, area, 76, lines, scroll, "Help — keys (Esc or ? closes");
}

/// Draws `lines` in a popup at most `w` wide over `area`, from line
/// `scroll` on when they do not all fit (the title then says which lines
/// show and how to scroll); `title` is closed with `)`. Lines are not
/// wrapped, so that scrolling counts what is on screen: a line wider than
/// the popup is cut; a scroll past the end shows the last lines.
pub fn scrolled_popup(
    f: &mut Frame,
    area: Rect,
    w: u16,
    lines: Vec<Line<'static>>,
    scroll: u16,
    title: &str,
) {
    let total = lines.len() as u16;
    let r = centered(area, w, total.saturating_add(2));
    let shown = r.height.saturating_sub(2);
    let scroll = scroll.min(total.saturating_sub(shown));
    let title = if shown < total {
        format!(
            "{title}; lines {}–{} of {total}, ↑↓ scroll)",
            scroll + 1,
            scroll + shown
        )
    } else {
        format!("{title})")
    };
    f.render_widget(Clear, r);
    f.render_widget(
        Paragraph::new(lines)
            .block(panel(&title))
            .scroll((scroll, 0)),
        r,
    );
}

/// Draws the warnings popup: the lints now, then the recent ones.
pub fn warnings(f: &mut Frame, area: Rect, model: &Model) {
    let m = model;
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
