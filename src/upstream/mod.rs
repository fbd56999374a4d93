//! Everything about the replicas: the pool, the client that talks to them,
//! and the health checks that keep the pool's view current.

pub(crate) mod client;
pub mod company;
pub(crate) mod conn;
pub(crate) mod discovery;
pub(crate) mod health;
pub(crate) mod http1;
pub(crate) mod kubernetes;
pub mod pool;
pub(crate) mod scrape;
pub mod signals;
