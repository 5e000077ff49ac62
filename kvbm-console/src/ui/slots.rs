//! The slots view: one row per request, filtered and sorted; the
//! selection follows its request when the rows re-sort.

use super::columns::{self, Col, GridRow};
use super::filter::{Filter, passes};
use super::list::ListState;
use super::{View, dim, head, panel, selected, state_color};
use crate::fmt;
use crate::model::Model;
use kvbm_events::RequestId;
use kvbm_events::reducer::SlotView;
use kvbm_events::slot::SlotState;
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::style::Style;
use ratatui::widgets::Paragraph;

/// Terminals at least this wide get a column per tier.
const WIDE: u16 = 120;

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

/// The slots view's state; see the module docs.
#[derive(Debug, Clone)]
pub struct Slots {
    /// The requests shown, filtered and sorted (their slots are looked up
    /// when drawn: only the visible ones).
    rows: Vec<RequestId>,
    list: ListState,
    /// The selected request, followed across re-sorts.
    selected: Option<RequestId>,
    sort: SlotSort,
    reverse: bool,
    filter: Option<Filter>,
    no_slots_reason: Option<String>,
}

impl Slots {
    /// No rows yet; `no_slots_reason` (when given) replaces "no requests
    /// yet" for a source that has no per-request slots.
    pub fn new(no_slots_reason: Option<String>) -> Self {
        Slots {
            rows: Vec::new(),
            list: ListState::default(),
            selected: None,
            sort: SlotSort::State,
            reverse: false,
            filter: None,
            no_slots_reason,
        }
    }

    /// Filters the rows from the next update on.
    pub fn set_filter(&mut self, filter: Option<Filter>) {
        self.filter = filter;
    }

    /// Sorts by the next column; returns it.
    pub fn next_sort(&mut self) -> SlotSort {
        self.sort = self.sort.next();
        self.sort
    }

    /// Reverses the sort.
    pub fn toggle_reverse(&mut self) {
        self.reverse = !self.reverse;
    }

    /// The sort column.
    pub fn sort(&self) -> SlotSort {
        self.sort
    }

    /// The requests shown, in order.
    pub fn rows(&self) -> &[RequestId] {
        &self.rows
    }

    /// The selected request.
    pub fn selected(&self) -> Option<&RequestId> {
        self.selected.as_ref()
    }

    fn remember_selection(&mut self) {
        self.selected = self.rows.get(self.list.selected).cloned();
    }
}

impl View for Slots {
    fn update(&mut self, model: &Model) {
        let state = model.state();
        let mut rows: Vec<&SlotView> = state
            .slots()
            .filter(|s| passes(self.filter.as_ref(), &[&s.request, s.state.name()]))
            .collect();
        let state_rank = |s: &SlotView| {
            SlotState::NAMES
                .iter()
                .position(|n| *n == s.state.name())
                .unwrap_or(0)
        };
        // Ties fall back to age, then id, so equal rows keep their order
        // from one update to the next (slots come out of a hash map).
        let key = |s: &SlotView| (s.created_ns, s.request.clone());
        match self.sort {
            SlotSort::State => rows.sort_by_cached_key(|s| (state_rank(s), key(s))),
            SlotSort::Request => rows.sort_by(|a, b| a.request.cmp(&b.request)),
            SlotSort::Age => rows.sort_by_cached_key(|s| key(s)),
            SlotSort::Prompt => {
                rows.sort_by_cached_key(|s| (std::cmp::Reverse(s.prompt_tokens), key(s)))
            }
            SlotSort::Generated => {
                rows.sort_by_cached_key(|s| (std::cmp::Reverse(s.generated), key(s)))
            }
            SlotSort::Blocks => {
                rows.sort_by_cached_key(|s| (std::cmp::Reverse(s.blocks[0]), key(s)))
            }
            SlotSort::Hits => {
                rows.sort_by_cached_key(|s| (std::cmp::Reverse(s.total_hit_tokens()), key(s)))
            }
            SlotSort::Outstanding => {
                rows.sort_by_cached_key(|s| (std::cmp::Reverse(s.outstanding), key(s)))
            }
        }
        if self.reverse {
            rows.reverse();
        }
        self.rows.clear();
        self.rows
            .extend(rows.into_iter().map(|s| s.request.clone()));
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

    fn moved(&mut self, delta: isize, visible: usize) {
        self.list.moved(delta, self.rows.len(), visible);
        self.remember_selection();
    }

    fn select(&mut self, row: usize, visible: usize) {
        self.list.select(row, self.rows.len(), visible);
        self.remember_selection();
    }

    /// Keeps the selection on the same request after a re-sort (or in
    /// range when it is gone).
    fn settle(&mut self, visible: usize) {
        let len = self.rows.len();
        let pos = self
            .selected
            .as_ref()
            .and_then(|id| self.rows.iter().position(|r| r == id));
        self.list.selected = pos.unwrap_or_else(|| self.list.selected.min(len.saturating_sub(1)));
        self.list.offset = self.list.offset_for(len, visible);
        self.remember_selection();
    }

    fn selected_request(&self, _model: &Model) -> Option<RequestId> {
        self.selected.clone()
    }

    fn draw(&self, model: &Model, f: &mut Frame, area: Rect) {
        let wide = area.width >= WIDE;
        let visible = area.height.saturating_sub(3) as usize;
        let list = &self.list;
        let off = list.offset_for(self.rows.len(), visible);
        let now = model.now_ns();
        let state = model.state();
        let sort = format!(
            "sorted by {}{}",
            self.sort.name(),
            if self.reverse { " (reversed)" } else { "" }
        );
        let title = format!(
            "Slots — {} shown{} · {} · pruned {}",
            self.rows.len(),
            self.filter
                .as_ref()
                .map_or(String::new(), |f| format!(" matching `{}`", f.text)),
            sort,
            state.pruned_slots()
        );
        let block = panel(title);
        if self.rows.is_empty() {
            let msg = if let Some(why) = &self.no_slots_reason {
                why.as_str()
            } else if self.filter.is_some() {
                "no request matches the filter (Esc clears it)"
            } else {
                "no requests yet"
            };
            f.render_widget(Paragraph::new(format!("  {msg}")).block(block), area);
            return;
        }
        let rows: Vec<GridRow> = self
            .rows
            .iter()
            .enumerate()
            .skip(off)
            .take(visible)
            .filter_map(|(i, id)| {
                let r = row(state.slot(id)?, now, wide);
                Some(if i == list.selected {
                    r.style(selected())
                } else {
                    r
                })
            })
            .collect();
        let cols: &[Col] = if wide { &WIDE_COLS } else { &NARROW_COLS };
        let inner = area.width.saturating_sub(2);
        let widths = columns::fit(cols, &rows, inner);
        f.render_widget(columns::table(cols, &widths, rows, head(), block), area);
    }
}

/// Columns on terminals at least [`WIDE`] wide: one per tier.
const WIDE_COLS: [Col; 14] = [
    Col::text("Request", 7, 40),
    Col::text("State", 8, 17),
    Col::num("Age", 3, 8),
    Col::num("Prompt", 6, 7),
    Col::num("Gen", 3, 6),
    Col::num("G1", 2, 6),
    Col::num("G2", 2, 6),
    Col::num("G3", 2, 6),
    Col::num("Hit G1", 6, 7),
    Col::num("Hit G2", 6, 7),
    Col::num("Hit G3", 6, 7),
    // Another connector's (kvbm beside it in vLLM's MultiConnector).
    Col::num("Hit ext", 7, 7),
    Col::num("Xfer", 4, 5),
    Col::num("TTFT", 4, 8),
];

/// Columns on narrower terminals: the tiers together.
const NARROW_COLS: [Col; 8] = [
    Col::text("Request", 7, 24),
    Col::text("State", 8, 17),
    Col::num("Age", 3, 8),
    Col::num("Prompt", 6, 7),
    Col::num("Gen", 3, 5),
    Col::text("G1/G2/G3", 8, 14),
    Col::num("Hit", 3, 7),
    Col::num("Xfer", 4, 5),
];

fn row(s: &SlotView, now: u64, wide: bool) -> GridRow {
    let age = now.saturating_sub(s.created_ns);
    let plain = |t: String| (t, Style::new());
    let mut cells = vec![
        plain(s.request.to_string()),
        (s.state.to_string(), Style::new().fg(state_color(&s.state))),
        plain(fmt::dur(age)),
        plain(s.prompt_tokens.to_string()),
        plain(s.generated.to_string()),
    ];
    if wide {
        cells.extend(s.blocks.iter().map(|b| plain(b.to_string())));
        cells.extend(s.hit_tokens.iter().map(|h| plain(h.to_string())));
        cells.push(plain(s.external_tokens.to_string()));
        cells.push(plain(s.outstanding.to_string()));
        cells.push(plain(s.ttft_ns().map_or("-".into(), fmt::dur)));
    } else {
        cells.push(plain(format!(
            "{}/{}/{}",
            s.blocks[0], s.blocks[1], s.blocks[2]
        )));
        cells.push(plain(s.total_hit_tokens().to_string()));
        cells.push(plain(s.outstanding.to_string()));
    }
    let r = GridRow {
        cells,
        style: Style::new(),
    };
    if s.is_finished() {
        r.style(dim(Style::new()))
    } else {
        r
    }
}
