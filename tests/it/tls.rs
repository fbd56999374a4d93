//! TLS on every hop, over real sockets with certificates made here: the
//! listeners serve HTTPS to the official OpenAI SDK trusting a CA of the
//! test's own; a rotated certificate is served without a restart (by the
//! file check and by SIGHUP's reload) and a broken one is refused while the
//! one before stays; mutual TLS on the listeners; `https://` replicas (a
//! `sluice sim` serving HTTPS) with a CA bundle and a client certificate,
//! and replicas whose certificate is expired, untrusted or wants a client
//! certificate refused with the reason.

use std::time::Duration;
use tokio::io::AsyncBufReadExt;

use crate::common::tls::{Pki, client_trusting, request, served_name};
use crate::common::*;

/// A config whose listeners serve `pair` over TLS.
fn with_tls(urls: &[String], pair: &tls::Pair) -> sluice::config::Config {
    let mut c = config_for(urls);
    c.server.tls.cert_file = Some(pair.cert.clone());
    c.server.tls.key_file = Some(pair.key.clone());
    c
}

/// A metric from an admin listener that serves TLS.
async fn tls_metric(
    gw: &sluice::server::Gateway,
    config: std::sync::Arc<rustls::ClientConfig>,
    series: &str,
) -> f64 {
    let (status, body) = request(gw.admin_addr, config, "GET", "/metrics", "", "")
        .await
        .unwrap();
    assert_eq!(status, 200, "{body}");
    metric(&body, series).unwrap_or(0.0)
}

#[tokio::test]
async fn the_openai_sdk_streams_over_https_trusting_a_custom_ca() {
    let pki = Pki::new("sdk");
    let pair = pki.issue("gateway", "gateway-1", false);
    let sim = start_sim(fast_sim()).await;
    let gw = start_gateway(with_tls(&[sim.url()], &pair), 1).await;
    let base = format!("https://localhost:{}/v1", gw.api_addr.port());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/sdk_tls.py");
    let out = tokio::process::Command::new(python::python())
        .arg(script)
        .arg(&base)
        .arg(&pki.ca)
        .output()
        .await
        .expect(python::MISSING);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "SDK script failed:\n{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["chat"]["finish_reason"], "stop");
    assert_eq!(v["chat"]["completion_tokens"], 8);
    assert_eq!(v["stream"]["pieces"], 8);
    assert_eq!(v["stream"]["finish_reason"], "stop");
    // Without the CA, the SDK refuses the certificate.
    assert_eq!(v["untrusted"], "APIConnectionError", "{v}");
    assert!(
        v["untrusted_cause"]
            .as_str()
            .unwrap()
            .contains("CERTIFICATE_VERIFY_FAILED"),
        "{v}"
    );
    // Plain HTTP to the HTTPS listener gets no answer, and is counted.
    let plain = client()
        .get(format!("http://{}/v1/models", gw.api_addr))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");
    let failures = tls_metric(
        &gw,
        pki.client(None),
        "sluice_tls_handshake_failures_total{listener=\"api\"}",
    )
    .await;
    assert!(failures >= 1.0, "{failures}");
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart_and_a_broken_one_is_refused() {
    let pki = Pki::new("rotation");
    let pair = pki.issue("gateway", "gateway-1", false);
    let sim = start_sim(fast_sim()).await;
    let mut config = with_tls(&[sim.url()], &pair);
    config.server.tls.reload_interval = Duration::from_millis(50);
    let gw = start_gateway(config, 1).await;
    let trust = pki.client(None);
    assert_eq!(served_name(gw.api_addr, trust.clone()).await, "gateway-1");
    // cert-manager writes the new pair in place: served from a handshake
    // soon after, by both listeners.
    pki.issue_to(&pair, "gateway-2", false);
    for addr in [gw.api_addr, gw.admin_addr] {
        let trust = trust.clone();
        wait_until(
            "the rotated certificate served",
            Duration::from_secs(10),
            || {
                let trust = trust.clone();
                async move { served_name(addr, trust).await == "gateway-2" }
            },
        )
        .await;
    }
    let ok = "sluice_tls_certificate_reloads_total{certificate=\"server\",result=\"ok\"}";
    assert!(tls_metric(&gw, trust.clone(), ok).await >= 1.0);
    // A half-written rotation: refused, counted, and the pair before stays.
    std::fs::write(&pair.cert, "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    let error = "sluice_tls_certificate_reloads_total{certificate=\"server\",result=\"error\"}";
    let gw_ref = &gw;
    let t = trust.clone();
    wait_until("the broken pair refused", Duration::from_secs(10), || {
        let t = t.clone();
        async move { tls_metric(gw_ref, t, error).await >= 1.0 }
    })
    .await;
    assert_eq!(served_name(gw.api_addr, trust.clone()).await, "gateway-2");
    let (status, _) = request(gw.api_addr, trust.clone(), "GET", "/v1/models", "", "")
        .await
        .unwrap();
    assert_eq!(status, 200);
}

#[tokio::test]
async fn sighup_reloads_the_certificate_at_once() {
    let pki = Pki::new("sighup");
    let pair = pki.issue("gateway", "gateway-1", false);
    let sim = start_sim(fast_sim()).await;
    let mut config = with_tls(&[sim.url()], &pair);
    // No file check within the test: only the reload serves the new pair.
    config.server.tls.reload_interval = Duration::from_secs(3600);
    let gw = start_gateway(config, 1).await;
    let trust = pki.client(None);
    pki.issue_to(&pair, "gateway-2", false);
    assert_eq!(served_name(gw.api_addr, trust.clone()).await, "gateway-1");
    gw.reload_certificates().unwrap();
    assert_eq!(served_name(gw.api_addr, trust.clone()).await, "gateway-2");
    // A key that is not the certificate's: refused with why, the pair
    // before stays.
    let other = pki.issue("other", "other", false);
    std::fs::copy(&other.key, &pair.key).unwrap();
    let err = gw.reload_certificates().unwrap_err().to_string();
    assert!(err.contains("is not the key of the certificate"), "{err}");
    assert_eq!(served_name(gw.api_addr, trust).await, "gateway-2");
}

#[tokio::test]
async fn listeners_with_client_cas_require_a_client_certificate() {
    let pki = Pki::new("mtls-in");
    let pair = pki.issue("gateway", "gateway", false);
    let app = pki.issue("app", "app", false);
    let stranger_pki = Pki::new("stranger");
    let stranger = stranger_pki.issue("stranger", "stranger", false);
    let sim = start_sim(fast_sim()).await;
    let mut config = with_tls(&[sim.url()], &pair);
    config.server.tls.client_ca_file = Some(pki.ca.clone());
    let gw = start_gateway(config, 1).await;
    let body = chat_body(false).to_string();
    let (status, answer) = request(
        gw.api_addr,
        pki.client(Some(&app)),
        "POST",
        "/v1/chat/completions",
        "",
        &body,
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{answer}");
    // No certificate, or one from another CA: no answer.
    for shown in [None, Some(&stranger)] {
        let got = request(
            gw.api_addr,
            client_trusting(&pki.ca, shown),
            "POST",
            "/v1/chat/completions",
            "",
            &body,
        )
        .await;
        assert!(
            got.is_err(),
            "answered without a trusted certificate: {got:?}"
        );
    }
    let failures = tls_metric(
        &gw,
        pki.client(Some(&app)),
        "sluice_tls_handshake_failures_total{listener=\"api\"}",
    )
    .await;
    assert_eq!(failures, 2.0);
}

/// A simulated replica serving HTTPS with `pair`, requiring client
/// certificates from `client_ca` if given.
async fn https_sim(
    pair: &tls::Pair,
    client_ca: Option<&std::path::Path>,
) -> sluice::sim::SimHandle {
    let cert = sluice::net::tls::Certificate::load(&pair.cert, &pair.key).unwrap();
    let mut cfg = fast_sim();
    cfg.tls = Some(sluice::net::tls::server_config(cert, client_ca).unwrap());
    start_sim(cfg).await
}

/// The error of the replica's last health check, once it has one.
async fn last_error(gw: &sluice::server::Gateway) -> String {
    let pool = gw.state().pool.clone();
    let mut out = String::new();
    wait_until("a failed health check", Duration::from_secs(10), || {
        let found = pool.replicas()[0].health.load().last_error.clone();
        if let Some(e) = &found {
            out = e.clone();
        }
        async move { found.is_some() }
    })
    .await;
    out
}

#[tokio::test]
async fn https_replicas_with_a_ca_bundle_and_a_client_certificate() {
    let pki = Pki::new("mtls-out");
    let replica = pki.issue("replica", "replica", false);
    let client_cert = pki.issue("sluice", "sluice", false);
    let sim = https_sim(&replica, Some(&pki.ca)).await;
    let url = format!("https://localhost:{}", sim.addr.port());
    let mut config = config_for(&[url]);
    config.upstream.tls.ca_file = Some(pki.ca.clone());
    config.upstream.tls.cert_file = Some(client_cert.cert.clone());
    config.upstream.tls.key_file = Some(client_cert.key.clone());
    // (The certificate files are checked this often.)
    config.server.tls.reload_interval = Duration::from_millis(50);
    // Health checks (the replica's model list) and requests go over TLS.
    let gw = start_gateway(config.clone(), 1).await;
    let chat = format!("{}/v1/chat/completions", api(&gw));
    for stream in [true, false] {
        let (status, _, body) = post(&chat, &chat_body(stream)).await;
        assert_eq!(status, 200, "{body}");
    }
    let (_, _, body) = post(&chat, &chat_body(true)).await;
    assert_eq!(data_payloads(&body).last().unwrap(), "[DONE]");
    assert_eq!(sim_finished(&sim, "length") + sim_finished(&sim, "stop"), 3);

    // The client certificate rotated in place: reloaded without a restart.
    pki.issue_to(&client_cert, "sluice-2", false);
    let reloaded = "sluice_tls_certificate_reloads_total{certificate=\"upstream\",result=\"ok\"}";
    let gw_ref = &gw;
    wait_until(
        "the client certificate reloaded",
        Duration::from_secs(10),
        || async move { gateway_metric(gw_ref, reloaded).await >= 1.0 },
    )
    .await;
    // Still served (new connections show the new certificate; pooled ones
    // keep their handshake).
    let (status, _, body) = post(&chat, &chat_body(false)).await;
    assert_eq!(status, 200, "{body}");

    // Without the client certificate the replica refuses the gateway: it
    // is not healthy, and says why.
    let mut anonymous = config.clone();
    anonymous.upstream.tls.cert_file = None;
    anonymous.upstream.tls.key_file = None;
    let gw2 = start_gateway(anonymous, 0).await;
    let error = last_error(&gw2).await;
    assert!(error.contains("CertificateRequired"), "{error}");
    assert!(!gw2.state().pool.replicas()[0].is_healthy());
}

#[tokio::test]
async fn replicas_with_expired_or_untrusted_certificates_are_refused_with_the_reason() {
    let pki = Pki::new("refused");
    let expired = pki.issue("expired", "replica", true);
    let other = Pki::new("other");
    let untrusted = other.issue("untrusted", "replica", false);
    for (pair, reason) in [
        (&expired, "certificate expired"),
        (&untrusted, "UnknownIssuer"),
    ] {
        let sim = https_sim(pair, None).await;
        let mut config = config_for(&[format!("https://localhost:{}", sim.addr.port())]);
        config.upstream.tls.ca_file = Some(pki.ca.clone());
        let gw = start_gateway(config, 0).await;
        let error = last_error(&gw).await;
        assert!(error.contains("invalid peer certificate"), "{error}");
        assert!(error.contains(reason), "{reason}: {error}");
        assert!(!gw.state().pool.replicas()[0].is_healthy());
        assert_eq!(sim_finished(&sim, "stop") + sim_finished(&sim, "length"), 0);
    }
}

/// The real binary on both sides of TLS: `sluice sim --tls-cert` as an
/// `https://` replica requiring a client certificate, a gateway reaching it
/// with one, and `sluice bench --ca-file` streaming through the gateway's
/// HTTPS listener (what `benches/e2e/stream_overhead.py --tls` runs).
#[tokio::test]
async fn the_binaries_serve_and_load_over_tls() {
    const BIN: &str = env!("CARGO_BIN_EXE_sluice");
    let pki = Pki::new("binaries");
    let replica = pki.issue("replica", "replica", false);
    let gateway = pki.issue("gateway", "gateway", false);
    // The replica binds a port of its own and names it in its log (a port
    // picked here and passed on could be taken by then).
    let mut sim = tokio::process::Command::new(BIN)
        .args(["sim", "--listen", "127.0.0.1:0"])
        .args(["--token-delay", "1ms", "--prefill-delay", "1ms"])
        .arg("--tls-cert")
        .arg(&replica.cert)
        .arg("--tls-key")
        .arg(&replica.key)
        .arg("--tls-client-ca")
        .arg(&pki.ca)
        .env("RUST_LOG", "info")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut log = tokio::io::BufReader::new(sim.stderr.take().unwrap()).lines();
    let port: u16 = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = log.next_line().await.unwrap() {
            if let Some(at) = line.split("addr=127.0.0.1:").nth(1) {
                return at.split_whitespace().next().unwrap().parse().unwrap();
            }
        }
        panic!("the replica ended without serving");
    })
    .await
    .expect("the replica did not start");
    // (Its later log lines are read and dropped: a full pipe would stall it.)
    tokio::spawn(async move { while let Ok(Some(_)) = log.next_line().await {} });
    let mut config = with_tls(&[format!("https://localhost:{port}")], &gateway);
    config.upstream.tls.ca_file = Some(pki.ca.clone());
    config.upstream.tls.cert_file = Some(gateway.cert.clone());
    config.upstream.tls.key_file = Some(gateway.key.clone());
    let gw = start_gateway(config, 1).await;
    let url = format!("https://localhost:{}", gw.api_addr.port());
    let ca = pki.ca.to_str().unwrap();
    let report = crate::bench::bench_json(&[
        "--url",
        &url,
        "--ca-file",
        ca,
        "--requests",
        "20",
        "--concurrency",
        "4",
        "--max-tokens",
        "8",
    ])
    .await;
    assert_eq!(report["ok"], 20, "{report}");
    sim.kill().await.unwrap();
}
