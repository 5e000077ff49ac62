//! Progress on stderr while a long command runs (reading a log back,
//! recording a simulated run): a bar when stderr is a terminal, nothing
//! when it is not, so logs and pipes stay clean.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A bar towards a known total, or a running count when there is none.
pub struct Progress(ProgressBar);

impl Progress {
    /// A bar towards `total` things (0: unknown, a plain count), labelled
    /// `what`.
    pub fn new(total: u64, what: &'static str) -> Self {
        // indicatif's stderr target draws nothing unless stderr is a
        // terminal.
        let target = ProgressDrawTarget::stderr();
        let bar = if total > 0 {
            ProgressBar::with_draw_target(Some(total), target).with_style(
                ProgressStyle::with_template("[{bar:30}] {percent:>3}%  {pos}/{len} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            )
        } else {
            ProgressBar::with_draw_target(None, target).with_style(
                ProgressStyle::with_template("{spinner} {pos} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            )
        };
        bar.set_message(what);
        Progress(bar)
    }

    /// Moves the bar to `n` (cheap: drawing is rate-limited).
    pub fn set(&self, n: u64) {
        self.0.set_position(n);
    }

    /// Clears the bar.
    pub fn done(&self) {
        self.0.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn the_bar_follows_the_count_and_both_templates_parse() {
        let p = Progress::new(200, "events read");
        p.set(100);
        assert_eq!(p.0.position(), 100);
        assert_eq!(p.0.length(), Some(200));
        assert_eq!(p.0.message(), "events read");
        let unknown = Progress::new(0, "events");
        unknown.set(7);
        assert_eq!(unknown.0.length(), None);
        p.done();
        assert!(p.0.is_finished());
    }
}
