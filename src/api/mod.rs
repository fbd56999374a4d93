//! Thin HTTP handlers: the proxied API, the model list, and the admin endpoints.

pub(crate) mod admin;
pub mod inbound;
pub(crate) mod models;
pub mod proxy;
pub(crate) mod request_id;
pub(crate) mod responses;
pub(crate) mod send;
pub(crate) mod session;
