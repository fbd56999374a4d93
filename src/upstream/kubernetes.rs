//! Replicas from the Kubernetes API: the ready pods a label selector picks,
//! or those of an InferencePool (`inference.networking.k8s.io/v1`: its
//! `selector` and `targetPorts`), listed then watched, so a pod that comes,
//! goes or turns unready is followed as soon as the API server says so. A
//! change to the InferencePool restarts the pods' watch with its new
//! selector; a pool deleted empties the source.
//!
//! A pod counts while it has an IP, is not being deleted, and its `Ready`
//! condition is true (the kubelet's readiness probe passed): the replicas
//! Kubernetes itself would put behind a Service. The watch is kube-rs's
//! (`kube::runtime::watcher`): it relists after a `410 Gone` and backs off
//! on errors; the last known set stays while the API server is away.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use futures_util::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};

use super::client::HttpClient;
use super::pool::Pool;
use super::{health, scrape};
use crate::config::{BackendConfig, Config, KubernetesSource};

/// The client for every `kubernetes` source: `discovery.kubeconfig`, else
/// the pod's service account, else `$KUBECONFIG` or `~/.kube/config`.
pub(crate) async fn client(config: &Config) -> anyhow::Result<kube::Client> {
    let kc = match &config.discovery.kubeconfig {
        Some(path) => {
            let file = kube::config::Kubeconfig::read_from(path)?;
            kube::Config::from_custom_kubeconfig(file, &Default::default()).await?
        }
        None => kube::Config::infer().await?,
    };
    Ok(kube::Client::try_from(kc)?)
}

/// What an InferencePool says: the pods' labels and their port.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Selection {
    labels: BTreeMap<String, String>,
    port: u16,
}

impl Selection {
    /// `spec.selector.matchLabels` and `spec.targetPorts[0].number`.
    fn of_pool(pool: &DynamicObject, port: Option<u16>) -> Option<Self> {
        let spec = pool.data.get("spec")?;
        let labels = spec
            .pointer("/selector/matchLabels")?
            .as_object()?
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
            .collect();
        let target = spec.pointer("/targetPorts/0/number")?.as_u64()?;
        Some(Self {
            labels,
            port: port.or_else(|| u16::try_from(target).ok())?,
        })
    }

    fn label_selector(&self) -> String {
        let parts: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        parts.join(",")
    }
}

/// A pod's address while it can serve: an IP, not being deleted, `Ready`.
fn ready_ip(pod: &Pod) -> Option<String> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_deref().filter(|ip| !ip.is_empty())?;
    ready.then(|| {
        if ip.contains(':') {
            format!("[{ip}]")
        } else {
            ip.to_string()
        }
    })
}

/// The replicas of the pods known, sorted (a stable order for the pool).
fn backends(src: &KubernetesSource, pods: &HashMap<String, Pod>, port: u16) -> Vec<BackendConfig> {
    let mut ips: Vec<String> = pods.values().filter_map(ready_ip).collect();
    ips.sort();
    ips.dedup();
    ips.iter().filter_map(|ip| src.backend(ip, port)).collect()
}

/// Keep source `index` (`discovery.kubernetes[index]`) in sync with the
/// API server, forever.
pub(crate) async fn run(
    pool: Arc<Pool>,
    http: HttpClient,
    config: Arc<Config>,
    index: usize,
    kube: kube::Client,
) {
    let Some(src) = config.discovery.kubernetes.get(index).cloned() else {
        return;
    };
    let source = config.discovery.kubernetes_source(index);
    let ns = src
        .namespace
        .clone()
        .unwrap_or_else(|| kube.default_namespace().to_string());
    let sync = |wanted: Vec<BackendConfig>| {
        let pool = pool.clone();
        let http = http.clone();
        let config = config.clone();
        async move {
            let n = wanted.len();
            if pool.sync_source(source, &wanted) {
                tracing::info!(
                    source,
                    replicas = n,
                    "Kubernetes discovery changed the replica set"
                );
                health::check_all(&pool, &http, &config.upstream.health_check).await;
                if config.routing.metrics.enabled {
                    let m = &config.routing.metrics;
                    scrape::scrape_all(&pool, &http, m.engine, m.interval).await;
                }
            }
        }
    };
    let pods: Api<Pod> = Api::namespaced(kube.clone(), &ns);
    let Some(name) = src.inference_pool.clone() else {
        let sel = Selection {
            labels: src.selector.clone(),
            port: src.port.unwrap_or_default(),
        };
        follow_pods(&src, pods, &sel, &sync).await;
        return;
    };
    let gvk = GroupVersionKind::gvk("inference.networking.k8s.io", "v1", "InferencePool");
    let resource = ApiResource::from_gvk(&gvk);
    let pools: Api<DynamicObject> = Api::namespaced_with(kube, &ns, &resource);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut pool_events = std::pin::pin!(watcher::watcher(pools, cfg).default_backoff());
    let mut current: Option<Selection> = None;
    loop {
        // Follow the pods of the selection in force until the pool changes.
        let change = match &current {
            Some(sel) => {
                tokio::select! {
                    ev = pool_events.next() => ev,
                    () = follow_pods(&src, pods.clone(), sel, &sync) => None,
                }
            }
            None => pool_events.next().await,
        };
        let Some(ev) = change else { return };
        let next = match ev {
            Ok(Event::Apply(p) | Event::InitApply(p)) => match Selection::of_pool(&p, src.port) {
                Some(sel) => Some(sel),
                None => {
                    tracing::warn!(pool = %name, namespace = %ns, "InferencePool without spec.selector.matchLabels and spec.targetPorts: no replicas from it");
                    None
                }
            },
            Ok(Event::Delete(_)) => None,
            Ok(Event::Init) => continue,
            Ok(Event::InitDone) if current.is_none() => None,
            Ok(Event::InitDone) => continue,
            Err(e) => {
                tracing::warn!(pool = %name, namespace = %ns, error = %e, "watching the InferencePool failed; keeping the last known replicas");
                continue;
            }
        };
        if next != current {
            tracing::info!(pool = %name, namespace = %ns, selection = ?next, "InferencePool selection");
            if next.is_none() {
                sync(Vec::new()).await;
            }
            current = next;
        }
    }
}

/// Follow the pods `sel` picks until the watch ends (it does not, unless
/// the runtime stops).
async fn follow_pods<F, Fut>(src: &KubernetesSource, pods: Api<Pod>, sel: &Selection, sync: &F)
where
    F: Fn(Vec<BackendConfig>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let cfg = watcher::Config::default().labels(&sel.label_selector());
    let events = watcher::watcher(pods, cfg).default_backoff();
    follow(src, events, sel.port, sync).await;
}

async fn follow<F, Fut>(
    src: &KubernetesSource,
    events: impl Stream<Item = Result<Event<Pod>, watcher::Error>>,
    port: u16,
    sync: &F,
) where
    F: Fn(Vec<BackendConfig>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut events = std::pin::pin!(events);
    let mut known: HashMap<String, Pod> = HashMap::new();
    // A relist's pods, swapped in whole when it completes.
    let mut listing: HashMap<String, Pod> = HashMap::new();
    let mut failing = false;
    while let Some(ev) = events.next().await {
        let key = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        match ev {
            Ok(Event::Init) => {
                listing.clear();
                continue;
            }
            Ok(Event::InitApply(p)) => {
                listing.insert(key(&p), p);
                continue;
            }
            Ok(Event::InitDone) => known = std::mem::take(&mut listing),
            Ok(Event::Apply(p)) => {
                known.insert(key(&p), p);
            }
            Ok(Event::Delete(p)) => {
                known.remove(&key(&p));
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "watching pods failed; keeping the last known replicas");
                    failing = true;
                }
                continue;
            }
        }
        if failing {
            tracing::info!("watching pods recovered");
            failing = false;
        }
        sync(backends(src, &known, port)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, ip: &str, ready: bool, deleting: bool) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": name,
                "deletionTimestamp": deleting.then_some("2026-11-27T10:00:00Z"),
            },
            "status": {
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap_or_default()
    }

    #[test]
    fn only_ready_pods_with_an_ip_not_being_deleted_are_replicas() {
        let src: KubernetesSource = serde_json::from_value(serde_json::json!({
            "selector": {"app": "vllm"}, "port": 8000, "models": ["m"], "dcgm_port": 9400,
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let mut pods = HashMap::new();
        for p in [
            pod("a", "10.0.0.2", true, false),
            pod("b", "10.0.0.1", true, false),
            pod("c", "10.0.0.3", false, false),
            pod("d", "10.0.0.4", true, true),
            pod("e", "", true, false),
            pod("f", "fd00::5", true, false),
        ] {
            pods.insert(p.metadata.name.clone().unwrap_or_default(), p);
        }
        let got: Vec<String> = backends(&src, &pods, 8000)
            .iter()
            .map(|b| format!("{} {:?}", b.url, b.dcgm_url.as_ref().map(|u| u.to_string())))
            .collect();
        assert_eq!(
            got,
            [
                "http://10.0.0.1:8000/ Some(\"http://10.0.0.1:9400/metrics\")",
                "http://10.0.0.2:8000/ Some(\"http://10.0.0.2:9400/metrics\")",
                "http://[fd00::5]:8000/ Some(\"http://[fd00::5]:9400/metrics\")",
            ]
        );
    }

    #[test]
    fn an_inference_pools_selector_and_port_or_the_sources_own() {
        let pool: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {
                "selector": {"matchLabels": {"app": "vllm", "tier": "a"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            },
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let sel = Selection::of_pool(&pool, None).unwrap_or_else(|| panic!("no selection"));
        assert_eq!(sel.port, 8000);
        assert_eq!(sel.label_selector(), "app=vllm,tier=a");
        assert_eq!(
            Selection::of_pool(&pool, Some(9000)).map(|s| s.port),
            Some(9000)
        );
        let bare: DynamicObject = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"}, "spec": {"selector": {}},
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(Selection::of_pool(&bare, None), None);
    }
}
