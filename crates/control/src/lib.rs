//! Shoal's control plane: what the pooler and the realtime service share, with nothing of
//! either's data path. Module map:
//!
//! - [`config`]: the TOML configuration, its validation and the embedded default.
//! - [`tenant`]: tenants as the API speaks them ([`tenant::model`]), their passwords sealed
//!   at rest ([`tenant::crypto`]) and the store that keeps them ([`tenant::store`]: SQLite
//!   embedded, or PostgreSQL shared by several nodes).
//! - [`api_auth`]: who may use the management API (a bearer token or an HS256 JWT).
//! - [`metrics`]: lock-free histograms and the Prometheus encoding helpers each service's
//!   collector uses.
//! - [`upstream_tls`]: TLS to PostgreSQL with libpq's `sslmode` meanings.
//! - [`runtime`]: the control runtime and `spawn` onto it (never a data-plane shard).
//! - [`logsafe`]: escaping client-controlled text in log lines.

pub mod api_auth;
pub mod config;
pub mod logsafe;
pub mod metrics;
pub mod runtime;
pub mod tenant;
pub mod upstream_tls;
