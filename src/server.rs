//! Listeners, background tasks, and graceful shutdown with a drain deadline.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::app::{AppState, build_admin, build_app};
use crate::config::Config;
use crate::upstream::{discovery, health, scrape};

/// A running gateway: its bound addresses and the handles to stop it.
pub struct Gateway {
    pub api_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub state: Arc<AppState>,
    stop: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
    background: Vec<JoinHandle<()>>,
}

/// Bind both listeners (port 0 picks a free one) and start serving.
pub async fn start(config: Config) -> anyhow::Result<Gateway> {
    let api = TcpListener::bind(config.server.listen)
        .await
        .with_context(|| format!("cannot listen on {} (server.listen)", config.server.listen))?;
    let admin = TcpListener::bind(config.server.admin_listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (server.admin_listen)",
                config.server.admin_listen
            )
        })?;
    let state = AppState::new(config)?;
    let (stop, stopped) = watch::channel(false);
    let api_addr = api.local_addr()?;
    let admin_addr = admin.local_addr()?;

    let mut background = vec![tokio::spawn(health::run(
        state.pool.clone(),
        state.client.clone(),
        state.config.upstream.health_check.clone(),
    ))];
    let m = &state.config.routing.metrics;
    if m.enabled {
        background.push(tokio::spawn(scrape::run(
            state.pool.clone(),
            state.client.clone(),
            m.engine,
            m.interval,
        )));
    }
    if !state.config.discovery.dns.is_empty() {
        let resolver = Arc::new(
            discovery::resolver(state.config.discovery.nameserver)
                .context("setting up the DNS resolver (discovery.dns)")?,
        );
        for i in 0..state.config.discovery.dns.len() {
            background.push(tokio::spawn(discovery::run(
                state.pool.clone(),
                state.client.clone(),
                state.config.clone(),
                i,
                resolver.clone(),
            )));
        }
    }
    let servers = vec![
        tokio::spawn(serve(api, build_app(state.clone()), stopped.clone())),
        tokio::spawn(serve(admin, build_admin(state.clone()), stopped)),
    ];
    Ok(Gateway {
        api_addr,
        admin_addr,
        state,
        stop,
        servers,
        background,
    })
}

async fn serve(listener: TcpListener, app: axum::Router, mut stopped: watch::Receiver<bool>) {
    use axum::serve::ListenerExt;
    // Every SSE event is a small write: disable Nagle so none waits for an ACK.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let shutdown = async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!(error = %e, "listener failed");
    }
}

impl Gateway {
    /// Stop accepting, let open requests finish for up to `drain`, then cut them.
    pub async fn shutdown(self, drain: Duration) {
        let _ = self.stop.send(true);
        for t in &self.background {
            t.abort();
        }
        let mut servers = self.servers;
        let all = async {
            for s in servers.iter_mut() {
                let _ = s.await;
            }
        };
        if tokio::time::timeout(drain, all).await.is_err() {
            tracing::warn!(
                drain = %humantime::format_duration(drain),
                "drain deadline passed; closing the remaining streams"
            );
            for s in &servers {
                s.abort();
            }
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
