//! The live window (events encoded once, shared by every client) and each
//! client's cursor over it and the ring.
//!
//! Positions are ring positions ([`kvbm_events::ring`]): 0 for the first event the
//! ring ever got, and so on. A client keeps the next position it wants and
//! the next sequence number it expects; whatever lies between the sequence
//! number expected and the one it is about to be sent is announced as a
//! [`Gap`](kvbm_schema::protocol::ServerMsg::Gap) first.

use super::AppState;
use axum::body::Bytes;
use kvbm_events::Event;
use kvbm_events::ring::RingBuffer;
use kvbm_schema::columnar::{BlockEncoder, decode_block, event_bytes};
use kvbm_schema::protocol::{FRAME_TARGET, GapReason, encode_batch};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;

/// Events of consecutive ring positions *and* consecutive sequence numbers,
/// encoded as one binary frame ([`kvbm_schema::protocol::encode_batch`]'s
/// format: one columnar block).
#[derive(Debug)]
pub(super) struct Batch {
    pub first_pos: u64,
    pub first_seq: u64,
    events: u64,
    frame: Bytes,
}

impl Batch {
    pub fn len(&self) -> u64 {
        self.events
    }

    pub fn end_pos(&self) -> u64 {
        self.first_pos + self.len()
    }

    pub fn last_seq(&self) -> u64 {
        self.first_seq + self.len() - 1
    }

    /// The frame of events `i..`. Only a client that starts inside a
    /// batch (resuming, or joining while it is the newest) needs a suffix:
    /// a block cannot be sliced, so that one is decoded and encoded again.
    pub fn frame_from(&self, i: usize) -> Bytes {
        if i == 0 {
            return self.frame.clone();
        }
        let mut events = match decode_block(&self.frame) {
            Ok(events) => events,
            // Cannot happen (the frame was encoded here); the whole batch
            // then goes, and the client counts what it had already as
            // duplicates rather than losing anything.
            Err(_) => return self.frame.clone(),
        };
        events.drain(..i.min(events.len()));
        let mut enc = BlockEncoder::new();
        let mut out = Vec::new();
        if encode_batch(&events, &mut enc, &mut out) != events.len() {
            // A suffix of a block always fits one block; if not, the
            // whole batch, as above.
            return self.frame.clone();
        }
        Bytes::from(out)
    }
}

/// Builds batches, cutting wherever sequence numbers or positions jump, or
/// where a block is full ([`FRAME_TARGET`] bytes, or a difference its
/// columns cannot hold).
pub(super) struct BatchBuilder {
    enc: BlockEncoder,
    events: u64,
    first_pos: u64,
    first_seq: u64,
}

impl BatchBuilder {
    pub fn new() -> Self {
        BatchBuilder {
            enc: BlockEncoder::new(),
            events: 0,
            first_pos: 0,
            first_seq: 0,
        }
    }

    fn next_pos(&self) -> u64 {
        self.first_pos + self.events
    }

    fn next_seq(&self) -> u64 {
        self.first_seq + self.events
    }

    /// Adds the event at ring position `pos`; returns the finished batch
    /// when this event could not extend the current one.
    pub fn push(&mut self, pos: u64, ev: &Event) -> Option<Batch> {
        let size = event_bytes(ev);
        let done = if self.events > 0
            && (pos != self.next_pos()
                || ev.seq != self.next_seq()
                || !self.enc.try_push(ev, size, FRAME_TARGET))
        {
            self.finish()
        } else if self.events > 0 {
            // `try_push` above took it.
            self.events += 1;
            return None;
        } else {
            None
        };
        // An empty block takes any event.
        let took = self.enc.try_push(ev, size, FRAME_TARGET);
        debug_assert!(took);
        self.first_pos = pos;
        self.first_seq = ev.seq;
        self.events = 1;
        done
    }

    /// The batch being built, if any.
    pub fn finish(&mut self) -> Option<Batch> {
        if self.events == 0 {
            return None;
        }
        let frame = Bytes::copy_from_slice(self.enc.finish());
        Some(Batch {
            first_pos: self.first_pos,
            first_seq: self.first_seq,
            events: std::mem::take(&mut self.events),
            frame,
        })
    }
}

struct WindowInner {
    batches: VecDeque<Arc<Batch>>,
    events: u64,
    /// The encoder's cursor: every position below it has been looked at.
    next_pos: u64,
}

/// The newest events, encoded once for every client.
pub(super) struct LiveWindow {
    inner: Mutex<WindowInner>,
    cap: u64,
    tx: watch::Sender<u64>,
}

/// Where a position stands in the window.
pub(super) enum Lookup {
    /// In this batch, at this index.
    Hit(Arc<Batch>, usize),
    /// Not in the window (older, or a hole the encoder could not fill): read
    /// the ring.
    Miss,
    /// At or past the encoder's cursor: nothing to send yet.
    CaughtUp,
}

impl LiveWindow {
    pub fn new(cap: usize, start_pos: u64) -> Self {
        LiveWindow {
            inner: Mutex::new(WindowInner {
                batches: VecDeque::new(),
                events: 0,
                next_pos: start_pos,
            }),
            cap: cap.max(1) as u64,
            tx: watch::Sender::new(start_pos),
        }
    }

    fn lock(&self) -> MutexGuard<'_, WindowInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.tx.subscribe()
    }

    pub fn lookup(&self, pos: u64) -> Lookup {
        let g = self.lock();
        if pos >= g.next_pos {
            return Lookup::CaughtUp;
        }
        let i = g.batches.partition_point(|b| b.end_pos() <= pos);
        match g.batches.get(i) {
            Some(b) if b.first_pos <= pos => Lookup::Hit(b.clone(), (pos - b.first_pos) as usize),
            _ => Lookup::Miss,
        }
    }

    fn publish(&self, batches: Vec<Batch>, next_pos: u64) {
        let mut evicted = Vec::new();
        let mut g = self.lock();
        for b in batches {
            g.events += b.len();
            g.batches.push_back(Arc::new(b));
        }
        while g.events > self.cap {
            match g.batches.pop_front() {
                Some(b) => {
                    g.events -= b.len();
                    evicted.push(b);
                }
                None => break,
            }
        }
        g.next_pos = g.next_pos.max(next_pos);
        drop(g);
        drop(evicted);
        self.tx.send_replace(next_pos);
    }
}

/// Waits for the ring to grow (or a fallback timeout when no feeder drives
/// the signal); false when the server shuts down.
pub(super) async fn wait_for_ring(
    rx: &mut watch::Receiver<u64>,
    attached: bool,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let fallback = if attached {
        Duration::from_millis(100)
    } else {
        Duration::from_millis(1)
    };
    tokio::select! {
        r = rx.changed() => {
            if r.is_err() {
                // The signal's sender lives in the engine handle, which the
                // server holds: this does not happen, but never spin.
                tokio::time::sleep(fallback).await;
            }
        }
        _ = tokio::time::sleep(fallback) => {}
        _ = super::shutting_down(shutdown) => return false,
    }
    !*shutdown.borrow()
}

/// The encoder task: follows the ring, encodes each event once into the
/// live window.
pub(super) async fn run_encoder(state: Arc<AppState>) {
    let ring = state.engine.ring.clone();
    let signal = state.engine.signal.clone();
    let mut ring_rx = signal.subscribe();
    let mut shutdown = state.shutdown.clone();
    let max = state.max_batch();
    let mut builder = BatchBuilder::new();
    let mut pos = state.live.lock().next_pos;
    loop {
        ring_rx.borrow_and_update();
        let r = ring.read_at_most(pos, max);
        if r.events.is_empty() {
            if pos < r.next {
                // Everything we wanted was overwritten and nothing newer is
                // held yet (cannot happen with a non-empty ring, but keep
                // the cursor honest).
                pos = r.next;
            }
            if !wait_for_ring(&mut ring_rx, signal.is_attached(), &mut shutdown).await {
                return;
            }
            continue;
        }
        let start = r.next - r.events.len() as u64;
        let mut out = Vec::new();
        for (i, ev) in r.events.iter().enumerate() {
            if let Some(b) = builder.push(start + i as u64, ev) {
                out.push(b);
            }
        }
        out.extend(builder.finish());
        pos = r.next;
        state.live.publish(out, pos);
        drop(r);
        tokio::task::yield_now().await;
    }
}

/// A gap to announce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct GapOut {
    pub from: u64,
    pub to: u64,
    pub reason: GapReason,
}

/// One thing to send.
#[derive(Debug)]
pub(super) enum Out {
    Gap(GapOut),
    Frame { bytes: Bytes, events: u64 },
}

/// What [`Cursor::next`] produced.
pub(super) enum Step {
    /// Send these, in order.
    Send(Vec<Out>),
    /// Caught up with the live window: wait.
    CaughtUp,
}

/// One client's place in the stream.
pub(super) struct Cursor {
    pos: u64,
    expected: Option<u64>,
    delivered_any: bool,
    builder: BatchBuilder,
    max: usize,
}

impl Cursor {
    /// From sequence number `since`, or from the oldest event held.
    pub fn new(ring: &RingBuffer, since: Option<u64>, max: usize) -> Self {
        let pos = match since {
            Some(s) => {
                let r = ring.since_seq(s);
                r.next - r.events.len() as u64
            }
            None => ring.counters().oldest_position(),
        };
        Cursor {
            pos,
            expected: since,
            delivered_any: false,
            builder: BatchBuilder::new(),
            max,
        }
    }

    /// The next ring position it wants: everything below it was sent or
    /// skipped.
    pub fn pos(&self) -> u64 {
        self.pos
    }

    /// The gap before an event with sequence number `seq`, if any.
    /// `overwritten`: the client's read skipped positions the ring no
    /// longer holds.
    fn gap_before(&mut self, seq: u64, overwritten: bool, ring: &RingBuffer) -> Option<GapOut> {
        let exp = self.expected?;
        if seq <= exp {
            return None;
        }
        // Every number below the first one held was emitted (an engine
        // numbers its events without gaps, listened to or not), so a hole
        // before the first event sent is as real as any other.
        let reason = if overwritten || (!self.delivered_any && ring.counters().overwritten > 0) {
            GapReason::Overwritten
        } else {
            GapReason::Lost
        };
        Some(GapOut {
            from: exp,
            to: seq - 1,
            reason,
        })
    }

    /// The next things to send.
    pub fn next(&mut self, ring: &RingBuffer, live: &LiveWindow) -> Step {
        loop {
            match live.lookup(self.pos) {
                Lookup::CaughtUp => return Step::CaughtUp,
                Lookup::Hit(b, idx) => {
                    let mut i = idx as u64;
                    if let Some(x) = self.expected {
                        i = i.max(x.saturating_sub(b.first_seq));
                    }
                    self.pos = b.end_pos();
                    if i >= b.len() {
                        continue; // all before `since`
                    }
                    let seq = b.first_seq + i;
                    let mut out = Vec::with_capacity(2);
                    if let Some(g) = self.gap_before(seq, false, ring) {
                        out.push(Out::Gap(g));
                    }
                    out.push(Out::Frame {
                        bytes: b.frame_from(i as usize),
                        events: b.len() - i,
                    });
                    self.expected = Some(b.last_seq() + 1);
                    self.delivered_any = true;
                    return Step::Send(out);
                }
                Lookup::Miss => {
                    let r = ring.read_at_most(self.pos, self.max);
                    let overwritten = r.missed > 0;
                    let start = r.next - r.events.len() as u64;
                    self.pos = r.next;
                    let mut out = Vec::new();
                    let mut first = true;
                    for (k, ev) in r.events.iter().enumerate() {
                        if self.expected.is_some_and(|x| ev.seq < x) {
                            continue;
                        }
                        let gap = self.gap_before(ev.seq, overwritten && first, ring);
                        first = false;
                        if let Some(g) = gap {
                            if let Some(b) = self.builder.finish() {
                                out.push(frame_out(b));
                            }
                            out.push(Out::Gap(g));
                        }
                        if let Some(b) = self.builder.push(start + k as u64, ev) {
                            out.push(frame_out(b));
                        }
                        self.expected = Some(ev.seq + 1);
                        self.delivered_any = true;
                    }
                    if let Some(b) = self.builder.finish() {
                        out.push(frame_out(b));
                    }
                    if out.is_empty() {
                        if r.caught_up() {
                            return Step::CaughtUp;
                        }
                        continue;
                    }
                    return Step::Send(out);
                }
            }
        }
    }
}

fn frame_out(b: Batch) -> Out {
    Out::Frame {
        events: b.len(),
        bytes: b.frame,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::EventKind;
    use kvbm_schema::protocol::decode_batch;

    fn ev(seq: u64) -> Event {
        Event {
            engine: 0,
            seq,
            ts_ns: seq,
            iteration: 0,
            request: None,
            kind: EventKind::TokensScheduled {
                prefill: 0,
                decode: 1,
                computed: 0,
            },
        }
    }

    fn seqs(frame: &Bytes) -> Vec<u64> {
        decode_batch(frame).unwrap().iter().map(|e| e.seq).collect()
    }

    #[test]
    fn batches_cut_at_holes_and_slice() {
        let mut b = BatchBuilder::new();
        assert!(b.push(0, &ev(10)).is_none());
        assert!(b.push(1, &ev(11)).is_none());
        let first = b.push(2, &ev(13)).unwrap(); // seq hole
        assert_eq!(
            (first.first_seq, first.len(), first.last_seq()),
            (10, 2, 11)
        );
        assert_eq!(seqs(&first.frame_from(0)), [10, 11]);
        assert_eq!(seqs(&first.frame_from(1)), [11]);
        let second = b.push(5, &ev(14)).unwrap(); // position hole
        assert_eq!((second.first_pos, second.first_seq), (2, 13));
        let third = b.finish().unwrap();
        assert_eq!((third.first_pos, third.end_pos()), (5, 6));
        assert!(b.finish().is_none());
    }

    /// A batch is one block: an event whose time difference a block
    /// cannot hold (an idle engine's 5 s pause) starts the next batch, and
    /// so does a block grown to `FRAME_TARGET`.
    #[test]
    fn batches_cut_where_a_block_is_full() {
        let mut b = BatchBuilder::new();
        assert!(b.push(0, &ev(0)).is_none());
        let mut late = ev(1);
        late.ts_ns = 5_000_000_000;
        let first = b.push(1, &late).unwrap();
        assert_eq!((first.first_seq, first.len()), (0, 1));
        let mut big = ev(2);
        big.kind = EventKind::BlocksAllocated {
            tier: kvbm_events::tier::Tier::Device,
            blocks: (0..FRAME_TARGET as u32 / 4).collect(),
        };
        big.ts_ns = late.ts_ns;
        let second = b.push(2, &big).unwrap();
        assert_eq!(seqs(&second.frame), [1]);
        let third = b.finish().unwrap();
        assert_eq!(decode_block(&third.frame).unwrap(), [big]);
    }

    fn drain(c: &mut Cursor, ring: &RingBuffer, live: &LiveWindow) -> (Vec<u64>, Vec<GapOut>) {
        let (mut got, mut gaps) = (Vec::new(), Vec::new());
        while let Step::Send(outs) = c.next(ring, live) {
            for o in outs {
                match o {
                    Out::Gap(g) => gaps.push(g),
                    Out::Frame { bytes, events } => {
                        let s = seqs(&bytes);
                        assert_eq!(s.len() as u64, events);
                        got.extend(s);
                    }
                }
            }
        }
        (got, gaps)
    }

    #[test]
    fn cursors_resume_without_duplicates_and_name_overwritten_ranges() {
        let ring = RingBuffer::with_capacity(8).unwrap();
        for s in 0..6 {
            ring.push(ev(s));
        }
        // The window starts where the ring is when the server starts;
        // older events come from the ring.
        let live = LiveWindow::new(4, 6);
        let mut c = Cursor::new(&ring, Some(2), 16);
        let (got, gaps) = drain(&mut c, &ring, &live);
        assert_eq!((got, gaps), (vec![2, 3, 4, 5], vec![]));
        // Encode 6..12 into the window (which keeps 4 events).
        for s in 6..12 {
            ring.push(ev(s));
        }
        let mut b = BatchBuilder::new();
        let mut out = Vec::new();
        for s in 6..12 {
            out.extend(b.push(s, &ev(s)));
        }
        out.extend(b.finish());
        live.publish(out, 12);
        let (got, gaps) = drain(&mut c, &ring, &live);
        assert_eq!((got, gaps), (vec![6, 7, 8, 9, 10, 11], vec![]));
        // A resume from 1: the ring now holds 4..12.
        let mut c = Cursor::new(&ring, Some(1), 16);
        let (got, gaps) = drain(&mut c, &ring, &live);
        assert_eq!(got, (4..12).collect::<Vec<_>>());
        assert_eq!(
            gaps,
            [GapOut {
                from: 1,
                to: 3,
                reason: GapReason::Overwritten
            }]
        );
        // A lost event upstream (a seq hole with contiguous positions).
        ring.record_gap(1);
        ring.push(ev(13));
        let mut b = BatchBuilder::new();
        assert!(b.push(12, &ev(13)).is_none());
        live.publish(b.finish().into_iter().collect(), 13);
        let (got, gaps) = drain(&mut c, &ring, &live);
        assert_eq!(got, [13]);
        assert_eq!(
            gaps,
            [GapOut {
                from: 12,
                to: 12,
                reason: GapReason::Lost
            }]
        );
    }

    #[test]
    fn a_hole_before_the_first_event_held_is_a_lost_gap() {
        // A server attached after the engine had emitted 0..5.
        let ring = RingBuffer::with_capacity(8).unwrap();
        for s in 5..8 {
            ring.push(ev(s));
        }
        let live = LiveWindow::new(4, 3);
        let mut c = Cursor::new(&ring, Some(0), 16);
        assert_eq!(
            drain(&mut c, &ring, &live),
            (
                vec![5, 6, 7],
                vec![GapOut {
                    from: 0,
                    to: 4,
                    reason: GapReason::Lost
                }]
            )
        );
        // Without `since`: from the oldest held, nothing to announce.
        let mut c = Cursor::new(&ring, None, 16);
        assert_eq!(drain(&mut c, &ring, &live), (vec![5, 6, 7], vec![]));
    }
}
