//! Integration tests: the real gateway and simulator over loopback sockets.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod alerting;
mod bench;
mod cli;
mod common;
mod deploy;
mod errors;
mod forwarding;
mod layers;
mod limits;
mod observability;
mod routing;
mod sdk;
mod sim;
mod streaming;
mod wire;
