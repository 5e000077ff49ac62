//! Snapshots: opaque blobs (the recorder stores a serialized reducer state)
//! taken at a sequence number, so a replay can start from the nearest one
//! instead of the beginning of the log.
//!
//! Snapshots are derived data, like the index: one that is damaged,
//! truncated, or from another engine or schema is skipped with a warning and
//! counted, never reported as an error, because the log alone can always
//! rebuild the state. Each is one file `snapshot-<seq, 20 digits>.bin`,
//! written to a temporary name and renamed into place so that a reader never
//! sees half of one.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use super::LogError;
use super::format::{SEQ_DIGITS, parse_seq_digits, u16_at, u32_at, u64_at};
use super::store::Store;

const SNAPSHOT_MAGIC: [u8; 8] = *b"KVBMSNAP";
const SNAPSHOT_VERSION: u16 = 1;
/// Length of a snapshot file's header.
pub const SNAPSHOT_HEADER_LEN: usize = 56;
const PREFIX: &str = "snapshot-";
const SUFFIX: &str = ".bin";

/// A snapshot read back from the log directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The state is the one after applying every record up to and including
    /// this sequence number.
    pub seq: u64,
    /// Timestamp of that record.
    pub ts_ns: u64,
    /// Schema version of the log it belongs to.
    pub schema_version: u32,
    /// Engine of the log it belongs to.
    pub engine_id: u64,
    /// The blob, as given to `write_snapshot`.
    pub bytes: Vec<u8>,
    /// Where it was read from.
    pub path: PathBuf,
}

/// The fixed fields of a snapshot file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SnapshotHeader {
    pub schema_version: u32,
    pub engine_id: u64,
    pub seq: u64,
    pub ts_ns: u64,
    pub len: u64,
    pub crc: u32,
}

pub(crate) fn file_name(seq: u64) -> String {
    format!("{PREFIX}{seq:0width$}{SUFFIX}", width = SEQ_DIGITS)
}

pub(crate) fn parse_file_name(name: &str) -> Option<u64> {
    parse_seq_digits(name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?)
}

pub(crate) fn is_temp_name(name: &str) -> bool {
    name.strip_suffix(".tmp")
        .and_then(parse_file_name)
        .is_some()
}

fn encode_header(h: &SnapshotHeader) -> [u8; SNAPSHOT_HEADER_LEN] {
    let mut b = [0u8; SNAPSHOT_HEADER_LEN];
    b[0..8].copy_from_slice(&SNAPSHOT_MAGIC);
    b[8..10].copy_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    b[10..12].copy_from_slice(&(SNAPSHOT_HEADER_LEN as u16).to_le_bytes());
    b[12..16].copy_from_slice(&h.schema_version.to_le_bytes());
    b[16..24].copy_from_slice(&h.engine_id.to_le_bytes());
    b[24..32].copy_from_slice(&h.seq.to_le_bytes());
    b[32..40].copy_from_slice(&h.ts_ns.to_le_bytes());
    b[40..48].copy_from_slice(&h.len.to_le_bytes());
    // 48..52 reserved, zero; 52..56 the checksum.
    b[52..56].copy_from_slice(&h.crc.to_le_bytes());
    b
}

fn snapshot_crc(header: &[u8; SNAPSHOT_HEADER_LEN], payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&header[0..52]), payload)
}

fn decode_header(b: &[u8; SNAPSHOT_HEADER_LEN]) -> Result<SnapshotHeader, String> {
    if b[0..8] != SNAPSHOT_MAGIC {
        return Err("bad magic".into());
    }
    let version = u16_at(b, 8);
    if version != SNAPSHOT_VERSION || usize::from(u16_at(b, 10)) != SNAPSHOT_HEADER_LEN {
        return Err(format!("unsupported snapshot version {version}"));
    }
    Ok(SnapshotHeader {
        schema_version: u32_at(b, 12),
        engine_id: u64_at(b, 16),
        seq: u64_at(b, 24),
        ts_ns: u64_at(b, 32),
        len: u64_at(b, 40),
        crc: u32_at(b, 52),
    })
}

/// Writes `snapshot-<seq>.bin` atomically; with `sync` the file and the
/// directory are fsynced so that the snapshot survives a power loss.
pub(crate) fn write(
    dir: &Path,
    seq: u64,
    ts_ns: u64,
    schema_version: u32,
    engine_id: u64,
    bytes: &[u8],
    sync: bool,
) -> io::Result<PathBuf> {
    let mut h = SnapshotHeader {
        schema_version,
        engine_id,
        seq,
        ts_ns,
        len: bytes.len() as u64,
        crc: 0,
    };
    h.crc = snapshot_crc(&encode_header(&h), bytes);
    let path = dir.join(file_name(seq));
    let tmp = dir.join(format!("{}.tmp", file_name(seq)));
    let mut f = File::create(&tmp)?;
    f.write_all(&encode_header(&h))?;
    f.write_all(bytes)?;
    if sync {
        f.sync_all()?;
    }
    drop(f);
    fs::rename(&tmp, &path)?;
    if sync {
        super::sync_dir(dir)?;
    }
    Ok(path)
}

/// Every `snapshot-<seq>.bin` in the store, by sequence number.
pub(crate) fn list(store: &Store) -> Result<Vec<(u64, String)>, LogError> {
    let mut out: Vec<(u64, String)> = store
        .names()?
        .into_iter()
        .filter_map(|name| Some((parse_file_name(&name)?, name)))
        .collect();
    out.sort();
    Ok(out)
}

/// Reads only the header of a snapshot file.
pub(crate) fn read_header(store: &Store, name: &str) -> Result<SnapshotHeader, String> {
    let (mut f, _) = store
        .open(name, SNAPSHOT_HEADER_LEN)
        .map_err(|e| e.to_string())?;
    let mut b = [0u8; SNAPSHOT_HEADER_LEN];
    f.read_exact(&mut b).map_err(|e| format!("header: {e}"))?;
    decode_header(&b)
}

/// Reads and checks a whole snapshot file. The payload length must match the
/// file's real size before anything is allocated for it.
pub(crate) fn read(store: &Store, name: &str, name_seq: u64) -> Result<Snapshot, String> {
    let (mut f, file_len) = store.open(name, 64 << 10).map_err(|e| e.to_string())?;
    let mut hb = [0u8; SNAPSHOT_HEADER_LEN];
    f.read_exact(&mut hb).map_err(|e| format!("header: {e}"))?;
    let h = decode_header(&hb)?;
    if h.seq != name_seq {
        return Err(format!("holds seq {} but is named for {name_seq}", h.seq));
    }
    if Some(h.len) != file_len.checked_sub(SNAPSHOT_HEADER_LEN as u64) {
        return Err(format!(
            "declares {} bytes but the file holds {}",
            h.len,
            file_len.saturating_sub(SNAPSHOT_HEADER_LEN as u64)
        ));
    }
    let mut bytes = Vec::new();
    f.take(h.len)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 != h.len {
        return Err("file shrank while reading".into());
    }
    let computed = snapshot_crc(&hb, &bytes);
    if computed != h.crc {
        return Err(format!(
            "checksum mismatch (stored {:#010x}, computed {computed:#010x})",
            h.crc
        ));
    }
    Ok(Snapshot {
        seq: h.seq,
        ts_ns: h.ts_ns,
        schema_version: h.schema_version,
        engine_id: h.engine_id,
        bytes,
        path: store.path(name),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(file_name(7), "snapshot-00000000000000000007.bin");
        assert_eq!(parse_file_name(&file_name(7)), Some(7));
        assert_eq!(parse_file_name("snapshot-7.bin"), None);
        assert!(is_temp_name("snapshot-00000000000000000007.bin.tmp"));
        assert!(!is_temp_name("other.tmp"));
    }

    #[test]
    fn round_trip_and_every_damage_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::Dir(dir.path().to_path_buf());
        let path = write(dir.path(), 9, 99, 3, 4, b"state bytes", false).expect("write");
        let name = file_name(9);
        let read = |seq| read(&store, &name, seq);
        let s = read(9).expect("read");
        assert_eq!(
            (s.seq, s.ts_ns, s.schema_version, s.engine_id),
            (9, 99, 3, 4)
        );
        assert_eq!(s.bytes, b"state bytes");
        assert_eq!(
            read(8).map(|_| ()),
            Err("holds seq 9 but is named for 8".into())
        );
        let good = fs::read(&path).expect("read file");
        for i in 0..good.len() {
            let mut d = good.clone();
            d[i] ^= 0x04;
            fs::write(&path, &d).expect("write");
            assert!(read(9).is_err(), "flip at {i} accepted");
        }
        for cut in 0..good.len() {
            fs::write(&path, &good[..cut]).expect("write");
            assert!(read(9).is_err(), "cut at {cut} accepted");
        }
    }
}
