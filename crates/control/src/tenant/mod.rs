//! Tenants as stored and served by the API: the model, sealed secrets, and the store.

pub mod crypto;
pub mod model;
pub mod store;
