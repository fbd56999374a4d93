//! A tiny authoritative DNS server on loopback UDP for discovery tests: it
//! answers A queries for one name with a list of IPv4 addresses the test can
//! change, TTL 0; anything else gets an empty NOERROR answer.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use parking_lot::Mutex;

use tokio::net::UdpSocket;

pub struct TestDns {
    pub addr: SocketAddr,
    answers: Arc<Mutex<Vec<Ipv4Addr>>>,
    task: tokio::task::JoinHandle<()>,
}

impl TestDns {
    pub fn set(&self, ips: &[Ipv4Addr]) {
        *self.answers.lock() = ips.to_vec();
    }
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serve `name` (e.g. "replicas.test.") with `ips`.
pub async fn start(name: &str, ips: &[Ipv4Addr]) -> TestDns {
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = sock.local_addr().unwrap();
    let answers = Arc::new(Mutex::new(ips.to_vec()));
    let (a, wanted) = (answers.clone(), encode_name(name));
    let task = tokio::spawn(async move {
        let mut buf = [0u8; 512];
        loop {
            let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                return;
            };
            let ips = a.lock().clone();
            if let Some(resp) = respond(&buf[..n], &wanted, &ips) {
                let _ = sock.send_to(&resp, peer).await;
            }
        }
    });
    TestDns {
        addr,
        answers,
        task,
    }
}

fn encode_name(name: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for label in name.trim_end_matches('.').split('.') {
        out.push(label.len() as u8);
        out.extend(label.to_ascii_lowercase().as_bytes());
    }
    out.push(0);
    out
}

fn respond(q: &[u8], wanted: &[u8], ips: &[Ipv4Addr]) -> Option<Vec<u8>> {
    if q.len() < 12 {
        return None;
    }
    // Question: the name (labels), then type and class.
    let mut i = 12;
    while *q.get(i)? != 0 {
        i += 1 + *q.get(i)? as usize;
    }
    let name_end = i + 1;
    let qtype = u16::from_be_bytes([*q.get(name_end)?, *q.get(name_end + 1)?]);
    let question = &q[12..name_end + 4];
    let name = q[12..name_end].to_ascii_lowercase();
    let answers: &[Ipv4Addr] = if name == wanted && qtype == 1 {
        ips
    } else {
        &[]
    };
    let mut r = Vec::with_capacity(512);
    r.extend(&q[0..2]); // id
    r.extend([0x84, 0x00]); // response, authoritative, NOERROR
    r.extend(1u16.to_be_bytes()); // one question
    r.extend((answers.len() as u16).to_be_bytes());
    r.extend([0, 0, 0, 0]); // no authority, no additional
    r.extend(question);
    for ip in answers {
        r.extend([0xC0, 0x0C]); // pointer to the question's name
        r.extend(1u16.to_be_bytes()); // A
        r.extend(1u16.to_be_bytes()); // IN
        r.extend(0u32.to_be_bytes()); // TTL 0
        r.extend(4u16.to_be_bytes());
        r.extend(ip.octets());
    }
    Some(r)
}
