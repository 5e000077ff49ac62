//! `compare A B`: two recordings side by side, each in the console's own
//! views, under a header with the deltas of `kvbm-recorder compare`'s
//! table (B against A).
//!
//! Keys go to both panes, so the two stay on the same view, filter and
//! place in their replays (`End` shows both at their ends); the mouse goes
//! to the pane under it. The header's metrics are computed once, from the
//! whole of each recording, by the same summary `kvbm-recorder compare`
//! gates on: the ones that differ first, the headline ones (hit ratio,
//! TTFT, requests) first among those.

use crate::app::App;
use crate::run::Screen;
use kvbm_events::Event;
use kvbm_recorder::analysis::compare::{Summary, fmt_delta, fmt_value};
use ratatui::Frame;
use ratatui::crossterm::event::{KeyEvent, MouseEvent};
use ratatui::layout::Rect;
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use std::collections::BTreeMap;
use std::time::Instant;

/// Header rows the metrics may take at most (one for every 8 rows of
/// the terminal, at least one); the rest are counted.
pub const MAX_METRIC_ROWS: u16 = 6;

/// The metrics a reader looks for first, in this order.
const HEADLINE: [&str; 7] = [
    "hit_ratio",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "requests",
    "finished",
    "prompt_tokens",
    "preemptions",
];

/// One metric of the header: its value in A and in B.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricRow {
    /// As `kvbm-recorder compare` names it.
    pub name: String,
    /// In A (0 where A lacks it, as the gates count it).
    pub a: f64,
    /// In B.
    pub b: f64,
}

impl MetricRow {
    /// `NAME A→B DELTA`, as the header shows it.
    pub fn text(&self) -> String {
        format!(
            "{} {}→{} {}",
            self.name,
            fmt_value(self.a),
            fmt_value(self.b),
            fmt_delta(self.a, self.b)
        )
    }
}

/// The header's rows for two recordings' events: every metric either
/// has, those that differ first, headline metrics first within each
/// group. A recording that cannot be summarised is an error naming it.
pub fn metric_rows(a: &[Event], b: &[Event]) -> Result<Vec<MetricRow>, String> {
    let summarise = |side: &str, ev: &[Event]| {
        Summary::from_events(ev)
            .map(|s| s.metrics())
            .map_err(|e| format!("{side} cannot be summarised: {e}"))
    };
    let (ma, mb) = (summarise("A", a)?, summarise("B", b)?);
    let mut names: Vec<&String> = ma.keys().chain(mb.keys()).collect();
    names.sort();
    names.dedup();
    let value = |m: &BTreeMap<String, f64>, n: &str| m.get(n).copied().unwrap_or(0.0);
    let mut rows: Vec<MetricRow> = names
        .into_iter()
        .map(|n| MetricRow {
            name: n.clone(),
            a: value(&ma, n),
            b: value(&mb, n),
        })
        .collect();
    let rank = |r: &MetricRow| {
        let headline = HEADLINE
            .iter()
            .position(|h| *h == r.name)
            .unwrap_or(HEADLINE.len());
        (r.a == r.b, headline)
    };
    // Stable: names stay alphabetical within a rank.
    rows.sort_by_key(rank);
    Ok(rows)
}

/// Two replays side by side under the deltas of their summaries.
pub struct Compare {
    /// A (left) and B (right).
    pub panes: [App; 2],
    rows: Result<Vec<MetricRow>, String>,
    size: Rect,
}

impl Compare {
    /// The two replays (apps on them) and the events each read.
    pub fn new(a: App, a_events: &[Event], b: App, b_events: &[Event]) -> Self {
        Compare {
            rows: metric_rows(a_events, b_events),
            panes: [a, b],
            size: Rect::default(),
        }
    }

    /// The header's metric rows (or why there are none).
    pub fn rows(&self) -> Result<&[MetricRow], &str> {
        self.rows.as_deref().map_err(String::as_str)
    }

    /// The header's lines at `width`: the title, then the metrics in as
    /// many columns as fit, at most [`MAX_METRIC_ROWS`] rows (fewer on a
    /// short terminal), the last cell saying how many did not fit.
    pub fn header_lines(&self, width: u16, height: u16) -> Vec<Line<'static>> {
        let bold = Style::default().add_modifier(Modifier::BOLD);
        let title = Line::from(vec![
            Span::styled(" kvbm  COMPARE ", bold),
            Span::raw(format!(
                " A: {}  │  B: {}  │ deltas B−A; keys go to both panes",
                self.panes[0].label, self.panes[1].label
            )),
        ]);
        let rows = match &self.rows {
            Ok(r) => r,
            Err(e) => {
                return vec![
                    title,
                    Line::styled(format!(" {e}"), Style::default().fg(Color::Red)),
                ];
            }
        };
        let texts: Vec<String> = rows.iter().map(MetricRow::text).collect();
        let cell = texts.iter().map(|t| t.chars().count()).max().unwrap_or(0) + 3;
        let cols = (usize::from(width).saturating_sub(1) / cell.max(1)).max(1);
        let fit = cols * usize::from((height / 8).clamp(1, MAX_METRIC_ROWS));
        let shown = if texts.len() > fit {
            fit - 1
        } else {
            texts.len()
        };
        let mut cells: Vec<(String, bool)> = texts
            .iter()
            .zip(rows)
            .take(shown)
            .map(|(t, r)| (t.clone(), r.a != r.b))
            .collect();
        if shown < texts.len() {
            cells.push((
                format!("… {} more (kvbm-recorder compare)", texts.len() - shown),
                false,
            ));
        }
        let mut lines = vec![title];
        for chunk in cells.chunks(cols) {
            let mut spans = vec![Span::raw(" ")];
            for (t, differs) in chunk {
                let style = if *differs {
                    Style::default().fg(Color::Yellow)
                } else {
                    Style::default().fg(Color::DarkGray)
                };
                spans.push(Span::styled(format!("{t:<cell$}"), style));
            }
            lines.push(Line::from(spans));
        }
        lines
    }

    /// The header's height and each pane's area at `size`.
    fn layout(&self, size: Rect) -> (Rect, [Rect; 2]) {
        let h = (self.header_lines(size.width, size.height).len() as u16).min(size.height);
        let header = Rect::new(size.x, size.y, size.width, h);
        let below = size.height - h;
        let left_w = size.width / 2;
        // One column between the panes for the divider.
        let right_w = size.width.saturating_sub(left_w + 1);
        let left = Rect::new(size.x, size.y + h, left_w, below);
        let right = Rect::new(size.x + left_w + 1, size.y + h, right_w, below);
        (header, [left, right])
    }
}

impl Screen for Compare {
    fn key(&mut self, ev: KeyEvent) {
        for p in &mut self.panes {
            p.key(ev);
        }
    }

    fn mouse(&mut self, mut ev: MouseEvent) {
        let (_, areas) = self.layout(self.size);
        for (p, a) in self.panes.iter_mut().zip(areas) {
            if ev.column >= a.x && ev.column < a.right() && ev.row >= a.y && ev.row < a.bottom() {
                ev.column -= a.x;
                ev.row -= a.y;
                p.mouse(ev);
                return;
            }
        }
    }

    fn resize(&mut self, width: u16, height: u16) {
        self.size = Rect::new(0, 0, width, height);
        let (_, areas) = self.layout(self.size);
        for (p, a) in self.panes.iter_mut().zip(areas) {
            p.resize(a.width, a.height);
        }
    }

    fn pull(&mut self, now: Instant) -> usize {
        self.panes.iter_mut().map(|p| p.pull(now)).sum()
    }

    fn tick(&mut self) {
        for p in &mut self.panes {
            p.tick();
        }
    }

    fn render(&self, f: &mut Frame) {
        let (header, areas) = self.layout(f.area());
        let lines = self.header_lines(header.width, f.area().height);
        f.render_widget(Paragraph::new(lines), header);
        for (p, a) in self.panes.iter().zip(areas) {
            p.render_in(f, a);
        }
        let divider = Rect::new(areas[0].right(), areas[0].y, 1, areas[0].height);
        if divider.x < f.area().right() {
            let bar: Vec<Line> = (0..divider.height).map(|_| Line::raw("│")).collect();
            f.render_widget(Paragraph::new(bar), divider);
        }
    }

    fn quitting(&self) -> bool {
        self.panes.iter().any(|p| p.quit)
    }

    fn quit(&mut self) {
        for p in &mut self.panes {
            p.quit = true;
        }
    }
}
