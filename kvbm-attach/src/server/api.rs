//! What the HTTP handlers ([`http`](super::http)) and the WebSocket handler
//! ([`ws`](super::ws)) both need: what the token check allowed a request
//! ([`Access`]) and the JSON responses ([`Fail`], [`json_error`],
//! [`json_ok`]).
//!
//! It depends on neither handler module, so the routes can name the
//! WebSocket handler without the WebSocket handler depending back on the
//! routes.

use super::control::Refusal;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kvbm_events::text::{MAX_MESSAGE_CHARS, clip};
use kvbm_schema::protocol::ApiError;

/// What the token check allowed for this request (a request extension).
#[derive(Debug, Clone, Copy)]
pub(super) struct Access {
    /// May run control commands (in-band on a WebSocket too).
    pub control: bool,
}

/// A JSON error response.
#[derive(Debug)]
pub(super) struct Fail(pub StatusCode, pub ApiError);

impl From<Refusal> for Fail {
    fn from((s, e): Refusal) -> Self {
        Fail(s, e)
    }
}

impl IntoResponse for Fail {
    fn into_response(self) -> Response {
        json_error(self.0, self.1)
    }
}

/// A JSON error response, its message clipped to
/// [`MAX_MESSAGE_CHARS`] (it may quote what the client sent).
pub(super) fn json_error(status: StatusCode, mut e: ApiError) -> Response {
    e.message = clip(&e.message, MAX_MESSAGE_CHARS);
    let body = serde_json::to_vec(&e).unwrap_or_else(|_| b"{}".to_vec());
    let mut r = (status, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A `200` with `value` as JSON (a JSON `500` if it cannot be serialised).
pub(super) fn json_ok(value: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => {
            let mut r = (StatusCode::OK, body).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => json_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::new("internal", format!("serialising the response: {e}")),
        ),
    }
}

/// A `400 bad_request`.
pub(super) fn bad_request(message: impl Into<String>) -> Fail {
    Fail(
        StatusCode::BAD_REQUEST,
        ApiError::new("bad_request", message),
    )
}
