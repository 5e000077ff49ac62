//! Text for people: [`thousands`] writes a count as people read it, and
//! the rest is for echoing untrusted text back.
//!
//! Echoing untrusted text back: a refusal should quote what it refused,
//! but a value that came from the network can be megabytes long, and
//! quoting all of it helps no one. [`clip`] keeps the start.
//!
//! Two limits, because two things get clipped:
//!
//! - a value quoted inside a sentence ([`MAX_QUOTED_CHARS`]): a state name,
//!   a breakpoint id, a version or a query parameter that did not parse.
//!   Short, so the sentence around it stays readable;
//! - a whole message ([`MAX_MESSAGE_CHARS`]): an error sent back to a
//!   client, or a parser's own error text (which may quote the input and
//!   list what it expected). Longer, because a useful message can be a
//!   few lines.

/// A count with thousands separators: `1,234,567`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Most characters of a value quoted inside an error message.
pub const MAX_QUOTED_CHARS: usize = 64;

/// Most characters of a whole error message sent back.
pub const MAX_MESSAGE_CHARS: usize = 300;

/// `s` cut to its first `max_chars` characters (never inside one), with
/// `…` after the cut to show there was more; `s` itself when it fits.
pub fn clip(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        None => s.to_string(),
        Some((cut, _)) => format!("{}…", &s[..cut]),
    }
}

/// An error and its causes on one line, each said once: a message that
/// already quotes its cause (as most here do) is not followed by it again,
/// as `anyhow`'s "Caused by:" list would.
pub fn said(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !msg.contains(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        cause = c.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_grouped_in_threes() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(65_536), "65,536");
        assert_eq!(thousands(u64::MAX), "18,446,744,073,709,551,615");
    }

    #[derive(Debug, thiserror::Error)]
    #[error("{what}")]
    struct Wrapped {
        what: String,
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn causes_are_said_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let quoted = Wrapped {
            what: "opening trace t: no such file".into(),
            source: io(),
        };
        assert_eq!(said(&quoted), "opening trace t: no such file");
        let bare = Wrapped {
            what: "opening trace t".into(),
            source: io(),
        };
        assert_eq!(said(&bare), "opening trace t: no such file");
    }

    #[test]
    fn clips_by_characters_and_marks_the_cut() {
        assert_eq!(clip("", 3), "");
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("abcd", 3), "abc…");
        assert_eq!(clip("abcd", 0), "…");
        // Characters, not bytes: never a cut inside one.
        assert_eq!(clip("éèêë", 2), "éè…");
        assert_eq!(clip("日本語", 3), "日本語");
        let long = "x".repeat(10 * MAX_MESSAGE_CHARS);
        let c = clip(&long, MAX_MESSAGE_CHARS);
        assert_eq!(c.chars().count(), MAX_MESSAGE_CHARS + 1);
        assert!(c.ends_with('…'));
    }
}
