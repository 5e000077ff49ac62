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
//! refused, so a breakpoint never outlives its owner. A breakpoint (or a
//! step) set by a command that names no session gets an owner all the
//! same, as one set over HTTP without a client does: a lease of
//! [`ANONYMOUS_LEASE`](crate::ANONYMOUS_LEASE) (5 minutes) that cannot be
//! renewed, after which it is removed and what it paused resumes. The
//! reply names the lease. At most [`MAX_LEASES`] are alive at once; past
//! that, leases that own nothing any more (what they set was cleared,
//! fired or resumed) are forgotten, and if every one still owns something
//! (or the control cannot say) the command is refused (`busy`, counted).
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
/// Most leases of breakpoints set without a session alive at once on one
/// engine (the attach server's own bound for those set without a client):
/// a controller that adds in a loop without a session is refused rather
/// than growing the engine's memory for [`ANONYMOUS_LEASE`](crate::ANONYMOUS_LEASE).
pub const MAX_LEASES: usize = 4096;

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
        /// Present when the command named no session and set something (a
        /// breakpoint, a step): its owner, removed when the lease runs out.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease: Option<kvbm_schema::protocol::Lease>,
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
    /// Leases of breakpoints set without a session, alive now.
    pub leases: u64,
    /// Such leases that ran out (their breakpoints removed).
    pub leases_expired: u64,
    /// Commands without a session refused because [`MAX_LEASES`] were
    /// alive.
    pub leases_refused: u64,
}

struct Sessions {
    /// The next owner id, for sessions and leases alike: one space, so a
    /// lease never names a session.
    next: u64,
    open: HashMap<u64, Instant>,
    /// Owners of what commands without a session set, and when each runs
    /// out. Not renewable, and not a session: no command can name one.
    leased: HashMap<u64, Instant>,
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
    leases_expired: AtomicU64,
    leases_refused: AtomicU64,
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
                leased: HashMap::new(),
            }),
            requests: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            sessions_refused: AtomicU64::new(0),
            leases_expired: AtomicU64::new(0),
            leases_refused: AtomicU64::new(0),
        })
    }

    /// The counters now.
    pub fn counters(&self) -> ResponderCounters {
        let (sessions, leases) = {
            let s = lock(&self.sessions);
            (s.open.len() as u64, s.leased.len() as u64)
        };
        ResponderCounters {
            requests: self.requests.load(Ordering::Relaxed),
            malformed: self.malformed.load(Ordering::Relaxed),
            sessions,
            expired: self.expired.load(Ordering::Relaxed),
            sessions_refused: self.sessions_refused.load(Ordering::Relaxed),
            leases,
            leases_expired: self.leases_expired.load(Ordering::Relaxed),
            leases_refused: self.leases_refused.load(Ordering::Relaxed),
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
                let mut s = lock(&self.sessions);
                let (owner, lease) = match session {
                    Some(id) if !s.open.contains_key(&id) => return no_session(id),
                    Some(id) => (Some(id), None),
                    // What a command without a session sets gets an owner
                    // of its own, or nothing would ever remove it (HTTP's
                    // lease for a breakpoint set without a client).
                    None if matches!(
                        command,
                        ControlCommand::Add { .. } | ControlCommand::Step
                    ) =>
                    {
                        if s.leased.len() >= MAX_LEASES
                            && let Some(owners) = self.control.owners()
                        {
                            // Forget the leases that own nothing any more.
                            // Asked of the engine, not read from what it
                            // lists: an armed step is not listed, and its
                            // lease forgotten, it would never lapse.
                            s.leased.retain(|id, _| owners.contains(id));
                        }
                        if s.leased.len() >= MAX_LEASES {
                            self.leases_refused.fetch_add(1, Ordering::Relaxed);
                            return ControlReply::error(
                                "busy",
                                format!(
                                    "{MAX_LEASES} breakpoints set without a session are alive on \
                                     this engine, the most it keeps: open a session, or wait for \
                                     their leases to run out ({} s)",
                                    crate::ANONYMOUS_LEASE.as_secs()
                                ),
                            );
                        }
                        let id = s.next;
                        s.next += 1;
                        s.leased.insert(id, Instant::now() + crate::ANONYMOUS_LEASE);
                        (Some(id), Some(id))
                    }
                    None => (None, None),
                };
                let r = self.control.execute(command, owner);
                if let Some(id) = lease
                    && r.is_err()
                {
                    // Nothing was set: nothing to own.
                    s.leased.remove(&id);
                }
                drop(s);
                match r {
                    Ok(result) => ControlReply::Result {
                        result,
                        lease: lease.map(|owner| kvbm_schema::protocol::Lease {
                            owner,
                            expires_in_ms: u64::try_from(crate::ANONYMOUS_LEASE.as_millis())
                                .unwrap_or(u64::MAX),
                        }),
                    },
                    Err(ControlError::Refused(e)) => ControlReply::error("refused", e.to_string()),
                    Err(e @ ControlError::NoBreakpoints) => {
                        ControlReply::error("no_breakpoints", e.to_string())
                    }
                    Err(ControlError::Unavailable(m)) => ControlReply::error("unavailable", m),
                }
            }
        }
    }

    /// Releases the sessions whose lease lapsed, and the leases of
    /// breakpoints set without a session that ran out; returns how many
    /// owners it released.
    pub fn expire(&self, now: Instant) -> usize {
        fn take_lapsed(owners: &mut HashMap<u64, Instant>, now: Instant) -> Vec<u64> {
            let ids: Vec<u64> = owners
                .iter()
                .filter(|(_, t)| **t <= now)
                .map(|(id, _)| *id)
                .collect();
            for id in &ids {
                owners.remove(id);
            }
            ids
        }
        let (sessions, leases) = {
            let mut s = lock(&self.sessions);
            (
                take_lapsed(&mut s.open, now),
                take_lapsed(&mut s.leased, now),
            )
        };
        // Counted before the release: whoever sees a paused call resume
        // also sees why.
        self.expired
            .fetch_add(sessions.len() as u64, Ordering::Relaxed);
        self.leases_expired
            .fetch_add(leases.len() as u64, Ordering::Relaxed);
        for id in sessions.iter().chain(&leases) {
            self.control.release_owner(*id);
        }
        sessions.len() + leases.len()
    }

    /// Releases every session and lease (the engine is going away).
    pub fn release_all(&self) {
        let ids: Vec<u64> = {
            let mut s = lock(&self.sessions);
            let sessions: Vec<u64> = s.open.drain().map(|(id, _)| id).collect();
            sessions
                .into_iter()
                .chain(s.leased.drain().map(|(id, _)| id))
                .collect()
        };
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
            ..
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
            ..
        }) = self.call(ControlRequest::Command {
            session: None,
            command: ControlCommand::List,
        }) {
            lock(&self.state).view = v;
        }
        match reply {
            ControlReply::Result { result, .. } => Ok(result),
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
                result: ControlResult::Added(7),
                lease: None,
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

    /// A command that names no session still gives what it sets an
    /// owner: a lease as long as the attach server's for a breakpoint set
    /// over HTTP without a client, after which the breakpoint is removed.
    /// (It used to stay ownerless until the engine exited.)
    #[test]
    fn a_breakpoint_set_without_a_session_lapses_with_its_lease() {
        let bps = Arc::new(kvbm_core::hooks::Breakpoints::new(
            None,
            kvbm_events::breakpoint::DEFAULT_DEADLINE,
        ));
        let session_lease = Duration::from_millis(200);
        let r = ControlResponder::new(bps.clone(), session_lease);
        // As the tester's script sends it.
        let add = br#"{"op":"command","command":{"command":"add","spec":{"request":{"Exact":"no-such-request"}}}}"#;
        let added = Instant::now();
        let ControlReply::Result {
            result: ControlResult::Added(id),
            lease: Some(lease),
        } = r.handle(add)
        else {
            panic!("not added with a lease")
        };
        assert_eq!(
            lease.expires_in_ms,
            crate::ANONYMOUS_LEASE.as_millis() as u64
        );
        let listed = || {
            let Ok(ControlResult::List(v)) = bps.execute(ControlCommand::List, None) else {
                panic!("no list")
            };
            v.breakpoints
        };
        let owner = listed()
            .iter()
            .find(|b| b.id == id)
            .and_then(|b| b.spec.owner);
        assert_eq!(owner, Some(lease.owner), "{:?}", listed());
        // The lease is no session: it can neither be renewed nor named.
        let as_session = ControlRequest::Command {
            session: Some(lease.owner),
            command: ControlCommand::ClearAll,
        };
        assert!(
            matches!(send(&r, &as_session), ControlReply::Error { code, .. } if code == "no_session")
        );
        assert!(matches!(
            send(&r, &ControlRequest::Renew { session: lease.owner }),
            ControlReply::Error { code, .. } if code == "no_session"
        ));
        // A command that sets nothing gets no lease.
        let list = ControlRequest::Command {
            session: None,
            command: ControlCommand::List,
        };
        assert!(matches!(
            send(&r, &list),
            ControlReply::Result { lease: None, .. }
        ));
        assert_eq!(r.counters().leases, 1);
        // Not when a session's lease would lapse ...
        assert_eq!(r.expire(Instant::now() + 2 * session_lease), 0);
        assert_eq!(listed().len(), 1);
        // ... but once its own ran out.
        assert_eq!(
            r.expire(added + crate::ANONYMOUS_LEASE + Duration::from_secs(1)),
            1
        );
        assert!(listed().is_empty(), "outlived its lease: {:?}", listed());
        let c = r.counters();
        assert_eq!((c.leases, c.leases_expired, c.expired), (0, 1, 0));
    }

    /// A step without a session is leased too; a command without a
    /// session that fails leaves no lease; past [`MAX_LEASES`] such
    /// commands are refused and counted; the engine going away releases
    /// every lease.
    #[test]
    fn leases_of_commands_without_a_session_are_bounded_and_released() {
        let probe = Arc::new(Probe::default());
        let r = ControlResponder::new(probe.clone(), DEFAULT_LEASE);
        let step = ControlRequest::Command {
            session: None,
            command: ControlCommand::Step,
        };
        let ControlReply::Result { lease: Some(l), .. } = send(&r, &step) else {
            panic!("a step without a lease")
        };
        assert_eq!(*lock(&probe.owners), vec![Some(l.owner)]);
        // Refused by the engine: nothing set, nothing leased.
        let bps = Arc::new(kvbm_core::hooks::Breakpoints::new(
            None,
            kvbm_events::breakpoint::DEFAULT_DEADLINE,
        ));
        let strict = ControlResponder::new(bps, DEFAULT_LEASE);
        let bad = br#"{"op":"command","command":{"command":"add","spec":{"state":"NoSuchState"}}}"#;
        assert!(matches!(strict.handle(bad), ControlReply::Error { .. }));
        assert_eq!(strict.counters().leases, 0);
        let add = ControlRequest::Command {
            session: None,
            command: ControlCommand::Add {
                spec: BreakpointSpec::default(),
            },
        };
        for _ in 1..MAX_LEASES {
            assert!(matches!(
                send(&r, &add),
                ControlReply::Result { lease: Some(_), .. }
            ));
        }
        match send(&r, &add) {
            ControlReply::Error { code, message } => {
                assert_eq!(code, "busy");
                assert!(message.contains(&MAX_LEASES.to_string()), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let c = r.counters();
        assert_eq!((c.leases, c.leases_refused), (MAX_LEASES as u64, 1));
        // Sessions are not held back by leases.
        assert!(matches!(
            send(&r, &ControlRequest::Open { client: None }),
            ControlReply::Opened { .. }
        ));
        r.release_all();
        assert_eq!(lock(&probe.released).len(), MAX_LEASES + 1);
        let c = r.counters();
        assert_eq!((c.leases, c.sessions), (0, 0));
    }

    /// Past [`MAX_LEASES`], an engine that can say who owns what has the
    /// leases that own nothing forgotten rather than the command refused,
    /// and keeps the lease of an armed step, which it does not list.
    #[test]
    fn leases_that_own_nothing_are_forgotten_and_an_armed_steps_is_kept() {
        let bps = Arc::new(kvbm_core::hooks::Breakpoints::new(
            None,
            kvbm_events::breakpoint::DEFAULT_DEADLINE,
        ));
        let r = ControlResponder::new(bps.clone(), DEFAULT_LEASE);
        let command = |command| ControlRequest::Command {
            session: None,
            command,
        };
        let ControlReply::Result {
            lease: Some(step), ..
        } = send(&r, &command(ControlCommand::Step))
        else {
            panic!("a step without a lease")
        };
        let add = command(ControlCommand::Add {
            spec: BreakpointSpec::default().with_request("never"),
        });
        // Cleared one by one: clearing all would disarm the step too.
        let clear_each = |bps: &kvbm_core::hooks::Breakpoints| {
            for b in bps.list() {
                assert!(bps.clear(b.id));
            }
        };
        // The engine keeps at most 1024 breakpoints: set and clear them.
        for _ in 1..MAX_LEASES {
            assert!(matches!(
                send(&r, &add),
                ControlReply::Result { lease: Some(_), .. }
            ));
            if bps.list().len() == kvbm_events::breakpoint::DEFAULT_MAX_BREAKPOINTS {
                clear_each(&bps);
            }
        }
        clear_each(&bps);
        assert_eq!(r.counters().leases, MAX_LEASES as u64);
        let ControlReply::Result { lease: Some(_), .. } = send(&r, &add) else {
            panic!("refused though 4095 leases own nothing")
        };
        let c = r.counters();
        assert_eq!((c.leases, c.leases_refused), (2, 0));
        assert_eq!(bps.owners().len(), 2);
        assert!(bps.owners().contains(&step.owner) && bps.is_armed());
        // The step's lease is still there to end it.
        r.release_all();
        assert!(bps.owners().is_empty());
        assert!(!bps.is_armed());
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
