//! The real binary: config checking, serving, and stopping on SIGTERM.

use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

fn temp_config(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[tokio::test]
async fn check_config_accepts_the_example_and_names_key_and_line() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/config/sluice.yaml");
    let out = Command::new(BIN)
        .args(["check-config", example])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let bad =
        temp_config("server:\n  listen: 0.0.0.0:8080\nupstream:\n  timeouts:\n    idle: forever\n");
    let out = Command::new(BIN)
        .args(["check-config", bad.path().to_str().unwrap()])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(":5: `upstream.timeouts.idle`"), "{err}");

    let bad = temp_config("backends:\n  - url: http://a:8000\n  - url: http://a:8000\n");
    let out = Command::new(BIN)
        .args(["check-config", bad.path().to_str().unwrap()])
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(":3: `backends[1]`"), "{err}");
}

/// Spawn the binary and read the address it logs as `key=ADDR`.
pub async fn spawn_and_find(args: &[&str], key: &str) -> (Child, String) {
    let (child, line) = spawn_and_wait_for(args, key).await;
    let pat = format!("{key}=");
    let addr = line
        .split(&pat)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .to_string();
    (child, addr)
}

/// Spawn the binary and return the first log line containing `key=`.
pub async fn spawn_and_wait_for(args: &[&str], key: &str) -> (Child, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let pat = format!("{key}=");
    let found = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains(&pat) {
                return line;
            }
        }
        panic!("process exited without logging {key}");
    })
    .await
    .expect("no address logged");
    // Keep draining stderr so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, found)
}

#[tokio::test]
async fn serve_and_sim_binaries_work_end_to_end_and_stop_on_sigterm() {
    let (mut sim, sim_addr) = spawn_and_find(
        &[
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--token-delay",
            "1ms",
            "--output-tokens",
            "4",
        ],
        "addr",
    )
    .await;
    let backend = format!("http://{sim_addr}");
    let (mut gw, api_addr) = spawn_and_find(
        &[
            "serve",
            "--backend",
            &backend,
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ],
        "api",
    )
    .await;
    let url = format!("http://{api_addr}/v1/chat/completions");
    wait_until("gateway routes", Duration::from_secs(10), || {
        let url = url.clone();
        async move {
            client()
                .post(&url)
                .json(&chat_body(false))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
    let (status, _, body) = post(&url, &chat_body(true)).await;
    assert_eq!(status, 200);
    assert!(body.ends_with("data: [DONE]\n\n"));

    for child in [&mut gw, &mut sim] {
        signal(child, "-TERM").await;
        let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
            .await
            .expect("did not stop on SIGTERM")
            .unwrap();
        assert!(status.success(), "{status:?}");
    }
}

#[tokio::test]
async fn serve_without_backends_fails_with_a_clear_message() {
    let out = Command::new(BIN).args(["serve"]).output().await.unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no backends"));
}

async fn signal(child: &Child, sig: &str) {
    let pid = child.id().unwrap().to_string();
    let ok = Command::new("kill")
        .args([sig, &pid])
        .status()
        .await
        .unwrap();
    assert!(ok.success());
}

#[tokio::test]
async fn sighup_reloads_the_config_without_cutting_streams() {
    // Replica A streams slowly (20 tokens, 100 ms apart); replica B serves another model.
    let a = start_sim(sluice::sim::SimConfig {
        model: "model-a".into(),
        token_delay: Duration::from_millis(100),
        output_tokens: 20,
        ..fast_sim()
    })
    .await;
    let b = start_sim(sluice::sim::SimConfig {
        model: "model-b".into(),
        ..fast_sim()
    })
    .await;
    let config_for = |url: &str, extra: &str| {
        format!(
            "server:\n  listen: 127.0.0.1:0\n  admin_listen: 127.0.0.1:0\n\
             telemetry:\n  access_log:\n    enabled: false\n\
             backends:\n  - url: {url}\n{extra}"
        )
    };
    let file = temp_config(&config_for(&a.url(), ""));
    let path = file.path().to_str().unwrap().to_string();
    let (gw, line) = spawn_and_wait_for(&["serve", "--config", &path], "api").await;
    let addr = |key: &str| {
        line.split(&format!("{key}="))
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .unwrap()
            .to_string()
    };
    let (api, admin) = (addr("api"), addr("admin"));
    let url = format!("http://{api}/v1/chat/completions");
    let status_of = |model: &'static str| {
        let url = url.clone();
        async move {
            client()
                .post(&url)
                .json(&chat_for(model, false))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    };
    wait_until("model-a routable", Duration::from_secs(10), || {
        let s = status_of("model-a");
        async move { s.await == 200 }
    })
    .await;

    // A stream on A is running when the config moves the gateway to B.
    let running = a.state.metrics.running.get();
    let stream = tokio::spawn({
        let url = url.clone();
        async move { post(&url, &chat_for("model-a", true)).await }
    });
    wait_until("stream running on A", Duration::from_secs(5), || {
        let n = a.state.metrics.running.get();
        async move { n > running }
    })
    .await;
    std::fs::write(file.path(), config_for(&b.url(), "")).unwrap();
    signal(&gw, "-HUP").await;
    wait_until(
        "model-b routable after SIGHUP",
        Duration::from_secs(10),
        || {
            let s = status_of("model-b");
            async move { s.await == 200 }
        },
    )
    .await;
    let reloads = |result: &'static str| {
        let admin = admin.clone();
        async move {
            let (_, text) = get_text(&format!("http://{admin}/metrics")).await;
            metric(
                &text,
                &format!("sluice_config_reloads_total{{result=\"{result}\"}}"),
            )
            .unwrap_or(0.0)
        }
    };
    assert_eq!(reloads("ok").await, 1.0);
    assert!(
        a.state.metrics.running.get() > running,
        "the reload took effect while the stream was still running"
    );

    // The stream that started before the reload ran to its end on A.
    let (status, _, body) = stream.await.unwrap();
    assert_eq!(status, 200);
    assert!(body.ends_with("data: [DONE]\n\n"), "stream cut: {body}");
    let tokens = data_payloads(&body)
        .iter()
        .filter(|p| p.contains("\"content\":\" "))
        .count();
    assert_eq!(tokens, 20, "{body}");
    assert_eq!(
        sim_finished(&a, "stop"),
        2,
        "warm-up + the stream, none aborted"
    );
    assert_eq!(sim_finished(&a, "abort"), 0);
    // New requests follow the new config: A's model is gone.
    assert_eq!(status_of("model-a").await, 404);

    // A broken config is refused; the running one stays.
    std::fs::write(
        file.path(),
        config_for(&b.url(), "routing:\n  policy: fastest\n"),
    )
    .unwrap();
    signal(&gw, "-HUP").await;
    wait_until("reload error counted", Duration::from_secs(10), || {
        let n = reloads("error");
        async move { n.await == 1.0 }
    })
    .await;
    assert_eq!(status_of("model-b").await, 200);

    let mut gw = gw;
    signal(&gw, "-TERM").await;
    let status = tokio::time::timeout(Duration::from_secs(10), gw.wait())
        .await
        .expect("did not stop on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn sim_refuses_options_it_cannot_honour() {
    for (args, says) in [
        (
            &["--profile", "fixed", "--swap-space", "64"][..],
            "--swap-space needs an engine profile",
        ),
        (
            &["--profile", "fixed", "--no-chunked-prefill"][..],
            "--no-chunked-prefill needs an engine profile",
        ),
        (
            &["--profile", "fixed", "--cache-at", "schedule"][..],
            "--cache-at schedule needs an engine profile",
        ),
        (
            &["--cache-at", "admission"][..],
            "invalid value 'admission'",
        ),
        (&["--swap-space", "lots"][..], "invalid value 'lots'"),
        (&["--max-num-batched-tokens", "0"][..], "invalid value '0'"),
        (&["--fault", "leak=1"][..], "fault `leak` takes no value"),
    ] {
        let out = tokio::time::timeout(
            Duration::from_secs(20),
            Command::new(BIN)
                .args(["sim", "--listen", "127.0.0.1:0"])
                .args(args)
                .output(),
        )
        .await
        .expect("refused at once")
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// The binary's jemalloc options are in force: the build's background
/// thread and the thread-cache collection interval of `src/main.rs` (a
/// performance setting nothing else would notice losing). jemalloc prints
/// its options at exit when asked to through the environment.
#[tokio::test]
async fn the_allocator_runs_with_the_binarys_options() {
    let out = Command::new(BIN)
        .arg("--version")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    let stats = String::from_utf8_lossy(&out.stderr);
    assert!(
        stats.contains("opt.tcache_gc_incr_bytes: 4194304"),
        "{stats}"
    );
    assert!(stats.contains("opt.background_thread: true"), "{stats}");
}
