//! A fake Kubernetes API server on loopback: lists and watches of pods (by
//! label selector) and InferencePools (by name), as the real one answers
//! them: a list carries its `resourceVersion`, a watch from it streams
//! newline-delimited `{type, object}` events (replaying what changed since
//! that version), and an object that leaves a watch's selection is sent to
//! it as `DELETED`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use parking_lot::Mutex;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::broadcast;

const PODS: &str = "pods";
const POOLS: &str = "inferencepools";

#[derive(Clone)]
struct Change {
    rv: u64,
    kind: &'static str,
    deleted: bool,
    object: Value,
}

#[derive(Default)]
struct Objects {
    rv: u64,
    /// (kind, name) -> object.
    live: BTreeMap<(&'static str, String), Value>,
    log: Vec<Change>,
}

#[derive(Clone)]
struct Api {
    objects: Arc<Mutex<Objects>>,
    changes: broadcast::Sender<Change>,
}

pub struct FakeKube {
    pub addr: SocketAddr,
    api: Api,
    dir: tempfile::TempDir,
}

impl FakeKube {
    /// A kubeconfig naming this server, with `namespace` as its context's.
    pub fn kubeconfig(&self, namespace: &str) -> std::path::PathBuf {
        let path = self.dir.path().join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"http://{}\"}}\n\
             users:\n- name: gw\n  user: {{token: test-token}}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: gw, namespace: {namespace}}}\n\
             current-context: fake\n",
            self.addr
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Add or replace a pod: its labels, IP and readiness.
    pub fn pod(&self, name: &str, labels: Value, ip: &str, ready: bool) {
        let status = if ready { "True" } else { "False" };
        self.apply(
            PODS,
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "llm", "labels": labels},
                "status": {"phase": "Running", "podIP": ip,
                           "conditions": [{"type": "Ready", "status": status}]},
            }),
        );
    }

    /// Add or replace an InferencePool selecting `labels` on `port`.
    pub fn pool(&self, name: &str, labels: Value, port: u16) {
        self.apply(
            POOLS,
            json!({
                "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                "metadata": {"name": name, "namespace": "llm"},
                "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": port}],
                         "endpointPickerRef": {"name": "sluice", "port": {"number": 9002}}},
            }),
        );
    }

    pub fn delete_pod(&self, name: &str) {
        self.delete(PODS, name);
    }

    pub fn delete_pool(&self, name: &str) {
        self.delete(POOLS, name);
    }

    fn apply(&self, kind: &'static str, mut object: Value) {
        let mut o = self.api.objects.lock();
        o.rv += 1;
        object["metadata"]["resourceVersion"] = json!(o.rv.to_string());
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        o.live.insert((kind, name), object.clone());
        self.publish(&mut o, kind, false, object);
    }

    fn delete(&self, kind: &'static str, name: &str) {
        let mut o = self.api.objects.lock();
        let Some(mut object) = o.live.remove(&(kind, name.to_string())) else {
            return;
        };
        o.rv += 1;
        object["metadata"]["resourceVersion"] = json!(o.rv.to_string());
        self.publish(&mut o, kind, true, object);
    }

    fn publish(&self, o: &mut Objects, kind: &'static str, deleted: bool, object: Value) {
        let c = Change {
            rv: o.rv,
            kind,
            deleted,
            object,
        };
        o.log.push(c.clone());
        let _ = self.api.changes.send(c);
    }
}

pub async fn start() -> FakeKube {
    let (changes, _) = broadcast::channel(1024);
    let api = Api {
        objects: Arc::default(),
        changes,
    };
    let app = Router::new()
        .route(
            "/api/v1/namespaces/{ns}/pods",
            get(
                |s: State<Api>, _: Path<String>, q: Query<BTreeMap<String, String>>| {
                    serve(s, q, PODS)
                },
            ),
        )
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
            get(
                |s: State<Api>, _: Path<String>, q: Query<BTreeMap<String, String>>| {
                    serve(s, q, POOLS)
                },
            ),
        )
        .with_state(api.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    FakeKube {
        addr,
        api,
        dir: tempfile::tempdir().unwrap(),
    }
}

/// Whether `object` is in a request's selection (`labelSelector` of
/// `k=v` terms, `fieldSelector` of `metadata.name=N`).
fn selected(object: &Value, q: &BTreeMap<String, String>) -> bool {
    let labels = &object["metadata"]["labels"];
    let by_label = q.get("labelSelector").is_none_or(|sel| {
        sel.split(',').filter(|t| !t.is_empty()).all(|term| {
            let (k, v) = term.split_once('=').unwrap_or((term, ""));
            labels[k].as_str() == Some(v)
        })
    });
    let by_field = q.get("fieldSelector").is_none_or(|sel| {
        sel.split(',').all(|term| match term.split_once('=') {
            Some(("metadata.name", n)) => object["metadata"]["name"].as_str() == Some(n),
            _ => true,
        })
    });
    by_label && by_field
}

async fn serve(
    State(api): State<Api>,
    Query(q): Query<BTreeMap<String, String>>,
    kind: &'static str,
) -> Response {
    if q.get("watch").map(String::as_str) != Some("true") {
        let o = api.objects.lock();
        let items: Vec<Value> = o
            .live
            .iter()
            .filter(|((k, _), v)| *k == kind && selected(v, &q))
            .map(|(_, v)| v.clone())
            .collect();
        let list = json!({"apiVersion": "v1", "kind": "List",
                          "metadata": {"resourceVersion": o.rv.to_string()}, "items": items});
        return axum::Json(list).into_response();
    }
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // Subscribe before reading the log: nothing falls between the two.
    let mut rx = api.changes.subscribe();
    let backlog: Vec<Change> = api.objects.lock().log.clone();
    let (tx, body_rx) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(64);
    tokio::spawn(async move {
        // The names this watch has shown as present.
        let mut shown: std::collections::BTreeSet<String> = Default::default();
        let mut last = from;
        // The objects present at `from` (listed by the client) count as shown.
        for c in backlog.iter().filter(|c| c.rv <= from && c.kind == kind) {
            let name = c.object["metadata"]["name"]
                .as_str()
                .unwrap_or("")
                .to_string();
            if !c.deleted && selected(&c.object, &q) {
                shown.insert(name);
            } else {
                shown.remove(&name);
            }
        }
        let mut send = |c: &Change| -> Option<String> {
            if c.rv <= last || c.kind != kind {
                return None;
            }
            last = c.rv;
            let name = c.object["metadata"]["name"]
                .as_str()
                .unwrap_or("")
                .to_string();
            let kind = if !c.deleted && selected(&c.object, &q) {
                if shown.insert(name) {
                    "ADDED"
                } else {
                    "MODIFIED"
                }
            } else if shown.remove(&name) {
                "DELETED"
            } else {
                return None;
            };
            Some(format!("{}\n", json!({"type": kind, "object": c.object})))
        };
        for c in &backlog {
            if let Some(line) = send(c)
                && tx.send(Ok(line)).await.is_err()
            {
                return;
            }
        }
        while let Ok(c) = rx.recv().await {
            if let Some(line) = send(&c)
                && tx.send(Ok(line)).await.is_err()
            {
                return;
            }
        }
    });
    let stream = tokio_stream_of(body_rx);
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}

fn tokio_stream_of(
    mut rx: tokio::sync::mpsc::Receiver<Result<String, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<String, std::io::Error>> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
