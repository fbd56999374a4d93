//! A replica that plays back a script of raw chunks: exact bytes, chosen chunk
//! boundaries, chosen delays. For tests that need byte-level control (splitting
//! events across chunks, odd formatting) or a hard shutdown (connect refused).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

#[derive(Clone)]
pub struct Script {
    pub status: u16,
    pub content_type: &'static str,
    /// (delay before the chunk, chunk bytes)
    pub chunks: Vec<(Duration, Bytes)>,
}

impl Script {
    pub fn sse(chunks: Vec<(Duration, &'static [u8])>) -> Self {
        Self {
            status: 200,
            content_type: "text/event-stream",
            chunks: chunks
                .into_iter()
                .map(|(d, b)| (d, Bytes::from_static(b)))
                .collect(),
        }
    }
}

pub struct Scripted {
    pub addr: SocketAddr,
    pub last_headers: Arc<Mutex<Option<HeaderMap>>>,
    /// The body of the last API request.
    pub last_body: Arc<Mutex<Option<Bytes>>>,
    tasks: Arc<Mutex<JoinSet<()>>>,
}

impl Scripted {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stop accepting and cut every open connection: later connects are refused.
    pub fn kill(&self) {
        self.tasks.lock().abort_all();
    }
}

type Body = BoxBody<Bytes, Infallible>;

/// What the replica saw of the last API request.
type Seen<T> = Arc<Mutex<Option<T>>>;

pub async fn start(model: &'static str, script: Script) -> Scripted {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let last_headers = Arc::new(Mutex::new(None));
    let last_body = Arc::new(Mutex::new(None));
    let tasks = Arc::new(Mutex::new(JoinSet::new()));
    let (lh, lb, ts) = (last_headers.clone(), last_body.clone(), tasks.clone());
    let accept = async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let (script, lh, lb) = (script.clone(), lh.clone(), lb.clone());
            let svc = service_fn(move |req: Request<Incoming>| {
                let (script, lh, lb) = (script.clone(), lh.clone(), lb.clone());
                async move { Ok::<_, Infallible>(answer(model, script, (lh, lb), req).await) }
            });
            let conn = async move {
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), svc)
                    .await;
            };
            ts.lock().spawn(conn);
        }
    };
    tasks.lock().spawn(accept);
    Scripted {
        addr,
        last_headers,
        last_body,
        tasks,
    }
}

async fn answer(
    model: &str,
    script: Script,
    (last, last_body): (Seen<HeaderMap>, Seen<Bytes>),
    req: Request<Incoming>,
) -> Response<Body> {
    if req.uri().path() == "/v1/models" {
        let body = format!(r#"{{"object":"list","data":[{{"id":"{model}","object":"model"}}]}}"#);
        return Response::new(
            http_body_util::Full::new(Bytes::from(body))
                .map_err(|e| match e {})
                .boxed(),
        );
    }
    *last.lock() = Some(req.headers().clone());
    if let Ok(body) = req.into_body().collect().await {
        *last_body.lock() = Some(body.to_bytes());
    }
    let chunks = stream::unfold(script.chunks.into_iter(), |mut it| async move {
        let (delay, bytes) = it.next()?;
        // The scripted replica's own pacing between chunks (not test synchronisation).
        tokio::time::sleep(delay).await;
        Some((Ok::<_, Infallible>(Frame::data(bytes)), it))
    });
    Response::builder()
        .status(StatusCode::from_u16(script.status).unwrap())
        .header("content-type", script.content_type)
        .body(StreamBody::new(chunks).boxed())
        .unwrap()
}
