//! Listeners, background tasks, and graceful shutdown with a drain deadline.

mod h1;
mod parse_errors;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use anyhow::Context as _;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::app::{Api, build_admin};
use crate::config::{Config, Http1Server};
use crate::net::Socket;
use crate::net::tls::Certificate;
use crate::state::{AppState, Live};
use crate::stream::signal::{Signal, SignalWatch};
use crate::upstream::{discovery, health, kubernetes, scrape};

/// A running gateway: its bound addresses and the handles to stop it.
pub struct Gateway {
    pub api_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// The endpoint picker's ext_proc and health listeners (`epp.listen`).
    pub epp_addr: Option<SocketAddr>,
    pub epp_health_addr: Option<SocketAddr>,
    live: Arc<Live>,
    stop: Signal,
    servers: Vec<JoinHandle<()>>,
    /// To stop the listeners' tasks when the drain grace is over.
    aborts: Vec<tokio::task::AbortHandle>,
    /// Health checks, scrapes and discovery of the current state.
    background: Mutex<Vec<JoinHandle<()>>>,
    /// The listeners' certificate (`server.tls`), reloaded by SIGHUP and
    /// by `tls_watch` when its files change.
    tls_cert: Option<Arc<Certificate>>,
    tls_watch: Option<JoinHandle<()>>,
}

/// Bind both listeners (port 0 picks a free one) and start serving.
pub async fn start(config: Config) -> anyhow::Result<Gateway> {
    let tls = crate::net::tls::server(&config.server.tls)?;
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
    // The endpoint picker's listeners, bound with the others: a port in
    // use fails the start, not a request later.
    let epp = match config.epp.listen {
        Some(at) => {
            let picker = TcpListener::bind(at)
                .await
                .with_context(|| format!("cannot listen on {at} (epp.listen)"))?;
            let h = config.epp.health_listen;
            let health = TcpListener::bind(h)
                .await
                .with_context(|| format!("cannot listen on {h} (epp.health_listen)"))?;
            Some((picker, health))
        }
        None => None,
    };
    let state = AppState::new(config)?;
    let stop = Signal::default();
    let api_addr = api.local_addr()?;
    let admin_addr = admin.local_addr()?;
    let background = spawn_background(&state)?;
    let header_timeout = state.config.server.header_timeout;
    let tls_cfg = state.config.server.tls.clone();
    let live = Live::new(state);
    let api_tls = tls.as_ref().map(|t| Handshake {
        acceptor: tokio_rustls::TlsAcceptor::from(t.api.clone()),
        within: header_timeout,
        listener: "api",
        live: live.clone(),
    });
    let admin_tls = tls.as_ref().filter(|_| tls_cfg.admin).map(|t| Handshake {
        acceptor: tokio_rustls::TlsAcceptor::from(t.admin.clone()),
        within: header_timeout,
        listener: "admin",
        live: live.clone(),
    });
    let api_service = Api::new(live.clone());
    let api_server = match live.load().config.server.http1 {
        Http1Server::Own => {
            let live = live.clone();
            tokio::spawn(serve(api, stop.clone(), api_tls, move |tcp, stop| {
                h1::serve_conn(tcp, api_service.clone(), live.clone(), stop, header_timeout)
            }))
        }
        Http1Server::Hyper => tokio::spawn(serve(
            api,
            stop.clone(),
            api_tls,
            with_hyper(api_service, live.clone(), header_timeout),
        )),
    };
    let admin_service = hyper_util::service::TowerToHyperService::new(build_admin(live.clone()));
    let mut servers = vec![
        api_server,
        tokio::spawn(serve(
            admin,
            stop.clone(),
            admin_tls,
            with_hyper(admin_service, live.clone(), header_timeout),
        )),
    ];
    let (mut epp_addr, mut epp_health_addr) = (None, None);
    if let Some((picker, health)) = epp {
        epp_addr = Some(picker.local_addr()?);
        epp_health_addr = Some(health.local_addr()?);
        servers.extend(crate::epp::serve(live.clone(), picker, health, &stop));
    }
    let aborts = servers.iter().map(JoinHandle::abort_handle).collect();
    let tls_cert = tls.map(|t| t.cert);
    let tls_watch = Some(tokio::spawn(watch_certificates(
        tls_cert.clone(),
        tls_cfg.reload_interval,
        live.clone(),
    )));
    Ok(Gateway {
        api_addr,
        admin_addr,
        epp_addr,
        epp_health_addr,
        live,
        stop,
        servers,
        aborts,
        background: Mutex::new(background),
        tls_cert,
        tls_watch,
    })
}

/// A listener's TLS: the handshake each connection makes before its first
/// request, within `server.header_timeout`.
#[derive(Clone)]
struct Handshake {
    acceptor: tokio_rustls::TlsAcceptor,
    within: Duration,
    /// `api` or `admin`, for the log and the metric.
    listener: &'static str,
    live: Arc<Live>,
}

impl Handshake {
    /// The connection under TLS; `None` (logged and counted) when the
    /// handshake failed or took too long.
    async fn open(self, tcp: tokio::net::TcpStream) -> Option<Socket> {
        let peer = tcp.peer_addr().ok();
        let failed = match tokio::time::timeout(self.within, self.acceptor.accept(tcp)).await {
            Ok(Ok(tls)) => {
                return Some(Socket::Tls(Box::new(tokio_rustls::TlsStream::Server(tls))));
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no handshake within server.header_timeout".to_string(),
        };
        tracing::warn!(
            listener = self.listener,
            peer = ?peer,
            error = %failed,
            "TLS handshake with a client failed"
        );
        self.live
            .load()
            .metrics
            .tls_handshake_failures
            .get(&(self.listener,))
            .inc();
        None
    }
}

/// The certificates that change under a running gateway (cert-manager
/// rotates the files in place): the listeners' and the client certificate
/// shown to `https://` replicas, checked every `every`.
async fn watch_certificates(listeners: Option<Arc<Certificate>>, every: Duration, live: Arc<Live>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let state = live.load();
        for (cert, which) in certificates(listeners.as_ref(), &state) {
            match cert.reload_if_changed() {
                Ok(false) => {}
                outcome => note_reload(&state, &cert, which, outcome.map(|_| ())),
            }
        }
    }
}

/// The certificates to reload, with their label: the listeners' (if TLS is
/// on) and the client certificate for `https://` replicas (if configured).
fn certificates(
    listeners: Option<&Arc<Certificate>>,
    state: &crate::state::AppState,
) -> impl Iterator<Item = (Arc<Certificate>, &'static str)> {
    let up = &state.config.upstream.tls;
    let client = up
        .cert_file
        .is_some()
        .then(|| crate::net::tls::shared_client(up).ok()?.cert.clone())
        .flatten();
    [(listeners.cloned(), "server"), (client, "upstream")]
        .into_iter()
        .filter_map(|(c, which)| Some((c?, which)))
}

/// Log and count one reload of a certificate.
fn note_reload(
    state: &crate::state::AppState,
    cert: &Certificate,
    which: &'static str,
    outcome: anyhow::Result<()>,
) {
    let (c, k) = cert.files();
    match &outcome {
        Ok(()) => tracing::info!(
            certificate = which,
            cert_file = %c.display(),
            key_file = %k.display(),
            "TLS certificate reloaded"
        ),
        Err(e) => tracing::error!(
            certificate = which,
            error = %format!("{e:#}"),
            "TLS certificate not reloaded; the one loaded before stays"
        ),
    }
    let result = if outcome.is_ok() { "ok" } else { "error" };
    state.metrics.tls_reloads.get(&(which, result)).inc();
}

/// The tasks that keep a state's view of the replicas current.
fn spawn_background(state: &Arc<AppState>) -> anyhow::Result<Vec<JoinHandle<()>>> {
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
    // The doctor evaluates every scrape interval, so a finding is raised
    // when its evidence shows and held (`doctor.clear_after`) whether or
    // not anyone asks in between.
    let every = if m.enabled {
        m.interval
    } else {
        Duration::from_secs(1)
    };
    let watched = state.clone();
    background.push(tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            crate::api::admin::diagnose_now(&watched);
        }
    }));
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
    for i in 0..state.config.discovery.kubernetes.len() {
        let state = state.clone();
        background.push(tokio::spawn(async move {
            // The API server may not answer yet (or the service account not
            // be mounted): retried, the rest of the gateway serves meanwhile.
            let mut wait = Duration::from_secs(1);
            let kube = loop {
                match kubernetes::client(&state.config).await {
                    Ok(c) => break c,
                    Err(e) => {
                        tracing::error!(error = %format!("{e:#}"), "no Kubernetes client for discovery.kubernetes; retrying");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(Duration::from_secs(30));
                    }
                }
            };
            kubernetes::run(
                state.pool.clone(),
                state.client.clone(),
                state.config.clone(),
                i,
                kube,
            )
            .await;
        }));
    }
    Ok(background)
}

/// Accept connections and serve each with `conn` (given the connection and
/// a watch of the stop) until `stopped`; then stop accepting, let every
/// connection finish its open requests (keep-alive connections close after
/// their current response), and return when all are done.
async fn serve<C, F>(listener: TcpListener, stopped: Signal, tls: Option<Handshake>, conn: C)
where
    C: Fn(Socket, SignalWatch) -> F + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let conn = Arc::new(conn);
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors, say: back off a little, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = stopped.raised() => break,
        };
        // Every SSE event is a small write: disable Nagle so none waits for an ACK.
        let _ = tcp.set_nodelay(true);
        match &tls {
            None => {
                conns.spawn(conn(Socket::Plain(tcp), stopped.watch()));
            }
            // The handshake runs in the connection's task, not in the loop
            // that accepts.
            Some(h) => {
                let (h, conn, watch) = (h.clone(), conn.clone(), stopped.watch());
                conns.spawn(async move {
                    if let Some(socket) = h.open(tcp).await {
                        conn(socket, watch).await;
                    }
                });
            }
        }
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    while conns.join_next().await.is_some() {}
}

/// Serve a connection with hyper's HTTP/1.1 server. Each connection must
/// deliver its request headers within `header_timeout` (a client trickling
/// headers holds nothing for long). What the HTTP parser refuses is answered
/// in the OpenAI error shape ([`parse_errors`]).
fn with_hyper<S>(
    service: S,
    live: Arc<Live>,
    header_timeout: Duration,
) -> impl Fn(Socket, SignalWatch) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
+ Send
+ Sync
+ 'static
where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    use hyper::server::conn::http1;
    use hyper_util::rt::{TokioIo, TokioTimer};

    move |tcp, mut stop| {
        let service = service.clone();
        let io = parse_errors::ParseErrors::new(TokioIo::new(tcp), live.clone());
        Box::pin(async move {
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(io, service);
            tokio::pin!(conn);
            // The connection, until it ends or the gateway stops (the stop
            // is watched for the price of an atomic load per wake-up).
            let stopping = std::future::poll_fn(|cx| {
                // Each poll of the connection is a turn: a response body
                // pending once in it answers again without re-registering.
                if crate::turn::take(|| conn.as_mut().poll(cx)).is_ready() {
                    return Poll::Ready(false);
                }
                if stop.poll(cx) {
                    Poll::Ready(true)
                } else {
                    Poll::Pending
                }
            })
            .await;
            if stopping {
                conn.as_mut().graceful_shutdown();
                let _ = conn.await;
            }
        })
    }
}

impl Gateway {
    /// The state serving new requests now.
    pub fn state(&self) -> Arc<AppState> {
        self.live.load()
    }

    /// Serve new requests with `config` from now on; requests already running
    /// finish on the state they started with (streams are never cut). Replicas,
    /// connections, health, prefix indexes and rate-limit counters carry over
    /// where their settings did not change. The listeners and the histogram
    /// buckets cannot change without a restart. On any error the running
    /// config stays and the error says why.
    pub fn reload(&self, config: Config) -> anyhow::Result<()> {
        self.reload_with(|| Ok(config))
    }

    /// [`reload`](Self::reload) with the config read by `load` (a file that
    /// no longer parses counts as a failed reload too).
    pub(crate) fn reload_with(
        &self,
        load: impl FnOnce() -> anyhow::Result<Config>,
    ) -> anyhow::Result<()> {
        let result = load().and_then(|c| self.try_reload(c));
        let outcome = if result.is_ok() { "ok" } else { "error" };
        self.live
            .load()
            .metrics
            .config_reloads
            .get(&(outcome,))
            .inc();
        result
    }

    /// Read the TLS certificates again (SIGHUP): the listeners' and the
    /// client certificate for `https://` replicas. Each one that fails to
    /// load is logged and the one before stays; the first error is returned.
    pub fn reload_certificates(&self) -> anyhow::Result<()> {
        let state = self.live.load();
        let mut first = Ok(());
        for (cert, which) in certificates(self.tls_cert.as_ref(), &state) {
            let outcome = cert.reload();
            if let Err(e) = &outcome
                && first.is_ok()
            {
                first = Err(anyhow::anyhow!("{e:#}"));
            }
            note_reload(&state, &cert, which, outcome);
        }
        first
    }

    fn try_reload(&self, config: Config) -> anyhow::Result<()> {
        // One reload at a time: the background tasks installed must be those
        // of the state that goes live.
        let mut background = self.background.lock();
        let old = self.live.load();
        let was = &old.config;
        let fixed = crate::config::needs_restart(was, &config);
        anyhow::ensure!(
            fixed.is_empty(),
            "`{}` cannot change on a reload: restart",
            fixed.join("`, `")
        );
        anyhow::ensure!(
            !config.backends.is_empty()
                || !config.discovery.dns.is_empty()
                || !config.discovery.kubernetes.is_empty(),
            "no backends: list `backends`, `discovery.dns` or `discovery.kubernetes`"
        );
        if !config.discovery.dns.is_empty() {
            // The one fallible step of the background tasks, tried before
            // anything shared (metric series, the scraping flag) is touched.
            discovery::resolver(config.discovery.nameserver)
                .context("setting up the DNS resolver (discovery.dns)")?;
        }
        // The old state's tasks stop first, so none of them (a discovery
        // sync, say) acts on the shared metrics while the new pool is built.
        for t in background.drain(..) {
            t.abort();
        }
        let built = AppState::build(config, Some(&old))
            .and_then(|state| spawn_background(&state).map(|tasks| (state, tasks)));
        match built {
            Ok((state, tasks)) => {
                *background = tasks;
                self.live.store(state);
                Ok(())
            }
            Err(e) => {
                // Keep the running state's view current.
                *background = spawn_background(&old).unwrap_or_default();
                Err(e)
            }
        }
    }

    /// Stop accepting, let open requests finish for up to `drain`, then cut
    /// them: every stream still open ends the way a failure after the first
    /// byte does (an error event, `[DONE]`, a clean end of the body), and the
    /// connections get [`CUT_GRACE`] to write that out before they are closed.
    pub async fn shutdown(self, drain: Duration) {
        self.stop.raise();
        if let Some(w) = &self.tls_watch {
            w.abort();
        }
        for t in self.background.lock().iter() {
            t.abort();
        }
        let mut servers = self.servers;
        let all = |servers: &mut Vec<JoinHandle<()>>| {
            let servers = std::mem::take(servers);
            async move {
                for s in servers {
                    let _ = s.await;
                }
            }
        };
        let waiting = all(&mut servers);
        tokio::pin!(waiting);
        if tokio::time::timeout(drain, &mut waiting).await.is_err() {
            tracing::warn!(
                drain = %humantime::format_duration(drain),
                "drain deadline passed; ending the remaining streams with an error event"
            );
            self.live.load().cut.raise();
            if tokio::time::timeout(CUT_GRACE, &mut waiting).await.is_err() {
                tracing::warn!("connections still open after the cut; closing them");
            }
            // Dropping the listeners' tasks' handles does not stop them: abort.
            for h in self.aborts {
                h.abort();
            }
        }
        // Drained (or cut): withdrawn from the seats the gateways split
        // through Redis.
        self.live.load().flow.leave().await;
    }
}

/// After the drain deadline, how long connections have to send the error
/// event of their cut stream (and any other response already under way).
pub(crate) const CUT_GRACE: Duration = Duration::from_secs(5);

/// SIGHUP, the conventional "reload your config" signal.
pub(crate) struct Hangups {
    #[cfg(unix)]
    signal: Option<tokio::signal::unix::Signal>,
}

impl Hangups {
    pub(crate) fn new() -> Self {
        Self {
            #[cfg(unix)]
            signal: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok(),
        }
    }

    /// The next SIGHUP (never, where there are no signals).
    pub(crate) async fn recv(&mut self) {
        #[cfg(unix)]
        if let Some(s) = &mut self.signal
            && s.recv().await.is_some()
        {
            return;
        }
        std::future::pending::<()>().await;
    }
}

impl Default for Hangups {
    fn default() -> Self {
        Self::new()
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub(crate) async fn shutdown_signal() {
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
