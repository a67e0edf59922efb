//! The sections of the TOML file as written: what serde reads, with the defaults of every
//! key. [`super::Config::parse`] turns them into the validated [`super::Config`].

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
/// How client sessions are spread over threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    /// One work-stealing runtime with `worker_threads` threads.
    MultiThread,
    /// One single-threaded runtime per core (`worker_threads` of them), each accepting on
    /// its own `SO_REUSEPORT` socket, packed onto as few as the load needs (see
    /// the pooler's `shard` module): the default, measured cheaper per transaction (docs/benchmarks.md).
    #[default]
    PerCore,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    Transaction,
    Session,
}

impl PoolMode {
    /// The mode as configured, and as the console, the API and the dashboard show it.
    pub fn name(self) -> &'static str {
        match self {
            PoolMode::Transaction => "transaction",
            PoolMode::Session => "session",
        }
    }
}

/// When a transaction-mode server is cleaned (`DISCARD ALL`) before another client gets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ServerReset {
    /// When the last client left state behind that Shoal saw (the default).
    #[default]
    Dirty,
    /// Whenever the next client is another one: for pools shared by clients that must not
    /// trust each other, since state changed by server-side code cannot be seen.
    Always,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum AuthMethod {
    #[serde(rename = "scram-sha-256")]
    ScramSha256,
    #[serde(rename = "md5")]
    Md5,
    #[serde(rename = "trust")]
    Trust,
    /// A TLS client certificate, verified against `[tls] ca_file`, whose common name is the
    /// user name (as PostgreSQL's `cert` method).
    #[serde(rename = "cert")]
    Cert,
}

/// Listener and process-wide settings (`[server]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    pub listen: Vec<SocketAddr>,
    pub unix_socket_dir: Option<PathBuf>,
    pub listen_backlog: u32,
    pub max_client_conn: usize,
    pub max_logins_in_progress: usize,
    pub max_logins_per_address: usize,
    pub auth_failure_ban: u32,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub auth_failure_window: f64,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub client_login_timeout: f64,
    pub max_packet_size: usize,
    pub max_large_message_memory: usize,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub shutdown_timeout: f64,
    pub tcp_keepalive: bool,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub tcp_keepalive_idle: f64,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub tcp_keepalive_interval: f64,
    pub worker_threads: usize,
    pub runtime: Runtime,
    /// `per_core`: open shards only as load needs them (see the pooler's `shard` module).
    pub shard_packing: bool,
    /// Busy fraction of every open shard above which another opens.
    pub shard_open_busy: f64,
    /// Open shards' total busy fraction under which, per shard left, the last one closes.
    pub shard_close_busy: f64,
    /// Idle cores the machine must have for another shard to open.
    pub shard_open_idle_cores: f64,
    /// Log every login and disconnection (with its reason) at info level.
    pub log_connections: bool,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            listen: vec!["127.0.0.1:6432".parse().expect("valid literal")],
            unix_socket_dir: None,
            listen_backlog: 4096,
            max_client_conn: 10_000,
            max_logins_in_progress: 10_000,
            max_logins_per_address: 0,
            auth_failure_ban: 10,
            auth_failure_window: 60.0,
            client_login_timeout: 15.0,
            max_packet_size: 64 * 1024 * 1024,
            max_large_message_memory: 512 * 1024 * 1024,
            shutdown_timeout: 30.0,
            tcp_keepalive: true,
            tcp_keepalive_idle: 300.0,
            tcp_keepalive_interval: 30.0,
            worker_threads: 0,
            runtime: Runtime::PerCore,
            shard_packing: true,
            shard_open_busy: 0.75,
            shard_close_busy: 0.35,
            shard_open_idle_cores: 0.5,
            log_connections: true,
        }
    }
}

/// Defaults for every pool (`[pool]`); databases and users may override some of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolSection {
    pub pool_mode: PoolMode,
    pub pool_size: usize,
    pub min_pool_size: usize,
    pub max_client_conn: usize,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub server_idle_timeout: f64,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub server_lifetime: f64,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub server_connect_timeout: f64,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub query_wait_timeout: f64,
    pub server_reset_query: String,
    pub server_reset: ServerReset,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub server_reset_timeout: f64,
    pub max_prepared_statements: usize,
    #[serde(deserialize_with = "super::duration::whole_seconds")]
    pub stats_period: u64,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub client_idle_timeout: f64,
    #[serde(deserialize_with = "super::duration::seconds")]
    pub slow_query_threshold: f64,
}

impl Default for PoolSection {
    fn default() -> Self {
        PoolSection {
            pool_mode: PoolMode::Transaction,
            pool_size: 20,
            min_pool_size: 0,
            max_client_conn: 0,
            server_idle_timeout: 600.0,
            server_lifetime: 3600.0,
            server_connect_timeout: 5.0,
            query_wait_timeout: 120.0,
            server_reset_query: "DISCARD ALL".into(),
            server_reset: ServerReset::Dirty,
            server_reset_timeout: 5.0,
            max_prepared_statements: 200,
            stats_period: 60,
            client_idle_timeout: 0.0,
            slow_query_threshold: 0.0,
        }
    }
}

/// An upstream database clients can name (`[databases.NAME]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSection {
    #[serde(default = "default_host")]
    pub host: String,
    #[serde(default = "default_port")]
    pub port: u16,
    pub dbname: Option<String>,
    #[serde(default)]
    pub sslmode: SslMode,
    pub sslrootcert: Option<PathBuf>,
    pub sslcert: Option<PathBuf>,
    pub sslkey: Option<PathBuf>,
    pub sslpassword: Option<String>,
    pub sslpassword_env: Option<String>,
    #[serde(default = "default_true")]
    pub sslsni: bool,
    pub client_tls: Option<ClientTls>,
    pub auth_user: Option<String>,
    pub auth_query: Option<String>,
    #[serde(default, deserialize_with = "super::duration::opt_seconds")]
    pub auth_query_cache_ttl: Option<f64>,
    pub pool_mode: Option<PoolMode>,
    pub pool_size: Option<usize>,
    pub min_pool_size: Option<usize>,
    pub max_client_conn: Option<usize>,
    pub server_reset: Option<ServerReset>,
    /// Read replicas of this database (see `replicas`).
    #[serde(default)]
    pub replicas: Vec<super::replicas::ReplicaSection>,
    pub read_routing: Option<super::replicas::ReadRouting>,
    pub max_replica_lag: Option<super::replicas::MaxLagSection>,
    pub replica_fallback: Option<super::replicas::ReplicaFallback>,
    #[serde(default, deserialize_with = "super::duration::opt_seconds")]
    pub replica_check_interval: Option<f64>,
    #[serde(default, deserialize_with = "super::duration::opt_seconds")]
    pub replica_ban_time: Option<f64>,
    pub prefer_zone: Option<String>,
    /// Query rules (`[[databases.NAME.rules]]`).
    #[serde(default)]
    pub rules: Vec<super::rules::RuleSection>,
    /// The result cache (see `cache`).
    pub cache: Option<bool>,
    #[serde(default, deserialize_with = "super::duration::opt_text")]
    pub cache_ttl: Option<String>,
    pub cache_all_reads: Option<bool>,
    #[serde(default)]
    pub cache_fingerprints: Vec<String>,
    pub cache_max_memory: Option<String>,
    /// Limits (see `limits`).
    #[serde(default, deserialize_with = "super::duration::opt_text")]
    pub max_statement_timeout: Option<String>,
    pub rate_limit: Option<f64>,
    pub rate_burst: Option<f64>,
    pub max_concurrency: Option<usize>,
    #[serde(default, deserialize_with = "super::duration::opt_text")]
    pub limit_wait: Option<String>,
}

impl DatabaseSection {
    pub fn limit_keys(&self) -> super::limits::LimitKeys<'_> {
        super::limits::LimitKeys {
            max_statement_timeout: self.max_statement_timeout.as_deref(),
            rate_limit: self.rate_limit,
            rate_burst: self.rate_burst,
            max_concurrency: self.max_concurrency,
            limit_wait: self.limit_wait.as_deref(),
        }
    }

    pub fn cache_keys(&self) -> super::cache::CacheKeys<'_> {
        super::cache::CacheKeys {
            cache: self.cache,
            cache_ttl: self.cache_ttl.as_deref(),
            cache_all_reads: self.cache_all_reads,
            cache_fingerprints: &self.cache_fingerprints,
            cache_max_memory: self.cache_max_memory.as_deref(),
        }
    }
}

/// TLS to PostgreSQL, with libpq's meanings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    /// Plain text only.
    Disable,
    /// TLS if the server offers it, unverified; plain text otherwise.
    #[default]
    Prefer,
    /// TLS, unverified.
    Require,
    /// TLS, certificate chain verified (not the host name).
    VerifyCa,
    /// TLS, chain and host name verified.
    VerifyFull,
}

/// How Shoal connects to a database's PostgreSQL over TLS.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamTlsSettings {
    pub mode: SslMode,
    pub rootcert: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Decrypts `key` when it is an encrypted PKCS#8 key (libpq's `sslpassword`).
    pub key_password: Option<KeyPassword>,
    pub sni: bool,
}

/// The password of an encrypted client key: compared, never shown.
#[derive(Clone, PartialEq, Eq)]
pub struct KeyPassword(pub String);

impl std::fmt::Debug for KeyPassword {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyPassword(..)")
    }
}

/// A client certificate a user presents to PostgreSQL instead of its database's.
#[derive(Debug, Clone, PartialEq)]
pub struct UpstreamCert {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub key_password: Option<KeyPassword>,
}

pub(super) fn default_true() -> bool {
    true
}

fn default_host() -> String {
    "127.0.0.1".into()
}
fn default_port() -> u16 {
    5432
}

/// A user clients log in as (`[users.NAME]`), with the credentials Shoal checks and the
/// credentials it uses upstream.
#[derive(Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct UserSection {
    pub password: Option<String>,
    pub password_env: Option<String>,
    pub secret: Option<String>,
    pub auth_method: Option<AuthMethod>,
    pub server_user: Option<String>,
    pub server_password: Option<String>,
    pub server_password_env: Option<String>,
    pub pool_mode: Option<PoolMode>,
    pub pool_size: Option<usize>,
    /// Overrides the database's `read_routing` for this user's pools.
    pub read_routing: Option<super::replicas::ReadRouting>,
    /// Query rules (`[[users.NAME.rules]]`).
    #[serde(default)]
    pub rules: Vec<super::rules::RuleSection>,
    /// Turns the database's result cache off (or on) for this user's pools.
    pub cache: Option<bool>,
    /// This user's own limits (beside its database's).
    pub rate_limit: Option<f64>,
    pub rate_burst: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub client_tls: Option<ClientTls>,
    /// A client certificate and key for this user's server logins (overrides the
    /// database's), and the key's password if it is encrypted.
    pub sslcert: Option<PathBuf>,
    pub sslkey: Option<PathBuf>,
    pub sslpassword: Option<String>,
    pub sslpassword_env: Option<String>,
}

/// Looking up users' secrets in PostgreSQL, as the configured `user` (whose upstream
/// credentials Shoal connects with), by `query` (one parameter: the user name; it returns
/// the name and the secret), cached for `cache_ttl`.
#[derive(Debug, Clone, PartialEq)]
pub struct AuthQuery {
    pub user: String,
    pub query: String,
    pub cache_ttl: Duration,
}

/// PostgreSQL's own catalog; a `SECURITY DEFINER` function over it is the safer choice.
pub const DEFAULT_AUTH_QUERY: &str =
    "SELECT rolname, rolpassword FROM pg_authid WHERE rolname = $1";

/// A secret Shoal logs in upstream with instead of a password (SCRAM or MD5 passthrough).
#[derive(Clone, PartialEq, Eq)]
pub enum Passthrough {
    /// The ClientKey recovered from the client's SCRAM proof, and the verifier it matched.
    Scram {
        client_key: [u8; 32],
        verifier: Box<str>,
    },
    /// The stored MD5 secret (`md5` + hex).
    Md5(String),
}

impl std::fmt::Debug for Passthrough {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Passthrough::Scram { .. } => "Passthrough::Scram(..)",
            Passthrough::Md5(_) => "Passthrough::Md5(..)",
        })
    }
}

/// How clients may or must use TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientTls {
    /// Encryption requests are declined; plain-text clients only.
    Disable,
    /// TLS when the client asks for it (the default with a certificate).
    Allow,
    /// Plain-text logins are refused (`28000`) before any password exchange.
    Require,
}

/// A certificate served to clients that ask for one of `server_names` (SNI).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateSection {
    pub server_names: Vec<String>,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// Client-facing TLS (`[tls]`).
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSection {
    /// The default certificate chain (PEM) and its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// `allow` when a certificate is configured, `disable` otherwise.
    pub client_tls: Option<ClientTls>,
    /// CA certificates (PEM) that client certificates must chain to; clients may then present
    /// one (required by users with `auth_method = "cert"`).
    pub ca_file: Option<PathBuf>,
    /// More certificates, chosen by the server name the client asks for.
    pub certificates: Vec<CertificateSection>,
}

impl TlsSection {
    pub fn mode(&self) -> ClientTls {
        self.client_tls.unwrap_or(if self.cert_file.is_some() {
            ClientTls::Allow
        } else {
            ClientTls::Disable
        })
    }
}

impl std::fmt::Debug for UserSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserSection")
            .field("auth_method", &self.auth_method)
            .field("server_user", &self.server_user)
            .finish_non_exhaustive()
    }
}
