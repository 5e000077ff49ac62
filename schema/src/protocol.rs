//! The attach protocol, version [`PROTOCOL_VERSION`]: what the attach
//! server (`kvbm_attach::server`) and its clients (the console's `attach`,
//! `kvbm-recorder record --from`) say to each other.
//!
//! # HTTP
//! Every request may carry [`VERSION_HEADER`]; a value other than
//! [`PROTOCOL_VERSION`] is refused with `400` and an [`ApiError`] whose
//! `code` is `"protocol_mismatch"`. Every response carries the header with
//! the server's version, and every error is a JSON [`ApiError`] with a
//! 4xx/5xx status, never a panic: a request the HTTP layer cannot even
//! parse (`400`, `414`, `431`) included. A request's body must arrive
//! within the server's request deadline (`408 request_timeout`), and a
//! declared `Content-Length` over the body limit is refused at once
//! (`413`).
//!
//! Version 2 added the engine run's identity ([`RunId`]): in
//! [`Health`], in [`ServerMsg::Hello`], and as the `run` a client resumes
//! in. An engine that restarts starts its sequence numbers again under a
//! new run id; a v1 client could not tell and spliced the runs together.
//!
//! - `GET /health` → `{"status":"ok","protocol":3,"run":"…",...}` ([`Health`]).
//! - `GET /snapshot` → the reducer's `EngineState` as JSON.
//! - `GET /metrics` → Prometheus text, every name prefixed `kvbm_`.
//! - `GET /breakpoints` → [`BreakpointsView`]; `POST /breakpoints` with a
//!   `BreakpointSpec` (unknown fields refused) → `{"id":N}`;
//!   `DELETE /breakpoints/{id}`; `POST /breakpoints/clear`;
//!   `POST /resume` with `{"pause_id":N}` or `{}` (all);
//!   `POST /step`. A request with [`CLIENT_HEADER`] naming a connected
//!   WebSocket client, and [`CLIENT_KEY_HEADER`] with that client's
//!   `client_key` from its hello, makes that client the owner of what it
//!   sets (`403 forbidden` without the right key: a client id alone does
//!   not let anyone tie breakpoints to another client's connection).
//!   Without them, what a request sets (a breakpoint, or the one-shot
//!   pause of a step) belongs to a *lease* that expires (the response to
//!   `POST /breakpoints` says when: [`Added`]), so no breakpoint is ever
//!   left without an owner.
//!   Bodies are JSON objects (`{}` for none; an empty body also means
//!   none); anything else is a `400`.
//!   Apart from `POST /breakpoints`, control endpoints answer with the
//!   [`ControlResult`] as JSON (`{"done":true}`, `{"count":2}`); an id that
//!   names no breakpoint (`DELETE`) or no paused call (`/resume`) is a
//!   `404 not_found`.
//! - `GET /events?since=SEQ&run=RUN&version=3` upgrades to a WebSocket
//!   (below). `run` is the run `since` counts in: when the server's run is
//!   another (the engine restarted), `since` does not apply and the stream
//!   starts at the new run's first event (seq 0; a gap says what the
//!   server no longer holds).
//!
//! With a token configured, requests need `Authorization: Bearer TOKEN`
//! (control endpoints always; read-only ones unless opened by config).
//!
//! # WebSocket `/events`
//! The server speaks first: a text frame with [`ServerMsg::Hello`], which
//! names the engine's run: a client that followed another run must not
//! take what follows for a continuation of it. The hello also says what
//! the engine runs as, when the engine said (`engine_info`: a JSON object
//! whose `summary` is one line for a person, the facts behind it beside;
//! the same value as `engine_info` in `GET /health` and `GET /snapshot`),
//! so a client learns it again at every (re)connection, a restarted
//! engine's included. The field is absent when the engine said nothing,
//! and a client that knows nothing of it ignores it (a hello's unknown
//! fields are ignored, never refused). Then
//! binary frames, each an [`encode_batch`] of events in sequence order
//! (one columnar block, as the durable log and NATS batches hold them),
//! starting at `since` (or at the oldest event the server holds when
//! `since` is absent). When events from the requested range are no longer
//! held (the ring overwrote them, or they were lost before the server saw
//! them), a [`ServerMsg::Gap`] text frame says which sequence numbers are
//! missing before the events after them are sent: a client that resumes
//! with `since = last seq + 1` gets no duplicates and no silent gaps.
//! [`ServerMsg::Live`] marks the end of the backfill.
//!
//! The client may send [`ClientMsg`] text frames: `Control` commands are
//! answered by [`ServerMsg::Reply`] with the same `id`; breakpoints set
//! this way belong to the connection, and when it closes its paused calls
//! resume and its breakpoints are removed (unless the server is configured
//! otherwise). The server pushes [`ServerMsg::Breakpoints`] when the
//! breakpoints or paused calls change (and at least every second while any
//! exist), so a client never has to poll. Commands are answered in order;
//! a client may send many before reading the replies (the server stops
//! reading its commands while the replies wait to be sent, rather than
//! dropping it).
//!
//! The server pings every client every few seconds; a client from which
//! nothing (not even a pong) arrives for the server's silence timeout is
//! disconnected, and its breakpoints removed: a frozen console (stopped,
//! or behind a half-open connection) cannot keep the engine paused.

use crate::columnar::{BlockEncoder, BlockError, decode_block};
use kvbm_events::control::{BreakpointsView, ControlCommand, ControlResult};
use kvbm_events::{Event, RunId};
use serde::{Deserialize, Serialize};

/// The protocol version both sides state; a server refuses a client of
/// another version, and a client a server of another.
///
/// - 2: binary frames held one flatbuffers record per event.
/// - 3: a binary frame is one columnar block, the encoding the durable
///   log and NATS batches use: a third of the bytes, decoded by the same
///   verifier.
pub const PROTOCOL_VERSION: u32 = 3;

/// HTTP header carrying the protocol version (requests and responses).
pub const VERSION_HEADER: &str = "x-kvbm-protocol";

/// HTTP header naming the WebSocket client (its `Hello.client`) a control
/// request acts for.
pub const CLIENT_HEADER: &str = "x-kvbm-client";

/// HTTP header with the `client_key` of the client [`CLIENT_HEADER`]
/// names: proof that the request comes from whoever holds that connection.
pub const CLIENT_KEY_HEADER: &str = "x-kvbm-client-key";

/// A JSON error body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// A stable machine-readable code (`bad_request`, `unauthorized`,
    /// `forbidden`, `not_found`, `protocol_mismatch`, `too_many_clients`,
    /// `too_many_connections`, `request_timeout`, `uri_too_long`,
    /// `headers_too_large`, `payload_too_large`, `no_breakpoints`,
    /// `refused`, `method_not_allowed`, `silent`, `shutting_down`,
    /// `internal`).
    pub code: String,
    /// What was wrong, for a person.
    pub message: String,
}

impl ApiError {
    /// An error with this code and message.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// `GET /health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Health {
    /// `"ok"`.
    pub status: String,
    /// The server's protocol version.
    pub protocol: u32,
    /// The engine id.
    pub engine: u32,
    /// The engine run being served.
    pub run: RunId,
    /// Sequence number of the newest event held, if any.
    pub last_seq: Option<u64>,
}

/// `POST /breakpoints`: the new breakpoint, and the lease that owns it
/// when no connected client does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Added {
    /// The breakpoint's id.
    pub id: u64,
    /// Present when the request named no client: the breakpoint is removed
    /// (and what it paused resumes) when the lease runs out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<Lease>,
}

/// What owns a breakpoint set without a client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The owner id the breakpoint carries (from the same space as client
    /// ids, so it never names a client).
    pub owner: u64,
    /// Milliseconds until it runs out.
    pub expires_in_ms: u64,
}

/// Why events are missing from a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GapReason {
    /// The server's ring no longer holds them (asked too late, or read too
    /// slowly).
    Overwritten,
    /// The server never saw them (lost between the engine and the ring).
    Lost,
}

/// A text frame from the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ServerMsg {
    /// The first frame.
    Hello {
        /// The server's protocol version.
        protocol: u32,
        /// The engine id.
        engine: u32,
        /// The engine run being served.
        run: RunId,
        /// This connection's client id (for [`CLIENT_HEADER`]).
        client: u64,
        /// This connection's secret (for [`CLIENT_KEY_HEADER`]): only
        /// whoever reads this hello can act for the connection over HTTP.
        client_key: String,
        /// Oldest and newest sequence numbers the server holds now.
        first_seq: Option<u64>,
        /// See `first_seq`.
        last_seq: Option<u64>,
        /// What the engine runs as, when it said: a JSON object whose
        /// `summary` is one line for a person (as `engine_info` in
        /// `GET /health`). Absent from the JSON when `None`, and `None`
        /// when an older server left it out.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        engine_info: Option<serde_json::Value>,
    },
    /// Events `from_seq ..= to_seq` will not be sent.
    Gap {
        /// First missing sequence number.
        from_seq: u64,
        /// Last missing sequence number.
        to_seq: u64,
        /// Why.
        reason: GapReason,
    },
    /// The backfill is over; what follows is live. It comes after every
    /// event the [`ServerMsg::Hello`] announced (up to its `last_seq`)
    /// that the client asked for.
    Live,
    /// The breakpoints and paused calls changed.
    Breakpoints(BreakpointsView),
    /// The answer to a [`ClientMsg::Control`].
    Reply {
        /// The command's id.
        id: u64,
        /// What it returned, or why it failed.
        result: Result<ControlResult, ApiError>,
    },
    /// The server is closing this connection, and why.
    Error(ApiError),
}

/// A text frame from the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMsg {
    /// A breakpoint command, answered by a [`ServerMsg::Reply`].
    Control {
        /// Echoed in the reply.
        id: u64,
        /// The command.
        command: ControlCommand,
    },
}

/// Why a binary frame could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// Longer than [`MAX_FRAME`].
    #[error("event batch of {len} bytes exceeds {MAX_FRAME}")]
    TooLarge {
        /// Frame length.
        len: usize,
    },
    /// The frame is not a valid block (the verifier refused it, or an
    /// event in it does not decode).
    #[error("event batch: {0}")]
    Block(#[from] BlockError),
}

/// Largest binary frame accepted: a block as large as the durable log
/// takes. The server's frames are far smaller ([`FRAME_TARGET`]).
pub const MAX_FRAME: usize = (16 << 20) + 4096;

/// The block size the server aims for when it batches events: a frame
/// holds events until its block would pass this many bytes
/// ([`crate::columnar::event_bytes`]), or until it cannot hold the next.
pub const FRAME_TARGET: usize = 1 << 20;

/// Encodes the leading events of `events` that fit one block (at most
/// [`FRAME_TARGET`] bytes, and whatever differences a block's columns can
/// hold) into `out` as one binary frame, and returns how many it took: at
/// least one, unless `events` is empty (then `out` is left empty).
pub fn encode_batch(events: &[Event], enc: &mut BlockEncoder, out: &mut Vec<u8>) -> usize {
    out.clear();
    let mut taken = 0;
    for e in events {
        if !enc.try_push(e, crate::columnar::event_bytes(e), FRAME_TARGET) {
            break;
        }
        taken += 1;
    }
    if taken > 0 {
        out.extend_from_slice(enc.finish());
    }
    taken
}

/// Reads a binary frame written by [`encode_batch`]: verifies the block
/// and decodes every event. Never panics on any input.
pub fn decode_batch(frame: &[u8]) -> Result<Vec<Event>, BatchError> {
    if frame.len() > MAX_FRAME {
        return Err(BatchError::TooLarge { len: frame.len() });
    }
    Ok(decode_block(frame)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::EventKind;
    use proptest::prelude::*;

    fn ev(seq: u64) -> Event {
        Event {
            engine: 3,
            seq,
            ts_ns: seq * 10,
            iteration: 1,
            request: Some("r".into()),
            kind: EventKind::TokensScheduled {
                prefill: 1,
                decode: 2,
                computed: 3,
            },
        }
    }

    #[test]
    fn batches_round_trip() {
        let events: Vec<Event> = (0..10).map(ev).collect();
        let mut buf = Vec::new();
        let mut enc = BlockEncoder::new();
        assert_eq!(encode_batch(&events, &mut enc, &mut buf), 10);
        assert_eq!(decode_batch(&buf).unwrap(), events);
        assert_eq!(encode_batch(&[], &mut enc, &mut buf), 0);
        assert!(buf.is_empty() && decode_batch(&buf).is_err());
        // A frame takes what one block can hold: an event 2^33 ns after
        // the one before it does not fit a block's u32 time difference.
        let mut later = ev(10);
        later.ts_ns = 1 << 33;
        let with_later: Vec<Event> = events.iter().cloned().chain([later.clone()]).collect();
        assert_eq!(encode_batch(&with_later, &mut enc, &mut buf), 10);
        assert_eq!(encode_batch(&with_later[10..], &mut enc, &mut buf), 1);
        assert_eq!(decode_batch(&buf).unwrap(), vec![later]);
    }

    #[test]
    fn messages_have_a_stable_json_shape() {
        let m = ServerMsg::Gap {
            from_seq: 5,
            to_seq: 9,
            reason: GapReason::Overwritten,
        };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"type":"gap","from_seq":5,"to_seq":9,"reason":"overwritten"}"#
        );
        let c: ClientMsg = serde_json::from_str(
            r#"{"type":"control","id":7,"command":{"command":"resume","pause_id":null}}"#,
        )
        .unwrap();
        assert_eq!(
            c,
            ClientMsg::Control {
                id: 7,
                command: ControlCommand::Resume { pause_id: None }
            }
        );
        assert!(
            serde_json::from_str::<ClientMsg>(
                r#"{"type":"control","id":1,"command":{"command":"step"},"x":1}"#
            )
            .is_err()
        );
    }

    /// A hello with the engine's description, one without it (the field
    /// absent from the JSON), one from a server older than the field, and
    /// a new hello read by a client older than the field: each reads.
    #[test]
    fn a_hello_reads_with_or_without_the_engine_info() {
        let info = serde_json::json!({"summary": "vLLM · tp 2", "tensor_parallel": 2});
        let hello = |engine_info| ServerMsg::Hello {
            protocol: 2,
            engine: 3,
            run: RunId(9),
            client: 4,
            client_key: "k".into(),
            first_seq: Some(0),
            last_seq: Some(5),
            engine_info,
        };
        for m in [hello(Some(info.clone())), hello(None)] {
            let json = serde_json::to_string(&m).unwrap();
            assert_eq!(json.contains("engine_info"), m != hello(None), "{json}");
            assert_eq!(serde_json::from_str::<ServerMsg>(&json).unwrap(), m);
        }
        let v = serde_json::to_value(hello(Some(info.clone()))).unwrap();
        assert_eq!(v["engine_info"], info);

        // From a server older than the field.
        let old = r#"{"type":"hello","protocol":2,"engine":3,"run":"0000000000000009","client":4,"client_key":"k","first_seq":0,"last_seq":5}"#;
        assert_eq!(serde_json::from_str::<ServerMsg>(old).unwrap(), hello(None));
        // An explicit null is none too.
        let null = old.replace(r#""last_seq":5"#, r#""last_seq":5,"engine_info":null"#);
        assert_eq!(
            serde_json::from_str::<ServerMsg>(&null).unwrap(),
            hello(None)
        );

        // Read by a client older than the field: the hello as it knew it.
        #[derive(Debug, PartialEq, Deserialize)]
        #[serde(tag = "type", rename_all = "snake_case")]
        enum OldServerMsg {
            Hello {
                protocol: u32,
                engine: u32,
                run: RunId,
                client: u64,
                client_key: String,
                first_seq: Option<u64>,
                last_seq: Option<u64>,
            },
        }
        let json = serde_json::to_string(&hello(Some(info))).unwrap();
        assert_eq!(
            serde_json::from_str::<OldServerMsg>(&json).unwrap(),
            OldServerMsg::Hello {
                protocol: 2,
                engine: 3,
                run: RunId(9),
                client: 4,
                client_key: "k".into(),
                first_seq: Some(0),
                last_seq: Some(5),
            }
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]
        #[test]
        fn decoding_random_or_mutated_frames_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            flip in any::<usize>(),
            bit in 0u8..8,
        ) {
            let _ = decode_batch(&bytes);
            let events = [ev(1), ev(2)];
            let mut frame = Vec::new();
            encode_batch(&events, &mut BlockEncoder::new(), &mut frame);
            let mut flipped = frame.clone();
            let i = flip % flipped.len();
            flipped[i] ^= 1 << bit;
            let _ = decode_batch(&flipped);
            // Cut short, a frame is refused, unless what was cut is
            // alignment padding nothing points into: then it still holds
            // the same events.
            frame.truncate(flip % frame.len());
            match decode_batch(&frame) {
                Err(_) => {}
                Ok(got) => prop_assert_eq!(&got[..], &events[..]),
            }
        }
    }
}
