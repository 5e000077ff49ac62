//! The filter typed after `/`. The app keeps the text as typed; each view
//! that filters (slots, transfers, the event log) holds a copy and applies
//! it when it computes its rows.

use regex::Regex;

/// A filter typed after `/`: a substring (case-insensitive), or a regex
/// written between slashes (`/^req-1[0-9]$/`).
#[derive(Debug, Clone)]
pub struct Filter {
    /// As typed.
    pub text: String,
    lower: String,
    re: Option<Regex>,
}

impl Filter {
    /// Reads a filter; the error says why a regex did not compile.
    pub fn new(text: &str) -> Result<Option<Filter>, String> {
        let t = text.trim();
        if t.is_empty() {
            return Ok(None);
        }
        let re = match t.strip_prefix('/').and_then(|r| r.strip_suffix('/')) {
            Some(pattern) if !pattern.is_empty() => Some(
                regex::RegexBuilder::new(pattern)
                    .size_limit(1 << 20)
                    .build()
                    .map_err(|e| format!("bad regex: {e}"))?,
            ),
            _ => None,
        };
        Ok(Some(Filter {
            text: t.to_string(),
            lower: t.to_lowercase(),
            re,
        }))
    }

    /// Whether any of `fields` matches.
    pub fn matches(&self, fields: &[&str]) -> bool {
        match &self.re {
            Some(re) => fields.iter().any(|f| re.is_match(f)),
            None => fields.iter().any(|f| {
                // Most fields are ASCII; avoid an allocation for them.
                if f.is_ascii() && self.lower.is_ascii() {
                    f.as_bytes()
                        .windows(self.lower.len().max(1))
                        .any(|w| w.eq_ignore_ascii_case(self.lower.as_bytes()))
                        || self.lower.is_empty()
                } else {
                    f.to_lowercase().contains(&self.lower)
                }
            }),
        }
    }
}

/// Whether `filter` (none: everything) lets `fields` through.
pub fn passes(filter: Option<&Filter>, fields: &[&str]) -> bool {
    filter.is_none_or(|f| f.matches(fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_by_substring_or_regex() {
        let f = Filter::new("DECOD").unwrap().unwrap();
        assert!(f.matches(&["req-1", "Decoding"]));
        assert!(!f.matches(&["req-1", "Prefilling"]));
        let f = Filter::new("/^req-1[0-9]$/").unwrap().unwrap();
        assert!(f.matches(&["req-12"]));
        assert!(!f.matches(&["req-123", "req-1"]));
        assert!(Filter::new("/(/").unwrap_err().contains("bad regex"));
        assert!(Filter::new("  ").unwrap().is_none());
        let f = Filter::new("é").unwrap().unwrap();
        assert!(f.matches(&["cafÉ"]));
    }
}
