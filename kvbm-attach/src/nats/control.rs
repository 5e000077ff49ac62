//! Breakpoint control through NATS request-reply on
//! `kvbm.control.<engine>`.
//!
//! The engine side ([`ControlResponder`]) answers each request with the
//! engine's own [`Control`] (its `Breakpoints`), so specs, limits and
//! deadlines are exactly the attach server's. NATS has no connection per
//! controller, so ownership rides on a *session*: a controller opens one
//! ([`ControlRequest::Open`]), gets its id and a lease, and renews it;
//! breakpoints it adds belong to the session (the owner). When a session
//! is closed, or its lease lapses because the controller stopped renewing
//! (it crashed, or lost NATS), the responder releases it: its breakpoints
//! are removed and the calls they paused resume — the attach server's
//! release-on-disconnect. A command naming a session that is not open is
//! refused, so a breakpoint never outlives its owner.
//!
//! Requests and replies are JSON (at most [`MAX_REQUEST_BYTES`]); a
//! malformed request gets an error reply naming what was wrong. At most
//! [`MAX_SESSIONS`] are open at once: a controller that opens sessions
//! in a loop and never closes them is refused (`busy`, counted) rather
//! than growing the engine's memory until their leases lapse.
//! [`NatsControl`] is the controller side, a [`Control`] for the console.

use super::{NatsError, check_engine_name, control_subject};
use futures_util::StreamExt;
use kvbm_events::control::{BreakpointsView, Control, ControlCommand, ControlError, ControlResult};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Largest request accepted.
pub const MAX_REQUEST_BYTES: usize = 64 << 10;
/// Default lease of a session.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// Most sessions open at once on one engine: a console holds one, so
/// this is room for many operators and a few crashed consoles whose
/// leases have not lapsed yet.
pub const MAX_SESSIONS: usize = 64;

/// A request to an engine's control.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlRequest {
    /// Open a session; `client` names the controller (for logs).
    Open {
        /// Who is asking.
        #[serde(default)]
        client: Option<String>,
    },
    /// Renew a session's lease.
    Renew {
        /// The session.
        session: u64,
    },
    /// Close a session (its breakpoints go, its pauses resume).
    Close {
        /// The session.
        session: u64,
    },
    /// Run a command, on behalf of `session` when given.
    Command {
        /// The owner of what it sets.
        #[serde(default)]
        session: Option<u64>,
        /// The command.
        command: ControlCommand,
    },
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case", deny_unknown_fields)]
pub enum ControlReply {
    /// A session is open.
    Opened {
        /// Its id.
        session: u64,
        /// Renew within this many milliseconds.
        lease_ms: u64,
    },
    /// Renewed or closed.
    Ok,
    /// A command's result.
    Result {
        /// What it returned.
        result: ControlResult,
    },
    /// Refused.
    Error {
        /// `bad_request`, `no_session`, `refused`, `no_breakpoints`.
        code: String,
        /// Why.
        message: String,
    },
}

impl ControlReply {
    fn error(code: &str, message: impl Into<String>) -> Self {
        ControlReply::Error {
            code: code.into(),
            message: kvbm_events::text::clip(&message.into(), kvbm_events::text::MAX_MESSAGE_CHARS),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a responder has done.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ResponderCounters {
    /// Requests answered.
    pub requests: u64,
    /// Requests refused as malformed (or without a reply subject).
    pub malformed: u64,
    /// Sessions open now.
    pub sessions: u64,
    /// Sessions released because their lease lapsed.
    pub expired: u64,
    /// Sessions refused because [`MAX_SESSIONS`] were open.
    pub sessions_refused: u64,
}

struct Sessions {
    next: u64,
    open: HashMap<u64, Instant>,
}

/// The engine side: answers `kvbm.control.<engine>`.
pub struct ControlResponder {
    control: Arc<dyn Control>,
    lease: Duration,
    sessions: Mutex<Sessions>,
    requests: AtomicU64,
    malformed: AtomicU64,
    expired: AtomicU64,
    sessions_refused: AtomicU64,
}

impl std::fmt::Debug for ControlResponder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlResponder")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl ControlResponder {
    /// A responder over `control`, with sessions that lapse after `lease`
    /// without a renewal.
    pub fn new(control: Arc<dyn Control>, lease: Duration) -> Arc<Self> {
        Arc::new(ControlResponder {
            control,
            lease: lease.max(Duration::from_millis(100)),
            sessions: Mutex::new(Sessions {
                next: 1,
                open: HashMap::new(),
            }),
            requests: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            sessions_refused: AtomicU64::new(0),
        })
    }

    /// The counters now.
    pub fn counters(&self) -> ResponderCounters {
        ResponderCounters {
            requests: self.requests.load(Ordering::Relaxed),
            malformed: self.malformed.load(Ordering::Relaxed),
            sessions: lock(&self.sessions).open.len() as u64,
            expired: self.expired.load(Ordering::Relaxed),
            sessions_refused: self.sessions_refused.load(Ordering::Relaxed),
        }
    }

    /// Answers one request (the bytes of a NATS message).
    pub fn handle(&self, payload: &[u8]) -> ControlReply {
        self.requests.fetch_add(1, Ordering::Relaxed);
        if payload.len() > MAX_REQUEST_BYTES {
            self.malformed.fetch_add(1, Ordering::Relaxed);
            return ControlReply::error(
                "bad_request",
                format!(
                    "request of {} bytes, at most {MAX_REQUEST_BYTES}",
                    payload.len()
                ),
            );
        }
        let req: ControlRequest = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => {
                self.malformed.fetch_add(1, Ordering::Relaxed);
                return ControlReply::error("bad_request", format!("malformed request: {e}"));
            }
        };
        match req {
            ControlRequest::Open { .. } => {
                // Lapsed sessions make room first, without waiting for
                // the serving loop's next sweep.
                self.expire(Instant::now());
                let mut s = lock(&self.sessions);
                if s.open.len() >= MAX_SESSIONS {
                    self.sessions_refused.fetch_add(1, Ordering::Relaxed);
                    return ControlReply::error(
                        "busy",
                        format!(
                            "{MAX_SESSIONS} control sessions are open on this engine, the most it \
                             keeps: close one, or wait for one not renewed to lapse ({} s)",
                            self.lease.as_secs_f64()
                        ),
                    );
                }
                let id = s.next;
                s.next += 1;
                s.open.insert(id, Instant::now() + self.lease);
                ControlReply::Opened {
                    session: id,
                    lease_ms: self.lease.as_millis() as u64,
                }
            }
            ControlRequest::Renew { session } => {
                let mut s = lock(&self.sessions);
                match s.open.get_mut(&session) {
                    Some(t) => {
                        *t = Instant::now() + self.lease;
                        ControlReply::Ok
                    }
                    None => no_session(session),
                }
            }
            ControlRequest::Close { session } => {
                let was = lock(&self.sessions).open.remove(&session).is_some();
                if was {
                    self.control.release_owner(session);
                    ControlReply::Ok
                } else {
                    no_session(session)
                }
            }
            ControlRequest::Command { session, command } => {
                // Under the sessions lock, so the session cannot lapse (and
                // be released) between the check and the command.
                let s = lock(&self.sessions);
                if let Some(id) = session
                    && !s.open.contains_key(&id)
                {
                    return no_session(id);
                }
                let r = self.control.execute(command, session);
                drop(s);
                match r {
                    Ok(result) => ControlReply::Result { result },
                    Err(ControlError::Refused(e)) => ControlReply::error("refused", e.to_string()),
                    Err(e @ ControlError::NoBreakpoints) => {
                        ControlReply::error("no_breakpoints", e.to_string())
                    }
                    Err(ControlError::Unavailable(m)) => ControlReply::error("unavailable", m),
                }
            }
        }
    }

    /// Releases the sessions whose lease lapsed; returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let lapsed: Vec<u64> = {
            let mut s = lock(&self.sessions);
            let ids: Vec<u64> = s
                .open
                .iter()
                .filter(|(_, t)| **t <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in &ids {
                s.open.remove(id);
            }
            ids
        };
        for id in &lapsed {
            self.control.release_owner(*id);
        }
        self.expired
            .fetch_add(lapsed.len() as u64, Ordering::Relaxed);
        lapsed.len()
    }

    /// Releases every session (the engine is going away).
    pub fn release_all(&self) {
        let ids: Vec<u64> = lock(&self.sessions)
            .open
            .drain()
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            self.control.release_owner(id);
        }
    }

    /// Serves `kvbm.control.<engine>` on `client` until the task is
    /// aborted; lapsed sessions are released every quarter lease.
    pub async fn serve(
        self: Arc<Self>,
        client: async_nats::Client,
        engine: &str,
    ) -> Result<(), NatsError> {
        check_engine_name(engine)?;
        let mut sub = client
            .subscribe(control_subject(engine))
            .await
            .map_err(|e| NatsError::Nats(format!("subscribing to control: {e}")))?;
        let mut tick = tokio::time::interval(self.lease / 4);
        loop {
            tokio::select! {
                msg = sub.next() => {
                    let Some(msg) = msg else { return Ok(()) };
                    let Some(reply) = msg.reply.clone() else {
                        self.malformed.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    // Commands take the engine's locks briefly; a blocking
                    // section keeps the runtime's threads free.
                    let me = self.clone();
                    let payload = msg.payload.clone();
                    let answer = tokio::task::spawn_blocking(move || me.handle(&payload))
                        .await
                        .unwrap_or_else(|_| ControlReply::error("unavailable", "the control handler panicked"));
                    let body = serde_json::to_vec(&answer).unwrap_or_default();
                    let _ = client.publish(reply, body.into()).await;
                }
                _ = tick.tick() => {
                    self.expire(Instant::now());
                }
            }
        }
    }
}

fn no_session(id: u64) -> ControlReply {
    ControlReply::error(
        "no_session",
        format!("session {id} is not open on this engine (closed, or its lease lapsed)"),
    )
}

/// Starts serving `engine`'s control on the runtime; abort the handle to
/// stop (then call [`ControlResponder::release_all`]).
pub fn spawn_responder(
    responder: Arc<ControlResponder>,
    client: async_nats::Client,
    engine: String,
    rt: &tokio::runtime::Handle,
) -> tokio::task::JoinHandle<()> {
    rt.spawn(async move {
        if let Err(e) = responder.serve(client, &engine).await {
            tracing::warn!("control responder for {engine}: {e}");
        }
    })
}

// ------------------------------------------------------------ controller

/// How long a command waits for its reply.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

struct ControllerState {
    session: Option<u64>,
    lease: Duration,
    view: BreakpointsView,
    last_error: Option<String>,
}

/// The controller side: a [`Control`] for one engine through NATS. Opens a
/// session on first use and renews it in the background; `List` answers
/// from a cache refreshed twice a second. Dropping it closes the session.
pub struct NatsControl {
    client: async_nats::Client,
    subject: String,
    rt: tokio::runtime::Handle,
    state: Arc<Mutex<ControllerState>>,
    keeper: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for NatsControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsControl")
            .field("subject", &self.subject)
            .finish_non_exhaustive()
    }
}

async fn request(
    client: &async_nats::Client,
    subject: &str,
    req: &ControlRequest,
    timeout: Duration,
) -> Result<ControlReply, String> {
    let body = serde_json::to_vec(req).map_err(|e| e.to_string())?;
    let msg = tokio::time::timeout(timeout, client.request(subject.to_string(), body.into()))
        .await
        .map_err(|_| format!("no reply within {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&msg.payload).map_err(|e| format!("malformed reply: {e}"))
}

impl NatsControl {
    /// Control of `engine` through `client`.
    pub fn new(
        client: async_nats::Client,
        engine: &str,
        rt: &tokio::runtime::Handle,
    ) -> Result<Self, NatsError> {
        check_engine_name(engine)?;
        let subject = control_subject(engine);
        let state = Arc::new(Mutex::new(ControllerState {
            session: None,
            lease: DEFAULT_LEASE,
            view: BreakpointsView::default(),
            last_error: None,
        }));
        let keeper = rt.spawn(keep(client.clone(), subject.clone(), state.clone()));
        Ok(NatsControl {
            client,
            subject,
            rt: rt.clone(),
            state,
            keeper,
        })
    }

    /// The session now, if one is open.
    pub fn session(&self) -> Option<u64> {
        lock(&self.state).session
    }

    /// The last failure, once.
    pub fn take_error(&self) -> Option<String> {
        lock(&self.state).last_error.take()
    }

    /// Sends `req` and waits for the reply on a std channel (never a
    /// tokio primitive, so calling it inside the runtime cannot panic).
    fn call(&self, req: ControlRequest) -> Result<ControlReply, String> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (client, subject) = (self.client.clone(), self.subject.clone());
        self.rt.spawn(async move {
            let _ = tx.send(request(&client, &subject, &req, COMMAND_TIMEOUT).await);
        });
        rx.recv_timeout(COMMAND_TIMEOUT + Duration::from_millis(500))
            .map_err(|_| format!("no reply within {COMMAND_TIMEOUT:?}"))?
    }

    fn ensure_session(&self) -> Result<u64, String> {
        if let Some(s) = self.session() {
            return Ok(s);
        }
        match self.call(ControlRequest::Open {
            client: Some("kvbm-console".into()),
        })? {
            ControlReply::Opened { session, lease_ms } => {
                let mut st = lock(&self.state);
                st.session = Some(session);
                st.lease = Duration::from_millis(lease_ms.max(100));
                Ok(session)
            }
            // `busy` when the engine has all the sessions it keeps.
            ControlReply::Error { code, message } => {
                Err(format!("opening a control session: {code}: {message}"))
            }
            other => Err(format!("unexpected reply {other:?}")),
        }
    }
}

/// Renews the session at a third of its lease and refreshes the cached
/// view; a session the engine no longer knows (it restarted, or the lease
/// lapsed) is forgotten, and the next command opens a new one.
async fn keep(client: async_nats::Client, subject: String, state: Arc<Mutex<ControllerState>>) {
    let mut last_renew = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (session, lease) = {
            let st = lock(&state);
            (st.session, st.lease)
        };
        if let Some(id) = session
            && last_renew.elapsed() >= lease / 3
        {
            last_renew = Instant::now();
            match request(
                &client,
                &subject,
                &ControlRequest::Renew { session: id },
                COMMAND_TIMEOUT,
            )
            .await
            {
                Ok(ControlReply::Ok) => {}
                Ok(ControlReply::Error { message, .. }) => {
                    let mut st = lock(&state);
                    st.session = None;
                    st.last_error = Some(message);
                }
                Ok(_) => {}
                Err(e) => {
                    lock(&state).last_error = Some(format!("renewing the control session: {e}"))
                }
            }
        }
        let list = ControlRequest::Command {
            session: None,
            command: ControlCommand::List,
        };
        if let Ok(ControlReply::Result {
            result: ControlResult::List(v),
        }) = request(&client, &subject, &list, COMMAND_TIMEOUT).await
        {
            lock(&state).view = v;
        }
    }
}

impl Drop for NatsControl {
    fn drop(&mut self) {
        self.keeper.abort();
        if let Some(session) = self.session() {
            let (client, subject) = (self.client.clone(), self.subject.clone());
            // Best effort: if it never arrives, the lease lapses.
            self.rt.spawn(async move {
                let _ = request(
                    &client,
                    &subject,
                    &ControlRequest::Close { session },
                    Duration::from_millis(500),
                )
                .await;
                let _ = client.flush().await;
            });
        }
    }
}

impl Control for NatsControl {
    fn execute(
        &self,
        command: ControlCommand,
        _owner: Option<u64>,
    ) -> Result<ControlResult, ControlError> {
        if command == ControlCommand::List {
            return Ok(ControlResult::List(lock(&self.state).view.clone()));
        }
        let fail = |e: String| {
            lock(&self.state).last_error = Some(e.clone());
            ControlError::Unavailable(e)
        };
        let session = self.ensure_session().map_err(fail)?;
        let reply = self
            .call(ControlRequest::Command {
                session: Some(session),
                command,
            })
            .map_err(fail)?;
        // Read the engine's view at once, so the screen shows the change.
        if let Ok(ControlReply::Result {
            result: ControlResult::List(v),
        }) = self.call(ControlRequest::Command {
            session: None,
            command: ControlCommand::List,
        }) {
            lock(&self.state).view = v;
        }
        match reply {
            ControlReply::Result { result } => Ok(result),
            ControlReply::Error { code, message } => {
                if code == "no_session" {
                    lock(&self.state).session = None;
                }
                Err(ControlError::Unavailable(format!("{code}: {message}")))
            }
            other => Err(fail(format!("unexpected reply {other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbm_events::breakpoint::BreakpointSpec;

    /// A control that records what it was asked.
    #[derive(Default)]
    struct Probe {
        released: Mutex<Vec<u64>>,
        owners: Mutex<Vec<Option<u64>>>,
    }

    impl Control for Probe {
        fn execute(
            &self,
            command: ControlCommand,
            owner: Option<u64>,
        ) -> Result<ControlResult, ControlError> {
            lock(&self.owners).push(owner);
            Ok(match command {
                ControlCommand::Add { .. } => ControlResult::Added(7),
                ControlCommand::List => ControlResult::List(BreakpointsView::default()),
                _ => ControlResult::Done(true),
            })
        }
        fn release_owner(&self, owner: u64) -> kvbm_events::breakpoint::OwnerReleased {
            lock(&self.released).push(owner);
            Default::default()
        }
    }

    fn send(r: &ControlResponder, req: &ControlRequest) -> ControlReply {
        r.handle(&serde_json::to_vec(req).unwrap())
    }

    #[test]
    fn sessions_own_what_they_set_and_are_released_when_they_lapse_or_close() {
        let probe = Arc::new(Probe::default());
        let r = ControlResponder::new(probe.clone(), Duration::from_millis(200));
        let ControlReply::Opened { session, lease_ms } =
            send(&r, &ControlRequest::Open { client: None })
        else {
            panic!()
        };
        assert_eq!(lease_ms, 200);
        let add = ControlRequest::Command {
            session: Some(session),
            command: ControlCommand::Add {
                spec: BreakpointSpec::default(),
            },
        };
        assert_eq!(
            send(&r, &add),
            ControlReply::Result {
                result: ControlResult::Added(7)
            }
        );
        assert_eq!(*lock(&probe.owners), vec![Some(session)]);
        // Renewed, it does not lapse; not renewed, it does.
        assert_eq!(
            send(&r, &ControlRequest::Renew { session }),
            ControlReply::Ok
        );
        assert_eq!(r.expire(Instant::now()), 0);
        assert_eq!(r.expire(Instant::now() + Duration::from_secs(1)), 1);
        assert_eq!(*lock(&probe.released), vec![session]);
        // A lapsed session can neither renew nor command.
        assert!(matches!(send(&r, &add), ControlReply::Error { code, .. } if code == "no_session"));
        assert!(matches!(
            send(&r, &ControlRequest::Renew { session }),
            ControlReply::Error { .. }
        ));
        // Closing releases at once.
        let ControlReply::Opened { session: s2, .. } =
            send(&r, &ControlRequest::Open { client: None })
        else {
            panic!()
        };
        assert_ne!(s2, session);
        assert_eq!(
            send(&r, &ControlRequest::Close { session: s2 }),
            ControlReply::Ok
        );
        assert_eq!(*lock(&probe.released), vec![session, s2]);
        assert_eq!(r.counters().expired, 1);
    }

    #[test]
    fn sessions_are_bounded_and_lapsed_ones_make_room() {
        let lease = Duration::from_millis(100);
        let r = ControlResponder::new(Arc::new(Probe::default()), lease);
        let open = || send(&r, &ControlRequest::Open { client: None });
        let mut ids = Vec::new();
        for _ in 0..MAX_SESSIONS {
            let ControlReply::Opened { session, .. } = open() else {
                panic!("refused below the limit")
            };
            ids.push(session);
        }
        match open() {
            ControlReply::Error { code, message } => {
                assert_eq!(code, "busy");
                assert!(message.contains(&MAX_SESSIONS.to_string()), "{message}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.counters().sessions_refused, 1);
        assert_eq!(r.counters().sessions, MAX_SESSIONS as u64);
        // Closing one makes room for one.
        assert_eq!(
            send(&r, &ControlRequest::Close { session: ids[0] }),
            ControlReply::Ok
        );
        assert!(matches!(open(), ControlReply::Opened { .. }));
        assert!(matches!(open(), ControlReply::Error { .. }));
        // Once their leases lapse, an open releases them first: no sweep
        // of the serving loop is needed.
        std::thread::sleep(lease + Duration::from_millis(50));
        assert!(matches!(open(), ControlReply::Opened { .. }));
        let c = r.counters();
        assert_eq!(
            (c.sessions, c.expired, c.sessions_refused),
            (1, MAX_SESSIONS as u64, 2)
        );
    }

    #[test]
    fn malformed_requests_get_an_error_naming_the_problem() {
        let r = ControlResponder::new(Arc::new(Probe::default()), DEFAULT_LEASE);
        for bad in [
            &b"not json"[..],
            br#"{"op":"launch"}"#,
            br#"{"op":"renew"}"#,
            br#"{"op":"command","command":{"command":"fly"}}"#,
            br#"{"op":"open","extra":1}"#,
        ] {
            match r.handle(bad) {
                ControlReply::Error { code, message } => {
                    assert_eq!(code, "bad_request");
                    assert!(message.starts_with("malformed request"), "{message}");
                }
                other => panic!("{other:?}"),
            }
        }
        let big = vec![b' '; MAX_REQUEST_BYTES + 1];
        assert!(matches!(r.handle(&big), ControlReply::Error { .. }));
        assert_eq!(r.counters().malformed, 6);
    }
}
