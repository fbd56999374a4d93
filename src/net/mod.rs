//! The sockets both HTTP/1.1 paths read and write: a plain TCP stream, or
//! TLS over one (`server.tls` on the listeners, `https://` replicas).
//!
//! An enum, not a type parameter: the own server and the upstream
//! connections read a plain socket through its readiness (a `recv` only
//! when the reactor says it is readable, no `recv` after a short read; see
//! [`crate::upstream::conn::read_draining`]), which a TLS stream cannot
//! offer (its records are decrypted as they are read). Each call site
//! matches once and keeps its plain path as it was; TLS goes through
//! [`AsyncRead`]/[`AsyncWrite`]. The code of both servers and the upstream
//! client is built once.

pub mod tls;

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// A connection, plain or under TLS.
pub enum Socket {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl Socket {
    /// The TCP stream under it.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Socket::Plain(t) => t,
            Socket::Tls(t) => t.get_ref().0,
        }
    }

    /// Read what a TLS stream has into `rbuf` (it must have room): the byte
    /// count, 0 at the peer's close.
    pub fn poll_read_tls(
        tls: &mut tokio_rustls::TlsStream<TcpStream>,
        cx: &mut Context<'_>,
        rbuf: &mut BytesMut,
    ) -> Poll<io::Result<usize>> {
        tokio_util::io::poll_read_buf(Pin::new(tls), cx, rbuf)
    }

    /// An idle TLS connection has nothing to read: not closed, and no
    /// unsolicited bytes. Records it holds that carry no data (a TLS 1.3
    /// session ticket) are processed, not counted.
    pub fn tls_is_quiet(tls: &mut tokio_rustls::TlsStream<TcpStream>) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut probe = [0u8; 1];
        let mut buf = ReadBuf::new(&mut probe);
        matches!(Pin::new(tls).poll_read(&mut cx, &mut buf), Poll::Pending)
    }
}

/// Room for a read of `bytes` in `rbuf`: an empty buffer with less left
/// starts again at its front when nothing else holds its bytes (no copy,
/// no allocation, and the next read lands in cache lines just used).
pub fn make_room(rbuf: &mut BytesMut, bytes: usize) {
    if rbuf.is_empty() {
        let _ = rbuf.try_reclaim(bytes);
    }
    if rbuf.capacity() - rbuf.len() < bytes / 4 {
        rbuf.reserve(bytes);
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Plain(t) => Pin::new(t).poll_read(cx, buf),
            Socket::Tls(t) => Pin::new(t).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Plain(t) => Pin::new(t).poll_write(cx, buf),
            Socket::Tls(t) => Pin::new(t).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Plain(t) => Pin::new(t).poll_write_vectored(cx, bufs),
            Socket::Tls(t) => Pin::new(t).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Socket::Plain(t) => t.is_write_vectored(),
            Socket::Tls(t) => t.is_write_vectored(),
        }
    }

    /// Plain: nothing is held. TLS: the records rustls holds are written.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Plain(_) => Poll::Ready(Ok(())),
            Socket::Tls(t) => Pin::new(t).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Plain(t) => Pin::new(t).poll_shutdown(cx),
            Socket::Tls(t) => Pin::new(t).poll_shutdown(cx),
        }
    }
}
