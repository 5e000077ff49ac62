//! Breakpoint commands (HTTP and WebSocket alike) and the watch that pushes
//! breakpoint changes to WebSocket clients.

use super::AppState;
use axum::http::StatusCode;
use kvbm_events::breakpoint::{BreakpointError, BreakpointInfo, PausedCall};
use kvbm_events::control::{BreakpointsView, ControlCommand, ControlError, ControlResult};
use kvbm_schema::protocol::ApiError;
use std::sync::Arc;
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
/// outlive it).
pub(super) fn execute_for(
    state: &AppState,
    cmd: ControlCommand,
    owner: Option<u64>,
) -> Result<ControlResult, Refusal> {
    match owner {
        None => execute(state, cmd, None),
        Some(id) => {
            let clients = state.clients.lock().unwrap_or_else(|e| e.into_inner());
            if !clients.contains(&id) {
                return Err((
                    StatusCode::BAD_REQUEST,
                    ApiError::new(
                        "bad_request",
                        format!("client {id} is not connected to this server"),
                    ),
                ));
            }
            let r = execute(state, cmd, Some(id));
            drop(clients);
            r
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
/// or paused.
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
