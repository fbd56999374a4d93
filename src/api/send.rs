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
    let attempt = async {
        let mut conn = replica.conns.checkout().await?;
        let resp = match conn.send(&req).await {
            // The replica closed a kept-alive connection just as it was reused
            // (servers time idle connections out: uvicorn after 5 s): the
            // request never reached it. Once more on a fresh connection.
            Err(SendError::NotSent(_)) if conn.reused() => {
                conn = replica.conns.connect().await?;
                conn.send(&req).await
            }
            r => r,
        };
        // A request that could not have reached the replica (the connection
        // died first) is a connect error: safe to retry on another replica.
        let resp = resp.map_err(SendError::into_gateway)?;
        Ok::<_, GatewayError>((resp, conn))
    };
    let (resp, mut conn) = match tokio::time::timeout_at(headers_by, attempt).await {
        Err(_) => return Err(GatewayError::UpstreamTimeout { phase }),
        Ok(r) => r?,
    };
    let status = resp.status();
    if status.is_success() {
        return Ok((resp, conn));
    }
    let read = tokio::time::timeout_at(headers_by, conn.collect(MAX_ERROR_BODY));
    let body = match read.await {
        Ok(Ok(b)) => {
            replica.conns.checkin(conn);
            b
        }
        _ => Bytes::new(),
    };
    Err(GatewayError::Upstream {
        status,
        body: normalise_upstream_error(status, &body),
    })
}
