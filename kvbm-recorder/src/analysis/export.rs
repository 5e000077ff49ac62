//! `kvbm-recorder export`: events out to formats other tools read.
//!
//! - **JSON lines** ([`JsonLinesWriter`], [`write_jsonl`]): one event per
//!   line, the serde form of [`Event`] (`{"engine":0,"seq":…,"kind":{…}}`
//!   with the kind tagged by name), for `jq`, pandas or a quick grep.
//! - **Chrome trace JSON** ([`ChromeTraceWriter`], [`write_chrome_trace`]):
//!   the Trace Event Format that Perfetto (ui.perfetto.dev) and
//!   chrome://tracing open. One process per engine (`pid` = engine id);
//!   one thread track per request (`tid` = its stable track number, named
//!   by a `thread_name` metadata event carrying the request id, and sorted
//!   by first appearance); each slot state a complete event (`"ph":"X"`);
//!   each transfer an async span (`"b"`/`"e"`, `id` = transfer id, `cat` =
//!   direction, so Perfetto groups transfers of one direction on one
//!   track); breakpoint hits and first tokens as instant events (`"i"`).
//!   Times are microseconds with three decimals, exact to the nanosecond,
//!   and `displayTimeUnit` is `ns`.
//!
//! Both write as they go through a `BufWriter`: nothing is built in memory
//! beyond what the timeline needs to close a span (one entry per live
//! request and in-flight transfer), so a long log exports in constant memory
//! apart from that.

use super::timeline::{StateInterval, TimelineBuilder, TimelineItem, TrackId, TransferSpan};
use kvbm_events::Event;
use std::borrow::Borrow;
use std::io::{self, BufWriter, Write};

/// Export failures.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The writer failed.
    #[error("writing the export failed: {0}")]
    Io(#[from] io::Error),
    /// An event could not be serialised.
    #[error("serialising an event failed: {0}")]
    Json(#[from] serde_json::Error),
}

/// Writes events as JSON lines.
#[derive(Debug)]
pub struct JsonLinesWriter<W: Write> {
    w: BufWriter<W>,
    written: u64,
}

impl<W: Write> JsonLinesWriter<W> {
    /// A writer over `w` (buffered here; pass the raw file or stdout).
    pub fn new(w: W) -> Self {
        JsonLinesWriter {
            w: BufWriter::new(w),
            written: 0,
        }
    }

    /// Writes one event and a newline.
    pub fn write(&mut self, ev: &Event) -> Result<(), ExportError> {
        serde_json::to_writer(&mut self.w, ev)?;
        self.w.write_all(b"\n")?;
        self.written += 1;
        Ok(())
    }

    /// Events written.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Flushes and hands back the writer.
    pub fn finish(self) -> Result<W, ExportError> {
        self.w.into_inner().map_err(|e| e.into_error().into())
    }
}

impl ExportError {
    /// Whether the reader went away (a closed pipe, as with `| head`):
    /// not a failure of the export.
    pub fn is_broken_pipe(&self) -> bool {
        let kind = match self {
            ExportError::Io(e) => Some(e.kind()),
            ExportError::Json(e) => e.io_error_kind(),
        };
        kind == Some(io::ErrorKind::BrokenPipe)
    }
}

/// Writes a whole stream as JSON lines; returns the number of events.
pub fn write_jsonl<E: Borrow<Event>, W: Write>(
    events: impl IntoIterator<Item = E>,
    w: W,
) -> Result<u64, ExportError> {
    let mut j = JsonLinesWriter::new(w);
    for e in events {
        j.write(e.borrow())?;
    }
    let n = j.written();
    j.finish()?;
    Ok(n)
}

/// What goes into a Chrome trace besides state spans and transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChromeOptions {
    /// Instant events for breakpoint hits.
    pub breakpoints: bool,
    /// Instant events for each request's first token.
    pub first_tokens: bool,
}

impl Default for ChromeOptions {
    fn default() -> Self {
        ChromeOptions {
            breakpoints: true,
            first_tokens: true,
        }
    }
}

/// The track of engine-wide marks (breakpoints without a request).
const ENGINE_TRACK: TrackId = 0;

/// Writes a Chrome trace as events arrive; see the module docs.
#[derive(Debug)]
pub struct ChromeTraceWriter<W: Write> {
    w: BufWriter<W>,
    opts: ChromeOptions,
    /// `None` once closed.
    timeline: Option<TimelineBuilder>,
    items: Vec<TimelineItem>,
    /// The pid: the engine of the first accepted event.
    engine: Option<u32>,
    engine_track_named: bool,
    first: bool,
    written: u64,
}

/// `ns` as microseconds with three decimals, exactly.
fn us(ns: u64) -> String {
    format!("{}.{:03}", ns / 1_000, ns % 1_000)
}

/// A JSON string literal.
fn js(s: &str) -> String {
    // Serialising a `str` cannot fail; the fallback keeps the output valid.
    serde_json::to_string(s).unwrap_or_else(|_| "\"?\"".into())
}

impl<W: Write> ChromeTraceWriter<W> {
    /// Starts a trace on `w` (buffered here).
    pub fn new(w: W, opts: ChromeOptions) -> Result<Self, ExportError> {
        let mut w = BufWriter::new(w);
        w.write_all(b"{\"traceEvents\":[\n")?;
        Ok(ChromeTraceWriter {
            w,
            opts,
            timeline: Some(TimelineBuilder::new()),
            items: Vec::new(),
            engine: None,
            engine_track_named: false,
            first: true,
            written: 0,
        })
    }

    /// Trace events written so far (metadata included).
    pub fn written(&self) -> u64 {
        self.written
    }

    fn raw(&mut self, json: &str) -> io::Result<()> {
        if !self.first {
            self.w.write_all(b",\n")?;
        }
        self.first = false;
        self.written += 1;
        self.w.write_all(json.as_bytes())
    }

    fn pid(&self) -> u32 {
        self.engine.unwrap_or(0)
    }

    /// Takes one event.
    pub fn observe(&mut self, ev: &Event) -> Result<(), ExportError> {
        let Some(timeline) = self.timeline.as_mut() else {
            return Ok(()); // closed: nothing more goes in
        };
        let mut items = std::mem::take(&mut self.items);
        let accepted = timeline.observe(ev, |i| items.push(i));
        if accepted && self.engine.is_none() {
            self.engine = Some(ev.engine);
            let pid = ev.engine;
            self.raw(&format!(
                "{{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":{pid},\"args\":{{\"name\":{}}}}}",
                js(&format!("kvbm engine {pid}"))
            ))?;
        }
        let res = self.write_items(&mut items);
        self.items = items;
        res
    }

    fn write_items(&mut self, items: &mut Vec<TimelineItem>) -> Result<(), ExportError> {
        for item in items.drain(..) {
            self.item(item)?;
        }
        Ok(())
    }

    fn name_track(&mut self, track: TrackId, name: &str) -> io::Result<()> {
        let pid = self.pid();
        self.raw(&format!(
            "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{track},\"args\":{{\"name\":{}}}}}",
            js(name)
        ))?;
        self.raw(&format!(
            "{{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":{pid},\"tid\":{track},\"args\":{{\"sort_index\":{track}}}}}"
        ))
    }

    fn item(&mut self, item: TimelineItem) -> io::Result<()> {
        let pid = self.pid();
        match item {
            TimelineItem::Track { track, request } => self.name_track(track, &request),
            TimelineItem::Interval(i) => self.interval(&i),
            TimelineItem::Transfer(t) => self.transfer(&t),
            TimelineItem::FirstToken {
                track,
                ts_ns,
                ttft_ns,
                ..
            } if self.opts.first_tokens => self.raw(&format!(
                "{{\"name\":\"first token\",\"cat\":\"token\",\"ph\":\"i\",\"s\":\"t\",\"pid\":{pid},\"tid\":{track},\"ts\":{},\"args\":{{\"ttft_ns\":{ttft_ns}}}}}",
                us(ts_ns)
            )),
            TimelineItem::Breakpoint(b) if self.opts.breakpoints => {
                if b.track == ENGINE_TRACK && !self.engine_track_named {
                    self.engine_track_named = true;
                    self.name_track(ENGINE_TRACK, "engine")?;
                }
                let request = b.request.as_deref().map(js).unwrap_or("null".into());
                self.raw(&format!(
                    "{{\"name\":{},\"cat\":\"breakpoint\",\"ph\":\"i\",\"s\":\"t\",\"pid\":{pid},\"tid\":{},\"ts\":{},\"args\":{{\"breakpoint\":{},\"entry\":{},\"seq\":{},\"request\":{request}}}}}",
                    js(&format!("breakpoint {}", b.breakpoint)),
                    b.track,
                    us(b.ts_ns),
                    b.breakpoint,
                    js(b.entry.name()),
                    b.seq,
                ))
            }
            TimelineItem::FirstToken { .. } | TimelineItem::Breakpoint(_) => Ok(()),
        }
    }

    fn interval(&mut self, i: &StateInterval) -> io::Result<()> {
        let pid = self.pid();
        self.raw(&format!(
            "{{\"name\":{},\"cat\":\"slot\",\"ph\":\"X\",\"pid\":{pid},\"tid\":{},\"ts\":{},\"dur\":{},\"args\":{{\"state\":{},\"request\":{},\"open\":{}}}}}",
            js(i.state.name()),
            i.track,
            us(i.start_ns),
            us(i.duration_ns()),
            js(&i.state.to_string()),
            js(&i.request),
            i.open
        ))
    }

    fn transfer(&mut self, t: &TransferSpan) -> io::Result<()> {
        let pid = self.pid();
        let dir = js(&t.direction.to_string());
        let name = js(&format!("transfer {}", t.direction));
        let tid = t.track.unwrap_or(ENGINE_TRACK);
        let request = t.request.as_deref().map(js).unwrap_or("null".into());
        let batch = t.batch.map_or("null".into(), |b| b.to_string());
        let promoted = t.promoted_ns.map_or("null".into(), |p| p.to_string());
        self.raw(&format!(
            "{{\"name\":{name},\"cat\":{dir},\"ph\":\"b\",\"id\":{},\"pid\":{pid},\"tid\":{tid},\"ts\":{},\"args\":{{\"transfer\":{},\"request\":{request},\"blocks\":{},\"batch\":{batch},\"promoted_ns\":{promoted}}}}}",
            t.transfer,
            us(t.planned_ns),
            t.transfer,
            t.blocks,
        ))?;
        self.raw(&format!(
            "{{\"name\":{name},\"cat\":{dir},\"ph\":\"e\",\"id\":{},\"pid\":{pid},\"tid\":{tid},\"ts\":{},\"args\":{{\"status\":{},\"open\":{}}}}}",
            t.transfer,
            us(t.end_ns),
            js(&t.status.to_string()),
            t.open
        ))
    }

    /// Closes what is still open at the end of the stream and ends the JSON
    /// document (once; later calls write nothing).
    fn close(&mut self) -> Result<(), ExportError> {
        let Some(timeline) = self.timeline.take() else {
            return Ok(());
        };
        let mut items = Vec::new();
        timeline.finish(|i| items.push(i));
        self.write_items(&mut items)?;
        self.w.write_all(b"\n],\"displayTimeUnit\":\"ns\"}\n")?;
        Ok(())
    }

    /// Closes what is still open at the end of the stream, ends the JSON
    /// document, flushes, and hands back the writer.
    pub fn finish(mut self) -> Result<W, ExportError> {
        self.close()?;
        self.w.into_inner().map_err(|e| e.into_error().into())
    }
}

/// Writes a whole stream as a Chrome trace; returns the number of trace
/// events written.
pub fn write_chrome_trace<E: Borrow<Event>, W: Write>(
    events: impl IntoIterator<Item = E>,
    w: W,
    opts: ChromeOptions,
) -> Result<u64, ExportError> {
    let mut c = ChromeTraceWriter::new(w, opts)?;
    for e in events {
        c.observe(e.borrow())?;
    }
    c.close()?;
    let n = c.written();
    c.finish()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::testutil::{Stream, arb_events};
    use kvbm_events::Direction;
    use proptest::prelude::*;
    use serde_json::Value;

    fn trace(events: &[Event]) -> Value {
        let mut out = Vec::new();
        write_chrome_trace(events, &mut out, ChromeOptions::default()).unwrap();
        serde_json::from_slice(&out).unwrap_or_else(|e| {
            panic!("{e}: {}", String::from_utf8_lossy(&out));
        })
    }

    fn with_ph<'a>(t: &'a Value, ph: &str) -> Vec<&'a Value> {
        t["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == ph)
            .collect()
    }

    #[test]
    fn jsonl_is_one_event_per_line_and_round_trips() {
        let mut s = Stream::new();
        s.at(0).life("a\"\nb", 1);
        let mut out = Vec::new();
        let n = write_jsonl(s.events(), &mut out).unwrap();
        assert_eq!(n, s.events().len() as u64);
        let text = String::from_utf8(out).unwrap();
        let back: Vec<Event> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(back, s.events());
    }

    #[test]
    fn chrome_trace_has_tracks_spans_and_transfers() {
        let mut s = Stream::with_engine(4);
        s.at(1_000).life("req-a", 7);
        s.at(2_000).create("req-b", 8);
        s.at(2_500).breakpoint(Some("req-b"), 1);
        s.at(2_600).breakpoint(None, 2);
        s.at(3_000).plan("req-b", 8, Direction::HOST_TO_DEVICE, 1);
        let t = trace(s.events());
        assert_eq!(t["displayTimeUnit"], "ns");
        let meta = with_ph(&t, "M");
        let names: Vec<(u64, &str)> = meta
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| {
                (
                    e["tid"].as_u64().unwrap(),
                    e["args"]["name"].as_str().unwrap(),
                )
            })
            .collect();
        assert_eq!(names, [(1, "req-a"), (2, "req-b"), (0, "engine")]);
        assert!(meta.iter().all(|e| e["pid"] == 4));
        assert!(meta.iter().any(|e| e["name"] == "process_name"));
        // req-a: Initialized, Prefilling, Decoding, Finishing.
        let xs = with_ph(&t, "X");
        let a: Vec<(&str, f64, f64)> = xs
            .iter()
            .filter(|e| e["tid"] == 1)
            .map(|e| {
                (
                    e["name"].as_str().unwrap(),
                    e["ts"].as_f64().unwrap(),
                    e["dur"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            a,
            [
                ("Initialized", 1.0, 0.01),
                ("Prefilling", 1.01, 0.025),
                ("Decoding", 1.035, 0.015),
                ("Finishing", 1.05, 0.01),
            ]
        );
        // req-b is still Initialized at the end: an open span to the end.
        let b: Vec<_> = xs.iter().filter(|e| e["tid"] == 2).collect();
        assert_eq!(b.len(), 1);
        assert_eq!(b[0]["args"]["open"], true);
        assert_eq!(b[0]["dur"].as_f64(), Some(1.0));
        // Two transfers, each a b/e pair with the same id and category.
        let (bs, es) = (with_ph(&t, "b"), with_ph(&t, "e"));
        assert_eq!((bs.len(), es.len()), (2, 2));
        for (b, e) in bs.iter().zip(&es) {
            assert_eq!(
                (&b["id"], &b["cat"], &b["name"]),
                (&e["id"], &e["cat"], &e["name"])
            );
        }
        let done = bs.iter().position(|b| b["id"] == 7).unwrap();
        assert_eq!(bs[done]["cat"], "G1→G2");
        assert_eq!(es[done]["args"]["status"], "Completed");
        assert_eq!(bs[done]["ts"].as_f64(), Some(1.03));
        assert_eq!(es[done]["ts"].as_f64(), Some(1.06));
        let open = bs.iter().position(|b| b["id"] == 8).unwrap();
        assert_eq!(es[open]["args"]["open"], true);
        // Breakpoints and first tokens as instants.
        let is = with_ph(&t, "i");
        assert_eq!(is.iter().filter(|e| e["cat"] == "breakpoint").count(), 2);
        assert_eq!(is.iter().filter(|e| e["name"] == "first token").count(), 1);
    }

    #[test]
    fn the_streaming_writer_matches_the_one_call_helper() {
        let mut s = Stream::new();
        s.at(0).life("a", 1);
        let mut one = Vec::new();
        let n = write_chrome_trace(s.events(), &mut one, ChromeOptions::default()).unwrap();
        let mut w = ChromeTraceWriter::new(Vec::new(), ChromeOptions::default()).unwrap();
        for e in s.events() {
            w.observe(e).unwrap();
        }
        let two = w.finish().unwrap();
        assert_eq!(one, two);
        let v: Value = serde_json::from_slice(&two).unwrap();
        assert_eq!(v["traceEvents"].as_array().unwrap().len() as u64, n);
    }

    #[test]
    fn an_empty_stream_is_a_valid_trace() {
        let t = trace(&[]);
        assert_eq!(t["traceEvents"].as_array().map(Vec::len), Some(0));
    }

    #[test]
    fn micros_are_exact() {
        assert_eq!(us(0), "0.000");
        assert_eq!(us(1), "0.001");
        assert_eq!(us(1_234_567), "1234.567");
        assert_eq!(us(u64::MAX), "18446744073709551.615");
    }

    proptest! {
        #[test]
        fn any_stream_exports_as_valid_json(events in arb_events(60)) {
            let mut out = Vec::new();
            write_chrome_trace(&events, &mut out, ChromeOptions::default()).unwrap();
            let v: Value = serde_json::from_slice(&out).unwrap();
            prop_assert!(v["traceEvents"].is_array());
            let mut out = Vec::new();
            write_jsonl(&events, &mut out).unwrap();
            prop_assert_eq!(String::from_utf8(out).unwrap().lines().count(), events.len());
        }
    }
}
