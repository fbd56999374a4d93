//! OpenAI-shaped bodies for what hyper's HTTP/1.1 parser rejects before any
//! handler runs: too many or too large headers (431), a URI too long (414),
//! a request line or header that does not parse (400); and what RFC 9112
//! refuses where hyper is lenient (`headers::rfc9112`): an HTTP/1.1 request without
//! exactly one valid `Host` (400), a transfer coding other than chunked (501).
//!
//! hyper answers those itself with an empty body and closes the connection;
//! it has no hook to shape that answer. This wrapper of the connection's
//! socket recognises the answer as it is written (a 4xx head with
//! `connection: close` and `content-length: 0`: the gateway's own answers
//! always carry a body) and writes in its place the same status with a JSON
//! body in the OpenAI error shape and an `x-request-id`. It is counted in
//! `sluice_requests_total` like any other request. Every other write goes
//! straight through; the check is a comparison of the first bytes.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use hyper::rt::{Read, ReadBufCursor, Write};

use crate::error::error_body;
use crate::state::Live;
use crate::upstream::client::request_id;

pub(crate) struct ParseErrors<I> {
    io: I,
    /// The replacement answer still to be written.
    pending: Option<Bytes>,
    live: Arc<Live>,
}

impl<I> ParseErrors<I> {
    pub(crate) fn new(io: I, live: Arc<Live>) -> Self {
        Self {
            io,
            pending: None,
            live,
        }
    }
}

/// The status of hyper's own answer to a parse error, if `head` is one.
fn parser_answer(head: &[u8]) -> Option<u16> {
    let rest = head.strip_prefix(b"HTTP/1.1 ")?;
    let code: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    if !(400..500).contains(&code) {
        return None;
    }
    let end = memchr::memmem::find(head, b"\r\n\r\n")?;
    let headers = &head[..end + 2];
    let has = |h: &[u8]| memchr::memmem::find(headers, h).is_some();
    (has(b"\r\nconnection: close\r\n")
        && has(b"\r\ncontent-length: 0\r\n")
        && end + 4 == head.len())
    .then_some(code)
}

/// The replacement: same status, an OpenAI error body, a request id.
pub(super) fn answer(code: u16) -> (Bytes, &'static str) {
    let (reason, message, kind) = crate::error::refusal(code);
    let body = error_body(message, "invalid_request_error", None, Some(kind));
    let id = request_id(&http::HeaderMap::new());
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nconnection: close\r\ncontent-type: application/json\r\nx-request-id: {}\r\ncontent-length: {}\r\n\r\n",
        id.to_str().unwrap_or_default(),
        body.len()
    );
    let mut out = head.into_bytes();
    out.extend_from_slice(&body);
    (Bytes::from(out), kind)
}

impl<I: Write + Unpin> ParseErrors<I> {
    /// Write out the replacement, if one is pending.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(p) = self.pending.as_mut() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, p))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            p.advance(n);
            if p.is_empty() {
                self.pending = None;
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Take `buf` as written, replaced, when it is hyper's parse-error answer.
    fn replace(&mut self, buf: &[u8]) -> bool {
        let Some(code) = parser_answer(buf) else {
            return false;
        };
        let (bytes, kind) = answer(code);
        count(&self.live, code, kind);
        self.pending = Some(bytes);
        true
    }
}

/// Count a refused head in `sluice_requests_total`, without a model.
pub(crate) fn count(live: &Live, code: u16, kind: &'static str) {
    crate::app::count_refused(live, code, kind);
}

impl<I: Read + Unpin> Read for ParseErrors<I> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: ReadBufCursor<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<I: Write + Unpin> Write for ParseErrors<I> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        if this.replace(buf) {
            // Taken whole; it goes out in `poll_pending` (now or on flush).
            let _ = this.poll_pending(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        if let Some(first) = bufs.first()
            && first.len() == total
            && this.replace(first)
        {
            let _ = this.poll_pending(cx)?;
            return Poll::Ready(Ok(total));
        }
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_pending(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_parsers_own_answers_are_recognised() {
        let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Tue, 24 Nov 2026 00:14:35 GMT\r\n\r\n";
        assert_eq!(parser_answer(hyper_431), Some(431));
        let hyper_400 = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        assert_eq!(parser_answer(hyper_400), Some(400));
        // The gateway's own answers carry a body, or keep the connection.
        let ours = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 80\r\nconnection: close\r\n\r\n";
        assert_eq!(parser_answer(ours), None);
        let kept = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        assert_eq!(parser_answer(kept), None);
        let with_body =
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\n{}";
        assert_eq!(parser_answer(with_body), None);
        assert_eq!(parser_answer(b"data: HTTP/1.1 431\r\n\r\n"), None);
        let (bytes, kind) = answer(431);
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        assert_eq!(kind, "headers_too_large");
        assert!(text.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"));
        let body = &text[text.find("\r\n\r\n").unwrap() + 4..];
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "headers_too_large");
        assert!(text.contains(&format!("content-length: {}\r\n", body.len())));
    }
}
