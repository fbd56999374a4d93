//! Upstream HTTP/1.1 connections driven by the request that uses them.
//!
//! hyper's pooled client runs each connection in its own task and hands the
//! response body over a one-chunk channel: every SSE event then costs a
//! cross-task wake-up, and the client side sees one write per event even when
//! the replica sent a burst. Here the connection future is owned by the request
//! and polled inside the response body's own `poll_frame`, so decoding the
//! next event needs no other task, and a burst already in the read buffer is
//! forwarded in one go (hyper's server keeps polling a body that is ready and
//! flushes once). The pool is a short critical section per request (checkout
//! and check-in), never per event.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response};
use http_body::Body as _;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::error::{GatewayError, TimeoutPhase};

type Io = TokioIo<TcpStream>;

/// Idle connections to one replica.
pub struct ConnPool {
    /// `host:port` to connect to.
    addr: String,
    /// The `Host` header (hyper's low-level client does not add one).
    pub host: HeaderValue,
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
    idle_timeout: Duration,
    connect_timeout: Duration,
}

struct Idle {
    sender: SendRequest<Full<Bytes>>,
    conn: Pin<Box<Connection<Io, Full<Bytes>>>>,
    since: Instant,
}

/// A connection checked out for one request. Dropping it closes the socket,
/// which is how a cancelled request is cancelled on the replica.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
    conn: Pin<Box<Connection<Io, Full<Bytes>>>>,
    /// The connection future finished (the replica closed it).
    closed: bool,
}

impl ConnPool {
    pub fn new(
        addr: String,
        host: HeaderValue,
        max_idle: usize,
        idle_timeout: Duration,
        connect_timeout: Duration,
    ) -> Self {
        Self {
            addr,
            host,
            idle: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
            connect_timeout,
        }
    }

    /// A live idle connection, or a new one.
    pub async fn checkout(&self) -> Result<Conn, GatewayError> {
        while let Some(mut c) = self.take_idle() {
            // A replica that closed an idle connection has sent FIN by now:
            // one poll notices, so the request does not go down a dead socket.
            let mut cx = Context::from_waker(Waker::noop());
            let open = c.conn.as_mut().poll(&mut cx).is_pending()
                && c.since.elapsed() < self.idle_timeout
                && c.sender.is_ready();
            if open {
                return Ok(Conn {
                    sender: c.sender,
                    conn: c.conn,
                    closed: false,
                });
            }
        }
        self.connect().await
    }

    fn take_idle(&self) -> Option<Idle> {
        self.idle.lock().ok()?.pop()
    }

    async fn connect(&self) -> Result<Conn, GatewayError> {
        let tcp = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&self.addr))
            .await
        {
            Err(_) => {
                return Err(GatewayError::UpstreamTimeout {
                    phase: TimeoutPhase::Connect,
                });
            }
            Ok(Err(e)) => return Err(GatewayError::UpstreamConnect(format!("{}: {e}", self.addr))),
            Ok(Ok(t)) => t,
        };
        // Tokens are small writes; Nagle would hold each for an ACK.
        let _ = tcp.set_nodelay(true);
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| GatewayError::UpstreamConnect(e.to_string()))?;
        Ok(Conn {
            sender,
            conn: Box::pin(conn),
            closed: false,
        })
    }

    /// Keep a connection whose response was read to the end, if it can carry
    /// another request.
    pub fn checkin(&self, mut c: Conn) {
        if c.closed {
            return;
        }
        // Let the connection finish the message it just delivered.
        let mut cx = Context::from_waker(Waker::noop());
        if c.conn.as_mut().poll(&mut cx).is_ready() || !c.sender.is_ready() {
            return;
        }
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < self.max_idle
        {
            idle.push(Idle {
                sender: c.sender,
                conn: c.conn,
                since: Instant::now(),
            });
        }
    }
}

impl Conn {
    /// Send the request and wait for the response head, driving the connection.
    pub async fn send(
        &mut self,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, hyper::Error> {
        let mut response = std::pin::pin!(self.sender.send_request(req));
        let conn = &mut self.conn;
        let closed = &mut self.closed;
        std::future::poll_fn(|cx| {
            if !*closed {
                match conn.as_mut().poll(cx) {
                    Poll::Ready(Err(e)) => {
                        *closed = true;
                        return Poll::Ready(Err(e));
                    }
                    Poll::Ready(Ok(())) => *closed = true,
                    Poll::Pending => {}
                }
            }
            response.as_mut().poll(cx)
        })
        .await
    }

    /// Make progress on the connection (read, decode) before polling its body.
    /// An error here is also reported by the body; it is returned for context.
    pub fn drive(&mut self, cx: &mut Context<'_>) -> Option<hyper::Error> {
        if self.closed {
            return None;
        }
        match self.conn.as_mut().poll(cx) {
            Poll::Pending => None,
            Poll::Ready(Ok(())) => {
                self.closed = true;
                None
            }
            Poll::Ready(Err(e)) => {
                self.closed = true;
                Some(e)
            }
        }
    }

    /// Read a whole body (at most `limit` bytes), driving the connection.
    pub async fn collect(&mut self, body: &mut Incoming, limit: usize) -> Result<Bytes, String> {
        let mut buf = bytes::BytesMut::new();
        std::future::poll_fn(|cx| {
            loop {
                if let Some(e) = self.drive(cx) {
                    return Poll::Ready(Err(e.to_string()));
                }
                match Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(None) => return Poll::Ready(Ok(())),
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e.to_string())),
                    Poll::Ready(Some(Ok(frame))) => {
                        if let Ok(data) = frame.into_data() {
                            if buf.len() + data.len() > limit {
                                return Poll::Ready(Err(format!(
                                    "response larger than {limit} bytes"
                                )));
                            }
                            buf.extend_from_slice(&data);
                        }
                    }
                }
            }
        })
        .await?;
        Ok(buf.freeze())
    }
}
