//! One attempt on a replica: send the request, wait for the response head,
//! and turn a non-2xx answer into an error carrying the replica's
//! (normalised) body. Shared by the proxied API and the Responses by-id routes.

use bytes::Bytes;
use tokio::time::Instant;

use crate::error::{GatewayError, TimeoutPhase, normalise_upstream_error};
use crate::upstream::conn::{Conn, SendError};
use crate::upstream::http1::Outgoing;
use crate::upstream::pool::Replica;

/// Largest error body read from a replica before giving up on it.
const MAX_ERROR_BODY: usize = 1 << 20;

/// Send one attempt and wait for response headers; non-2xx answers become errors
/// carrying the replica's (normalised) body.
pub(crate) async fn send(
    replica: &Replica,
    req: Outgoing,
    headers_by: Instant,
    stream: bool,
) -> Result<(http::Response<()>, Conn), GatewayError> {
    let phase = if stream {
        TimeoutPhase::FirstToken
    } else {
        TimeoutPhase::Total
    };
    let timed_out = || GatewayError::UpstreamTimeout { phase };
    // Only a new connection is awaited under a timer of its own; the wait
    // for the answer is bounded by the connection's kept timer
    // (`Conn::send`). Boxed: a connect is rare next to the requests on a
    // kept connection, and inline its ~430 bytes were in every request's
    // future (which each request allocates and writes).
    let connect = || async {
        Box::pin(tokio::time::timeout_at(headers_by, replica.conns.connect()))
            .await
            .map_err(|_| timed_out())?
    };
    let mut conn = match replica.conns.idle_conn() {
        Some(conn) => conn,
        None => connect().await?,
    };
    let resp = match conn.send(&req, headers_by).await {
        // The replica closed a kept-alive connection just as it was reused
        // (servers time idle connections out: uvicorn after 5 s): the
        // request never reached it. Once more on a fresh connection.
        Err(SendError::NotSent(_)) if conn.reused() => {
            conn = connect().await?;
            conn.send(&req, headers_by).await
        }
        r => r,
    };
    // A request that could not have reached the replica (the connection
    // died first) is a connect error: safe to retry on another replica.
    let resp = resp.map_err(|e| e.into_gateway(phase))?;
    let status = resp.status();
    if status.is_success() {
        return Ok((resp, conn));
    }
    // Boxed: the rare path's state stays out of every request's future.
    Err(Box::pin(refusal(replica, conn, status, headers_by)).await)
}

/// A non-2xx answer: its body (bounded) as the gateway's error.
async fn refusal(
    replica: &Replica,
    mut conn: Conn,
    status: http::StatusCode,
    by: Instant,
) -> GatewayError {
    let body = match conn.collect(MAX_ERROR_BODY, by).await {
        Ok(Ok(b)) => {
            replica.conns.checkin(conn);
            b
        }
        _ => Bytes::new(),
    };
    GatewayError::Upstream {
        status,
        body: normalise_upstream_error(status, &body),
    }
}
