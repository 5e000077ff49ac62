//! Block contents for round-trip tests: bytes that depend on the block the
//! data was born in and on their offset, so a block that lands in the wrong
//! place, or shifted, is caught.

/// `n` bytes of block `origin`'s pattern.
pub fn pattern(origin: u32, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| {
            let x = (u64::from(origin) << 32) | i as u64;
            (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8
        })
        .collect()
}
