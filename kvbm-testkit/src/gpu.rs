//! GPU tests that run anywhere: where no GPU can be used they skip, loudly
//! (a line on stderr saying which test and why), and under
//! `KVBM_REQUIRE_GPU=1` they fail instead, so a run meant to exercise the
//! device cannot pass without touching it.

/// Whether `KVBM_REQUIRE_GPU=1` asks for a GPU.
pub fn required() -> bool {
    std::env::var("KVBM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// `test` cannot use a GPU because of `why`: panics under
/// `KVBM_REQUIRE_GPU=1`, otherwise prints that it skips.
pub fn skip(test: &str, why: &str) {
    assert!(
        !required(),
        "{test}: KVBM_REQUIRE_GPU=1 but no GPU can be used: {why}"
    );
    eprintln!("SKIPPED {test}: no GPU ({why}); KVBM_REQUIRE_GPU=1 makes this a failure");
}
