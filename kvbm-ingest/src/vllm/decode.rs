//! Decoding vLLM's (and SGLang's) KV-event payloads: msgpack, either the
//! positional envelope `[ts, events, data_parallel_rank]` or a map with the
//! keys `ts`, `events` and `data_parallel_rank`. Each event is a map with a
//! `type` key or, in older vLLM, a positional array whose first element is
//! the type name. Unknown keys and trailing positional fields are ignored;
//! missing trailing positional fields take their defaults.
//!
//! Nothing here panics on any input: a malformed envelope is an `Err`; an
//! event inside a good envelope that cannot be used (malformed, of a type
//! or on a medium kvbm does not know) is skipped and counted by reason in
//! [`KvBatch::skipped`], which the recorder's summary and the console show.
//!
//! Media ([`Medium`]): every medium vLLM (`GPU`, `CPU`, `STORAGE`) and
//! SGLang (`GPU`, `CPU_PINNED`, `DISK`, `EXTERNAL`) define has a tier:
//! GPU → G1; CPU and CPU_PINNED → G2; STORAGE, DISK and EXTERNAL (SGLang's
//! shared or remote pool, its L4) → G3, kvbm's outermost tier. A few
//! aliases are accepted too (see [`Medium::parse`]). Two media on one tier
//! (DISK and EXTERNAL) stay apart as holders of a block (see
//! [`translate`](super::translate)). A missing medium is GPU, as in vLLM.

use kvbm_events::tier::Tier;
use rmpv::Value;
use serde::Serialize;

/// Deepest msgpack nesting accepted (real payloads nest 3 or 4 levels).
const MAX_DEPTH: usize = 32;

/// One decoded publisher batch.
#[derive(Debug, Clone, PartialEq)]
pub struct KvBatch {
    /// The publisher's timestamp (seconds since the epoch, `time.time()`).
    pub ts: f64,
    /// The events it carried, in order (skipped ones left out).
    pub events: Vec<KvEvent>,
    /// Events that were skipped, by reason.
    pub skipped: Skipped,
    /// vLLM's data-parallel rank, when given.
    pub dp_rank: Option<i64>,
}

/// Where a block lives, as the engine names it: the `medium` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Medium {
    /// `GPU` (both engines; also the default when absent).
    Gpu,
    /// vLLM's `CPU`.
    Cpu,
    /// SGLang's `CPU_PINNED`.
    CpuPinned,
    /// vLLM's `STORAGE`.
    Storage,
    /// SGLang's `DISK`.
    Disk,
    /// SGLang's `EXTERNAL`: a shared or remote pool (its L4).
    External,
}

impl Medium {
    /// Every medium, for documentation and tests.
    pub const ALL: [Medium; 6] = [
        Medium::Gpu,
        Medium::Cpu,
        Medium::CpuPinned,
        Medium::Storage,
        Medium::Disk,
        Medium::External,
    ];

    /// Reads a medium name, case-insensitively: the engines' names above,
    /// and the aliases `CUDA`/`DEVICE`/`G1` (GPU), `HOST`/`G2` (CPU),
    /// `SSD`/`LOCAL_FILE`/`G3` (DISK). Anything else is `None`.
    pub fn parse(name: &str) -> Option<Medium> {
        Some(match name.to_ascii_uppercase().as_str() {
            "GPU" | "CUDA" | "DEVICE" | "G1" => Medium::Gpu,
            "CPU" | "HOST" | "G2" => Medium::Cpu,
            "CPU_PINNED" => Medium::CpuPinned,
            "STORAGE" => Medium::Storage,
            "DISK" | "SSD" | "LOCAL_FILE" | "G3" => Medium::Disk,
            "EXTERNAL" => Medium::External,
            _ => return None,
        })
    }

    /// The engine's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::CpuPinned => "CPU_PINNED",
            Medium::Storage => "STORAGE",
            Medium::Disk => "DISK",
            Medium::External => "EXTERNAL",
        }
    }

    /// The kvbm tier it maps to (see the module docs).
    pub fn tier(self) -> Tier {
        match self {
            Medium::Gpu => Tier::Device,
            Medium::Cpu | Medium::CpuPinned => Tier::Host,
            Medium::Storage | Medium::Disk | Medium::External => Tier::Disk,
        }
    }
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks became cached (`BlockStored`).
    Stored {
        /// Their hashes, as u64 (see [`hash_of`]).
        block_hashes: Vec<u64>,
        /// The parent of the first block.
        parent: Option<u64>,
        /// Tokens the blocks hold (`token_ids` length).
        num_tokens: usize,
        /// `block_size`, when given.
        block_size: Option<u64>,
        /// The medium (GPU when absent).
        medium: Medium,
        /// vLLM's KV-cache group (`group_idx`), when given.
        group: Option<i64>,
    },
    /// Blocks were evicted (`BlockRemoved`).
    Removed {
        /// Their hashes.
        block_hashes: Vec<u64>,
        /// The medium (GPU when absent).
        medium: Medium,
        /// The KV-cache group, when given.
        group: Option<i64>,
    },
    /// Every block of a medium was dropped (`AllBlocksCleared`).
    AllCleared {
        /// The medium (GPU when absent).
        medium: Medium,
    },
}

impl KvEvent {
    /// The kvbm tier the event is about.
    pub fn tier(&self) -> Tier {
        match self {
            KvEvent::Stored { medium, .. }
            | KvEvent::Removed { medium, .. }
            | KvEvent::AllCleared { medium } => medium.tier(),
        }
    }
}

/// Events skipped inside good payloads, by reason.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// A `medium` that is none of [`Medium`]'s names.
    pub unknown_medium: u64,
    /// A `type` other than `BlockStored`, `BlockRemoved`, `AllBlocksCleared`.
    pub unknown_type: u64,
    /// Not a map or array, or a field of the wrong type.
    pub malformed: u64,
    /// The last skip, in words (e.g. ``medium `TAPE` is not one kvbm maps``).
    pub last: Option<String>,
}

impl Skipped {
    /// Events skipped, all reasons.
    pub fn total(&self) -> u64 {
        self.unknown_medium + self.unknown_type + self.malformed
    }

    /// Adds `other`'s counts (its `last` wins when it has one).
    pub fn add(&mut self, other: &Skipped) {
        self.unknown_medium += other.unknown_medium;
        self.unknown_type += other.unknown_type;
        self.malformed += other.malformed;
        if other.last.is_some() {
            self.last.clone_from(&other.last);
        }
    }

    fn count(&mut self, why: Skip) {
        let text = match &why {
            Skip::Medium(m) => format!("medium `{m}` is not one kvbm maps"),
            Skip::Type(t) => format!("event type `{t}` is not one kvbm reads"),
            Skip::Malformed(what) => format!("malformed event: {what}"),
        };
        match why {
            Skip::Medium(_) => self.unknown_medium += 1,
            Skip::Type(_) => self.unknown_type += 1,
            Skip::Malformed(_) => self.malformed += 1,
        }
        self.last = Some(text);
    }
}

impl std::fmt::Display for Skipped {
    /// `3 (unknown medium 2, unknown type 1, malformed 0; last: …)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (unknown medium {}, unknown type {}, malformed {}",
            self.total(),
            self.unknown_medium,
            self.unknown_type,
            self.malformed
        )?;
        if let Some(l) = &self.last {
            write!(f, "; last: {l}")?;
        }
        write!(f, ")")
    }
}

/// Why one event was skipped.
enum Skip {
    Medium(String),
    Type(String),
    Malformed(&'static str),
}

/// Why a payload could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack (or truncated).
    #[error("not msgpack: {0}")]
    Msgpack(String),
    /// Bytes after the value.
    #[error("{0} trailing bytes after the msgpack value")]
    Trailing(usize),
    /// msgpack of the wrong shape.
    #[error("unexpected shape: {0}")]
    Shape(&'static str),
}

/// Maps a medium name to its tier ([`Medium::parse`] then
/// [`Medium::tier`]); `None` for a name kvbm does not map.
pub fn tier_of_medium(medium: &str) -> Option<Tier> {
    Medium::parse(medium).map(Medium::tier)
}

/// A block hash as u64: an unsigned integer as is (values above
/// `i64::MAX` included), a negative one as its two's-complement bit
/// pattern, a byte string (or a text string) as the xxh3-64 of its bytes
/// (seed 0), so the mapping is deterministic across runs and processes.
pub fn hash_of(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) => Some(xxhash_rust::xxh3::xxh3_64(b)),
        Value::String(s) => Some(xxhash_rust::xxh3::xxh3_64(s.as_bytes())),
        _ => None,
    }
}

/// Decodes one payload frame.
pub fn decode_payload(bytes: &[u8]) -> Result<KvBatch, DecodeError> {
    let mut rd = bytes;
    let v = rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::Trailing(rd.len()));
    }
    decode_value(&v)
}

fn map_get<'a>(m: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    m.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .filter(|v| !v.is_nil())
}

/// Decodes an already parsed payload value.
pub fn decode_value(v: &Value) -> Result<KvBatch, DecodeError> {
    let (ts, events, rank) = match v {
        Value::Array(a) => (a.first(), a.get(1), a.get(2)),
        Value::Map(m) => (
            map_get(m, "ts"),
            map_get(m, "events"),
            map_get(m, "data_parallel_rank").or_else(|| map_get(m, "dp_rank")),
        ),
        _ => return Err(DecodeError::Shape("the envelope is not an array or a map")),
    };
    let ts = match ts {
        Some(Value::F64(f)) => *f,
        Some(Value::F32(f)) => f64::from(*f),
        Some(Value::Integer(i)) => i.as_f64().unwrap_or(0.0),
        _ => return Err(DecodeError::Shape("ts is not a number")),
    };
    let Some(Value::Array(events)) = events else {
        return Err(DecodeError::Shape("events is not an array"));
    };
    let dp_rank = match rank {
        None | Some(Value::Nil) => None,
        Some(Value::Integer(i)) => i.as_i64(),
        Some(_) => return Err(DecodeError::Shape("data_parallel_rank is not an integer")),
    };
    let mut out = Vec::with_capacity(events.len());
    let mut skipped = Skipped::default();
    for e in events {
        match decode_event(e) {
            Ok(ev) => out.push(ev),
            Err(why) => skipped.count(why),
        }
    }
    Ok(KvBatch {
        ts,
        events: out,
        skipped,
        dp_rank,
    })
}

/// The fields of one event, by name, whichever shape it came in.
struct Fields<'a> {
    ty: &'a str,
    shape: Shape<'a>,
}

enum Shape<'a> {
    Map(&'a [(Value, Value)]),
    /// The elements after the type name, and their names in order.
    Array(&'a [Value], &'static [&'static str]),
}

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        match self.shape {
            Shape::Map(m) => map_get(m, key),
            Shape::Array(a, order) => {
                let i = order.iter().position(|o| *o == key)?;
                a.get(i).filter(|v| !v.is_nil())
            }
        }
    }
}

/// Field order of the positional (array) forms, after the type name.
const STORED_ORDER: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
];
const REMOVED_ORDER: &[&str] = &["block_hashes", "medium"];
const CLEARED_ORDER: &[&str] = &["medium"];

fn fields(v: &Value) -> Option<Fields<'_>> {
    match v {
        Value::Map(m) => Some(Fields {
            ty: map_get(m, "type")?.as_str()?,
            shape: Shape::Map(m),
        }),
        Value::Array(a) => {
            let ty = a.first()?.as_str()?;
            let order: &'static [&'static str] = match ty {
                "BlockStored" => STORED_ORDER,
                "BlockRemoved" => REMOVED_ORDER,
                _ => CLEARED_ORDER,
            };
            Some(Fields {
                ty,
                shape: Shape::Array(&a[1..], order),
            })
        }
        _ => None,
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, Skip> {
    v.and_then(Value::as_array)
        .ok_or(Skip::Malformed("block_hashes is missing or not a list"))?
        .iter()
        .map(|h| hash_of(h).ok_or(Skip::Malformed("a block hash is not an integer or bytes")))
        .collect()
}

fn medium(v: Option<&Value>) -> Result<Medium, Skip> {
    match v {
        None => Ok(Medium::Gpu),
        Some(m) => {
            let name = m
                .as_str()
                .ok_or(Skip::Malformed("medium is not a string"))?;
            Medium::parse(name).ok_or_else(|| Skip::Medium(kvbm_events::text::clip(name, 40)))
        }
    }
}

fn group(v: Option<&Value>) -> Result<Option<i64>, Skip> {
    match v {
        None => Ok(None),
        Some(g) => g
            .as_i64()
            .map(Some)
            .ok_or(Skip::Malformed("group_idx is not an integer")),
    }
}

fn decode_event(v: &Value) -> Result<KvEvent, Skip> {
    let f = fields(v).ok_or(Skip::Malformed(
        "not a map with a `type` or an array led by one",
    ))?;
    match f.ty {
        "BlockStored" => {
            let block_hashes = hashes(f.get("block_hashes"))?;
            let parent = match f.get("parent_block_hash") {
                None => None,
                Some(p) => Some(hash_of(p).ok_or(Skip::Malformed("parent_block_hash"))?),
            };
            let num_tokens = match f.get("token_ids") {
                None => 0,
                Some(t) => t
                    .as_array()
                    .ok_or(Skip::Malformed("token_ids is not a list"))?
                    .len(),
            };
            let block_size = match f.get("block_size") {
                None => None,
                Some(b) => Some(
                    b.as_u64()
                        .ok_or(Skip::Malformed("block_size is not an integer"))?,
                ),
            };
            Ok(KvEvent::Stored {
                block_hashes,
                parent,
                num_tokens,
                block_size,
                medium: medium(f.get("medium"))?,
                group: group(f.get("group_idx"))?,
            })
        }
        "BlockRemoved" => Ok(KvEvent::Removed {
            block_hashes: hashes(f.get("block_hashes"))?,
            medium: medium(f.get("medium"))?,
            group: group(f.get("group_idx"))?,
        }),
        "AllBlocksCleared" => Ok(KvEvent::AllCleared {
            medium: medium(f.get("medium"))?,
        }),
        other => Err(Skip::Type(kvbm_events::text::clip(other, 40))),
    }
}
