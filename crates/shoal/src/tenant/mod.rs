//! Tenants: many databases on many PostgreSQL servers, each with its own users, limits and
//! rules, added and changed while Shoal runs. `model` is the operator's JSON, `store` keeps
//! it, `crypto` seals its passwords (all three from `shoal-control`); [`service`] applies a
//! change to the store and to routing, where [`crate::route::tenant`] holds tenants ready
//! for logins.

pub mod service;
pub use shoal_control::tenant::{crypto, model, store};
