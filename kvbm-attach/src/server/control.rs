//! Breakpoint commands (HTTP and WebSocket alike) and the watch that pushes
//! breakpoint changes to WebSocket clients.

use super::AppState;
use super::secret::ct_eq;
use axum::http::StatusCode;
use kvbm_events::breakpoint::{BreakpointError, BreakpointInfo, PausedCall};
use kvbm_events::control::{BreakpointsView, ControlCommand, ControlError, ControlResult};
use kvbm_schema::protocol::{ApiError, CLIENT_KEY_HEADER, Lease};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A refused command: the HTTP status and the error.
pub(super) type Refusal = (StatusCode, ApiError);

/// The engine's breakpoints and paused calls now (empty without control).
pub(super) fn view(state: &AppState) -> BreakpointsView {
    state
        .engine
        .control
        .as_deref()
        .map(|c| c.view())
        .unwrap_or_default()
}

fn refused(e: ControlError) -> Refusal {
    match e {
        ControlError::Refused(e @ BreakpointError::Full { .. }) => (
            StatusCode::CONFLICT,
            ApiError::new("refused", e.to_string()),
        ),
        ControlError::Refused(e) => (
            StatusCode::BAD_REQUEST,
            ApiError::new("refused", e.to_string()),
        ),
        ControlError::NoBreakpoints => (
            StatusCode::CONFLICT,
            ApiError::new("no_breakpoints", e.to_string()),
        ),
        ControlError::Unavailable(m) => (
            StatusCode::SERVICE_UNAVAILABLE,
            ApiError::new("unavailable", m),
        ),
    }
}

/// Runs `cmd` on behalf of `owner` (a WebSocket client id, if any) on the
/// engine's control, and wakes the watch that pushes changes.
pub(super) fn execute(
    state: &AppState,
    cmd: ControlCommand,
    owner: Option<u64>,
) -> Result<ControlResult, Refusal> {
    let Some(control) = state.engine.control.as_deref() else {
        return match cmd {
            ControlCommand::List => Ok(ControlResult::List(BreakpointsView::default())),
            _ => Err(refused(ControlError::NoBreakpoints)),
        };
    };
    let listing = matches!(cmd, ControlCommand::List);
    let r = control.execute(cmd, owner).map_err(refused)?;
    if !listing {
        state.bp_poke.notify_one();
    }
    Ok(r)
}

/// Runs `cmd` for the client named by `owner`, checking under the client
/// registry's lock that it is still connected (so its breakpoints cannot
/// outlive it) and, for a request that came over HTTP, that it gave the
/// client's key (`key`: `None` for the client's own WebSocket).
pub(super) fn execute_for(
    state: &AppState,
    cmd: ControlCommand,
    owner: u64,
    key: Option<&str>,
) -> Result<ControlResult, Refusal> {
    let clients = state.clients.lock().unwrap_or_else(|e| e.into_inner());
    let Some(want) = clients.get(&owner) else {
        return Err((
            StatusCode::BAD_REQUEST,
            ApiError::new(
                "bad_request",
                format!("client {owner} is not connected to this server"),
            ),
        ));
    };
    if let Some(key) = key
        && !ct_eq(key.as_bytes(), want.as_bytes())
    {
        return Err((
            StatusCode::FORBIDDEN,
            ApiError::new(
                "forbidden",
                format!(
                    "{CLIENT_KEY_HEADER} does not match client {owner}: only whoever holds that \
                     connection (and read its hello) may act for it"
                ),
            ),
        ));
    }
    let r = execute(state, cmd, Some(owner));
    drop(clients);
    r
}

/// Most leases alive at once; past it, leases that own nothing any more
/// are forgotten first.
const MAX_LEASES: usize = 4096;

/// Runs a command that came over HTTP without naming a client. A new
/// breakpoint, or a step (a one-shot breakpoint), gets an owner all the
/// same: a lease of [`ServerConfig::lease`](super::ServerConfig::lease),
/// after which it is removed (the step disarmed) and what it paused
/// resumes. Other commands give nothing an owner.
pub(super) fn execute_leased(
    state: &AppState,
    cmd: ControlCommand,
) -> Result<(ControlResult, Option<Lease>), Refusal> {
    let owns = matches!(cmd, ControlCommand::Add { .. } | ControlCommand::Step);
    if !owns || state.engine.control.is_none() {
        return execute(state, cmd, None).map(|r| (r, None));
    }
    let owner = state.next_client.fetch_add(1, Ordering::Relaxed);
    let lease = state.cfg.lease;
    {
        let mut leases = state.leases.lock().unwrap_or_else(|e| e.into_inner());
        if leases.len() >= MAX_LEASES
            && let Some(owners) = state.engine.control.as_deref().and_then(|c| c.owners())
        {
            // Forget the leases whose breakpoints were cleared, whose step
            // fired, whose pauses ended. Asked of the engine rather than
            // read from its listed breakpoints, which do not show an armed
            // step: its lease forgotten, the step would never lapse.
            leases.retain(|id, _| owners.contains(id));
        }
        if leases.len() >= MAX_LEASES {
            state
                .counters
                .leases_refused
                .fetch_add(1, Ordering::Relaxed);
            return Err((
                StatusCode::CONFLICT,
                ApiError::new(
                    "refused",
                    format!("{MAX_LEASES} breakpoint leases are alive"),
                ),
            ));
        }
        leases.insert(owner, Instant::now() + lease);
    }
    match execute(state, cmd, Some(owner)) {
        Ok(r) => Ok((
            r,
            Some(Lease {
                owner,
                expires_in_ms: u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
            }),
        )),
        Err(e) => {
            state
                .leases
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&owner);
            Err(e)
        }
    }
}

/// Ends the leases that ran out: their breakpoints are removed and what
/// they paused resumes.
fn expire_leases(state: &AppState, now: Instant) {
    let Some(control) = state.engine.control.as_deref() else {
        return;
    };
    let expired: Vec<u64> = {
        let mut leases = state.leases.lock().unwrap_or_else(|e| e.into_inner());
        let ids: Vec<u64> = leases
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            leases.remove(id);
        }
        ids
    };
    for id in expired {
        // Counted before the release: whoever sees the paused call resume
        // must also see the lease counted as expired.
        state
            .counters
            .leases_expired
            .fetch_add(1, Ordering::Relaxed);
        let r = control.release_owner(id);
        if r.breakpoints > 0 || r.resumed > 0 {
            tracing::info!(
                lease = id,
                breakpoints = r.breakpoints,
                resumed = r.resumed,
                "a breakpoint lease ran out: its breakpoints removed and its pauses resumed"
            );
            state.bp_poke.notify_one();
        }
    }
}

/// What changes are pushed on: the breakpoints and the paused calls
/// without their ever-changing clocks.
#[derive(PartialEq)]
struct Key {
    breakpoints: Vec<BreakpointInfo>,
    paused: Vec<PausedCall>,
}

fn key(v: &BreakpointsView) -> Key {
    Key {
        breakpoints: v.breakpoints.clone(),
        paused: v
            .paused
            .iter()
            .map(|p| PausedCall {
                waited: Duration::ZERO,
                deadline_in: Duration::ZERO,
                ..p.clone()
            })
            .collect(),
    }
}

/// Polls the breakpoints (and wakes at once after a command); publishes the
/// view when it changed, and at least every second while anything is set
/// or paused. Ends the leases that ran out on the way.
pub(super) async fn run_breakpoint_watch(state: Arc<AppState>) {
    if state.engine.control.is_none() {
        return;
    }
    let mut shutdown = state.shutdown.clone();
    let mut last = key(&BreakpointsView::default());
    let mut last_push = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(state.cfg.breakpoints_poll) => {}
            _ = state.bp_poke.notified() => {}
            _ = super::shutting_down(&mut shutdown) => return,
        }
        expire_leases(&state, Instant::now());
        let v = view(&state);
        let k = key(&v);
        let busy = !v.breakpoints.is_empty() || !v.paused.is_empty();
        if k != last || (busy && last_push.elapsed() >= Duration::from_secs(1)) {
            last = k;
            last_push = Instant::now();
            state.bp_tx.send_replace(Arc::new(v));
        }
    }
}
