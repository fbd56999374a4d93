//! A replica that writes raw HTTP/1.1 bytes: the wire forms a hyper server
//! never produces (sized or close-delimited streams, interim 1xx responses,
//! chunk extensions, trailers, malformed heads) and connections closed at
//! chosen moments. It answers `GET /v1/models` itself (and 404 to the gateway's
//! scrape of `/metrics`); every other request goes to the test's `answer` with
//! its index on its connection (0 for the first).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What to do with one request.
pub enum Reply {
    /// Write these bytes and keep the connection for the next request.
    KeepAlive(Vec<u8>),
    /// Write these bytes and close the connection.
    Close(Vec<u8>),
    /// Close the connection without answering.
    Hangup,
    /// Never answer: hold the connection until the gateway closes it.
    Silent,
    /// Write these bytes (a head and part of its body), then say nothing
    /// more and hold the connection until the gateway closes it.
    Stall(Vec<u8>),
}

pub struct Raw {
    pub addr: std::net::SocketAddr,
    /// Connections that carried a request handed to `answer`.
    pub connections: Arc<AtomicUsize>,
    /// Requests handed to `answer`.
    pub requests: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Raw {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Answer = dyn Fn(usize) -> Reply + Send + Sync;

pub async fn start(
    model: &'static str,
    answer: impl Fn(usize) -> Reply + Send + Sync + 'static,
) -> Raw {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let requests = Arc::new(AtomicUsize::new(0));
    let answer: Arc<Answer> = Arc::new(answer);
    let (conns, reqs) = (connections.clone(), requests.clone());
    let task = tokio::spawn(async move {
        let mut tasks = tokio::task::JoinSet::new();
        while let Ok((tcp, _)) = listener.accept().await {
            tasks.spawn(serve(
                tcp,
                model,
                answer.clone(),
                conns.clone(),
                reqs.clone(),
            ));
        }
    });
    Raw {
        addr,
        connections,
        requests,
        task,
    }
}

async fn serve(
    mut tcp: TcpStream,
    model: &str,
    answer: Arc<Answer>,
    connections: Arc<AtomicUsize>,
    requests: Arc<AtomicUsize>,
) {
    let mut buf = Vec::new();
    let mut index = 0;
    loop {
        let Some(path) = read_request(&mut tcp, &mut buf).await else {
            return;
        };
        if path == "/v1/models" {
            let body =
                format!(r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#);
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            );
            if tcp
                .write_all(format!("{head}{body}").as_bytes())
                .await
                .is_err()
            {
                return;
            }
            continue;
        }
        if !path.starts_with("/v1/") {
            // The gateway's scrape of replica metrics: none here.
            let head = "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
            if tcp.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            continue;
        }
        if index == 0 {
            connections.fetch_add(1, Ordering::SeqCst);
        }
        requests.fetch_add(1, Ordering::SeqCst);
        let reply = answer(index);
        index += 1;
        match reply {
            Reply::KeepAlive(bytes) => {
                if tcp.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            Reply::Close(bytes) => {
                let _ = tcp.write_all(&bytes).await;
                return;
            }
            Reply::Hangup => return,
            Reply::Silent => {
                while read_more(&mut tcp, &mut buf).await > 0 {}
                return;
            }
            Reply::Stall(bytes) => {
                if tcp.write_all(&bytes).await.is_err() {
                    return;
                }
                while read_more(&mut tcp, &mut buf).await > 0 {}
                return;
            }
        }
    }
}

/// Read one request (head and `Content-Length` body); its path, or `None` when
/// the peer closed.
async fn read_request(tcp: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let length: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + length {
                if read_more(tcp, buf).await == 0 {
                    return None;
                }
            }
            buf.drain(..end + 4 + length);
            return head.split(' ').nth(1).map(str::to_string);
        }
        if read_more(tcp, buf).await == 0 {
            return None;
        }
    }
}

async fn read_more(tcp: &mut TcpStream, buf: &mut Vec<u8>) -> usize {
    let mut chunk = [0u8; 4096];
    let n = tcp.read(&mut chunk).await.unwrap_or(0);
    buf.extend_from_slice(&chunk[..n]);
    n
}

/// A complete chat stream as SSE: two content events, the finish, `[DONE]`.
pub const SSE: &str = concat!(
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"Hel\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: [DONE]\n\n",
);
