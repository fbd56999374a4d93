//! A real OTLP trace receiver for tests, on the opentelemetry-proto types: a
//! tonic gRPC server and an HTTP/protobuf endpoint (`POST /v1/traces`), both
//! storing what they receive.

use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::net::TcpListener;

/// One received span, with its resource's service name.
#[derive(Debug, Clone)]
pub struct Got {
    pub service: String,
    pub span: Span,
}

impl Got {
    pub fn attr(&self, key: &str) -> Option<Value> {
        self.span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.clone())
            .and_then(|v| v.value)
    }

    pub fn str(&self, key: &str) -> Option<String> {
        match self.attr(key)? {
            Value::StringValue(s) => Some(s),
            _ => None,
        }
    }

    pub fn int(&self, key: &str) -> Option<i64> {
        match self.attr(key)? {
            Value::IntValue(i) => Some(i),
            _ => None,
        }
    }

    pub fn trace_id_hex(&self) -> String {
        hex::encode(&self.span.trace_id)
    }
}

#[derive(Clone, Default)]
pub struct Store(pub Arc<Mutex<Vec<Got>>>);

impl Store {
    fn add(&self, req: ExportTraceServiceRequest) {
        let mut v = self.0.lock();
        for rs in req.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
                .and_then(|kv| kv.value.clone())
                .and_then(|v| v.value)
                .map(|v| match v {
                    Value::StringValue(s) => s,
                    _ => String::new(),
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    v.push(Got {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
    }

    pub fn spans(&self) -> Vec<Got> {
        self.0.lock().clone()
    }

    /// SERVER spans: one per kept request.
    pub fn requests(&self) -> Vec<Got> {
        self.spans()
            .into_iter()
            .filter(|g| g.span.kind == 2)
            .collect()
    }
}

struct Grpc(Store);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.add(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

pub struct Receiver {
    pub addr: SocketAddr,
    pub store: Store,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn grpc() -> Receiver {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let store = Store::default();
    let svc = TraceServiceServer::new(Grpc(store.clone()));
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await;
    });
    Receiver { addr, store, task }
}

pub async fn http() -> Receiver {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let store = Store::default();
    let s = store.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let s = s.clone();
            async move {
                match ExportTraceServiceRequest::decode(body) {
                    Ok(req) => {
                        s.add(req);
                        (
                            [("content-type", "application/x-protobuf")],
                            ExportTraceServiceResponse::default().encode_to_vec(),
                        )
                            .into_response_parts()
                    }
                    Err(_) => panic!("not an OTLP protobuf body"),
                }
            }
        }),
    );
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Receiver { addr, store, task }
}

trait IntoParts {
    fn into_response_parts(self) -> axum::response::Response;
}

impl<T: axum::response::IntoResponse> IntoParts for T {
    fn into_response_parts(self) -> axum::response::Response {
        self.into_response()
    }
}
