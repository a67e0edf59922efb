//! The sections for what runs beside the pooler: the HTTP management API, the tenant store
//! and tenant routing.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

/// `[api]`: the HTTP listener for the tenant API (and, later, metrics). Present: on.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiSection {
    #[serde(default = "default_api_listen")]
    pub listen: SocketAddr,
    /// Environment variable holding the HS256 secret that signs API tokens (JWTs).
    #[serde(default = "default_jwt_env")]
    pub jwt_secret_env: String,
    /// Environment variable holding a static bearer token, accepted beside JWTs.
    pub token_env: Option<String>,
}

fn default_api_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 4000))
}

fn default_jwt_env() -> String {
    "API_JWT_SECRET".into()
}

/// `[store]`: where tenants are kept.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSection {
    /// `sqlite:PATH` (embedded, the default) or `postgres://…` (shared by several nodes).
    pub url: Option<String>,
    /// Holds the embedded store, its encryption key when none is given, and the API token
    /// made when no JWT secret is set.
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    /// Environment variable holding the 32-byte key (64 hex digits or base64) that encrypts
    /// tenant passwords at rest.
    #[serde(default = "default_key_env")]
    pub encryption_key_env: String,
    /// Seconds between full re-reads of a shared store (notifications carry changes at once;
    /// this heals a missed one).
    #[serde(
        deserialize_with = "super::duration::seconds",
        default = "default_resync"
    )]
    pub resync_interval: f64,
    /// TLS to a shared (postgres) store, with libpq's meanings as for `[databases]`.
    #[serde(default)]
    pub sslmode: super::SslMode,
    pub sslrootcert: Option<PathBuf>,
}

impl Default for StoreSection {
    fn default() -> Self {
        StoreSection {
            url: None,
            data_dir: default_data_dir(),
            encryption_key_env: default_key_env(),
            resync_interval: default_resync(),
            sslmode: Default::default(),
            sslrootcert: None,
        }
    }
}

impl StoreSection {
    /// The store's URL, the embedded SQLite file under `data_dir` when none is set.
    /// The shared store's TLS settings (as an upstream database's).
    pub fn tls_settings(&self) -> super::UpstreamTlsSettings {
        super::UpstreamTlsSettings {
            mode: self.sslmode,
            rootcert: self.sslrootcert.clone(),
            cert: None,
            key: None,
            key_password: None,
            sni: true,
        }
    }

    pub fn url(&self) -> String {
        self.url
            .clone()
            .unwrap_or_else(|| format!("sqlite:{}", self.data_dir.join("tenants.db").display()))
    }
}

fn default_data_dir() -> PathBuf {
    PathBuf::from("shoal-data")
}

fn default_key_env() -> String {
    "SHOAL_ENC_KEY".into()
}

fn default_resync() -> f64 {
    30.0
}

/// `[tenants]`: how clients name their tenant, and tenant pool upkeep.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantsSection {
    /// With `db.example.com`, a client connecting with SNI `acme.db.example.com` reaches
    /// tenant `acme`.
    pub sni_base_domain: Option<String>,
    /// Seconds a tenant pool may sit with no client before it is closed (its memory freed);
    /// the next login makes it again.
    #[serde(
        deserialize_with = "super::duration::seconds",
        default = "default_pool_idle_close"
    )]
    pub pool_idle_close: f64,
}

impl Default for TenantsSection {
    fn default() -> Self {
        TenantsSection {
            sni_base_domain: None,
            pool_idle_close: default_pool_idle_close(),
        }
    }
}

fn default_pool_idle_close() -> f64 {
    300.0
}

/// `[metrics]`: `/metrics`, `/health` and `/ready` on a listener of their own (they are also
/// served on the API's listener when `[api]` is configured).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MetricsSection {
    pub listen: Option<SocketAddr>,
    /// Environment variable holding a bearer token `/metrics` then requires.
    pub token_env: Option<String>,
}

/// `[admin]`: who may use the admin console (the virtual database `pgbouncer`, or `shoal`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct AdminSection {
    /// Configured users allowed every console command.
    #[serde(default)]
    pub users: Vec<String>,
    /// Configured users allowed `SHOW` commands only.
    #[serde(default)]
    pub stats_users: Vec<String>,
}

/// `[realtime]`: the WebSocket service (Phoenix channels) beside the pooler. Present: on.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RealtimeSection {
    #[serde(default = "default_realtime_listen")]
    pub listen: SocketAddr,
    /// A request header naming the tenant, for deployments without a wildcard DNS name per
    /// tenant (default: the first label of `Host`; a `/t/TENANT/...` path prefix always
    /// works).
    pub tenant_header: Option<String>,
    /// Seconds a socket may stay silent (no heartbeat, no message) before it is closed
    /// and its presences leave.
    #[serde(
        deserialize_with = "super::duration::seconds",
        default = "default_heartbeat_timeout"
    )]
    pub heartbeat_timeout: f64,
    /// Seconds a socket that connected with `resume=<id>` is kept, channels and all, after
    /// its connection is lost, for the client to come back to (0: none is kept).
    #[serde(
        deserialize_with = "super::duration::seconds",
        default = "default_resume_window"
    )]
    pub resume_window: f64,
}

fn default_heartbeat_timeout() -> f64 {
    60.0
}

fn default_resume_window() -> f64 {
    30.0
}

fn default_realtime_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 4001))
}

/// `[serverless]`: the front door for serverless and edge functions (Neon's serverless
/// driver): the PostgreSQL protocol over WebSocket, into the same login, routing and pools
/// as TCP clients.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerlessSection {
    pub listen: SocketAddr,
    /// Largest WebSocket message accepted, in bytes (a PostgreSQL message may span several).
    #[serde(default = "default_serverless_max_message")]
    pub max_message_size: usize,
    /// Ask for the password in cleartext, as Neon's proxy does, so the driver's pipelined
    /// connect (its default: the password sent before it is asked) works. Off: SCRAM, and
    /// the driver needs `pipelineConnect = false`.
    #[serde(default = "super::sections::default_true")]
    pub cleartext_password: bool,
    /// Where plain-text HTTP and WebSockets are taken from when Shoal has a certificate
    /// (`[tls]`): passwords cross the front door as they are, so by default only from
    /// loopback; `anywhere` for a TLS-terminating proxy on another host. Without a
    /// certificate the front door is plain for everyone.
    #[serde(default)]
    pub accept_plain: AcceptPlain,
    /// Largest HTTP query body (`POST /sql`) accepted, in bytes: larger gets 413.
    #[serde(default = "default_serverless_max_body")]
    pub max_request_size: usize,
    /// Largest HTTP answer, in bytes: a query whose rows would exceed it fails with 507
    /// rather than holding them all in memory.
    #[serde(default = "default_serverless_max_body")]
    pub max_response_size: usize,
    /// Seconds an HTTP query (a batch: all of it) may take, login included; past it the
    /// statement is cancelled and the answer is 504.
    #[serde(
        deserialize_with = "super::duration::seconds",
        default = "default_serverless_request_timeout"
    )]
    pub request_timeout: f64,
}

/// See [`ServerlessSection::accept_plain`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AcceptPlain {
    #[default]
    Loopback,
    Anywhere,
}

fn default_serverless_max_message() -> usize {
    16 << 20
}

fn default_serverless_max_body() -> usize {
    10 << 20
}

fn default_serverless_request_timeout() -> f64 {
    60.0
}
