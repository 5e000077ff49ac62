//! What an attach server says about its engine in `GET /health`: the
//! engine's description (`engine_info`, set by the engine with
//! `kvbm_attach::server::ServedEngine::with_info`), whose `summary` the
//! console's header shows.
//!
//! The attach client follows the event stream over a WebSocket and reads
//! nothing else, so this is one plain HTTP/1.1 request of its own, on a
//! connection of its own: bounded in time ([`FETCH_TIMEOUT`] by default)
//! and in size ([`MAX_HEALTH_BYTES`]), with the bearer token when there is
//! one. What it reads is the server's word, never trusted further than
//! that: the summary shown is cleaned by
//! [`kvbm_recorder::sidecar::engine_summary`].

use kvbm_attach::client::Endpoint;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one `/health` request may take, connection included.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest `/health` response read (headers and body).
pub const MAX_HEALTH_BYTES: usize = 1 << 20;

/// The engine's description in the server's `/health` (`None`: the server
/// has none, or is older than the field); an error says why it could not
/// be read.
pub async fn engine_info(
    endpoint: &Endpoint,
    token: Option<&str>,
    timeout: Duration,
) -> Result<Option<serde_json::Value>, String> {
    let body = tokio::time::timeout(timeout, get(endpoint, "/health", token))
        .await
        .map_err(|_| format!("GET {endpoint}/health took longer than {timeout:?}"))??;
    let v: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| format!("GET {endpoint}/health: not JSON: {e}"))?;
    Ok(v.get("engine_info").filter(|i| !i.is_null()).cloned())
}

/// `GET path` on `endpoint`: the body of a `200`.
async fn get(endpoint: &Endpoint, path: &str, token: Option<&str>) -> Result<Vec<u8>, String> {
    let what = format!("GET {endpoint}{path}");
    let mut s = tokio::net::TcpStream::connect((endpoint.host.as_str(), endpoint.port))
        .await
        .map_err(|e| format!("{what}: connecting: {e}"))?;
    let host = kvbm_events::addr::join_authority(&endpoint.host, endpoint.port);
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: application/json\r\nConnection: close\r\n"
    );
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| format!("{what}: sending: {e}"))?;
    let mut raw = Vec::new();
    (&mut s)
        .take(MAX_HEALTH_BYTES as u64 + 1)
        .read_to_end(&mut raw)
        .await
        .map_err(|e| format!("{what}: reading: {e}"))?;
    if raw.len() > MAX_HEALTH_BYTES {
        return Err(format!(
            "{what}: the answer is over {MAX_HEALTH_BYTES} bytes"
        ));
    }
    let (status, body) = parse_response(&raw).map_err(|e| format!("{what}: {e}"))?;
    if status != 200 {
        let said = String::from_utf8_lossy(&body);
        return Err(format!(
            "{what}: answered {status} {}",
            kvbm_events::text::clip(said.trim(), kvbm_events::text::MAX_QUOTED_CHARS)
        ));
    }
    Ok(body)
}

/// The status and the body of an HTTP/1.1 response read whole (to the
/// connection's close): `Content-Length` and chunked bodies both.
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("the answer has no end of headers")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "headers that are not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            format!(
                "a bad status line {:?}",
                kvbm_events::text::clip(status_line, kvbm_events::text::MAX_QUOTED_CHARS)
            )
        })?;
    let header = |name: &str| {
        head.split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
    };
    let rest = &raw[end + 4..];
    let body = if header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(rest)?
    } else if let Some(n) = header("content-length") {
        let n: usize = n.parse().map_err(|_| "a bad Content-Length")?;
        rest.get(..n)
            .ok_or("a body shorter than its Content-Length")?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok((status, body))
}

/// A chunked body, decoded.
fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let nl = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("a chunk without its size line")?;
        let size = std::str::from_utf8(&rest[..nl]).map_err(|_| "a bad chunk size")?;
        let size = size.split(';').next().unwrap_or_default().trim();
        let n = usize::from_str_radix(size, 16).map_err(|_| "a bad chunk size")?;
        if n == 0 {
            return Ok(out);
        }
        let chunk = rest.get(nl + 2..nl + 2 + n).ok_or("a chunk cut short")?;
        out.extend_from_slice(chunk);
        rest = rest.get(nl + 2 + n + 2..).ok_or("a chunk cut short")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_read_by_length_chunks_or_to_the_close() {
        let r = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}trailing";
        assert_eq!(parse_response(r).unwrap(), (200, b"{}".to_vec()));
        let r = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4;x=y\r\n\":1}\r\n0\r\n\r\n";
        assert_eq!(parse_response(r).unwrap(), (200, b"{\"a\":1}".to_vec()));
        let r = b"HTTP/1.1 401 Unauthorized\r\n\r\nno";
        assert_eq!(parse_response(r).unwrap(), (401, b"no".to_vec()));
        for bad in [
            &b"HTTP/1.1 200 OK\r\n"[..],
            b"HTTP/1.1 x OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nff\r\nab",
        ] {
            assert!(
                parse_response(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
