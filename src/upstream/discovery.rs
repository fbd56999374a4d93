//! Replicas from DNS: a name (a Kubernetes headless Service) resolved again on
//! an interval; its A/AAAA records, with the configured port, are the replicas
//! of that source. Replicas that stay keep their state; new ones start
//! unhealthy until a health check passes (one runs at once after a change).
//! A failed lookup keeps the last known set (logged once per episode); an
//! answer with no records empties the source.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use hickory_resolver::config::{NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::{Resolver, TokioResolver};

use super::client::HttpClient;
use super::pool::Pool;
use super::{health, scrape};
use crate::config::{BackendConfig, Config, DnsSource};

/// The system resolver (`/etc/resolv.conf`), or one DNS server if configured.
pub(crate) fn resolver(nameserver: Option<SocketAddr>) -> anyhow::Result<TokioResolver> {
    let mut builder = match nameserver {
        Some(addr) => {
            let mut ns = NameServerConfig::udp_and_tcp(addr.ip());
            for c in &mut ns.connections {
                c.port = addr.port();
            }
            Resolver::builder_with_config(
                ResolverConfig::from_name_servers(vec![ns]),
                TokioRuntimeProvider::default(),
            )
        }
        None => Resolver::builder_tokio()?,
    };
    // Every interval must ask again, whatever TTL the records carry.
    builder.options_mut().cache_size = 0;
    Ok(builder.build()?)
}

fn backends_of(src: &DnsSource, ips: &[IpAddr]) -> Vec<BackendConfig> {
    ips.iter()
        .filter_map(|ip| match ip {
            IpAddr::V4(v4) => src.backend(&v4.to_string()),
            IpAddr::V6(v6) => src.backend(&format!("[{v6}]")),
        })
        .collect()
}

/// Keep source `index` in sync with its DNS name, forever.
pub(crate) async fn run(
    pool: Arc<Pool>,
    client: HttpClient,
    config: Arc<Config>,
    index: usize,
    resolver: Arc<TokioResolver>,
) {
    let Some(src) = config.discovery.dns.get(index).cloned() else {
        return;
    };
    let mut tick = tokio::time::interval(src.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        let ips: Vec<IpAddr> = match resolver.lookup_ip(src.name.as_str()).await {
            Ok(found) => {
                if failing {
                    tracing::info!(name = %src.name, "DNS discovery recovered");
                    failing = false;
                }
                let mut v: Vec<IpAddr> = found.iter().collect();
                v.sort();
                v.dedup();
                v
            }
            Err(e) if e.is_no_records_found() => Vec::new(),
            Err(e) => {
                if !failing {
                    tracing::warn!(name = %src.name, error = %e, "DNS discovery failed; keeping the last known replicas");
                    failing = true;
                }
                continue;
            }
        };
        if pool.sync_source(index, &backends_of(&src, &ips)) {
            tracing::info!(name = %src.name, replicas = ips.len(), "DNS discovery changed the replica set");
            health::check_all(&pool, &client, &config.upstream.health_check).await;
            if config.routing.metrics.enabled {
                let m = &config.routing.metrics;
                scrape::scrape_all(&pool, &client, m.engine, m.interval).await;
            }
        }
    }
}
