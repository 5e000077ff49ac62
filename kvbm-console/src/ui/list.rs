//! A list's selection and scroll position, shared by every view that has
//! a list.

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

    /// Moves the selection by `delta` rows within a `len`-row list of
    /// which `visible` rows show.
    pub fn moved(&mut self, delta: isize, len: usize, visible: usize) {
        let max = len.saturating_sub(1);
        self.selected = self.selected.min(max).saturating_add_signed(delta).min(max);
        self.offset = self.offset_for(len, visible);
    }

    /// Selects `row` (clamped to the list).
    pub fn select(&mut self, row: usize, len: usize, visible: usize) {
        self.selected = row.min(len.saturating_sub(1));
        self.offset = self.offset_for(len, visible);
    }

    /// Keeps the selection in range after the list changed.
    pub fn clamp(&mut self, len: usize, visible: usize) {
        self.select(self.selected, len, visible);
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
}
