//! The admin token (`server.admin_auth`): every admin route but the probes
//! refused without it, served with it; `/metrics` open by choice; the
//! commands that read the admin listener send it.

use std::time::Duration;

use sluice::server::Gateway;

use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");
const TOKEN: &str = "adm-7f3c9e1b";

async fn status(gw: &Gateway, path: &str, token: Option<&str>) -> (u16, String, Option<String>) {
    let mut r = client().get(format!("{}{path}", admin(gw)));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let resp = r.send().await.unwrap();
    let code = resp.status().as_u16();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_string());
    (code, resp.text().await.unwrap(), challenge)
}

async fn locked(metrics_open: bool) -> (sluice::sim::SimHandle, Gateway, tempfile::TempDir) {
    let sim = start_sim(fast_sim()).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    std::fs::write(&file, format!("{TOKEN}\n")).unwrap();
    let mut c = config_for(&[sim.url()]);
    c.server.admin_auth.token_file = Some(file);
    c.server.admin_auth.metrics_open = metrics_open;
    let gw = start_gateway(c, 1).await;
    (sim, gw, dir)
}

#[tokio::test]
async fn admin_routes_want_the_token_and_the_probes_do_not() {
    let (_sim, gw, _dir) = locked(false).await;
    for path in [
        "/admin/backends",
        "/admin/routing",
        "/admin/diagnose",
        "/admin/config",
        "/metrics",
        "/nowhere",
    ] {
        let (code, body, challenge) = status(&gw, path, None).await;
        assert_eq!(code, 401, "{path}: {body}");
        assert_eq!(challenge.as_deref(), Some("Bearer"), "{path}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_admin_token", "{path}");
        assert_eq!(status(&gw, path, Some("wrong")).await.0, 401, "{path}");
    }
    for path in [
        "/admin/backends",
        "/admin/routing",
        "/admin/diagnose",
        "/admin/config",
        "/metrics",
    ] {
        let (code, body, _) = status(&gw, path, Some(TOKEN)).await;
        assert_eq!(code, 200, "{path}: {body}");
    }
    assert_eq!(status(&gw, "/nowhere", Some(TOKEN)).await.0, 404);
    // Kubernetes' probes carry no token.
    assert_eq!(status(&gw, "/healthz", None).await.0, 200);
    assert_eq!(status(&gw, "/readyz", None).await.0, 200);
    // The effective config never shows the token's source as a secret.
    let (_, cfg, _) = status(&gw, "/admin/config", Some(TOKEN)).await;
    assert!(!cfg.contains(TOKEN), "{cfg}");
}

#[tokio::test]
async fn metrics_can_be_left_open_for_a_scraper_without_the_token() {
    let (_sim, gw, _dir) = locked(true).await;
    let (code, body, _) = status(&gw, "/metrics", None).await;
    assert_eq!(code, 200);
    assert!(body.contains("sluice_requests_total"), "{body}");
    assert_eq!(status(&gw, "/admin/backends", None).await.0, 401);
}

#[tokio::test]
async fn sluice_diagnose_sends_the_token_and_says_when_it_is_missing() {
    let (_sim, gw, _dir) = locked(false).await;
    let url = admin(&gw);
    let run = |token: Option<&'static str>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = std::process::Command::new(BIN);
            c.args(["diagnose", "--admin", &url])
                .env_remove("SLUICE_ADMIN_TOKEN");
            if let Some(t) = token {
                c.env("SLUICE_ADMIN_TOKEN", t);
            }
            c.output().unwrap()
        })
    };
    let without = tokio::time::timeout(Duration::from_secs(30), run(None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(without.status.code(), Some(1));
    let err = String::from_utf8_lossy(&without.stderr);
    assert!(
        err.contains("401") && err.contains("SLUICE_ADMIN_TOKEN"),
        "{err}"
    );
    let with = tokio::time::timeout(Duration::from_secs(30), run(Some(TOKEN)))
        .await
        .unwrap()
        .unwrap();
    let out = String::from_utf8_lossy(&with.stdout);
    assert_eq!(with.status.code(), Some(0), "{out}");
    assert!(out.contains("healthy"), "{out}");
}

#[tokio::test]
async fn a_token_file_that_cannot_be_read_stops_the_start() {
    let sim = start_sim(fast_sim()).await;
    let mut c = config_for(&[sim.url()]);
    c.server.admin_auth.token_file = Some("/nonexistent/admin-token".into());
    let err = sluice::server::start(c).await.err().expect("refused");
    assert!(
        format!("{err:#}").contains("server.admin_auth.token_file"),
        "{err:#}"
    );
}
