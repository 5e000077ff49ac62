//! Decoding vLLM's (and SGLang's) KV-event payloads: msgpack, either the
//! positional envelope `[ts, events, data_parallel_rank]` or a map with the
//! keys `ts`, `events` and `data_parallel_rank`. Each event is a map with a
//! `type` key or, in older vLLM, a positional array whose first element is
//! the type name. Unknown keys and trailing positional fields are ignored;
//! missing trailing positional fields take their defaults.
//!
//! Nothing here panics on any input: a malformed envelope is an `Err`, a
//! malformed event inside a good envelope is skipped and counted in
//! [`KvBatch::bad_events`].

use kvbm_events::tier::Tier;
use rmpv::Value;

/// Deepest msgpack nesting accepted (real payloads nest 3 or 4 levels).
const MAX_DEPTH: usize = 32;

/// One decoded publisher batch.
#[derive(Debug, Clone, PartialEq)]
pub struct KvBatch {
    /// The publisher's timestamp (seconds since the epoch, `time.time()`).
    pub ts: f64,
    /// The events it carried, in order (malformed ones left out).
    pub events: Vec<KvEvent>,
    /// Events that could not be read and were skipped.
    pub bad_events: u64,
    /// vLLM's data-parallel rank, when given.
    pub dp_rank: Option<i64>,
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
        /// The tier (`medium`; GPU when absent).
        tier: Tier,
    },
    /// Blocks were evicted (`BlockRemoved`).
    Removed {
        /// Their hashes.
        block_hashes: Vec<u64>,
        /// The tier.
        tier: Tier,
    },
    /// Every block of a tier was dropped (`AllBlocksCleared`).
    AllCleared {
        /// The tier (GPU when absent).
        tier: Tier,
    },
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

/// Maps a medium name to a tier: `GPU`/`CUDA`/`DEVICE` → G1 Device,
/// `CPU`/`HOST`/`CPU_PINNED` → G2 Host, `STORAGE`/`DISK`/`SSD`/`LOCAL_FILE`
/// → G3 Disk (case-insensitive). Anything else is `None`.
pub fn tier_of_medium(medium: &str) -> Option<Tier> {
    match medium.to_ascii_uppercase().as_str() {
        "GPU" | "CUDA" | "DEVICE" | "G1" => Some(Tier::Device),
        "CPU" | "HOST" | "CPU_PINNED" | "G2" => Some(Tier::Host),
        "STORAGE" | "DISK" | "SSD" | "LOCAL_FILE" | "G3" => Some(Tier::Disk),
        _ => None,
    }
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
    let mut bad = 0u64;
    for e in events {
        match decode_event(e) {
            Some(ev) => out.push(ev),
            None => bad += 1,
        }
    }
    Ok(KvBatch {
        ts,
        events: out,
        bad_events: bad,
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

fn hashes(v: Option<&Value>) -> Option<Vec<u64>> {
    v?.as_array()?.iter().map(hash_of).collect()
}

fn tier(v: Option<&Value>) -> Option<Tier> {
    match v {
        None => Some(Tier::Device),
        Some(m) => tier_of_medium(m.as_str()?),
    }
}

fn decode_event(v: &Value) -> Option<KvEvent> {
    let f = fields(v)?;
    match f.ty {
        "BlockStored" => {
            let block_hashes = hashes(f.get("block_hashes"))?;
            let parent = match f.get("parent_block_hash") {
                None => None,
                Some(p) => Some(hash_of(p)?),
            };
            let num_tokens = match f.get("token_ids") {
                None => 0,
                Some(t) => t.as_array()?.len(),
            };
            let block_size = match f.get("block_size") {
                None => None,
                Some(b) => Some(b.as_u64()?),
            };
            Some(KvEvent::Stored {
                block_hashes,
                parent,
                num_tokens,
                block_size,
                tier: tier(f.get("medium"))?,
            })
        }
        "BlockRemoved" => Some(KvEvent::Removed {
            block_hashes: hashes(f.get("block_hashes"))?,
            tier: tier(f.get("medium"))?,
        }),
        "AllBlocksCleared" => Some(KvEvent::AllCleared {
            tier: tier(f.get("medium"))?,
        }),
        _ => None,
    }
}
