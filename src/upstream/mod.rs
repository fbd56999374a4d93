//! Everything about the replicas: the pool, the client that talks to them,
//! and the health checks that keep the pool's view current.

pub mod client;
pub mod conn;
pub mod discovery;
pub mod health;
mod http1;
pub mod pool;
pub mod scrape;
pub mod signals;
