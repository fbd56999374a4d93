//! `sluice top` in a real pseudo-terminal (tmux): the screen it draws over a
//! running gateway, captured.

use std::process::Command;
use std::time::Duration;

use crate::common::*;

/// A tmux server of the test's own (its socket name), killed when dropped.
struct Tmux(String);

impl Tmux {
    fn run(&self, args: &[&str]) -> std::process::Output {
        Command::new("tmux")
            .args(["-L", &self.0])
            .args(args)
            .output()
            .expect("tmux (scripts/test.sh installs it)")
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
    }
}

#[tokio::test]
async fn top_draws_the_fleet_in_place_in_a_terminal() {
    let sims = [start_sim(fast_sim()).await, start_sim(fast_sim()).await];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let mut c = config_for(&urls);
    c.routing.metrics.interval = Duration::from_millis(100);
    let gw = start_gateway(c, 2).await;
    let (status, _, _) = post(
        &format!("{}/v1/chat/completions", api(&gw)),
        &chat_body(true),
    )
    .await;
    assert_eq!(status, 200);

    let tmux = std::sync::Arc::new(Tmux(format!("sluice-top-{}", std::process::id())));
    let cmd = format!(
        "{} top --admin {} --interval 200ms",
        env!("CARGO_BIN_EXE_sluice"),
        admin(&gw)
    );
    let t = tmux.clone();
    let started = tokio::task::spawn_blocking(move || {
        t.run(&[
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            "130",
            "-y",
            "30",
            &cmd,
        ])
    })
    .await
    .unwrap();
    assert!(started.status.success(), "{started:?}");

    let labels: Vec<String> = urls
        .iter()
        .map(|u| u.trim_start_matches("http://").to_string())
        .collect();
    let screen = std::sync::Arc::new(parking_lot::Mutex::new(String::new()));
    wait_until("top's screen", Duration::from_secs(15), || {
        let (t, screen, labels) = (tmux.clone(), screen.clone(), labels.clone());
        async move {
            let out =
                tokio::task::spawn_blocking(move || t.run(&["capture-pane", "-p", "-t", "top"]))
                    .await
                    .unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            let ok = text.contains("REPLICA")
                && labels.iter().all(|l| text.contains(l.as_str()))
                && text.contains("req/s")
                && text.contains("Diagnosis  healthy");
            *screen.lock() = text;
            ok
        }
    })
    .await;
    let text = screen.lock().clone();
    // Redrawn in place: one frame on the screen, its title on the first line.
    assert!(text.starts_with("sluice top"), "{text}");
    assert_eq!(text.matches("REPLICA").count(), 1, "{text}");
    assert!(text.contains("[") && text.contains("%"), "KV bars: {text}");
}
