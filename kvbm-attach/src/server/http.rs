//! Routes, middleware (version, token, JSON errors, the body's size and
//! deadline) and the HTTP handlers.

use super::api::{Access, Fail, bad_request, json_error, json_ok};
use super::conn::{ConnInfo, RESERVED_DEADLINE};
use super::secret::ct_eq;
use super::{AppState, control, metrics, ws};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use kvbm_events::breakpoint::BreakpointSpec;
use kvbm_events::control::{ControlCommand, ControlResult};
use kvbm_events::text::{MAX_QUOTED_CHARS, clip};
use kvbm_schema::protocol::{
    Added, ApiError, CLIENT_HEADER, CLIENT_KEY_HEADER, Health, PROTOCOL_VERSION, VERSION_HEADER,
};
use serde::Deserialize;
use std::sync::Arc;
use std::sync::atomic::Ordering;

pub(super) fn router(state: Arc<AppState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/snapshot", get(snapshot))
        .route("/metrics", get(get_metrics))
        .route("/breakpoints", get(list_bps).post(add_bp))
        .route("/breakpoints/clear", post(clear_all))
        .route("/breakpoints/{id}", delete(clear_one))
        .route("/resume", post(resume))
        .route("/step", post(step))
        .route("/events", get(ws::events))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn_with_state(state.clone(), bound_body))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn(check_version))
        .layer(middleware::from_fn(json_errors))
        .with_state(state)
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Fail {
    Fail(
        StatusCode::NOT_FOUND,
        ApiError::new("not_found", format!("no endpoint {method} {}", uri.path())),
    )
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> Fail {
    Fail(
        StatusCode::METHOD_NOT_ALLOWED,
        ApiError::new(
            "method_not_allowed",
            format!("{} does not accept {method}", uri.path()),
        ),
    )
}

// ---------------------------------------------------------------------------
// Middleware
// ---------------------------------------------------------------------------

/// The version a request states (header, or `version` in the query).
fn stated_versions(req: &Request) -> Vec<String> {
    let mut v = Vec::new();
    for h in req.headers().get_all(VERSION_HEADER) {
        v.push(String::from_utf8_lossy(h.as_bytes()).trim().to_string());
    }
    if let Some(q) = req.uri().query() {
        for pair in q.split('&') {
            if let Some(("version", val)) = pair.split_once('=') {
                v.push(val.to_string());
            }
        }
    }
    v
}

async fn check_version(req: Request, next: Next) -> Response {
    for v in stated_versions(&req) {
        if v.parse::<u32>().ok() != Some(PROTOCOL_VERSION) {
            return json_error(
                StatusCode::BAD_REQUEST,
                ApiError::new(
                    "protocol_mismatch",
                    format!(
                        "the client speaks protocol version {}, this server speaks version {PROTOCOL_VERSION}",
                        clip(&v, MAX_QUOTED_CHARS)
                    ),
                ),
            );
        }
    }
    next.run(req).await
}

fn bearer_ok(headers: &HeaderMap, token: &str) -> bool {
    let mut ok = false;
    for h in headers.get_all(header::AUTHORIZATION) {
        let v = h.as_bytes();
        let (scheme, rest) = v.split_at(v.len().min(7));
        if scheme.eq_ignore_ascii_case(b"bearer ") {
            ok |= ct_eq(rest.trim_ascii(), token.as_bytes());
        }
    }
    ok
}

async fn auth(State(state): State<Arc<AppState>>, mut req: Request, next: Next) -> Response {
    let read_only = matches!(*req.method(), Method::GET | Method::HEAD);
    let access = match &state.cfg.token {
        None => Access { control: true },
        Some(t) => {
            let ok = bearer_ok(req.headers(), t);
            let let_through = ok || (read_only && state.cfg.open_read);
            if !let_through {
                state.counters.unauthorized.fetch_add(1, Ordering::Relaxed);
                let msg = if req.headers().contains_key(header::AUTHORIZATION) {
                    "wrong token"
                } else if read_only {
                    "this server needs `Authorization: Bearer TOKEN`"
                } else {
                    "control needs `Authorization: Bearer TOKEN`"
                };
                let mut r =
                    json_error(StatusCode::UNAUTHORIZED, ApiError::new("unauthorized", msg));
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return r;
            }
            Access { control: ok }
        }
    };
    req.extensions_mut().insert(access);
    next.run(req).await
}

/// Reads a request's whole body before the handlers see it: a declared
/// length over the limit is refused at once (`413`), and a body that has
/// not arrived within the request deadline (shorter on the place kept for
/// loopback) is answered `408`, so that no request holds its connection
/// waiting for bytes that never come. Requests without a body pass as
/// they are (a WebSocket upgrade among them).
async fn bound_body(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let limit = state.cfg.max_body_bytes;
    let headers = req.headers();
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().parse::<u64>());
    let has_body = declared.is_some() || headers.contains_key(header::TRANSFER_ENCODING);
    if !has_body {
        return next.run(req).await;
    }
    if let Some(Ok(n)) = declared
        && n > limit as u64
    {
        return json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::new(
                "payload_too_large",
                format!("a body of {n} bytes is over the limit of {limit}"),
            ),
        );
    }
    let reserved = req
        .extensions()
        .get::<ConnInfo>()
        .is_some_and(|c| c.reserved);
    let deadline = if reserved {
        state.cfg.request_timeout.min(RESERVED_DEADLINE)
    } else {
        state.cfg.request_timeout
    };
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Err(_) => {
            state
                .counters
                .request_timeouts
                .fetch_add(1, Ordering::Relaxed);
            let mut r = json_error(
                StatusCode::REQUEST_TIMEOUT,
                ApiError::new(
                    "request_timeout",
                    format!("the request's body did not arrive within {deadline:?}"),
                ),
            );
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return r;
        }
        Ok(Err(e)) => {
            // axum wraps http-body's `LengthLimitError` ("length limit
            // exceeded") without naming its type.
            let mut too_large = false;
            let mut cause: Option<&dyn std::error::Error> = Some(&e);
            while let Some(c) = cause {
                too_large |= c.to_string().contains("length limit");
                cause = c.source();
            }
            return if too_large {
                json_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    ApiError::new(
                        "payload_too_large",
                        format!("the request body is over the limit of {limit} bytes"),
                    ),
                )
            } else {
                json_error(
                    StatusCode::BAD_REQUEST,
                    ApiError::new("bad_request", format!("unreadable body: {e}")),
                )
            };
        }
        Ok(Ok(b)) => b,
    };
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

fn code_for(status: StatusCode) -> &'static str {
    match status {
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::FORBIDDEN => "forbidden",
        StatusCode::REQUEST_TIMEOUT => "request_timeout",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        s if s.is_server_error() => "internal",
        _ => "bad_request",
    }
}

/// Every error is a JSON `ApiError` (axum's own rejections are text), and
/// every response states the protocol version.
async fn json_errors(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    let is_json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    let mut res = if (status.is_client_error() || status.is_server_error()) && !is_json {
        let (_, body) = res.into_parts();
        let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
        let mut message = String::from_utf8_lossy(&text).trim().to_string();
        if message.is_empty() {
            message = status
                .canonical_reason()
                .unwrap_or("request failed")
                .to_string();
        }
        json_error(status, ApiError::new(code_for(status), message))
    } else {
        res
    };
    res.headers_mut()
        .insert(VERSION_HEADER, HeaderValue::from(PROTOCOL_VERSION));
    res
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------

/// A response with what the engine runs as beside it, when the engine
/// said ([`ServedEngine::with_info`](super::ServedEngine::with_info)):
/// `engine_info` next to the body's own fields, absent otherwise, so a
/// reader that knows only the body's type reads it unchanged.
#[derive(serde::Serialize)]
struct WithInfo<'a, T: serde::Serialize> {
    #[serde(flatten)]
    body: &'a T,
    #[serde(skip_serializing_if = "Option::is_none")]
    engine_info: Option<&'a serde_json::Value>,
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let health = Health {
        status: "ok".into(),
        protocol: PROTOCOL_VERSION,
        engine: state.engine.id,
        run: state.engine.run,
        last_seq: state.engine.ring.latest(1).last().map(|e| e.seq),
    };
    json_ok(&WithInfo {
        body: &health,
        engine_info: state.engine.info(),
    })
}

async fn snapshot(State(state): State<Arc<AppState>>) -> Response {
    // Serialising a large state takes a while: off the async workers.
    let r = tokio::task::spawn_blocking(move || {
        let g = state.reduced.lock();
        serde_json::to_vec(&WithInfo {
            body: &g.state,
            engine_info: state.engine.info(),
        })
    })
    .await;
    match r {
        Ok(Ok(body)) => {
            let mut r = (StatusCode::OK, body).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Ok(Err(e)) => Fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::new("internal", format!("serialising the state: {e}")),
        )
        .into_response(),
        Err(e) => Fail(
            StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::new("internal", format!("the snapshot task failed: {e}")),
        )
        .into_response(),
    }
}

async fn get_metrics(State(state): State<Arc<AppState>>) -> Response {
    let body = metrics::render(&state);
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// The body of a control request: JSON within the size limit, or a JSON
/// error (413 when too large, 400 otherwise).
fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    empty: Option<T>,
) -> Result<T, Fail> {
    let bytes = body.map_err(|e| {
        let status = e.status();
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            Fail(
                status,
                ApiError::new("payload_too_large", "the request body is too large"),
            )
        } else {
            Fail(
                StatusCode::BAD_REQUEST,
                ApiError::new("bad_request", format!("unreadable body: {e}")),
            )
        }
    })?;
    if bytes.iter().all(|b| b.is_ascii_whitespace())
        && let Some(v) = empty
    {
        return Ok(v);
    }
    // An object and nothing else: serde would take `[]` (or `[5]`) for a
    // struct as readily as `{}`.
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes)
        .map_err(|e| bad_request(format!("the body must be a JSON object: {e}")))?;
    T::deserialize(serde_json::Value::Object(map))
        .map_err(|e| bad_request(format!("malformed JSON body: {e}")))
}

/// The WebSocket client a control request acts for ([`CLIENT_HEADER`]) and
/// the key it gave ([`CLIENT_KEY_HEADER`]; empty when missing, which no
/// client's key is).
fn owner(headers: &HeaderMap) -> Result<Option<(u64, String)>, Fail> {
    let Some(v) = headers.get(CLIENT_HEADER) else {
        return Ok(None);
    };
    let id = v
        .to_str()
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .ok_or_else(|| bad_request(format!("{CLIENT_HEADER} must be a client id (a number)")))?;
    let key = headers
        .get(CLIENT_KEY_HEADER)
        .map(|k| String::from_utf8_lossy(k.as_bytes()).trim().to_string())
        .unwrap_or_default();
    Ok(Some((id, key)))
}

/// Runs a control command from an HTTP request: for the client it names
/// (key checked), or without one (a new breakpoint then gets a lease).
fn run_leased(
    state: &AppState,
    headers: &HeaderMap,
    cmd: ControlCommand,
) -> Result<(ControlResult, Option<kvbm_schema::protocol::Lease>), Fail> {
    Ok(match owner(headers)? {
        Some((id, key)) => (control::execute_for(state, cmd, id, Some(&key))?, None),
        None => control::execute_leased(state, cmd)?,
    })
}

fn run(state: &AppState, headers: &HeaderMap, cmd: ControlCommand) -> Result<ControlResult, Fail> {
    run_leased(state, headers, cmd).map(|(r, _)| r)
}

async fn list_bps(State(state): State<Arc<AppState>>) -> Response {
    json_ok(&control::view(&state))
}

async fn add_bp(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Fail> {
    let spec: BreakpointSpec = parse_body(body, None)?;
    match run_leased(&state, &headers, ControlCommand::Add { spec })? {
        (ControlResult::Added(id), lease) => Ok(json_ok(&Added { id, lease })),
        (other, _) => Ok(json_ok(&other)),
    }
}

async fn clear_one(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Fail> {
    let id: u64 = id.parse().map_err(|_| {
        bad_request(format!(
            "breakpoint id {:?} is not a number",
            clip(&id, MAX_QUOTED_CHARS)
        ))
    })?;
    match run(&state, &headers, ControlCommand::Clear { id })? {
        ControlResult::Done(false) => Err(Fail(
            StatusCode::NOT_FOUND,
            ApiError::new("not_found", format!("no breakpoint {id}")),
        )),
        r => Ok(json_ok(&r)),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

async fn clear_all(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Fail> {
    let Empty {} = parse_body(body, Some(Empty {}))?;
    Ok(json_ok(&run(&state, &headers, ControlCommand::ClearAll)?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeBody {
    #[serde(default)]
    pause_id: Option<u64>,
}

async fn resume(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Fail> {
    let ResumeBody { pause_id } = parse_body(body, Some(ResumeBody { pause_id: None }))?;
    match run(&state, &headers, ControlCommand::Resume { pause_id })? {
        ControlResult::Done(false) => Err(Fail(
            StatusCode::NOT_FOUND,
            ApiError::new(
                "not_found",
                format!("no paused call {}", pause_id.unwrap_or_default()),
            ),
        )),
        r => Ok(json_ok(&r)),
    }
}

async fn step(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Fail> {
    let Empty {} = parse_body(body, Some(Empty {}))?;
    Ok(json_ok(&run(&state, &headers, ControlCommand::Step)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_compare_is_a_compare() {
        assert!(ct_eq(b"secret", b"secret"));
        assert!(!ct_eq(b"secret", b"secreT"));
        assert!(!ct_eq(b"secret", b"secret2"));
        assert!(!ct_eq(b"", b"x"));
        assert!(ct_eq(b"", b""));
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer tok"),
        );
        assert!(bearer_ok(&h, "tok"));
        assert!(!bearer_ok(&h, "to"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic tok"));
        assert!(!bearer_ok(&h, "tok"));
    }
}
