//! Request workloads for the simulated engine: what arrives when, with which
//! prompt tokens and how many tokens to generate.
//!
//! Three things live here:
//!
//! - **Mooncake traces** ([`parse_mooncake`], [`parse_mooncake_lenient`],
//!   [`MooncakeReader`]). One JSON object per line: `timestamp` (ms),
//!   `input_length`, `output_length` (tokens) and `hash_ids`, one id per
//!   512-token prompt block, where equal ids are the same reusable prefix
//!   block. The trace carries no tokens, so each hash id is turned into
//!   `block_tokens` deterministic tokens derived from the id alone
//!   ([`hash_id_tokens`]): equal ids give equal tokens, hence equal kvbm
//!   sequence hashes, and the block manager sees exactly the reuse the trace
//!   describes.
//! - **A synthetic generator** ([`generate`]): Poisson arrivals, prompt and
//!   output length distributions and a fraction of requests that start with
//!   one of a few shared prefixes, all from one seed.
//! - **The ideal prefix-hit ratio** ([`ideal_prefix_hits`],
//!   [`ideal_prefix_hits_from_hash_ids`]): what an infinite cache would give a
//!   workload, independent of any pool. The simulator's fidelity test compares
//!   its own hit ratio with this.
//!
//! Randomness comes from a small SplitMix64 generator in this module rather
//! than the `rand` crate: the streams must stay bit-for-bit stable across
//! dependency upgrades, because recorded runs and test expectations are keyed
//! by seed.
//!
//! Bad input never panics: a malformed trace line becomes a [`WorkloadError`]
//! naming its line number and what was wrong, and the lenient parser keeps
//! every good line while reporting each bad one.

use kvbm_core::tokens::{Token, TokenSequence};
use serde_json::{Map, Value};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::io::{self, BufRead, Read};

/// Tokens per hash id in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;
/// Default vocabulary size for generated tokens (a Llama-2-sized vocabulary).
pub const DEFAULT_VOCAB: u32 = 32_000;
/// Default cap on a prompt or output length, in tokens (1 Mi tokens).
pub const DEFAULT_MAX_TOKENS: u64 = 1 << 20;
/// Default cap on one trace line, in bytes. A line at the default token cap
/// has about 2,048 hash ids, i.e. tens of KiB; 16 MiB leaves plenty of room
/// while keeping a newline-free garbage file from being read whole.
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 << 20;
/// Default cap on how far past [`DEFAULT_MAX_LINE_BYTES`] an over-long line
/// is skipped in search of its end (64 MiB). A line that long is garbage
/// already; skipping it keeps the lines after it, but input with no newline
/// in 80 MiB (`/dev/zero`, a binary file) is not a trace, and skipping it
/// to the end could take forever.
pub const DEFAULT_MAX_SKIP_BYTES: u64 = 64 << 20;

// Domain separators, so that the token stream of hash id `n`, the filler of
// line `n`, the synthetic prefix `n` and so on are unrelated streams even
// when their numeric seeds coincide.
const DOMAIN_HASH_ID: u64 = 0x6b76_626d_6861_7368; // "kvbmhash"
const DOMAIN_FILL: u64 = 0x6b76_626d_6669_6c6c; // "kvbmfill"
const DOMAIN_ARRIVAL: u64 = 0x6b76_626d_6172_7276; // "kvbmarrv"
const DOMAIN_REQUEST: u64 = 0x6b76_626d_7265_7173; // "kvbmreqs"
const DOMAIN_PREFIX: u64 = 0x6b76_626d_7072_6678; // "kvbmprfx"

/// The salt under which the ideal hit ratio hashes prompts. Hits do not depend
/// on the salt as long as every request uses the same one, so any fixed value
/// gives the count an engine with a single model would see.
const IDEAL_SALT: &[u8] = b"kvbm-workload";

// ---------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------

/// One request of a workload: when it arrives, its prompt and how many tokens
/// it generates.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// Unique within a workload: `mc-<line>` for trace requests, `syn-<index>`
    /// for synthetic ones.
    pub id: String,
    /// Arrival time in milliseconds from the start of the workload.
    pub arrival_ms: f64,
    /// Prompt token ids. Never empty.
    pub prompt: Vec<Token>,
    /// Tokens to generate. At least 1.
    pub output_len: usize,
    /// Where the request came from.
    pub origin: Origin,
}

/// Where a [`RequestSpec`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A line of a Mooncake trace.
    Mooncake {
        /// 1-based line number in the trace file.
        line: usize,
        /// The hash ids that contributed tokens to the prompt, in order: the
        /// line's ids, minus any beyond `ceil(input_length / block_tokens)`
        /// (those would contribute nothing). The last may contribute only part
        /// of its block.
        hash_ids: Vec<u64>,
    },
    /// The synthetic generator.
    Synthetic {
        /// Position in the generated workload (0-based).
        index: usize,
        /// Which shared prefix the prompt starts with, if any.
        shared_prefix: Option<usize>,
    },
}

impl RequestSpec {
    /// The trace hash ids behind the prompt; empty for synthetic requests.
    pub fn hash_ids(&self) -> &[u64] {
        match &self.origin {
            Origin::Mooncake { hash_ids, .. } => hash_ids,
            Origin::Synthetic { .. } => &[],
        }
    }
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Errors from reading or generating a workload.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A trace line is malformed.
    #[error("line {line}: {error}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What was wrong with it.
        error: LineError,
    },
    /// Reading the trace failed. Reading stops here: after an I/O error the
    /// position in the stream is unknown, so later lines cannot be trusted.
    #[error("line {line}: read failed: {source}")]
    Io {
        /// The line being read when it failed (1-based).
        line: usize,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A line is longer than [`MooncakeOptions::max_line_bytes`] and no
    /// newline came within [`MooncakeOptions::max_skip_bytes`] more: the
    /// input is not a trace (`/dev/zero`, a binary file). Reading stops
    /// here rather than skipping without end.
    #[error(
        "line {line}: no end of line in the {read} bytes read from its start \
         (a line may have at most {max_line}); this is not a trace, giving up"
    )]
    EndlessLine {
        /// The line (1-based).
        line: usize,
        /// Bytes read from the line's start before giving up.
        read: u64,
        /// [`MooncakeOptions::max_line_bytes`].
        max_line: usize,
    },
    /// The requests read so far ask for more tokens, prompts and outputs
    /// together, than [`MooncakeOptions::max_total_tokens`]. Reading stops
    /// at the line that crossed it.
    #[error(
        "line {line}: by this line the trace asks for more than {max} tokens \
         (prompts and outputs together)"
    )]
    TooManyTokens {
        /// The line whose request crossed the cap (1-based).
        line: usize,
        /// The cap.
        max: u64,
    },
    /// An option or configuration value is out of range.
    #[error("invalid setting `{field}`: {reason}")]
    InvalidSetting {
        /// The offending field.
        field: &'static str,
        /// Why it is invalid.
        reason: String,
    },
}

impl WorkloadError {
    /// The trace line the error is about, if it is about one.
    pub fn line(&self) -> Option<usize> {
        match self {
            WorkloadError::Line { line, .. }
            | WorkloadError::Io { line, .. }
            | WorkloadError::EndlessLine { line, .. }
            | WorkloadError::TooManyTokens { line, .. } => Some(*line),
            WorkloadError::InvalidSetting { .. } => None,
        }
    }
}

fn invalid(field: &'static str, reason: impl Into<String>) -> WorkloadError {
    WorkloadError::InvalidSetting {
        field,
        reason: reason.into(),
    }
}

/// What is wrong with one trace line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// The line is longer than [`MooncakeOptions::max_line_bytes`].
    #[error("line is longer than {max} bytes")]
    TooLong {
        /// The cap.
        max: usize,
    },
    /// The line is not valid JSON.
    #[error("invalid JSON: {0}")]
    Json(String),
    /// The line is JSON but not an object.
    #[error("expected a JSON object, found {0}")]
    NotAnObject(String),
    /// A required field is absent.
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    /// A field that must be a non-negative integer is something else.
    #[error("field `{field}` must be a non-negative integer, found {found}")]
    NotACount {
        /// The field.
        field: &'static str,
        /// A short rendering of what was there.
        found: String,
    },
    /// A length is zero (a request needs at least one prompt token and one
    /// output token).
    #[error("field `{0}` must be at least 1")]
    Zero(&'static str),
    /// A length exceeds its cap.
    #[error("field `{field}` is {value}, above the cap of {max}")]
    OverCap {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The cap ([`MooncakeOptions::max_input_tokens`] or
        /// [`MooncakeOptions::max_output_tokens`]).
        max: u64,
    },
    /// `hash_ids` is not an array.
    #[error("field `hash_ids` must be an array, found {0}")]
    HashIdsNotArray(String),
    /// An element of `hash_ids` is not a non-negative integer.
    #[error("hash_ids[{index}] must be a non-negative integer, found {found}")]
    BadHashId {
        /// Position in the array.
        index: usize,
        /// A short rendering of what was there.
        found: String,
    },
}

/// A short rendering of a JSON value for error messages: enough to recognise
/// it, never the whole of a huge value.
fn describe(v: &Value) -> String {
    const MAX: usize = 40;
    let s = match v {
        Value::Array(a) => return format!("an array of {} elements", a.len()),
        Value::Object(_) => return "an object".to_string(),
        other => other.to_string(),
    };
    if s.chars().count() > MAX {
        let cut: String = s.chars().take(MAX).collect();
        format!("{cut}…")
    } else {
        s
    }
}

// ---------------------------------------------------------------------------
// PRNG
// ---------------------------------------------------------------------------

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, statistically fine for
/// workloads, and with a fixed definition so seeds reproduce forever.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 output function, also used to derive seeds.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SplitMix64 {
    /// A stream for `(domain, key)`. Mixing before seeding keeps streams of
    /// nearby keys (ids 0, 1, 2, ...) from being shifted copies of each other,
    /// which raw SplitMix64 states `s` and `s + gamma` would be.
    fn for_key(domain: u64, key: u64) -> Self {
        SplitMix64(mix64(mix64(domain) ^ key))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        mix64(self.0)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `(0, 1]`: safe to take the logarithm of.
    fn next_f64_open0(&mut self) -> f64 {
        1.0 - self.next_f64()
    }

    /// Uniform in `[0, n)` for `n >= 1` (Lemire's multiply-shift; the bias is
    /// below 2^-64 * n, irrelevant here).
    fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// A token in `[0, vocab)`.
    fn token(&mut self, vocab: u32) -> Token {
        (self.next_u64() % u64::from(vocab)) as Token
    }

    /// Standard normal (Box–Muller; one of the pair is discarded, which keeps
    /// the stream stateless beyond the counter).
    fn normal(&mut self) -> f64 {
        let u1 = self.next_f64_open0();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

/// The tokens hash id `id` stands for: `block_tokens` tokens in `[0, vocab)`,
/// a function of the id alone. Every request containing the id gets the same
/// tokens, so equal ids hash equal in kvbm.
pub fn hash_id_tokens(id: u64, block_tokens: usize, vocab: u32) -> Vec<Token> {
    let mut out = Vec::with_capacity(block_tokens);
    push_stream(&mut out, DOMAIN_HASH_ID, id, block_tokens, vocab);
    out
}

fn push_stream(out: &mut Vec<Token>, domain: u64, key: u64, n: usize, vocab: u32) {
    let mut rng = SplitMix64::for_key(domain, key);
    out.extend((0..n).map(|_| rng.token(vocab)));
}

// ---------------------------------------------------------------------------
// Mooncake traces
// ---------------------------------------------------------------------------

/// How to read a Mooncake trace.
#[derive(Debug, Clone, PartialEq)]
pub struct MooncakeOptions {
    /// Tokens per hash id ([`MOONCAKE_BLOCK_TOKENS`] for the published
    /// traces).
    pub block_tokens: usize,
    /// Generated tokens are in `[0, vocab)`.
    pub vocab: u32,
    /// Stop after this many requests (bad lines skipped by the lenient parser
    /// do not count).
    pub max_requests: Option<usize>,
    /// `arrival_ms = timestamp * time_scale`: 0.5 replays twice as fast, 0
    /// makes everything arrive at once. Finite and non-negative.
    pub time_scale: f64,
    /// Lines with a larger `input_length` are rejected.
    pub max_input_tokens: u64,
    /// Lines with a larger `output_length` are rejected.
    pub max_output_tokens: u64,
    /// Lines longer than this (excluding the newline) are rejected without
    /// being held in memory whole.
    pub max_line_bytes: usize,
    /// How many bytes past `max_line_bytes` an over-long line is skipped in
    /// search of its end; past that, reading stops with
    /// [`WorkloadError::EndlessLine`].
    pub max_skip_bytes: u64,
    /// Most tokens, prompts and outputs together, the requests read may ask
    /// for; the line that crosses it ends reading with
    /// [`WorkloadError::TooManyTokens`]. `None`: no cap (a reader that
    /// keeps only the hash ids needs none; one that builds every prompt
    /// holds 4 bytes a token, and a few-KB trace can ask for a Gi tokens).
    pub max_total_tokens: Option<u64>,
}

impl Default for MooncakeOptions {
    fn default() -> Self {
        MooncakeOptions {
            block_tokens: MOONCAKE_BLOCK_TOKENS,
            vocab: DEFAULT_VOCAB,
            max_requests: None,
            time_scale: 1.0,
            max_input_tokens: DEFAULT_MAX_TOKENS,
            max_output_tokens: DEFAULT_MAX_TOKENS,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            max_skip_bytes: DEFAULT_MAX_SKIP_BYTES,
            max_total_tokens: None,
        }
    }
}

impl MooncakeOptions {
    /// Checks every field; the parsers call this first.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.block_tokens == 0 {
            return Err(invalid("block_tokens", "must be at least 1"));
        }
        if self.vocab == 0 {
            return Err(invalid("vocab", "must be at least 1"));
        }
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return Err(invalid(
                "time_scale",
                format!("must be finite and >= 0, got {}", self.time_scale),
            ));
        }
        // Lengths become `usize` and `Vec` capacities; keep them well inside
        // what a 32-bit host could allocate too.
        for (field, v) in [
            ("max_input_tokens", self.max_input_tokens),
            ("max_output_tokens", self.max_output_tokens),
        ] {
            if v == 0 || v > u64::from(u32::MAX) {
                return Err(invalid(
                    field,
                    format!("must be between 1 and {}, got {v}", u32::MAX),
                ));
            }
        }
        if self.max_line_bytes == 0 {
            return Err(invalid("max_line_bytes", "must be at least 1"));
        }
        if self.max_total_tokens == Some(0) {
            return Err(invalid("max_total_tokens", "must be at least 1"));
        }
        Ok(())
    }
}

/// One validated trace line, before its tokens are generated (what an
/// analysis that needs only the hash ids reads: [`MooncakeReader::next_line`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MooncakeLine {
    /// 1-based line number.
    pub line: usize,
    /// Arrival, ms.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Tokens to generate.
    pub output_length: usize,
    /// The prefix block ids, as written (possibly past the prompt's end).
    pub hash_ids: Vec<u64>,
}

/// A non-negative integer, also accepting integral floats such as `1024.0`
/// (which some trace writers emit) when they are exact in an `f64`.
fn as_count(v: &Value) -> Option<u64> {
    if let Some(u) = v.as_u64() {
        return Some(u);
    }
    let f = v.as_f64()?;
    const EXACT: f64 = (1u64 << 53) as f64;
    (f.is_finite() && f >= 0.0 && f.fract() == 0.0 && f <= EXACT).then_some(f as u64)
}

fn count_field(obj: &Map<String, Value>, field: &'static str) -> Result<u64, LineError> {
    let v = obj.get(field).ok_or(LineError::MissingField(field))?;
    as_count(v).ok_or_else(|| LineError::NotACount {
        field,
        found: describe(v),
    })
}

fn length_field(
    obj: &Map<String, Value>,
    field: &'static str,
    max: u64,
) -> Result<usize, LineError> {
    let value = count_field(obj, field)?;
    if value == 0 {
        return Err(LineError::Zero(field));
    }
    if value > max {
        return Err(LineError::OverCap { field, value, max });
    }
    // `max` is validated to fit in a u32, so this cannot fail; the error is
    // for form's sake.
    usize::try_from(value).map_err(|_| LineError::OverCap { field, value, max })
}

/// serde_json's messages end in "at line 1 column N"; "line 1" would be
/// confused with the trace's line number, so keep only the column.
fn json_error(e: &serde_json::Error) -> LineError {
    let full = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    let msg = full.strip_suffix(&suffix).unwrap_or(&full);
    LineError::Json(format!("{msg} (column {})", e.column()))
}

fn parse_record(
    bytes: &[u8],
    line: usize,
    opts: &MooncakeOptions,
) -> Result<MooncakeLine, LineError> {
    // Parse to a `Value` first rather than deriving `Deserialize`, so each
    // problem gets a precise message naming the field.
    let v: Value = serde_json::from_slice(bytes).map_err(|e| json_error(&e))?;
    let obj = v
        .as_object()
        .ok_or_else(|| LineError::NotAnObject(describe(&v)))?;
    let timestamp_ms = count_field(obj, "timestamp")?;
    let input_length = length_field(obj, "input_length", opts.max_input_tokens)?;
    let output_length = length_field(obj, "output_length", opts.max_output_tokens)?;
    let ids = obj
        .get("hash_ids")
        .ok_or(LineError::MissingField("hash_ids"))?;
    let ids = ids
        .as_array()
        .ok_or_else(|| LineError::HashIdsNotArray(describe(ids)))?;
    // Validate every id, even those past the prompt's end: a line with a bad
    // id is malformed wherever the id sits.
    let hash_ids = ids
        .iter()
        .enumerate()
        .map(|(index, id)| {
            as_count(id).ok_or_else(|| LineError::BadHashId {
                index,
                found: describe(id),
            })
        })
        .collect::<Result<Vec<u64>, _>>()?;
    Ok(MooncakeLine {
        line,
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
    })
}

impl MooncakeLine {
    fn into_request(mut self, opts: &MooncakeOptions) -> RequestSpec {
        let line = self.line;
        let bt = opts.block_tokens;
        let len = self.input_length;
        // Ids past ceil(len / bt) contribute no token; drop them so that
        // `Origin::hash_ids` says exactly what the prompt is made of.
        self.hash_ids.truncate(len.div_ceil(bt));
        let mut prompt = Vec::with_capacity(len);
        for &id in &self.hash_ids {
            // A partial last block takes the first tokens of the id's block,
            // so it is a prefix of the full block other lines see.
            let take = bt.min(len - prompt.len());
            push_stream(&mut prompt, DOMAIN_HASH_ID, id, take, opts.vocab);
        }
        if prompt.len() < len {
            // More prompt than hash ids cover: the rest is unique to this
            // line (its own stream, keyed by the line number), so it can
            // never be mistaken for a shared block.
            let missing = len - prompt.len();
            push_stream(&mut prompt, DOMAIN_FILL, line as u64, missing, opts.vocab);
        }
        RequestSpec {
            id: format!("mc-{line}"),
            arrival_ms: self.timestamp_ms as f64 * opts.time_scale,
            prompt,
            output_len: self.output_length,
            origin: Origin::Mooncake {
                line,
                hash_ids: self.hash_ids,
            },
        }
    }
}

/// Reads a Mooncake trace one request at a time, so a simulator can stream a
/// trace far larger than memory.
///
/// Yields `Ok(request)` for each good line and `Err(WorkloadError::Line)` for
/// each malformed one, then carries on with the next line; blank lines are
/// skipped silently. An I/O error, a line with no end in sight
/// ([`WorkloadError::EndlessLine`]) or the token cap crossed
/// ([`WorkloadError::TooManyTokens`]) is yielded once and ends the
/// iteration.
/// Requests come out in file order (the published traces are sorted by
/// timestamp; this reader does not re-sort).
#[derive(Debug)]
pub struct MooncakeReader<R> {
    reader: R,
    opts: MooncakeOptions,
    line: usize,
    emitted: usize,
    /// Tokens (prompt and output) of the lines yielded so far.
    tokens: u64,
    buf: Vec<u8>,
    done: bool,
}

impl<R: BufRead> MooncakeReader<R> {
    /// A reader over `reader`. Fails if `opts` is invalid.
    pub fn new(reader: R, opts: MooncakeOptions) -> Result<Self, WorkloadError> {
        opts.validate()?;
        Ok(MooncakeReader {
            reader,
            opts,
            line: 0,
            emitted: 0,
            tokens: 0,
            buf: Vec::new(),
            done: false,
        })
    }

    /// Lines read so far (including blank and bad ones).
    pub fn lines_read(&self) -> usize {
        self.line
    }

    /// Reads one line (without its newline) into `self.buf`. `Ok(false)` at
    /// end of input.
    fn read_line(&mut self) -> Result<bool, LineOrIo> {
        self.buf.clear();
        let max = self.opts.max_line_bytes;
        // Read at most one byte past the cap, so an endless line is noticed
        // without being held in memory whole.
        let limit = (max as u64).saturating_add(1);
        let n = (&mut self.reader)
            .take(limit)
            .read_until(b'\n', &mut self.buf)
            .map_err(LineOrIo::Io)?;
        if n == 0 {
            return Ok(false);
        }
        let ended = self.buf.last() == Some(&b'\n');
        if ended {
            self.buf.pop();
        }
        if self.buf.len() > max {
            if !ended {
                let skipped =
                    skip_line(&mut self.reader, self.opts.max_skip_bytes).map_err(LineOrIo::Io)?;
                if skipped.is_none() {
                    return Err(LineOrIo::Endless {
                        read: (n as u64).saturating_add(self.opts.max_skip_bytes),
                    });
                }
            }
            return Err(LineOrIo::Line(LineError::TooLong { max }));
        }
        Ok(true)
    }
}

enum LineOrIo {
    Line(LineError),
    Io(io::Error),
    /// No newline within the skip cap; `read` bytes of the line were read.
    Endless {
        read: u64,
    },
}

/// Discards input up to and including the next newline, reading at most
/// `max` bytes: `Some(bytes discarded)` once past the newline or at the end
/// of input, `None` when `max` bytes went by without one.
fn skip_line(r: &mut impl BufRead, max: u64) -> io::Result<Option<u64>> {
    let mut skipped = 0u64;
    loop {
        let left = max - skipped;
        let (consume, found) = match r.fill_buf() {
            Ok([]) => return Ok(Some(skipped)),
            Ok(buf) => {
                let window = &buf[..buf.len().min(usize::try_from(left).unwrap_or(usize::MAX))];
                match window.iter().position(|&b| b == b'\n') {
                    Some(i) => (i + 1, true),
                    None => (window.len(), false),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        r.consume(consume);
        skipped += consume as u64;
        if found {
            return Ok(Some(skipped));
        }
        if skipped >= max {
            return Ok(None);
        }
    }
}

impl<R: BufRead> MooncakeReader<R> {
    /// The next line, validated but without generating its tokens;
    /// errors and the end of input as for the iterator.
    pub fn next_line(&mut self) -> Option<Result<MooncakeLine, WorkloadError>> {
        loop {
            if self.done {
                return None;
            }
            if self.opts.max_requests.is_some_and(|m| self.emitted >= m) {
                self.done = true;
                return None;
            }
            self.line += 1;
            let line = self.line;
            match self.read_line() {
                Ok(false) => {
                    self.done = true;
                    return None;
                }
                Ok(true) => {}
                Err(LineOrIo::Line(error)) => {
                    return Some(Err(WorkloadError::Line { line, error }));
                }
                Err(LineOrIo::Io(source)) => {
                    self.done = true;
                    return Some(Err(WorkloadError::Io { line, source }));
                }
                Err(LineOrIo::Endless { read }) => {
                    self.done = true;
                    return Some(Err(WorkloadError::EndlessLine {
                        line,
                        read,
                        max_line: self.opts.max_line_bytes,
                    }));
                }
            }
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            return Some(match parse_record(&self.buf, line, &self.opts) {
                Ok(rec) => {
                    // Checked before the caller builds the prompt, so the
                    // cap bounds what is ever held.
                    self.tokens = self
                        .tokens
                        .saturating_add(rec.input_length as u64)
                        .saturating_add(rec.output_length as u64);
                    if let Some(max) = self.opts.max_total_tokens
                        && self.tokens > max
                    {
                        self.done = true;
                        return Some(Err(WorkloadError::TooManyTokens { line, max }));
                    }
                    self.emitted += 1;
                    Ok(rec)
                }
                Err(error) => Err(WorkloadError::Line { line, error }),
            });
        }
    }
}

impl<R: BufRead> Iterator for MooncakeReader<R> {
    type Item = Result<RequestSpec, WorkloadError>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.next_line()?;
        Some(item.map(|l| l.into_request(&self.opts)))
    }
}

/// Parses a whole trace, failing on the first bad line (with its number).
pub fn parse_mooncake(
    reader: impl BufRead,
    opts: &MooncakeOptions,
) -> Result<Vec<RequestSpec>, WorkloadError> {
    MooncakeReader::new(reader, opts.clone())?.collect()
}

/// A line the lenient parser skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedLine {
    /// 1-based line number.
    pub line: usize,
    /// Why it was skipped.
    pub error: LineError,
}

/// What the lenient parser kept and what it skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct ParseReport {
    /// The good lines' requests, in file order.
    pub requests: Vec<RequestSpec>,
    /// Each bad line, in file order.
    pub skipped: Vec<SkippedLine>,
}

/// Parses a whole trace, keeping every good line and recording each bad one,
/// so one corrupt line does not lose the rest. Fails only on invalid options,
/// an I/O error, a line with no end in sight or the token cap crossed.
pub fn parse_mooncake_lenient(
    reader: impl BufRead,
    opts: &MooncakeOptions,
) -> Result<ParseReport, WorkloadError> {
    let mut lines = Vec::new();
    let mut skipped = Vec::new();
    let mut r = MooncakeReader::new(reader, opts.clone())?;
    // Every line first, prompts after: a trace that fails (the token cap
    // crossed, say) fails before any prompt is built.
    while let Some(item) = r.next_line() {
        match item {
            Ok(l) => lines.push(l),
            Err(WorkloadError::Line { line, error }) => skipped.push(SkippedLine { line, error }),
            Err(e) => return Err(e),
        }
    }
    Ok(ParseReport {
        requests: lines.into_iter().map(|l| l.into_request(opts)).collect(),
        skipped,
    })
}

// ---------------------------------------------------------------------------
// Synthetic workloads
// ---------------------------------------------------------------------------

/// A length distribution, in tokens. Samples are rounded and clipped to
/// `[1, SyntheticConfig::max_len]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LengthDist {
    /// Always `n`.
    Fixed(usize),
    /// Uniform over `min..=max`.
    Uniform {
        /// Smallest length.
        min: usize,
        /// Largest length.
        max: usize,
    },
    /// Log-normal with the given mean (of the length itself, not of its
    /// logarithm) and `sigma` the standard deviation of the logarithm:
    /// `ln L ~ N(ln(mean) - sigma²/2, sigma²)`. Real prompt and output
    /// lengths are heavy-tailed like this.
    LogNormal {
        /// Mean length, > 0.
        mean: f64,
        /// Spread of the logarithm, >= 0.
        sigma: f64,
    },
}

impl LengthDist {
    fn validate(&self, field: &'static str, cap: usize) -> Result<(), WorkloadError> {
        match *self {
            LengthDist::Fixed(n) if n == 0 || n > cap => Err(invalid(
                field,
                format!("Fixed({n}) must be between 1 and max_len = {cap}"),
            )),
            LengthDist::Uniform { min, max } if min == 0 || min > max || max > cap => Err(invalid(
                field,
                format!(
                    "Uniform {{ min: {min}, max: {max} }} needs 1 <= min <= max <= max_len = {cap}"
                ),
            )),
            LengthDist::LogNormal { mean, sigma }
                if !(mean.is_finite() && mean > 0.0 && sigma.is_finite() && sigma >= 0.0) =>
            {
                Err(invalid(
                    field,
                    format!(
                        "LogNormal {{ mean: {mean}, sigma: {sigma} }} needs a finite mean > 0 and a finite sigma >= 0"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    fn sample(&self, rng: &mut SplitMix64, cap: usize) -> usize {
        match *self {
            LengthDist::Fixed(n) => n.clamp(1, cap),
            LengthDist::Uniform { min, max } => {
                let span = (max - min) as u64 + 1;
                (min + rng.below(span) as usize).clamp(1, cap)
            }
            LengthDist::LogNormal { mean, sigma } => {
                let mu = mean.ln() - sigma * sigma / 2.0;
                let x = (mu + sigma * rng.normal()).exp().round();
                // NaN (from inf - inf with absurd sigmas) lands on 1 rather
                // than anywhere surprising.
                if x.is_nan() || x < 1.0 {
                    1
                } else if x >= cap as f64 {
                    cap
                } else {
                    x as usize
                }
            }
        }
    }
}

/// A synthetic workload. Everything is a function of `seed`.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    /// The seed: the same config and seed always give the same workload.
    pub seed: u64,
    /// How many requests.
    pub num_requests: usize,
    /// Mean arrivals per second of a Poisson process (exponential gaps; the
    /// first request arrives after one gap, not at 0). At least `1e-6`.
    pub arrival_rate_per_s: f64,
    /// Prompt length, including any shared prefix.
    pub prompt_len: LengthDist,
    /// Tokens to generate.
    pub output_len: LengthDist,
    /// Fraction of requests, in `[0, 1]`, whose prompt starts with one of the
    /// shared prefixes (chosen uniformly).
    pub shared_prefix_ratio: f64,
    /// How many distinct shared prefixes (at least 1 when the ratio is > 0).
    pub num_shared_prefixes: usize,
    /// Tokens in each shared prefix (at least 1 and below `max_len` when the
    /// ratio is > 0). A request with a shared prefix has at least one token
    /// of its own after it, so its prompt is
    /// `max(sampled, shared_prefix_len + 1)` tokens.
    pub shared_prefix_len: usize,
    /// Generated tokens are in `[0, vocab)`.
    pub vocab: u32,
    /// Cap on any sampled length.
    pub max_len: usize,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            seed: 0,
            num_requests: 100,
            arrival_rate_per_s: 10.0,
            prompt_len: LengthDist::LogNormal {
                mean: 1024.0,
                sigma: 0.5,
            },
            output_len: LengthDist::LogNormal {
                mean: 128.0,
                sigma: 0.5,
            },
            shared_prefix_ratio: 0.5,
            num_shared_prefixes: 4,
            shared_prefix_len: 512,
            vocab: DEFAULT_VOCAB,
            max_len: DEFAULT_MAX_TOKENS as usize,
        }
    }
}

/// Lowest accepted arrival rate: one request per ~11.6 days. Below it the
/// arrival times of long workloads stop being meaningful numbers.
const MIN_ARRIVAL_RATE: f64 = 1e-6;

impl SyntheticConfig {
    /// Checks every field; [`generate`] calls this first.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.max_len == 0 {
            return Err(invalid("max_len", "must be at least 1"));
        }
        if self.vocab == 0 {
            return Err(invalid("vocab", "must be at least 1"));
        }
        if !(self.arrival_rate_per_s.is_finite() && self.arrival_rate_per_s >= MIN_ARRIVAL_RATE) {
            return Err(invalid(
                "arrival_rate_per_s",
                format!(
                    "must be finite and >= {MIN_ARRIVAL_RATE}, got {}",
                    self.arrival_rate_per_s
                ),
            ));
        }
        self.prompt_len.validate("prompt_len", self.max_len)?;
        self.output_len.validate("output_len", self.max_len)?;
        if !(0.0..=1.0).contains(&self.shared_prefix_ratio) {
            return Err(invalid(
                "shared_prefix_ratio",
                format!("must be in [0, 1], got {}", self.shared_prefix_ratio),
            ));
        }
        if self.shared_prefix_ratio > 0.0 {
            if self.num_shared_prefixes == 0 {
                return Err(invalid(
                    "num_shared_prefixes",
                    "must be at least 1 when shared_prefix_ratio > 0",
                ));
            }
            if self.shared_prefix_len == 0 || self.shared_prefix_len >= self.max_len {
                return Err(invalid(
                    "shared_prefix_len",
                    format!(
                        "must be between 1 and max_len - 1 = {} when shared_prefix_ratio > 0, got {}",
                        self.max_len - 1,
                        self.shared_prefix_len
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Generates a synthetic workload, in arrival order.
///
/// Deterministic: arrivals come from one stream and each request's content
/// from its own stream keyed by `(seed, index)`, so a request does not change
/// when, say, the output length distribution of the others does.
pub fn generate(cfg: &SyntheticConfig) -> Result<Vec<RequestSpec>, WorkloadError> {
    cfg.validate()?;
    let prefix_seed = mix64(cfg.seed ^ DOMAIN_PREFIX);
    let prefixes: Vec<Vec<Token>> = if cfg.shared_prefix_ratio > 0.0 {
        (0..cfg.num_shared_prefixes)
            .map(|k| {
                let mut p = Vec::with_capacity(cfg.shared_prefix_len);
                push_stream(
                    &mut p,
                    prefix_seed,
                    k as u64,
                    cfg.shared_prefix_len,
                    cfg.vocab,
                );
                p
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut arrivals = SplitMix64::for_key(DOMAIN_ARRIVAL, cfg.seed);
    let request_seed = mix64(cfg.seed ^ DOMAIN_REQUEST);
    let mut t_ms = 0.0f64;
    let mut out = Vec::with_capacity(cfg.num_requests);
    for index in 0..cfg.num_requests {
        t_ms += -arrivals.next_f64_open0().ln() / cfg.arrival_rate_per_s * 1000.0;
        let mut rng = SplitMix64::for_key(request_seed, index as u64);
        // Always draw the coin and the prefix, so the rest of the stream is
        // aligned whatever the ratio.
        let coin = rng.next_f64();
        let which = rng.below(cfg.num_shared_prefixes.max(1) as u64) as usize;
        let shared = (coin < cfg.shared_prefix_ratio).then_some(which);
        let mut len = cfg.prompt_len.sample(&mut rng, cfg.max_len);
        let output_len = cfg.output_len.sample(&mut rng, cfg.max_len);
        let mut prompt = Vec::new();
        if let Some(k) = shared {
            len = len.max(cfg.shared_prefix_len + 1);
            prompt.reserve_exact(len);
            prompt.extend_from_slice(&prefixes[k]);
        } else {
            prompt.reserve_exact(len);
        }
        let own = len - prompt.len();
        prompt.extend((0..own).map(|_| rng.token(cfg.vocab)));
        out.push(RequestSpec {
            id: format!("syn-{index}"),
            arrival_ms: t_ms,
            prompt,
            output_len,
            origin: Origin::Synthetic {
                index,
                shared_prefix: shared,
            },
        });
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Ideal prefix hits
// ---------------------------------------------------------------------------

/// How much of a workload's prompts an infinite prefix cache could serve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefixStats {
    /// Requests considered.
    pub requests: usize,
    /// Sum of prompt lengths.
    pub prompt_tokens: u64,
    /// Sum over requests of the leading full blocks already seen in an
    /// earlier request, times the block size.
    pub hit_tokens: u64,
    /// `hit_tokens / prompt_tokens` (0 when there are no prompt tokens).
    pub ratio: f64,
    /// Requests whose whole prompt was a hit. A real engine must still
    /// compute at least the last prompt token to produce logits, so it
    /// recomputes one block of these; a simulator comparing with `hit_tokens`
    /// may need to allow for that.
    pub full_prompt_hits: usize,
}

impl PrefixStats {
    fn new(requests: usize, prompt_tokens: u64, hit_tokens: u64, full: usize) -> Self {
        PrefixStats {
            requests,
            prompt_tokens,
            hit_tokens,
            ratio: if prompt_tokens == 0 {
                0.0
            } else {
                hit_tokens as f64 / prompt_tokens as f64
            },
            full_prompt_hits: full,
        }
    }
}

/// Indices of `requests` in arrival order; ties keep their input order.
fn arrival_order(requests: &[RequestSpec]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by(|&a, &b| requests[a].arrival_ms.total_cmp(&requests[b].arrival_ms));
    order
}

/// The prefix hits an infinite cache would give, computed from the prompt
/// tokens with kvbm's own hashing ([`TokenSequence`]), so it is exactly what
/// the block manager could match.
///
/// Requests are taken in arrival order (ties in slice order). For each, its
/// full blocks of `block_size` tokens are hashed; the leading run of blocks
/// whose sequence hash appeared in an earlier request counts as hits (the
/// first miss ends the run, as in `BlockPool::match_prefix`); then all its
/// full blocks join the cache. Only prompts are cached: generated tokens are
/// not known here. Fails only on a zero block size.
pub fn ideal_prefix_hits(
    requests: &[RequestSpec],
    block_size: usize,
) -> Result<PrefixStats, WorkloadError> {
    if block_size == 0 {
        return Err(invalid("block_size", "must be at least 1"));
    }
    let salt = kvbm_core::tokens::salt_hash(IDEAL_SALT);
    let mut seen = HashSet::new();
    let (mut prompt_tokens, mut hit_tokens, mut full) = (0u64, 0u64, 0usize);
    for i in arrival_order(requests) {
        let r = &requests[i];
        let seq = TokenSequence::from_tokens(&r.prompt, block_size, salt)
            .map_err(|e| invalid("block_size", e.to_string()))?;
        let hashes = seq.sequence_hashes();
        let hits = hashes.iter().take_while(|h| seen.contains(*h)).count();
        seen.extend(hashes);
        let hit = (hits * block_size) as u64;
        prompt_tokens += r.prompt.len() as u64;
        hit_tokens += hit;
        full += usize::from(!r.prompt.is_empty() && hit == r.prompt.len() as u64);
    }
    Ok(PrefixStats::new(
        requests.len(),
        prompt_tokens,
        hit_tokens,
        full,
    ))
}

/// The same quantity as [`ideal_prefix_hits`], computed from trace hash ids
/// alone, without tokens: the check the token path is measured against.
///
/// `block_tokens` is the tokens per hash id (512 for Mooncake). A request's
/// full blocks are its first `min(hash_ids.len(), prompt_len / block_tokens)`
/// ids; a block is a hit when the same *chain* of ids up to and including it
/// was seen before (a trie, not a set of ids, because a sequence hash names a
/// block together with its whole prefix). Agrees exactly with
/// [`ideal_prefix_hits`] at `block_size == block_tokens` for trace requests
/// (barring 64-bit hash collisions). Synthetic requests have no hash ids and
/// count as prompt tokens with no hits.
pub fn ideal_prefix_hits_from_hash_ids(
    requests: &[RequestSpec],
    block_tokens: usize,
) -> Result<PrefixStats, WorkloadError> {
    if block_tokens == 0 {
        return Err(invalid("block_tokens", "must be at least 1"));
    }
    // Trie over id chains: (parent node, id) -> node. Node 0 is the root.
    let mut trie: HashMap<(u64, u64), u64> = HashMap::new();
    let (mut prompt_tokens, mut hit_tokens, mut full) = (0u64, 0u64, 0usize);
    for i in arrival_order(requests) {
        let r = &requests[i];
        let ids = r.hash_ids();
        let full_blocks = ids.len().min(r.prompt.len() / block_tokens);
        let mut node = 0u64;
        let mut hits = 0usize;
        let mut run = true;
        for &id in &ids[..full_blocks] {
            let next_node = trie.len() as u64 + 1;
            node = match trie.entry((node, id)) {
                Entry::Occupied(e) => {
                    // Once the run is broken the chain is new, so later
                    // blocks cannot be found anyway; `run` makes that plain.
                    hits += usize::from(run);
                    *e.get()
                }
                Entry::Vacant(e) => {
                    run = false;
                    *e.insert(next_node)
                }
            };
        }
        let hit = (hits * block_tokens) as u64;
        prompt_tokens += r.prompt.len() as u64;
        hit_tokens += hit;
        full += usize::from(!r.prompt.is_empty() && hit == r.prompt.len() as u64);
    }
    Ok(PrefixStats::new(
        requests.len(),
        prompt_tokens,
        hit_tokens,
        full,
    ))
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::io::Cursor;

    fn line(ts: u64, input: u64, output: u64, ids: &[u64]) -> String {
        format!(
            r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": {output}, "hash_ids": {ids:?}}}"#
        )
    }

    fn small() -> MooncakeOptions {
        MooncakeOptions {
            block_tokens: 4,
            ..MooncakeOptions::default()
        }
    }

    fn parse(text: &str, opts: &MooncakeOptions) -> Result<Vec<RequestSpec>, WorkloadError> {
        parse_mooncake(Cursor::new(text.as_bytes()), opts)
    }

    fn line_error(text: &str) -> (usize, LineError) {
        match parse(text, &MooncakeOptions::default()) {
            Err(WorkloadError::Line { line, error }) => (line, error),
            other => panic!("expected a line error, got {other:?}"),
        }
    }

    // --- PRNG ---------------------------------------------------------------

    #[test]
    fn splitmix_matches_reference_values() {
        // Reference: the published SplitMix64 sequence for state 0
        // (e.g. Vigna's splitmix64.c).
        let mut r = SplitMix64(0);
        assert_eq!(r.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(r.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(r.next_u64(), 0x06c4_5d18_8009_454f);
    }

    #[test]
    fn hash_id_tokens_are_pinned() {
        // Pins the id -> tokens mapping: changing it changes every simulated
        // cache hash, and recorded runs would stop lining up.
        let t = hash_id_tokens(0, 4, DEFAULT_VOCAB);
        let again = hash_id_tokens(0, 4, DEFAULT_VOCAB);
        assert_eq!(t, again);
        assert!(t.iter().all(|&x| x < DEFAULT_VOCAB));
        assert_ne!(
            hash_id_tokens(0, 16, DEFAULT_VOCAB),
            hash_id_tokens(1, 16, DEFAULT_VOCAB)
        );
        // A partial block is a prefix of the full block.
        assert_eq!(
            &hash_id_tokens(7, 512, 100)[..10],
            &hash_id_tokens(7, 10, 100)[..]
        );
        assert_eq!(t, GOLDEN_ID0_TOKENS);
    }
    // Computed independently in Python from the definitions above
    // (SplitMix64 keyed by mix64(mix64(DOMAIN_HASH_ID) ^ id), token = output
    // mod vocab).
    const GOLDEN_ID0_TOKENS: [Token; 4] = [24345, 29702, 5086, 13424];

    // --- Mooncake parsing ---------------------------------------------------

    #[test]
    fn parses_a_trace_and_builds_prompts() {
        let text = [
            line(0, 10, 3, &[1, 2, 3]), // 4 + 4 + 2 tokens
            String::new(),              // blank lines are skipped
            "   ".to_string(),
            line(5, 8, 1, &[1, 2]),       // same first two blocks
            line(9, 6, 2, &[1, 2, 3, 4]), // ids past the prompt are dropped
        ]
        .join("\n");
        let opts = MooncakeOptions {
            time_scale: 2.0,
            ..small()
        };
        let reqs = parse(&text, &opts).unwrap();
        assert_eq!(reqs.len(), 3);
        let b = |id| hash_id_tokens(id, 4, DEFAULT_VOCAB);
        assert_eq!(reqs[0].id, "mc-1");
        assert_eq!(reqs[0].prompt.len(), 10);
        assert_eq!(&reqs[0].prompt[..4], &b(1)[..]);
        assert_eq!(&reqs[0].prompt[4..8], &b(2)[..]);
        assert_eq!(&reqs[0].prompt[8..], &b(3)[..2]);
        assert_eq!(reqs[0].output_len, 3);
        assert_eq!(reqs[1].id, "mc-4");
        assert_eq!(reqs[1].arrival_ms, 10.0);
        assert_eq!(reqs[1].prompt, reqs[0].prompt[..8]);
        assert_eq!(reqs[2].hash_ids(), &[1, 2]);
        assert_eq!(
            reqs[2].origin,
            Origin::Mooncake {
                line: 5,
                hash_ids: vec![1, 2]
            }
        );
    }

    #[test]
    fn prompt_longer_than_hash_ids_gets_unique_filler() {
        let text = [
            line(0, 10, 1, &[1]),
            line(0, 10, 1, &[1]),
            line(0, 3, 1, &[]),
        ]
        .join("\n");
        let reqs = parse(&text, &small()).unwrap();
        assert_eq!(reqs[0].prompt.len(), 10);
        assert_eq!(reqs[0].prompt[..4], reqs[1].prompt[..4]);
        // The filler is per line: two lines with the same ids differ after them.
        assert_ne!(reqs[0].prompt[4..], reqs[1].prompt[4..]);
        assert_eq!(reqs[2].prompt.len(), 3);
        // And it never looks like a shared block.
        let stats = ideal_prefix_hits(&reqs, 4).unwrap();
        assert_eq!(stats.hit_tokens, 4);
    }

    #[test]
    fn crlf_and_trailing_line_without_newline() {
        let text = format!("{}\r\n{}", line(0, 4, 1, &[1]), line(1, 4, 1, &[2]));
        assert_eq!(parse(&text, &small()).unwrap().len(), 2);
    }

    #[test]
    fn integral_floats_are_accepted_fractions_are_not() {
        let ok =
            r#"{"timestamp": 12.0, "input_length": 4.0, "output_length": 1, "hash_ids": [3.0]}"#;
        let r = parse(ok, &small()).unwrap();
        assert_eq!(r[0].arrival_ms, 12.0);
        assert_eq!(r[0].hash_ids(), &[3]);
        let bad = r#"{"timestamp": 12.5, "input_length": 4, "output_length": 1, "hash_ids": []}"#;
        assert_eq!(
            line_error(bad),
            (
                1,
                LineError::NotACount {
                    field: "timestamp",
                    found: "12.5".into()
                }
            )
        );
    }

    #[test]
    fn malformed_lines_name_their_line_and_problem() {
        let good = line(0, 4, 1, &[1]);
        let cases: Vec<(String, LineError)> = vec![
            ("{not json".into(), LineError::Json(String::new())),
            ("[1, 2]".into(), LineError::NotAnObject("an array of 2 elements".into())),
            ("42".into(), LineError::NotAnObject("42".into())),
            (
                r#"{"timestamp": 0, "output_length": 1, "hash_ids": []}"#.into(),
                LineError::MissingField("input_length"),
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 1}"#.into(),
                LineError::MissingField("hash_ids"),
            ),
            (
                r#"{"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": []}"#
                    .into(),
                LineError::NotACount {
                    field: "timestamp",
                    found: "-1".into(),
                },
            ),
            (
                r#"{"timestamp": 0, "input_length": "4", "output_length": 1, "hash_ids": []}"#
                    .into(),
                LineError::NotACount {
                    field: "input_length",
                    found: "\"4\"".into(),
                },
            ),
            (
                r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#
                    .into(),
                LineError::Zero("input_length"),
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": []}"#
                    .into(),
                LineError::Zero("output_length"),
            ),
            (
                r#"{"timestamp": 0, "input_length": 99999999999, "output_length": 1, "hash_ids": []}"#
                    .into(),
                LineError::OverCap {
                    field: "input_length",
                    value: 99_999_999_999,
                    max: DEFAULT_MAX_TOKENS,
                },
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 1e300, "hash_ids": []}"#
                    .into(),
                LineError::NotACount {
                    field: "output_length",
                    found: "1e+300".into(),
                },
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": 7}"#.into(),
                LineError::HashIdsNotArray("7".into()),
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, -2]}"#
                    .into(),
                LineError::BadHashId {
                    index: 1,
                    found: "-2".into(),
                },
            ),
            (
                r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, null]}"#
                    .into(),
                LineError::BadHashId {
                    index: 1,
                    found: "null".into(),
                },
            ),
        ];
        for (bad, want) in cases {
            let text = format!("{good}\n\n{bad}\n{good}\n");
            let (line, got) = line_error(&text);
            assert_eq!(line, 3, "{bad}");
            match (&want, &got) {
                (LineError::Json(_), LineError::Json(msg)) => {
                    assert!(msg.contains("column"), "{msg}");
                    assert!(!msg.contains("line 1"), "{msg}");
                }
                _ => assert_eq!(got, want, "{bad}"),
            }
            let err = parse(&text, &MooncakeOptions::default()).unwrap_err();
            assert!(err.to_string().starts_with("line 3: "), "{err}");
            assert_eq!(err.line(), Some(3));
            // The lenient parser keeps both good lines.
            let report =
                parse_mooncake_lenient(Cursor::new(text.as_bytes()), &MooncakeOptions::default())
                    .unwrap();
            assert_eq!(report.requests.len(), 2);
            assert_eq!(report.skipped.len(), 1);
            assert_eq!(report.skipped[0].line, 3);
        }
    }

    #[test]
    fn long_lines_are_rejected_and_skipped_without_losing_the_next() {
        let opts = MooncakeOptions {
            max_line_bytes: 100,
            ..small()
        };
        let long = line(0, 4, 1, &[7; 60]);
        assert!(long.len() > 100);
        let text = format!("{}\n{long}\n{}", line(0, 4, 1, &[1]), line(0, 4, 1, &[2]));
        let report = parse_mooncake_lenient(Cursor::new(text.as_bytes()), &opts).unwrap();
        assert_eq!(report.requests.len(), 2);
        assert_eq!(report.requests[1].id, "mc-3");
        assert_eq!(
            report.skipped,
            vec![SkippedLine {
                line: 2,
                error: LineError::TooLong { max: 100 }
            }]
        );
        // A line of exactly the cap is fine.
        let exact = format!("{:<100}", line(0, 4, 1, &[1]));
        assert_eq!(parse(&exact, &opts).unwrap().len(), 1);
        // An endless line at EOF is an error, not an allocation of the whole.
        let endless = "x".repeat(10_000);
        let (line, err) = match parse(&endless, &opts) {
            Err(WorkloadError::Line { line, error }) => (line, error),
            other => panic!("{other:?}"),
        };
        assert_eq!((line, err), (1, LineError::TooLong { max: 100 }));
    }

    #[test]
    fn a_line_with_no_end_in_sight_stops_reading_instead_of_skipping_forever() {
        let opts = MooncakeOptions {
            max_line_bytes: 100,
            max_skip_bytes: 1_000,
            ..small()
        };
        // Endless input, like /dev/zero: before the skip cap, this never
        // returned.
        let endless = io::BufReader::new(io::repeat(b'x'));
        let mut r = MooncakeReader::new(endless, opts.clone()).unwrap();
        match r.next() {
            Some(Err(WorkloadError::EndlessLine {
                line: 1,
                read: 1_101,
                max_line: 100,
            })) => {}
            other => panic!("{other:?}"),
        }
        assert!(r.next().is_none());
        // A newline just inside the skip cap is still found, and the next
        // line kept.
        let text = format!("{}\n{}\n", "x".repeat(1_100), line(0, 4, 1, &[1]));
        let report = parse_mooncake_lenient(Cursor::new(text.as_bytes()), &opts).unwrap();
        assert_eq!((report.requests.len(), report.skipped.len()), (1, 1));
        // One byte further and it is not.
        let text = format!("{}\n{}\n", "x".repeat(1_102), line(0, 4, 1, &[1]));
        let err = parse_mooncake_lenient(Cursor::new(text.as_bytes()), &opts).unwrap_err();
        assert!(
            matches!(err, WorkloadError::EndlessLine { line: 1, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("1101 bytes"), "{err}");
    }

    #[test]
    fn the_token_cap_stops_reading_at_the_line_that_crosses_it() {
        let opts = MooncakeOptions {
            max_total_tokens: Some(20),
            ..small()
        };
        // 5 + 5 + 5 tokens, a bad line (not counted), then 5 + 1 more.
        let text = [
            line(0, 4, 1, &[1]),
            line(0, 4, 1, &[2]),
            line(0, 4, 1, &[3]),
            "bad".into(),
            line(0, 4, 1, &[4]),
            line(0, 4, 2, &[5]),
            line(0, 4, 1, &[6]),
        ]
        .join("\n");
        let err = parse_mooncake_lenient(Cursor::new(text.as_bytes()), &opts).unwrap_err();
        assert!(
            matches!(err, WorkloadError::TooManyTokens { line: 6, max: 20 }),
            "{err}"
        );
        assert_eq!(err.line(), Some(6));
        // Exactly at the cap is fine: 26 by line 6, 31 by line 7.
        let cap = |max| MooncakeOptions {
            max_total_tokens: Some(max),
            ..opts.clone()
        };
        let err = parse_mooncake_lenient(Cursor::new(text.as_bytes()), &cap(26)).unwrap_err();
        assert_eq!(err.line(), Some(7), "{err}");
        let report = parse_mooncake_lenient(Cursor::new(text.as_bytes()), &cap(31)).unwrap();
        assert_eq!(report.requests.len(), 6);
        // `max_requests` ends reading before the cap is looked at.
        let report = parse_mooncake_lenient(
            Cursor::new(text.as_bytes()),
            &MooncakeOptions {
                max_requests: Some(4),
                ..opts
            },
        )
        .unwrap();
        assert_eq!(report.requests.len(), 4);
    }

    #[test]
    fn invalid_utf8_is_a_json_error() {
        let mut bytes = line(0, 4, 1, &[1]).into_bytes();
        bytes.push(b'\n');
        bytes.extend_from_slice(b"{\"timestamp\": \xff}\n");
        let err = parse_mooncake(Cursor::new(bytes), &small()).unwrap_err();
        assert!(matches!(
            err,
            WorkloadError::Line {
                line: 2,
                error: LineError::Json(_)
            }
        ));
    }

    #[test]
    fn io_errors_stop_reading_with_the_line_number() {
        struct Failing(usize);
        impl Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0 == 0 {
                    return Err(io::Error::other("disk on fire"));
                }
                self.0 -= 1;
                let l = format!(
                    "{}\n",
                    r#"{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": []}"#
                );
                buf[..l.len()].copy_from_slice(l.as_bytes());
                Ok(l.len())
            }
        }
        let r = io::BufReader::with_capacity(4096, Failing(2));
        let err = parse_mooncake_lenient(r, &small()).unwrap_err();
        assert!(matches!(err, WorkloadError::Io { line: 3, .. }), "{err}");
        let mut it = MooncakeReader::new(io::BufReader::new(Failing(1)), small()).unwrap();
        assert!(it.next().unwrap().is_ok());
        assert!(it.next().unwrap().is_err());
        assert!(it.next().is_none());
    }

    #[test]
    fn max_requests_counts_good_lines_only() {
        let text = [
            line(0, 4, 1, &[1]),
            "bad".into(),
            line(0, 4, 1, &[2]),
            line(0, 4, 1, &[3]),
        ]
        .join("\n");
        let opts = MooncakeOptions {
            max_requests: Some(2),
            ..small()
        };
        let report = parse_mooncake_lenient(Cursor::new(text.as_bytes()), &opts).unwrap();
        assert_eq!(report.requests.len(), 2);
        assert_eq!(report.requests[1].id, "mc-3");
        assert_eq!(report.skipped.len(), 1);
    }

    #[test]
    fn options_are_validated() {
        let bad = [
            MooncakeOptions {
                block_tokens: 0,
                ..Default::default()
            },
            MooncakeOptions {
                vocab: 0,
                ..Default::default()
            },
            MooncakeOptions {
                time_scale: -1.0,
                ..Default::default()
            },
            MooncakeOptions {
                time_scale: f64::NAN,
                ..Default::default()
            },
            MooncakeOptions {
                max_input_tokens: 0,
                ..Default::default()
            },
            MooncakeOptions {
                max_output_tokens: u64::MAX,
                ..Default::default()
            },
            MooncakeOptions {
                max_line_bytes: 0,
                ..Default::default()
            },
            MooncakeOptions {
                max_total_tokens: Some(0),
                ..Default::default()
            },
        ];
        for opts in bad {
            assert!(
                matches!(parse("", &opts), Err(WorkloadError::InvalidSetting { .. })),
                "{opts:?}"
            );
        }
        assert!(parse("", &MooncakeOptions::default()).unwrap().is_empty());
    }

    // --- property tests on the parser ---------------------------------------

    /// Byte-level mutations of a valid line.
    #[derive(Debug, Clone)]
    enum Mutation {
        Replace(usize, u8),
        Delete(usize, usize),
        Insert(usize, Vec<u8>),
        Truncate(usize),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        let junk = prop::collection::vec(
            prop_oneof![
                any::<u8>(),
                Just(b'-'),
                Just(b'.'),
                Just(b'e'),
                Just(b'"'),
                Just(b','),
                Just(b'9'),
                Just(b'\n'),
                Just(b'}'),
                Just(b']'),
            ],
            1..8,
        );
        prop_oneof![
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Replace(i, b)),
            (any::<usize>(), 1usize..10).prop_map(|(i, n)| Mutation::Delete(i, n)),
            (any::<usize>(), junk).prop_map(|(i, v)| Mutation::Insert(i, v)),
            any::<usize>().prop_map(Mutation::Truncate),
        ]
    }

    fn apply(line: &[u8], m: &Mutation) -> Vec<u8> {
        let mut v = line.to_vec();
        let n = v.len();
        match m {
            Mutation::Replace(i, b) => v[i % n] = *b,
            Mutation::Delete(i, k) => {
                let s = i % n;
                v.drain(s..(s + k).min(n));
            }
            Mutation::Insert(i, bytes) => {
                let s = i % (n + 1);
                v.splice(s..s, bytes.iter().copied());
            }
            Mutation::Truncate(i) => v.truncate(i % n),
        }
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
            let lines = bytes.split(|&b| b == b'\n').count();
            match parse_mooncake(Cursor::new(&bytes), &small()) {
                Ok(_) => {}
                Err(e) => {
                    let l = e.line().expect("parse errors carry a line");
                    prop_assert!(l >= 1 && l <= lines, "line {} of {}", l, lines);
                }
            }
            let report = parse_mooncake_lenient(Cursor::new(&bytes), &small()).unwrap();
            prop_assert!(report.requests.len() + report.skipped.len() <= lines);
        }

        #[test]
        fn random_json_ish_strings_never_panic(s in r#"[\{\}\[\]":,0-9a-z_ \n.e-]{0,200}"#) {
            let lines = s.split('\n').count();
            if let Err(e) = parse(&s, &small()) {
                let l = e.line().expect("parse errors carry a line");
                prop_assert!(l >= 1 && l <= lines);
            }
        }

        #[test]
        fn a_mutated_line_only_affects_itself(
            m in mutation(),
            ids in prop::collection::vec(0u64..1000, 0..6),
            input in 1u64..40,
        ) {
            let good_a = line(1, 5, 2, &[10, 11]);
            let good_b = line(3, 6, 1, &[10, 12]);
            let target = line(2, input, 3, &ids);
            let mutated = apply(target.as_bytes(), &m);
            let mut text = good_a.clone().into_bytes();
            text.push(b'\n');
            text.extend_from_slice(&mutated);
            text.push(b'\n');
            text.extend_from_slice(good_b.as_bytes());
            // The mutation may add newlines; the good lines are the first
            // and the last.
            let last_line = text.split(|&b| b == b'\n').count();
            let report = parse_mooncake_lenient(Cursor::new(&text), &small()).unwrap();
            prop_assert_eq!(report.requests.first().map(|r| r.id.clone()), Some("mc-1".to_string()));
            let last_id = format!("mc-{last_line}");
            prop_assert_eq!(report.requests.last().map(|r| r.id.clone()), Some(last_id));
            for s in &report.skipped {
                prop_assert!(s.line > 1 && s.line < last_line, "{:?}", s);
            }
            match parse_mooncake(Cursor::new(&text), &small()) {
                Ok(reqs) => {
                    prop_assert!(report.skipped.is_empty());
                    prop_assert_eq!(reqs, report.requests);
                }
                Err(e) => {
                    prop_assert_eq!(e.line(), report.skipped.first().map(|s| s.line));
                }
            }
        }

        #[test]
        fn token_and_hash_id_ideal_hits_agree(
            reqs in prop::collection::vec(
                (prop::collection::vec(0u64..6, 0..6), 1usize..30),
                0..25,
            )
        ) {
            // Small alphabets make repeats (and inconsistent prefixes, where
            // the same id follows different parents) common.
            let text: Vec<String> = reqs
                .iter()
                .enumerate()
                .map(|(i, (ids, len))| line(i as u64, *len as u64, 1, ids))
                .collect();
            let specs = parse(&text.join("\n"), &small()).unwrap();
            let by_tokens = ideal_prefix_hits(&specs, 4).unwrap();
            let by_ids = ideal_prefix_hits_from_hash_ids(&specs, 4).unwrap();
            prop_assert_eq!(by_tokens, by_ids);
        }
    }

    // --- ideal prefix hits --------------------------------------------------

    #[test]
    fn ideal_hits_count_the_leading_run_only() {
        // Second request: blocks 1 and 2 hit, 9 misses, then 3 would "hit" by
        // id but its chain differs; only the leading run counts.
        let text = [line(0, 12, 1, &[1, 2, 3]), line(1, 16, 1, &[1, 2, 9, 3])].join("\n");
        let reqs = parse(&text, &small()).unwrap();
        let s = ideal_prefix_hits(&reqs, 4).unwrap();
        assert_eq!((s.prompt_tokens, s.hit_tokens), (28, 8));
        assert_eq!(s.ratio, 8.0 / 28.0);
        assert_eq!(s, ideal_prefix_hits_from_hash_ids(&reqs, 4).unwrap());
        // A smaller block size sees the same prefix at finer grain.
        assert_eq!(ideal_prefix_hits(&reqs, 2).unwrap().hit_tokens, 8);
    }

    #[test]
    fn ideal_hits_follow_arrival_order_and_flag_full_prompt_hits() {
        // In file order the long request comes first, but it arrives later.
        let text = [line(10, 8, 1, &[1, 2]), line(0, 4, 1, &[1])].join("\n");
        let reqs = parse(&text, &small()).unwrap();
        let s = ideal_prefix_hits(&reqs, 4).unwrap();
        assert_eq!(s.hit_tokens, 4);
        assert_eq!(s.full_prompt_hits, 0);
        let text = [line(0, 8, 1, &[1, 2]), line(1, 4, 1, &[1])].join("\n");
        let s = ideal_prefix_hits(&parse(&text, &small()).unwrap(), 4).unwrap();
        assert_eq!((s.hit_tokens, s.full_prompt_hits), (4, 1));
        assert!(ideal_prefix_hits(&[], 0).is_err());
        assert!(ideal_prefix_hits_from_hash_ids(&[], 0).is_err());
        assert_eq!(ideal_prefix_hits(&[], 4).unwrap().ratio, 0.0);
    }

    #[test]
    fn partial_last_blocks_are_not_cached() {
        // The first request holds block 2 only partially: kvbm never hashes
        // a partial block, so the second request misses on it.
        let text = [line(0, 6, 1, &[1, 2]), line(1, 8, 1, &[1, 2])].join("\n");
        let reqs = parse(&text, &small()).unwrap();
        let s = ideal_prefix_hits(&reqs, 4).unwrap();
        assert_eq!(s.hit_tokens, 4);
        assert_eq!(s, ideal_prefix_hits_from_hash_ids(&reqs, 4).unwrap());
        // At block size 2 the shared part of the partial block does hit.
        assert_eq!(ideal_prefix_hits(&reqs, 2).unwrap().hit_tokens, 6);
    }

    // --- the sample trace ---------------------------------------------------

    /// The sample trace kept in the repository (`data/mooncake/`).
    const SAMPLE: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../data/mooncake/synthetic_trace.jsonl"
    );

    #[test]
    fn sample_trace_parses_and_its_ideal_hit_ratio_is_consistent() {
        // Missing is a failure, not a skip: the trace is part of the
        // repository.
        let file = std::fs::File::open(SAMPLE).unwrap_or_else(|e| {
            panic!("the sample Mooncake trace {SAMPLE} (data/mooncake/ in the repository): {e}")
        });
        let reqs = parse_mooncake(io::BufReader::new(file), &MooncakeOptions::default()).unwrap();
        assert_eq!(reqs.len(), 3993);
        assert!(reqs.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        let by_ids = ideal_prefix_hits_from_hash_ids(&reqs, MOONCAKE_BLOCK_TOKENS).unwrap();
        let by_tokens = ideal_prefix_hits(&reqs, MOONCAKE_BLOCK_TOKENS).unwrap();
        let at_16 = ideal_prefix_hits(&reqs, 16).unwrap();
        for (name, s) in [
            ("hash ids, 512", &by_ids),
            ("tokens, 512", &by_tokens),
            ("tokens, 16", &at_16),
        ] {
            eprintln!(
                "sample trace ideal prefix hits ({name}): {} / {} tokens = {:.4} ({} full-prompt hits)",
                s.hit_tokens, s.prompt_tokens, s.ratio, s.full_prompt_hits
            );
        }
        assert_eq!(by_tokens, by_ids);
        // Independently computed (Python, from the hash ids): 39,802,880 of
        // 61,194,628 prompt tokens. The paper quotes about 66%.
        assert_eq!(by_ids.prompt_tokens, 61_194_628);
        assert_eq!(by_ids.hit_tokens, 39_802_880);
        // Finer blocks can only find more (the shared head of partial
        // blocks), never less. (Block size 16 only: each token-path pass
        // costs seconds in an unoptimised test build.)
        assert!(at_16.hit_tokens >= by_tokens.hit_tokens);
    }

    // --- synthetic ----------------------------------------------------------

    fn cfg() -> SyntheticConfig {
        SyntheticConfig {
            seed: 42,
            num_requests: 200,
            arrival_rate_per_s: 50.0,
            prompt_len: LengthDist::Uniform { min: 64, max: 256 },
            output_len: LengthDist::Fixed(8),
            shared_prefix_ratio: 0.5,
            num_shared_prefixes: 3,
            shared_prefix_len: 48,
            vocab: 1000,
            max_len: 4096,
        }
    }

    #[test]
    fn generation_is_deterministic_per_seed() {
        let a = generate(&cfg()).unwrap();
        let b = generate(&cfg()).unwrap();
        assert_eq!(a, b);
        let c = generate(&SyntheticConfig { seed: 43, ..cfg() }).unwrap();
        assert_ne!(a, c);
        // A request's content does not depend on how many follow it.
        let short = generate(&SyntheticConfig {
            num_requests: 10,
            ..cfg()
        })
        .unwrap();
        assert_eq!(short[..], a[..10]);
        // Pinned: changing the streams changes every recorded synthetic run.
        assert_eq!(a[0].prompt.len(), GOLDEN_SYN_FIRST.0);
        assert_eq!(a[0].prompt[..4], GOLDEN_SYN_FIRST.1);
    }
    // Computed independently in Python from the definitions above: request
    // 0 of `cfg()` is not shared (coin 0.59 >= 0.5), 121 tokens long.
    const GOLDEN_SYN_FIRST: (usize, [Token; 4]) = (121, [454, 568, 577, 870]);

    #[test]
    fn generated_requests_respect_the_config() {
        let reqs = generate(&cfg()).unwrap();
        assert_eq!(reqs.len(), 200);
        assert!(reqs.windows(2).all(|w| w[0].arrival_ms <= w[1].arrival_ms));
        assert!(reqs[0].arrival_ms > 0.0);
        let mut shared = 0;
        for (i, r) in reqs.iter().enumerate() {
            assert_eq!(r.id, format!("syn-{i}"));
            assert_eq!(r.output_len, 8);
            assert!((64..=256).contains(&r.prompt.len()));
            assert!(r.prompt.iter().all(|&t| t < 1000));
            let Origin::Synthetic {
                index,
                shared_prefix,
            } = r.origin
            else {
                panic!("origin")
            };
            assert_eq!(index, i);
            if let Some(k) = shared_prefix {
                shared += 1;
                let first = reqs
                    .iter()
                    .find(|o| matches!(o.origin, Origin::Synthetic { shared_prefix: Some(j), .. } if j == k))
                    .unwrap();
                assert_eq!(r.prompt[..48], first.prompt[..48]);
            }
        }
        assert!((70..=130).contains(&shared), "{shared} of 200 shared");
        // Mean gap ~ 1/50 s = 20 ms.
        let mean_gap = reqs.last().unwrap().arrival_ms / reqs.len() as f64;
        assert!((14.0..=26.0).contains(&mean_gap), "{mean_gap}");
    }

    #[test]
    fn shared_prefixes_produce_ideal_hits_and_none_without() {
        let hits = |ratio| {
            let reqs = generate(&SyntheticConfig {
                shared_prefix_ratio: ratio,
                ..cfg()
            })
            .unwrap();
            ideal_prefix_hits(&reqs, 16).unwrap()
        };
        assert_eq!(hits(0.0).hit_tokens, 0);
        let all = hits(1.0);
        // Every request but the first of each prefix hits its 3 full blocks.
        assert_eq!(all.hit_tokens, (200 - 3) * 48);
    }

    #[test]
    fn short_samples_still_leave_a_token_after_the_prefix() {
        let reqs = generate(&SyntheticConfig {
            prompt_len: LengthDist::Fixed(10),
            shared_prefix_ratio: 1.0,
            ..cfg()
        })
        .unwrap();
        assert!(reqs.iter().all(|r| r.prompt.len() == 49));
    }

    #[test]
    fn lognormal_lengths_have_the_requested_mean_and_are_clipped() {
        let reqs = generate(&SyntheticConfig {
            num_requests: 4000,
            prompt_len: LengthDist::LogNormal {
                mean: 500.0,
                sigma: 0.8,
            },
            output_len: LengthDist::LogNormal {
                mean: 1e9,
                sigma: 3.0,
            },
            shared_prefix_ratio: 0.0,
            max_len: 100_000,
            ..cfg()
        })
        .unwrap();
        let mean = reqs.iter().map(|r| r.prompt.len() as f64).sum::<f64>() / 4000.0;
        assert!((440.0..=560.0).contains(&mean), "{mean}");
        assert!(reqs.iter().all(|r| (1..=100_000).contains(&r.output_len)));
        assert!(reqs.iter().any(|r| r.output_len == 100_000));
        // Absurd sigmas clip rather than misbehave.
        let odd = generate(&SyntheticConfig {
            num_requests: 50,
            prompt_len: LengthDist::LogNormal {
                mean: 1.0,
                sigma: 1e300,
            },
            ..cfg()
        })
        .unwrap();
        assert!(odd.iter().all(|r| (1..=4096).contains(&r.prompt.len())));
    }

    #[test]
    fn bad_configs_are_typed_errors() {
        let bad: Vec<(SyntheticConfig, &str)> = vec![
            (
                SyntheticConfig {
                    arrival_rate_per_s: 0.0,
                    ..cfg()
                },
                "arrival_rate_per_s",
            ),
            (
                SyntheticConfig {
                    arrival_rate_per_s: f64::INFINITY,
                    ..cfg()
                },
                "arrival_rate_per_s",
            ),
            (
                SyntheticConfig {
                    shared_prefix_ratio: 1.5,
                    ..cfg()
                },
                "shared_prefix_ratio",
            ),
            (
                SyntheticConfig {
                    shared_prefix_ratio: f64::NAN,
                    ..cfg()
                },
                "shared_prefix_ratio",
            ),
            (
                SyntheticConfig {
                    num_shared_prefixes: 0,
                    ..cfg()
                },
                "num_shared_prefixes",
            ),
            (
                SyntheticConfig {
                    shared_prefix_len: 4096,
                    ..cfg()
                },
                "shared_prefix_len",
            ),
            (
                SyntheticConfig {
                    prompt_len: LengthDist::Fixed(0),
                    ..cfg()
                },
                "prompt_len",
            ),
            (
                SyntheticConfig {
                    prompt_len: LengthDist::Uniform { min: 5, max: 4 },
                    ..cfg()
                },
                "prompt_len",
            ),
            (
                SyntheticConfig {
                    output_len: LengthDist::LogNormal {
                        mean: -1.0,
                        sigma: 1.0,
                    },
                    ..cfg()
                },
                "output_len",
            ),
            (
                SyntheticConfig {
                    output_len: LengthDist::Fixed(5000),
                    ..cfg()
                },
                "output_len",
            ),
            (SyntheticConfig { vocab: 0, ..cfg() }, "vocab"),
            (
                SyntheticConfig {
                    max_len: 0,
                    ..cfg()
                },
                "max_len",
            ),
        ];
        for (c, field) in bad {
            match generate(&c) {
                Err(WorkloadError::InvalidSetting { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        // No sharing: the prefix fields do not matter.
        let ok = SyntheticConfig {
            shared_prefix_ratio: 0.0,
            num_shared_prefixes: 0,
            shared_prefix_len: 0,
            ..cfg()
        };
        assert_eq!(generate(&ok).unwrap().len(), 200);
        assert!(generate(&SyntheticConfig::default()).is_ok());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn generation_never_panics_and_is_deterministic(
            seed in any::<u64>(),
            n in 0usize..30,
            rate in 1e-6f64..1e6,
            ratio in 0.0f64..=1.0,
            k in 1usize..4,
            plen in 1usize..64,
            mean in 0.5f64..500.0,
            sigma in 0.0f64..4.0,
        ) {
            let c = SyntheticConfig {
                seed,
                num_requests: n,
                arrival_rate_per_s: rate,
                prompt_len: LengthDist::LogNormal { mean, sigma },
                output_len: LengthDist::Uniform { min: 1, max: 9 },
                shared_prefix_ratio: ratio,
                num_shared_prefixes: k,
                shared_prefix_len: plen,
                vocab: 50,
                max_len: 1000,
            };
            let a = generate(&c).unwrap();
            prop_assert_eq!(&a, &generate(&c).unwrap());
            prop_assert_eq!(a.len(), n);
            for r in &a {
                prop_assert!(!r.prompt.is_empty() && r.prompt.len() <= 1000);
                prop_assert!(r.arrival_ms.is_finite());
            }
        }
    }
}
