//! Integration tests: the real gateway and simulator over loopback sockets.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "helpers of tests fail the way tests do: by panicking (clippy.toml allows it only inside #[test] functions)"
)]
#![expect(
    unreachable_pub,
    reason = "helpers are shared by the modules of this one test binary; nothing is exported"
)]

mod admin_auth;
mod alerting;
mod bench;
mod cli;
mod common;
mod dashboard;
mod defects;
mod deploy;
mod deps;
mod disagg;
mod docs;
mod doctor;
mod doctor_sim;
mod epp;
mod errors;
mod exposition;
mod flow;
mod forwarding;
mod h1;
mod kubernetes;
mod layers;
mod limits;
mod observability;
mod protocols;
mod quality;
mod routing;
mod sdk;
mod sessions;
mod sim;
mod streaming;
mod tls;
mod top;
mod wire;
