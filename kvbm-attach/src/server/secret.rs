//! Secrets: comparing one with a guess in a time that does not depend on
//! how much of the guess was right ([`ct_eq`]), and drawing a fresh one
//! for a connection ([`client_key`]).

/// Compares without an early exit, so the time taken does not tell how
/// much of a guess was right.
pub(super) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    let n = a.len().max(b.len());
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0xff);
        diff |= u64::from(std::hint::black_box(x ^ y));
    }
    std::hint::black_box(diff) == 0
}

/// A fresh secret for a connection (128 random bits, hex): what a request
/// over HTTP must show to act for that connection.
pub(super) fn client_key() -> String {
    use kvbm_events::run::random_u64;
    format!("{:016x}{:016x}", random_u64(), random_u64())
}
