//! One request: its states as a horizontal timeline, its transfers as
//! spans beneath, and its own events.

use super::columns::{self, Col, GridRow};
use super::list::ListState;
use super::{View, head, panel, selected, state_color};
use crate::fmt;
use crate::model::{History, Model};
use kvbm_events::reducer::SlotView;
use kvbm_events::slot::SlotState;
use kvbm_events::{Event, EventKind, RequestId};
use kvbm_recorder::analysis::capacity::Lookup;
use kvbm_recorder::analysis::capacity::reasons::KEEP_LOOKUPS;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use std::collections::VecDeque;

/// Transfer spans drawn at most.
const MAX_SPANS: usize = 6;
/// Lookups explained at most (the first, and the latest after it).
const MAX_LOOKUPS: usize = 2;
/// The summary panel: two lines of state, the lookups, the border.
const INFO_HEIGHT: u16 = 4 + MAX_LOOKUPS as u16;

/// One lookup, explained: what each tier hit and why it stopped.
pub fn lookup_line(n: usize, l: &Lookup) -> String {
    format!(
        "lookup {n}{}: {}",
        if l.first { "" } else { " (again)" },
        explain(l)
    )
}

/// What a lookup hit in each tier, why it stopped, and what its missed
/// tokens were.
fn explain(l: &Lookup) -> String {
    let hits = format!(
        "hit G1 {} G2 {} G3 {} of {} blocks",
        l.hit_blocks[0], l.hit_blocks[1], l.hit_blocks[2], l.matchable_blocks
    );
    let why = match &l.stopped {
        None => "every block it could hit".to_string(),
        Some(r) => format!("stopped: {r}"),
    };
    let t = &l.totals;
    let misses: Vec<String> = t
        .reasons()
        .iter()
        .filter(|(_, v)| *v > 0)
        .map(|(name, v)| format!("{name} {v}"))
        .collect();
    format!(
        "{hits}; {why}{}",
        if misses.is_empty() {
            String::new()
        } else {
            format!(" · missed tokens: {}", misses.join(", "))
        }
    )
}

/// The explanation of each lookup among `events` (the request's events,
/// oldest first), matched to `lookups` (oldest first) by time; `None` for
/// other events. The engine emits `PrefixLookup` once, at a request's
/// first lookup: a later lookup (after a preemption) starts with a
/// `MatchResult`, and is explained in that row. A first lookup older than
/// those the analysis keeps ([`KEEP_LOOKUPS`] a request) says so; a later
/// one that old is not told apart from the `MatchResult`s around it.
fn explained_rows(events: &[&Event], lookups: &[Lookup]) -> Vec<Option<String>> {
    let mut next = 0;
    events
        .iter()
        .map(|e| {
            while lookups.get(next).is_some_and(|l| l.ts_ns < e.ts_ns) {
                next += 1;
            }
            let here = lookups.get(next).filter(|l| l.ts_ns == e.ts_ns);
            match &e.kind {
                EventKind::PrefixLookup { tokens, .. } => Some(match here {
                    Some(l) => {
                        next += 1;
                        format!("{tokens} tokens: {}", explain(l))
                    }
                    None => format!(
                        "{tokens} tokens (its explanation is no longer kept: the latest {KEEP_LOOKUPS} of a request are)"
                    ),
                }),
                EventKind::MatchResult { .. } => here.filter(|l| !l.first).map(|l| {
                    next += 1;
                    format!("looked up again: {}", explain(l))
                }),
                _ => None,
            }
        })
        .collect()
}

/// The event list's area inside the view's body.
pub fn list_area(body: Rect) -> Rect {
    let [_, _, list] = Layout::vertical([
        Constraint::Length(INFO_HEIGHT),
        Constraint::Length(4 + MAX_SPANS as u16),
        Constraint::Min(3),
    ])
    .areas(body);
    // Inside the border.
    Rect::new(
        list.x + 1,
        list.y + 1,
        list.width.saturating_sub(2),
        list.height.saturating_sub(2),
    )
}

/// Indices into the history of `request`'s events, oldest first, from
/// index `from` on. The history is in time order, so the scan starts no
/// earlier than the slot's creation.
fn scan_events_of(model: &Model, request: &str, from: usize) -> Vec<usize> {
    let h = model.history();
    let from_ns = model.state().slot(request).map_or(0, |s| s.created_ns);
    // Binary search on time over the history's indices.
    let (mut lo, mut hi) = (from, h.len().max(from));
    while lo < hi {
        let mid = (lo + hi) / 2;
        if h.get(mid).is_some_and(|e| e.ts_ns < from_ns) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    (lo..h.len())
        .filter(|&i| h.get(i).and_then(|e| e.request.as_deref()) == Some(request))
        .collect()
}

/// The detail of one request. Its rows are the request's events, found
/// incrementally: it keeps their absolute positions (events dropped from
/// the history's front before them + their index, so drops do not shift
/// them) and, while the history only grows, scans just the new events.
#[derive(Debug, Clone)]
pub struct Detail {
    request: RequestId,
    /// Absolute position the last scan reached.
    end: u64,
    /// Absolute positions of the request's events, oldest first.
    positions: VecDeque<u64>,
    /// Indices into the history of those still held.
    rows: Vec<usize>,
    list: ListState,
}

impl Detail {
    /// The detail of `request`, not yet scanned.
    pub fn new(request: RequestId) -> Self {
        Detail {
            request,
            end: 0,
            positions: VecDeque::new(),
            rows: Vec::new(),
            list: ListState::default(),
        }
    }

    /// The request.
    pub fn request(&self) -> &RequestId {
        &self.request
    }

    /// Brings the positions up to date with `history`: only the new events
    /// are scanned while the history just grew; after it went back (a
    /// replay's seek) everything is scanned again.
    fn rescan(&mut self, model: &Model) {
        let h: &History = model.history();
        let (base, end) = (h.dropped(), h.dropped() + h.len() as u64);
        if self.end <= end && self.end >= base {
            while self.positions.front().is_some_and(|&p| p < base) {
                self.positions.pop_front();
            }
        } else {
            self.end = base;
            self.positions.clear();
        }
        let from = (self.end - base) as usize;
        self.positions.extend(
            scan_events_of(model, &self.request, from)
                .into_iter()
                .map(|i| base + i as u64),
        );
        self.end = end;
    }
}

impl View for Detail {
    fn update(&mut self, model: &Model) {
        self.rescan(model);
        let base = model.history().dropped();
        self.rows.clear();
        self.rows.extend(
            self.positions
                .iter()
                .filter(|&&p| p >= base)
                .map(|&p| (p - base) as usize),
        );
    }

    fn row_count(&self) -> usize {
        self.rows.len()
    }

    fn list(&self) -> &ListState {
        &self.list
    }

    fn list_mut(&mut self) -> &mut ListState {
        &mut self.list
    }

    fn visible_rows(&self, body: Rect) -> usize {
        list_area(body).height.saturating_sub(1) as usize
    }

    fn rows_area(&self, body: Rect) -> Option<Rect> {
        let a = list_area(body);
        Some(Rect::new(a.x, a.y + 1, a.width, a.height.saturating_sub(1)))
    }

    fn selected_request(&self, _model: &Model) -> Option<RequestId> {
        Some(self.request.clone())
    }

    fn draw(&self, model: &Model, f: &mut Frame, area: Rect) {
        let [info_a, time_a, list_a] = Layout::vertical([
            Constraint::Length(INFO_HEIGHT),
            Constraint::Length(4 + MAX_SPANS as u16),
            Constraint::Min(3),
        ])
        .areas(area);
        let request: &str = &self.request;
        let slot = model.state().slot(request);
        let now = model.now_ns();
        let h = model.history();
        let evs: Vec<&Event> = self.rows.iter().filter_map(|&i| h.get(i)).collect();
        let lookups = model.capacity().request_lookups(request);

        // Summary.
        f.render_widget(
            Paragraph::new(summary(slot, &lookups, now)).block(panel(format!("Request {request}"))),
            info_a,
        );

        // Timeline.
        draw_timeline(f, time_a, slot, &evs, now);

        // Events.
        self.draw_events(f, area, list_a, &evs, &lookups);
    }
}

impl Detail {
    /// The request's event list, one row each, the selected row marked and
    /// a lookup's row explained by that lookup.
    fn draw_events(
        &self,
        f: &mut Frame,
        area: Rect,
        list_a: Rect,
        evs: &[&Event],
        lookups: &[Lookup],
    ) {
        let request: &str = &self.request;
        let inner = list_area(area);
        let visible = inner.height.saturating_sub(1) as usize;
        let l = &self.list;
        let off = l.offset_for(evs.len(), visible);
        let explained = explained_rows(evs, lookups);
        let rows: Vec<GridRow> = evs
            .iter()
            .zip(explained)
            .enumerate()
            .skip(off)
            .take(visible)
            .map(|(i, (e, why))| {
                let r = GridRow::plain([
                    e.seq.to_string(),
                    fmt::clock(e.ts_ns),
                    e.kind.name().to_string(),
                    why.unwrap_or_else(|| super::events::describe(&e.kind)),
                ]);
                if i == l.selected {
                    r.style(selected())
                } else {
                    r
                }
            })
            .collect();
        let widths = columns::fit(&EVENT_COLS, &rows, list_a.width.saturating_sub(2));
        let table = columns::table(
            &EVENT_COLS,
            &widths,
            rows,
            head(),
            panel(format!("Events of {request} ({})", evs.len())),
        );
        f.render_widget(table, list_a);
    }
}

/// The summary panel's lines: the request's state, ages, tokens and
/// blocks (or why it is not tracked), then its first and latest lookups.
fn summary(slot: Option<&SlotView>, lookups: &[Lookup], now: u64) -> Vec<Line<'static>> {
    let mut info = match slot {
        Some(s) => vec![
            Line::from(vec![
                Span::styled(s.state.to_string(), Style::new().fg(state_color(&s.state))),
                Span::raw(format!(
                    "  age {} · in state {} · prompt {} · computed {} · generated {}/{}",
                    fmt::dur(now.saturating_sub(s.created_ns)),
                    fmt::dur(now.saturating_sub(s.state_since_ns)),
                    s.prompt_tokens,
                    s.computed,
                    s.generated,
                    s.max_output_tokens
                )),
            ]),
            Line::from(format!(
                "blocks G1 {} G2 {} G3 {} · cached tokens hit G1 {} G2 {} G3 {}{} · outstanding {} · TTFT {}",
                s.blocks[0],
                s.blocks[1],
                s.blocks[2],
                s.hit_tokens[0],
                s.hit_tokens[1],
                s.hit_tokens[2],
                // Only where another connector (vLLM's MultiConnector)
                // provided some: most engines have none.
                if s.external_tokens > 0 {
                    format!(" external (other connector) {}", s.external_tokens)
                } else {
                    String::new()
                },
                s.outstanding,
                s.ttft_ns().map_or("-".into(), fmt::dur)
            )),
        ],
        None => vec![Line::from(Span::styled(
            "no longer tracked (pruned after finishing, or not seen yet); its events follow",
            Style::new().fg(Color::DarkGray),
        ))],
    };
    // Why its lookups missed: the first, and the latest after it, here;
    // every one in its row of the event list below.
    let shown: Vec<(usize, &Lookup)> = match lookups.len() {
        0 => Vec::new(),
        1 => vec![(1, &lookups[0])],
        n => vec![(1, &lookups[0]), (n, &lookups[n - 1])],
    };
    if shown.is_empty() {
        info.push(Line::from(Span::styled(
            "no lookup recorded",
            Style::new().fg(Color::DarkGray),
        )));
    }
    for (n, l) in shown {
        info.push(Line::from(Span::styled(
            lookup_line(n, l),
            Style::new().fg(if l.stopped.is_some() {
                Color::Yellow
            } else {
                Color::Green
            }),
        )));
    }
    info
}

/// The timeline panel: the request's states as one bar with a legend, its
/// transfers as spans beneath, on one time axis.
fn draw_timeline(f: &mut Frame, time_a: Rect, slot: Option<&SlotView>, evs: &[&Event], now: u64) {
    let inner_w = time_a.width.saturating_sub(2) as usize;
    let mut lines = Vec::new();
    let t0 = slot
        .map(|s| s.created_ns)
        .or(evs.first().map(|e| e.ts_ns))
        .unwrap_or(now);
    let sp = spans(evs);
    // The axis runs to the end of the request, or of its last transfer
    // (offloads can outlive a finished request), or to now.
    let end = slot
        .filter(|s| s.is_finished())
        .map(|s| s.state_since_ns)
        .unwrap_or(now)
        .max(sp.iter().map(|s| s.end.unwrap_or(now)).max().unwrap_or(0))
        .max(t0 + 1);
    if let Some(s) = slot {
        let mut bar: Vec<Span> = Vec::new();
        let mut drawn = 0usize;
        for (a, b, state) in s.intervals(end) {
            let to = if state == SlotState::Finished {
                inner_w
            } else {
                col(b, t0, end, inner_w).max(drawn)
            };
            let to = to.max(col(a, t0, end, inner_w) + 1).min(inner_w);
            if to > drawn {
                bar.push(Span::styled(
                    "█".repeat(to - drawn),
                    Style::new().fg(state_color(&state)),
                ));
                drawn = to;
            }
        }
        lines.push(Line::from(bar));
        let legend: Vec<Span> = s
            .intervals(end)
            .flat_map(|(a, b, state)| {
                [
                    Span::styled("■ ", Style::new().fg(state_color(&state))),
                    Span::raw(format!("{} {}  ", state.name(), fmt::dur(b - a))),
                ]
            })
            .collect();
        lines.push(Line::from(legend));
        if s.history_dropped > 0 {
            lines.push(Line::from(Span::styled(
                format!("({} earlier states not kept)", s.history_dropped),
                Style::new().fg(Color::Red),
            )));
        }
    }
    if sp.is_empty() {
        lines.push(Line::from(Span::styled(
            "no transfers",
            Style::new().fg(Color::DarkGray),
        )));
    }
    let hidden = sp.len().saturating_sub(MAX_SPANS);
    for s in sp.iter().skip(hidden) {
        let a = col(s.start, t0, end, inner_w);
        let b = col(s.end.unwrap_or(now), t0, end, inner_w)
            .max(a + 1)
            .min(inner_w);
        let color = match s.status {
            "completed" => Color::Green,
            "skipped" | "cancelled" => Color::DarkGray,
            "failed" => Color::Red,
            _ => Color::Cyan,
        };
        let label = format!(" {} {}", s.label, s.status);
        let bar = Span::styled("━".repeat(b - a), Style::new().fg(color));
        let width = label.chars().count();
        let line = if b + width > inner_w && a > width {
            // No room on the right: the label goes on the left of the span.
            vec![
                Span::raw(" ".repeat(a - width - 1)),
                Span::raw(label),
                Span::raw(" "),
                bar,
            ]
        } else {
            // Otherwise on the right, clipped at the border if need be.
            vec![Span::raw(" ".repeat(a)), bar, Span::raw(label)]
        };
        lines.push(Line::from(line));
    }
    let title = format!(
        "Timeline from {} for {}{}",
        fmt::clock(t0),
        fmt::dur(end - t0),
        if hidden > 0 {
            format!(" · {hidden} earlier transfers not drawn")
        } else {
            String::new()
        }
    );
    f.render_widget(Paragraph::new(lines).block(panel(title)), time_a);
}

const EVENT_COLS: [Col; 4] = [
    Col::num("Seq", 3, 12),
    Col::text("Time", 4, 24),
    Col::text("Kind", 4, 24),
    Col::text("Detail", 6, u16::MAX),
];

/// A transfer of this request as a span on the timeline.
struct Span_ {
    id: u64,
    label: String,
    start: u64,
    end: Option<u64>,
    status: &'static str,
}

fn spans(events: &[&Event]) -> Vec<Span_> {
    let mut out: Vec<Span_> = Vec::new();
    for e in events {
        let (id, status) = match &e.kind {
            EventKind::TransferPlanned {
                transfer,
                direction,
                blocks,
            } => {
                out.push(Span_ {
                    id: *transfer,
                    label: format!("#{transfer} {direction} {blocks} blk"),
                    start: e.ts_ns,
                    end: None,
                    status: "planned",
                });
                continue;
            }
            EventKind::TransferPromoted { transfer, .. } => (*transfer, "promoted"),
            EventKind::TransferCompleted { transfer, .. } => (*transfer, "completed"),
            EventKind::TransferSkipped { transfer, .. } => (*transfer, "skipped"),
            EventKind::TransferCancelled { transfer, .. } => (*transfer, "cancelled"),
            EventKind::TransferFailed { transfer, .. } => (*transfer, "failed"),
            _ => continue,
        };
        if let Some(s) = out.iter_mut().rev().find(|s| s.id == id) {
            s.status = status;
            if status != "promoted" {
                s.end = Some(e.ts_ns);
            }
        }
    }
    out
}

fn col(t: u64, t0: u64, t1: u64, width: usize) -> usize {
    if t1 <= t0 || width == 0 {
        return 0;
    }
    (((t.saturating_sub(t0)) as f64 / (t1 - t0) as f64) * width as f64).min(width as f64 - 1.0)
        as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::hash::SequenceHash;
    use kvbm_recorder::analysis::capacity::ReasonTotals;

    fn lookup_event(seq: u64, ts_ns: u64) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns,
            iteration: 0,
            request: Some("r".into()),
            kind: EventKind::PrefixLookup {
                tokens: 100 + seq as u32,
                block_size: 16,
                computed_blocks: 0,
                hashes: vec![SequenceHash(1), SequenceHash(2), SequenceHash(3)],
            },
        }
    }

    fn lookup(ts_ns: u64, g1: u32) -> Lookup {
        Lookup {
            ts_ns,
            first: ts_ns == 10,
            hit_blocks: [g1, 0, 0],
            matchable_blocks: 3,
            stopped: None,
            totals: ReasonTotals::default(),
        }
    }

    /// A later lookup (after a preemption) has no `PrefixLookup` of its
    /// own: it is explained in the `MatchResult` row that starts it, and
    /// the `MatchResult`s of the first lookup and the rest of the later
    /// one keep their own description.
    #[test]
    fn a_later_lookup_is_explained_in_the_match_result_that_starts_it() {
        let matched = |seq: u64, ts_ns: u64| Event {
            kind: EventKind::MatchResult {
                tier: kvbm_events::Tier::Host,
                looked_up: 3,
                hit_blocks: 1,
                hit_tokens: 16,
            },
            ..lookup_event(seq, ts_ns)
        };
        let events = [
            lookup_event(0, 10),
            matched(1, 10),
            matched(2, 50),
            matched(3, 50),
        ];
        let mut later = lookup(50, 2);
        later.first = false;
        let refs: Vec<&Event> = events.iter().collect();
        let rows = explained_rows(&refs, &[lookup(10, 0), later]);
        assert!(
            rows[0].as_deref().unwrap().contains("hit G1 0 G2 0"),
            "{rows:?}"
        );
        assert_eq!(rows[1], None, "{rows:?}");
        let again = rows[2].as_deref().unwrap();
        assert!(
            again.starts_with("looked up again: hit G1 2 G2 0"),
            "{again}"
        );
        assert_eq!(rows[3], None, "{rows:?}");
    }

    /// Every lookup event gets its own explanation, matched by time (not
    /// the first or the latest for all); other events get none; a lookup
    /// the analysis no longer keeps says so.
    #[test]
    fn each_lookup_row_is_explained_by_its_own_lookup() {
        let mut events: Vec<Event> = (0..12).map(|i| lookup_event(i, 10 * (i + 1))).collect();
        events.insert(
            3,
            Event {
                kind: EventKind::TokensScheduled {
                    prefill: 1,
                    decode: 0,
                    computed: 0,
                },
                ..lookup_event(99, 35)
            },
        );
        // The analysis kept the latest 8 of the 12, each with its own hits.
        let kept: Vec<Lookup> = (4..12).map(|i| lookup(10 * (i + 1), i as u32)).collect();
        let refs: Vec<&Event> = events.iter().collect();
        let rows = explained_rows(&refs, &kept);
        assert_eq!(rows.len(), 13);
        assert_eq!(rows[3], None, "not a lookup");
        for (row, e) in rows.iter().zip(&events) {
            let EventKind::PrefixLookup { tokens, .. } = e.kind else {
                continue;
            };
            let row = row.as_deref().unwrap();
            assert!(row.starts_with(&format!("{tokens} tokens")), "{row}");
            let i = e.seq;
            if i < 4 {
                assert!(row.contains("no longer kept"), "{row}");
            } else {
                assert!(
                    row.contains(&format!("hit G1 {i} G2 0 G3 0 of 3 blocks")),
                    "{row}"
                );
            }
        }
    }
}
