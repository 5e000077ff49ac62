//! Breakpoint commands (HTTP and WebSocket alike) and the watch that pushes
//! breakpoint changes to WebSocket clients.

use super::AppState;
use crate::protocol::{ApiError, BreakpointsView, ControlCommand, ControlResult};
use axum::http::StatusCode;
use kvbm_core::hooks::{BreakpointError, BreakpointInfo, Breakpoints, PausedCall};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A refused command: the HTTP status and the error.
pub(super) type Refusal = (StatusCode, ApiError);

pub(super) fn view(bps: &Breakpoints) -> BreakpointsView {
    BreakpointsView {
        breakpoints: bps.list(),
        paused: bps.paused(),
    }
}

fn refused(e: BreakpointError) -> Refusal {
    let status = match e {
        BreakpointError::Full { .. } => StatusCode::CONFLICT,
        _ => StatusCode::BAD_REQUEST,
    };
    (status, ApiError::new("refused", e.to_string()))
}

/// Runs `cmd` on behalf of `owner` (a WebSocket client id, if any). The
/// owner of an added breakpoint is always `owner`, whatever the spec said.
pub(super) fn execute(
    state: &AppState,
    cmd: ControlCommand,
    owner: Option<u64>,
) -> Result<ControlResult, Refusal> {
    let Some(bps) = state.engine.breakpoints.as_deref() else {
        return match cmd {
            ControlCommand::List => Ok(ControlResult::List(BreakpointsView::default())),
            _ => Err((
                StatusCode::CONFLICT,
                ApiError::new("no_breakpoints", "this engine has no breakpoints installed"),
            )),
        };
    };
    let r = match cmd {
        ControlCommand::Add { mut spec } => {
            spec.owner = owner;
            ControlResult::Added(bps.add(spec).map_err(refused)?)
        }
        ControlCommand::Clear { id } => ControlResult::Done(bps.clear(id)),
        ControlCommand::ClearAll => ControlResult::Count(bps.clear_all() as u64),
        ControlCommand::Resume { pause_id: Some(p) } => ControlResult::Done(bps.resume(p)),
        ControlCommand::Resume { pause_id: None } => ControlResult::Count(bps.resume_all() as u64),
        ControlCommand::Step => ControlResult::Done(match owner {
            Some(o) => bps.step_for(o),
            None => bps.step(),
        }),
        ControlCommand::List => return Ok(ControlResult::List(view(bps))),
    };
    state.bp_poke.notify_one();
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
    let Some(bps) = state.engine.breakpoints.clone() else {
        return;
    };
    let mut shutdown = state.shutdown.clone();
    let mut last = key(&BreakpointsView::default());
    let mut last_push = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(state.cfg.breakpoints_poll) => {}
            _ = state.bp_poke.notified() => {}
            _ = super::shutting_down(&mut shutdown) => return,
        }
        let v = view(&bps);
        let k = key(&v);
        let busy = !v.breakpoints.is_empty() || !v.paused.is_empty();
        if k != last || (busy && last_push.elapsed() >= Duration::from_secs(1)) {
            last = k;
            last_push = Instant::now();
            state.bp_tx.send_replace(Arc::new(v));
        }
    }
}
