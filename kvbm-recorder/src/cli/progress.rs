//! A progress bar on stderr while a long read runs.

use std::io::IsTerminal;

/// A progress bar on stderr when it is a terminal (nothing otherwise, so
/// logs and pipes stay clean).
pub struct Progress {
    pub(super) on: bool,
    pub(super) total: u64,
}

impl Progress {
    /// A bar towards `total` (0: unknown, a plain count).
    pub fn new(total: u64) -> Self {
        Progress {
            on: std::io::stderr().is_terminal(),
            total,
        }
    }

    /// `[=====>     ]  45%  123456/274000 reading`
    pub fn line(&self, what: &str, n: u64) -> String {
        const WIDTH: u64 = 30;
        if self.total == 0 {
            return format!("{what}: {n} events");
        }
        let n = n.min(self.total);
        let filled = (n * WIDTH / self.total) as usize;
        let bar: String = (0..WIDTH as usize)
            .map(|i| match i.cmp(&filled) {
                std::cmp::Ordering::Less => '=',
                std::cmp::Ordering::Equal => '>',
                std::cmp::Ordering::Greater => ' ',
            })
            .collect();
        format!(
            "[{bar}] {:>3}%  {n}/{} {what}",
            n * 100 / self.total,
            self.total
        )
    }

    /// Redraws the bar at `n`.
    pub fn tick(&self, what: &str, n: u64) {
        if self.on {
            eprint!("\r{}", self.line(what, n));
        }
    }

    /// Clears the bar.
    pub fn done(&self) {
        if self.on {
            eprint!("\r\x1b[K");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn progress_bar_draws_the_fraction_done() {
        let p = Progress {
            on: false,
            total: 200,
        };
        assert_eq!(
            p.line("events read", 100),
            format!(
                "[{}>{}]  50%  100/200 events read",
                "=".repeat(15),
                " ".repeat(14)
            )
        );
        assert!(p.line("x", 500).contains("100%  200/200"));
        let unknown = Progress {
            on: false,
            total: 0,
        };
        assert_eq!(unknown.line("reading", 7), "reading: 7 events");
    }
}
