//! Reading frames and scanning a segment, with the torn-tail versus
//! corruption decision.
//!
//! Everything is generic over `Read + Seek` so that the same code runs on a
//! buffered file in production and on bytes in memory in tests. Bounds are
//! checked against the segment's length before anything is read or
//! allocated: a length field never sizes a buffer until it is known to be at
//! most [`MAX_BLOCK_BYTES`] and to fit in what remains of the file. Frames are
//! checked (bounds, checksum, header fields, order) but not decompressed:
//! that is the reader's, record by record.

use std::io::{self, Read, Seek, SeekFrom};

use super::CorruptReason;
use super::format::{
    FRAME_HEADER_LEN, FrameHeader, HeaderError, MAX_BLOCK_BYTES, SEGMENT_HEADER_LEN, SegmentHeader,
    frame_crc,
};
use super::index::IndexBuilder;

/// What reading one frame at a position found.
#[derive(Debug)]
pub(crate) enum Step {
    /// A complete frame whose checksum matches; its body is in the buffer.
    Frame(FrameHeader),
    /// Exactly at the end: no bytes left.
    End,
    /// A frame that is incomplete, oversized or fails its checksum. `next`
    /// is where the following frame would start if the length field is to
    /// be believed (a hint for the corruption check).
    Bad {
        reason: CorruptReason,
        next: Option<u64>,
    },
}

/// Reads the frame at `pos` (the reader is positioned there) without reading
/// past `end`. The body is left in `buf`, still compressed.
pub(crate) fn read_frame<R: Read>(
    r: &mut R,
    pos: u64,
    end: u64,
    buf: &mut Vec<u8>,
) -> io::Result<Step> {
    let available = end.saturating_sub(pos);
    if available == 0 {
        return Ok(Step::End);
    }
    if available < FRAME_HEADER_LEN {
        return Ok(Step::Bad {
            reason: CorruptReason::Truncated {
                needed: FRAME_HEADER_LEN,
                available,
            },
            next: None,
        });
    }
    let mut hb = [0u8; FRAME_HEADER_LEN as usize];
    r.read_exact(&mut hb)?;
    let h = FrameHeader::decode(&hb);
    if h.len > MAX_BLOCK_BYTES {
        return Ok(Step::Bad {
            reason: CorruptReason::TooLarge {
                len: h.len,
                max: MAX_BLOCK_BYTES,
            },
            next: None,
        });
    }
    if h.frame_len() > available {
        return Ok(Step::Bad {
            reason: CorruptReason::Truncated {
                needed: h.frame_len(),
                available,
            },
            next: None,
        });
    }
    // Bounded by both checks above.
    buf.clear();
    buf.resize(h.len as usize, 0);
    r.read_exact(buf)?;
    let computed = frame_crc(&hb, buf);
    if computed != h.crc {
        return Ok(Step::Bad {
            reason: CorruptReason::CrcMismatch {
                stored: h.crc,
                computed,
            },
            next: Some(pos + h.frame_len()),
        });
    }
    Ok(Step::Frame(h))
}

/// Reads and decodes a segment header from the start of `r`.
pub(crate) fn read_header<R: Read + Seek>(
    r: &mut R,
    file_len: u64,
) -> io::Result<Result<SegmentHeader, HeaderError>> {
    if file_len < SEGMENT_HEADER_LEN {
        return Ok(Err(HeaderError::Truncated { len: file_len }));
    }
    let mut b = [0u8; SEGMENT_HEADER_LEN as usize];
    r.seek(SeekFrom::Start(0))?;
    r.read_exact(&mut b)?;
    Ok(SegmentHeader::decode(&b))
}

/// How a segment's readable data ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SegmentEnd {
    /// Every byte after the header is a good record.
    Clean,
    /// The last segment ends in an incomplete or damaged record with nothing
    /// valid after it: the writer died mid-write. `bytes` from `offset` on
    /// are not records.
    Torn { offset: u64, bytes: u64 },
    /// A bad record with valid data after it, or in a segment that is not
    /// the last: everything before `offset` is readable, nothing after.
    Corrupt { offset: u64, reason: CorruptReason },
    /// The header names a format version this build does not read.
    Unsupported { version: u16 },
}

/// Result of scanning one segment file.
#[derive(Debug)]
pub(crate) struct SegmentScan {
    /// `None` when the header could not be read.
    pub header: Option<SegmentHeader>,
    /// The good records' index, still open so a writer can go on adding.
    pub index: IndexBuilder,
    pub end: SegmentEnd,
}

/// Settings of a scan.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScanParams {
    /// The first sequence number the file name announces.
    pub name_seq: u64,
    /// Last good sequence number of the segments before this one.
    pub prev_seq: Option<u64>,
    /// Only the last segment may end in a torn tail.
    pub last_segment: bool,
    pub index_every_records: u32,
    pub index_every_bytes: u64,
}

/// Reads a whole segment: its header, then every block frame, building its
/// index, until the end or the first bad frame, and says how it ends.
pub(crate) fn scan_segment<R: Read + Seek>(
    r: &mut R,
    file_len: u64,
    p: ScanParams,
) -> io::Result<SegmentScan> {
    let header = match read_header(r, file_len)? {
        Ok(h) => h,
        Err(e) => {
            let end = header_problem_end(r, file_len, e, &p)?;
            return Ok(SegmentScan {
                header: None,
                index: IndexBuilder::new(p.index_every_records, p.index_every_bytes),
                end,
            });
        }
    };
    if header.first_seq != p.name_seq {
        return Ok(SegmentScan {
            header: Some(header),
            index: IndexBuilder::new(p.index_every_records, p.index_every_bytes),
            end: SegmentEnd::Corrupt {
                offset: 0,
                reason: CorruptReason::NameMismatch {
                    name: p.name_seq,
                    header: header.first_seq,
                },
            },
        });
    }
    let mut builder = IndexBuilder::new(p.index_every_records, p.index_every_bytes);
    let mut buf = Vec::new();
    let mut pos = SEGMENT_HEADER_LEN;
    let mut prev = p.prev_seq;
    r.seek(SeekFrom::Start(pos))?;
    let end = loop {
        match read_frame(r, pos, file_len, &mut buf)? {
            Step::End => break SegmentEnd::Clean,
            Step::Frame(h) => {
                if let Some(reason) = check_frame(&h, pos, &header, prev) {
                    // A frame with a good checksum was written whole, so this
                    // is never a torn write.
                    break SegmentEnd::Corrupt {
                        offset: pos,
                        reason,
                    };
                }
                builder.push(&h, pos);
                prev = Some(h.last_seq);
                pos += h.frame_len();
            }
            Step::Bad { reason, next } => {
                break bad_frame_end(r, pos, file_len, reason, next, prev, &p)?;
            }
        }
    };
    Ok(SegmentScan {
        header: Some(header),
        index: builder,
        end,
    })
}

/// The checks every reader applies to a frame with a good checksum: its
/// header fields can describe a block, and its records follow the ones
/// before. A frame failing them was written whole, so this is never a torn
/// write.
pub(crate) fn check_frame(
    h: &FrameHeader,
    pos: u64,
    header: &SegmentHeader,
    prev: Option<u64>,
) -> Option<CorruptReason> {
    if let Err(why) = h.check() {
        return Some(CorruptReason::BadBlock(why));
    }
    if pos == SEGMENT_HEADER_LEN && h.first_seq != header.first_seq {
        return Some(CorruptReason::FirstSeqMismatch {
            seq: h.first_seq,
            expected: header.first_seq,
        });
    }
    match prev {
        Some(prev) if h.first_seq <= prev => Some(CorruptReason::SeqNotIncreasing {
            seq: h.first_seq,
            prev,
        }),
        _ => None,
    }
}

fn header_problem_end<R: Read + Seek>(
    r: &mut R,
    file_len: u64,
    e: HeaderError,
    p: &ScanParams,
) -> io::Result<SegmentEnd> {
    if let HeaderError::Unsupported(version) = e {
        return Ok(SegmentEnd::Unsupported { version });
    }
    // A segment is created by writing its header in one call, so a short or
    // garbled header in the last segment is a crash during creation unless
    // a valid record follows it.
    if p.last_segment && find_valid_frame(r, 0, file_len, p.prev_seq, None)?.is_none() {
        return Ok(SegmentEnd::Torn {
            offset: 0,
            bytes: file_len,
        });
    }
    Ok(SegmentEnd::Corrupt {
        offset: 0,
        reason: CorruptReason::BadHeader(e.to_string()),
    })
}

fn bad_frame_end<R: Read + Seek>(
    r: &mut R,
    pos: u64,
    file_len: u64,
    reason: CorruptReason,
    next: Option<u64>,
    prev: Option<u64>,
    p: &ScanParams,
) -> io::Result<SegmentEnd> {
    if p.last_segment && find_valid_frame(r, pos, file_len, prev, next)?.is_none() {
        Ok(SegmentEnd::Torn {
            offset: pos,
            bytes: file_len - pos,
        })
    } else {
        Ok(SegmentEnd::Corrupt {
            offset: pos,
            reason,
        })
    }
}

/// Bytes read at a time while looking for a valid frame.
const WINDOW_CHUNK: u64 = 64 << 10;

/// Looks for a frame that parses, fits, passes its checksum and continues the
/// sequence (`seq > after_seq`) anywhere strictly after `bad_at`, trying the
/// position the bad frame's length field points at first. Finding one means
/// the bad frame is damage in the middle of the log, not a torn tail.
///
/// Only runs on the last segment's first bad frame. Its cost is the bytes
/// after the bad frame times the candidate frames' lengths in the worst case;
/// a real torn tail is at most one partial record, so it is small there.
pub(crate) fn find_valid_frame<R: Read + Seek>(
    r: &mut R,
    bad_at: u64,
    end: u64,
    after_seq: Option<u64>,
    hint: Option<u64>,
) -> io::Result<Option<u64>> {
    if let Some(at) = hint.filter(|&at| at > bad_at) {
        let mut w = Window::new(at);
        if valid_frame_at(r, &mut w, at, end, after_seq)? {
            return Ok(Some(at));
        }
    }
    let mut w = Window::new(bad_at + 1);
    let mut at = bad_at + 1;
    while end
        .checked_sub(at)
        .is_some_and(|left| left >= FRAME_HEADER_LEN)
    {
        if valid_frame_at(r, &mut w, at, end, after_seq)? {
            return Ok(Some(at));
        }
        at += 1;
    }
    Ok(None)
}

fn valid_frame_at<R: Read + Seek>(
    r: &mut R,
    w: &mut Window,
    at: u64,
    end: u64,
    after_seq: Option<u64>,
) -> io::Result<bool> {
    if end.saturating_sub(at) < FRAME_HEADER_LEN {
        return Ok(false);
    }
    let hb: [u8; FRAME_HEADER_LEN as usize] = match w.get(r, at, FRAME_HEADER_LEN)?.try_into() {
        Ok(hb) => hb,
        Err(_) => return Ok(false),
    };
    let h = FrameHeader::decode(&hb);
    if h.len > MAX_BLOCK_BYTES
        || h.frame_len() > end - at
        || after_seq.is_some_and(|prev| h.first_seq <= prev)
    {
        return Ok(false);
    }
    let bytes = w.get(r, at, h.frame_len())?;
    if bytes.len() as u64 != h.frame_len() {
        return Ok(false);
    }
    let body = bytes.get(FRAME_HEADER_LEN as usize..).unwrap_or_default();
    Ok(frame_crc(&hb, body) == h.crc && h.check().is_ok())
}

/// A sliding window over the file for the corruption check: holds bytes
/// `[base, base + buf.len())` and grows only as far as a candidate frame
/// that is known to fit in the file.
struct Window {
    base: u64,
    buf: Vec<u8>,
}

impl Window {
    fn new(base: u64) -> Self {
        Self {
            base,
            buf: Vec::new(),
        }
    }

    /// Bytes `[at, at + n)`, or fewer if the file turns out shorter than
    /// the caller measured. Reads ahead by a chunk so that consecutive
    /// candidates rarely touch the file.
    fn get<R: Read + Seek>(&mut self, r: &mut R, at: u64, n: u64) -> io::Result<&[u8]> {
        let have_end = self.base + self.buf.len() as u64;
        if at < self.base || at > have_end {
            self.base = at;
            self.buf.clear();
        } else if at + n > have_end {
            // Drop what is behind the candidate before reading more.
            self.buf.drain(..(at - self.base) as usize);
            self.base = at;
        }
        let have = self.buf.len() as u64;
        let need = at - self.base + n;
        if need > have {
            let more = (need - have).max(WINDOW_CHUNK);
            r.seek(SeekFrom::Start(self.base + have))?;
            // `take` + `read_to_end` stops at the real end of the file, so
            // nothing is allocated for bytes that are not there.
            (&mut *r).take(more).read_to_end(&mut self.buf)?;
        }
        let start = (at - self.base) as usize;
        let stop = start.saturating_add(n as usize).min(self.buf.len());
        Ok(self.buf.get(start..stop).unwrap_or_default())
    }
}
