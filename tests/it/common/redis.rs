//! A real `redis-server` on a free loopback port, stopped when dropped.

use std::time::Duration;

use tokio::process::{Child, Command};

pub struct Redis {
    pub port: u16,
    child: Option<Child>,
}

impl Redis {
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kill the server (to test an outage); `restart` brings it back on the same port.
    pub async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill().await;
        }
    }

    pub async fn restart(&mut self) {
        self.kill().await;
        self.child = Some(spawn(self.port).await);
    }
}

async fn spawn(port: u16) -> Child {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("redis-server must be installed (scripts/test.sh installs the Debian package)");
    super::wait_until(
        "redis accepts connections",
        Duration::from_secs(10),
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        },
    )
    .await;
    child
}

pub async fn start() -> Redis {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    Redis {
        port,
        child: Some(spawn(port).await),
    }
}
