//! Tables whose columns are as wide as what they hold.
//!
//! A column is as wide as its header or its longest visible cell, within
//! its own minimum and maximum; when the columns do not fit, the ones with
//! the most room above their minimum give it up first, and a cell wider
//! than its column ends in `…`. Space left over stays at the right rather
//! than stretching a column (an id column 60 characters wide for `syn-36`
//! only makes rows hard to follow). Numbers are right-aligned.

use ratatui::layout::{Constraint, Rect};
use ratatui::style::Style;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Cell, Row, Table};
use unicode_width::UnicodeWidthStr;

/// Gap between columns.
pub const GAP: u16 = 1;

/// How a column's cells line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// One column: its header and its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Col {
    /// Header.
    pub title: &'static str,
    /// Never narrower than this (when the screen allows).
    pub min: u16,
    /// Never wider than this.
    pub max: u16,
    /// Alignment.
    pub align: Align,
}

impl Col {
    /// A text column.
    pub const fn text(title: &'static str, min: u16, max: u16) -> Col {
        Col {
            title,
            min,
            max,
            align: Align::Left,
        }
    }

    /// A number column.
    pub const fn num(title: &'static str, min: u16, max: u16) -> Col {
        Col {
            title,
            min,
            max,
            align: Align::Right,
        }
    }
}

/// One row: its cells (text and style) and the row's own style.
#[derive(Debug, Clone, Default)]
pub struct GridRow {
    /// One per column.
    pub cells: Vec<(String, Style)>,
    /// The whole row's style (selection, dimming).
    pub style: Style,
}

impl GridRow {
    /// Plain cells.
    pub fn plain(cells: impl IntoIterator<Item = String>) -> Self {
        GridRow {
            cells: cells.into_iter().map(|c| (c, Style::new())).collect(),
            style: Style::new(),
        }
    }

    /// Sets the row's style.
    pub fn style(mut self, style: Style) -> Self {
        self.style = style;
        self
    }
}

/// Display width of `s` in terminal columns.
pub fn width_of(s: &str) -> u16 {
    u16::try_from(s.width()).unwrap_or(u16::MAX)
}

/// Column widths for `rows` (any number of tables that should line up)
/// within `avail` columns. See the module doc.
pub fn fit<'a>(cols: &[Col], rows: impl IntoIterator<Item = &'a GridRow>, avail: u16) -> Vec<u16> {
    let mut w: Vec<u16> = cols.iter().map(|c| width_of(c.title)).collect();
    for r in rows {
        for (i, (text, _)) in r.cells.iter().enumerate().take(cols.len()) {
            w[i] = w[i].max(width_of(text));
        }
    }
    for (w, c) in w.iter_mut().zip(cols) {
        *w = (*w).clamp(c.min.min(c.max), c.max);
    }
    let gaps = GAP.saturating_mul(cols.len().saturating_sub(1) as u16);
    let mut total: u32 = w.iter().map(|&x| u32::from(x)).sum::<u32>() + u32::from(gaps);
    // Too wide: take a column at a time from the one with the most room
    // above its minimum, so wide columns shrink before narrow ones.
    while total > u32::from(avail) {
        let Some((i, _)) = w
            .iter()
            .zip(cols)
            .enumerate()
            .map(|(i, (&x, c))| (i, x.saturating_sub(c.min)))
            .filter(|&(_, room)| room > 0)
            .max_by_key(|&(i, room)| (room, std::cmp::Reverse(i)))
        else {
            break;
        };
        w[i] -= 1;
        total -= 1;
    }
    w
}

/// `s` cut to `width` columns, ending in `…` when it was cut.
pub fn clip(s: &str, width: u16) -> String {
    if width_of(s) <= width {
        return s.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut out = String::new();
    let mut used = 0u16;
    for ch in s.chars() {
        let cw = width_of(ch.encode_utf8(&mut [0; 4]));
        if used + cw > width - 1 {
            break;
        }
        out.push(ch);
        used += cw;
    }
    out.push('…');
    out
}

/// A table of `rows` under `cols` with widths `widths` (from [`fit`]),
/// header styled `head`, in `block`.
pub fn table<'a>(
    cols: &[Col],
    widths: &[u16],
    rows: Vec<GridRow>,
    head: Style,
    block: Block<'a>,
) -> Table<'a> {
    let cell = |text: &str, style: Style, c: &Col, w: u16| {
        let line = Line::from(Span::styled(clip(text, w), style));
        Cell::from(match c.align {
            Align::Left => line,
            Align::Right => line.right_aligned(),
        })
    };
    let header = Row::new(
        cols.iter()
            .zip(widths)
            .map(|(c, &w)| cell(c.title, Style::new(), c, w)),
    )
    .style(head);
    let body: Vec<Row> = rows
        .into_iter()
        .map(|r| {
            Row::new(
                r.cells
                    .iter()
                    .zip(cols.iter().zip(widths))
                    .map(|((text, style), (c, &w))| cell(text, *style, c, w)),
            )
            .style(r.style)
        })
        .collect();
    Table::new(body, widths.iter().map(|&w| Constraint::Length(w)))
        .header(header)
        .column_spacing(GAP)
        .block(block)
}

/// Rows of `area` left for a table's body under its borders and header.
pub fn body_rows(area: Rect) -> usize {
    area.height.saturating_sub(3) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const COLS: [Col; 3] = [
        Col::text("Request", 7, 40),
        Col::text("State", 5, 17),
        Col::num("Age", 3, 8),
    ];

    #[test]
    fn columns_are_as_wide_as_their_content_within_bounds() {
        let rows = [
            GridRow::plain(["syn-36".into(), "Decoding".into(), "1.2s".into()]),
            GridRow::plain(["syn-1234".into(), "Finished".into(), "12.4s".into()]),
        ];
        // "Request" (7) is wider than any id; "Decoding" (8) than "State".
        assert_eq!(fit(&COLS, &rows, 200), vec![8, 8, 5]);
        let long = [GridRow::plain(["x".repeat(100), "s".into(), "1".into()])];
        assert_eq!(fit(&COLS, &long, 200), vec![40, 5, 3]);
    }

    #[test]
    fn too_narrow_takes_from_the_widest_column_first() {
        let rows = [GridRow::plain([
            "x".repeat(30),
            "PendingEvaluation".into(),
            "12.4s".into(),
        ])];
        // 30 + 17 + 5 + 2 gaps = 54; 40 available: the id gives 11 until
        // its room above its minimum equals the state's, then they take
        // turns.
        assert_eq!(fit(&COLS, &rows, 40), vec![17, 16, 5]);
        // Everything at its minimum, and no further.
        assert_eq!(fit(&COLS, &rows, 5), vec![7, 5, 3]);
    }

    #[test]
    fn clip_marks_what_it_cut() {
        assert_eq!(clip("syn-36", 10), "syn-36");
        assert_eq!(clip("cmpl-0123456789", 8), "cmpl-01…");
        assert_eq!(clip("abc", 0), "");
        assert_eq!(clip("→→→", 2), "→…");
    }

    proptest! {
        #[test]
        fn fit_never_exceeds_bounds_or_content(
            cells in prop::collection::vec(prop::collection::vec(".{0,50}", 3), 0..8),
            avail in 0u16..300,
        ) {
            let rows: Vec<GridRow> = cells.into_iter().map(GridRow::plain).collect();
            let w = fit(&COLS, &rows, avail);
            for (i, c) in COLS.iter().enumerate() {
                let content = rows
                    .iter()
                    .map(|r| width_of(&r.cells[i].0))
                    .chain([width_of(c.title)])
                    .max()
                    .unwrap_or(0);
                prop_assert!(w[i] <= c.max);
                prop_assert!(w[i] <= content.max(c.min));
                prop_assert!(w[i] >= c.min.min(c.max));
            }
            let total: u32 = w.iter().map(|&x| u32::from(x)).sum::<u32>() + 2;
            let mins: u32 = COLS.iter().map(|c| u32::from(c.min)).sum::<u32>() + 2;
            prop_assert!(total <= u32::from(avail).max(mins));
        }
    }
}
