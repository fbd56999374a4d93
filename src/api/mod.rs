//! Thin HTTP handlers: the proxied API, the model list, and the admin endpoints.

pub mod admin;
pub mod inbound;
pub mod models;
pub mod proxy;
pub mod request_id;
