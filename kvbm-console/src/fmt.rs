//! Number and duration formatting for narrow table cells.

/// A duration in ns with a unit that keeps it short: `850ns`, `12.3µs`,
/// `4.56ms`, `7.89s`, `12m05s`, `3h07m`.
pub fn dur(ns: u64) -> String {
    let f = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}µs", f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2}ms", f / 1e6)
    } else if ns < 60_000_000_000 {
        format!("{:.2}s", f / 1e9)
    } else if ns < 3_600_000_000_000 {
        let s = ns / 1_000_000_000;
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        let m = ns / 60_000_000_000;
        format!("{}h{:02}m", m / 60, m % 60)
    }
}

/// Timestamps from this one on (2000-01-01 00:00:00 UTC, in ns since the
/// Unix epoch) are wall-clock time, not time since an engine started: an
/// engine that stamps `time.time()` (vLLM and SGLang's KV events) gives
/// them, and no engine runs for 30 years.
pub const WALL_CLOCK_FROM_NS: u64 = 946_684_800 * 1_000_000_000;

/// Engine time as `MM:SS.mmm` (hours added when needed); a wall-clock
/// timestamp (see [`WALL_CLOCK_FROM_NS`]) as its UTC time of day,
/// `HH:MM:SS.mmm`.
pub fn clock(ns: u64) -> String {
    if ns >= WALL_CLOCK_FROM_NS {
        let ms = ns / 1_000_000 % 86_400_000;
        let (h, m, s, ms) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
        return format!("{h:02}:{m:02}:{s:02}.{ms:03}");
    }
    let ms = ns / 1_000_000;
    let (h, m, s, ms) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}.{ms:03}")
    } else {
        format!("{m:02}:{s:02}.{ms:03}")
    }
}

/// A count with thousands separators: `1,234,567`.
pub fn count(n: u64) -> String {
    kvbm_events::text::thousands(n)
}

/// Bytes with a binary unit: `512B`, `4.0KiB`, `1.5MiB`, `2.0GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}B")
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// A ratio as a percentage, or `-` when the denominator is zero.
pub fn pct(num: u64, den: u64) -> String {
    if den == 0 {
        "-".into()
    } else {
        format!("{:.1}%", num as f64 * 100.0 / den as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(dur(850), "850ns");
        assert_eq!(dur(12_345), "12.3µs");
        assert_eq!(dur(4_560_000), "4.56ms");
        assert_eq!(dur(7_890_000_000), "7.89s");
        assert_eq!(dur(725_000_000_000), "12m05s");
        assert_eq!(dur(11_220_000_000_000), "3h07m");
        assert_eq!(clock(61_234_000_000), "01:01.234");
        assert_eq!(clock(3_661_000_000_000), "1:01:01.000");
        // vLLM's `time.time()` stamps: the time of day, not 498734 hours.
        assert_eq!(clock(1_795_452_101_875_000_000), "16:41:41.875");
        assert_eq!(clock(WALL_CLOCK_FROM_NS), "00:00:00.000");
        assert_eq!(count(0), "0");
        assert_eq!(count(1234567), "1,234,567");
        assert_eq!(count(100), "100");
        assert_eq!(bytes(512), "512B");
        assert_eq!(bytes(1536 * 1024), "1.5MiB");
        assert_eq!(pct(1, 4), "25.0%");
        assert_eq!(pct(1, 0), "-");
    }
}
