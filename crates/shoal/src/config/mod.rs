//! The TOML configuration: its schema, defaults, validation with line numbers, and the
//! embedded default used when no file is given.
//!
//! Every key is documented in `docs/configuration.md`; keep the two in step.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use shoal_wire::{md5, scram::Verifier};

mod service;
pub use service::{AdminSection, ApiSection, MetricsSection, StoreSection, TenantsSection};

/// The configuration used when `shoal` starts without `--config`: one pool in front of a
/// local PostgreSQL on port 5432, for trying Shoal out. `scripts/quickstart` starts exactly
/// that PostgreSQL.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../../../config/default.toml");

/// A configuration problem, located in the file so the operator can fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{origin}:{line}:{column}: {message}")]
    Syntax {
        origin: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{origin}:{line}: {message}")]
    Invalid {
        origin: String,
        line: usize,
        message: String,
    },
}

/// How client sessions are spread over threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Runtime {
    /// One work-stealing runtime with `worker_threads` threads.
    MultiThread,
    /// One single-threaded runtime per core (`worker_threads` of them), each accepting on
    /// its own `SO_REUSEPORT` socket, packed onto as few as the load needs (see
    /// [`crate::shard`]): the default, measured cheaper per transaction (docs/benchmarks.md).
    #[default]
    PerCore,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    Transaction,
    Session,
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
    pub auth_failure_window: f64,
    pub client_login_timeout: f64,
    pub max_packet_size: usize,
    pub max_large_message_memory: usize,
    pub shutdown_timeout: f64,
    pub tcp_keepalive: bool,
    pub tcp_keepalive_idle: f64,
    pub tcp_keepalive_interval: f64,
    pub worker_threads: usize,
    pub runtime: Runtime,
    /// `per_core`: open shards only as load needs them (see [`crate::shard`]).
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
    pub server_idle_timeout: f64,
    pub server_lifetime: f64,
    pub server_connect_timeout: f64,
    pub query_wait_timeout: f64,
    pub server_reset_query: String,
    pub server_reset_timeout: f64,
    pub max_prepared_statements: usize,
    pub stats_period: u64,
    pub client_idle_timeout: f64,
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
    #[serde(default = "default_true")]
    pub sslsni: bool,
    pub client_tls: Option<ClientTls>,
    pub auth_user: Option<String>,
    pub auth_query: Option<String>,
    pub auth_query_cache_ttl: Option<f64>,
    pub pool_mode: Option<PoolMode>,
    pub pool_size: Option<usize>,
    pub min_pool_size: Option<usize>,
    pub max_client_conn: Option<usize>,
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
    pub sni: bool,
}

fn default_true() -> bool {
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
    pub client_tls: Option<ClientTls>,
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

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: ServerSection,
    #[serde(default)]
    tls: TlsSection,
    #[serde(default)]
    pool: PoolSection,
    #[serde(default)]
    databases: BTreeMap<String, DatabaseSection>,
    #[serde(default)]
    users: BTreeMap<String, UserSection>,
    api: Option<ApiSection>,
    store: Option<StoreSection>,
    #[serde(default)]
    tenants: TenantsSection,
    #[serde(default)]
    metrics: MetricsSection,
    #[serde(default)]
    admin: AdminSection,
}

impl std::fmt::Debug for UserSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserSection")
            .field("auth_method", &self.auth_method)
            .field("server_user", &self.server_user)
            .finish_non_exhaustive()
    }
}

/// How Shoal checks a client's password. Secrets are kept only in the form the method needs.
#[derive(Clone)]
pub enum ClientAuth {
    Scram(Verifier),
    /// The stored MD5 secret (`md5` + hex).
    Md5(String),
    Trust,
    /// A verified TLS client certificate naming the user.
    Cert,
}

/// A user after validation: credentials resolved, environment variables read.
#[derive(Clone)]
pub struct User {
    pub name: String,
    pub auth: ClientAuth,
    pub server_user: String,
    pub server_password: Option<String>,
    pub pool_mode: Option<PoolMode>,
    pub pool_size: Option<usize>,
    /// Overrides the database's and `[tls] client_tls` for this user.
    pub client_tls: Option<ClientTls>,
    /// Upstream login without a password (users found by auth_query).
    pub passthrough: Option<std::sync::Arc<Passthrough>>,
    /// Overrides the database's `max_client_conn` (tenant users' `max_clients`).
    pub max_client_conn: Option<usize>,
}

impl std::fmt::Debug for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("User")
            .field("name", &self.name)
            .field("server_user", &self.server_user)
            .finish_non_exhaustive()
    }
}

/// A database after validation.
#[derive(Debug, Clone)]
pub struct Database {
    pub name: String,
    pub host: String,
    pub port: u16,
    /// Which addresses of `host` to connect to (tenants' `ip_version`).
    pub family: IpFamily,
    pub dbname: String,
    pub tls: UpstreamTlsSettings,
    /// Overrides `[tls] client_tls` for this database.
    pub client_tls: Option<ClientTls>,
    /// Users not in the configuration are looked up in PostgreSQL (see [`AuthQuery`]).
    pub auth_query: Option<AuthQuery>,
    pub pool_mode: Option<PoolMode>,
    pub pool_size: Option<usize>,
    pub min_pool_size: Option<usize>,
    pub max_client_conn: Option<usize>,
}

/// Which of a host name's addresses Shoal connects to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IpFamily {
    #[default]
    Any,
    V4,
    V6,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerSection,
    pub tls: TlsSection,
    pub pool: PoolSection,
    pub databases: BTreeMap<String, Database>,
    pub users: BTreeMap<String, User>,
    pub api: Option<ApiSection>,
    pub store: Option<StoreSection>,
    pub tenants: TenantsSection,
    pub metrics: MetricsSection,
    pub admin: AdminSection,
    /// The file this was read from (reloads read it again); `None` for the embedded default.
    pub source: Option<PathBuf>,
}

/// Settings of one (database, user) pool, with overrides applied.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSettings {
    pub mode: PoolMode,
    pub size: usize,
    pub min_size: usize,
    pub max_client_conn: usize,
    pub idle_timeout: Duration,
    pub lifetime: Duration,
    pub connect_timeout: Duration,
    pub wait_timeout: Duration,
    pub reset_query: String,
    /// Bound on every wait for a server's reply while Shoal prepares, cleans or resets it; a
    /// server that does not answer in time is closed.
    pub reset_timeout: Duration,
    /// Named prepared statements kept per server connection in transaction mode (0 is
    /// taken as 1: statements are always tracked).
    pub max_prepared_statements: usize,
    /// Seconds between the pool's stats log lines (0: none).
    pub stats_period: u64,
    /// An idle client (transaction mode, no transaction open) is disconnected after this
    /// long (zero: never).
    pub client_idle_timeout: Duration,
    /// Queries slower than this are logged (rate-limited); zero: none.
    pub slow_query: Duration,
}

pub fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut c = Self::parse(&text, &path.display().to_string(), &|k| {
            std::env::var(k).ok()
        })?;
        c.source = Some(path.to_owned());
        Ok(c)
    }

    pub fn embedded_default() -> Result<Config, ConfigError> {
        Self::parse(EMBEDDED_DEFAULT, "<embedded default>", &|k| {
            std::env::var(k).ok()
        })
    }

    /// Parses and validates `text`; `env` looks up environment variables named by `*_env`
    /// keys (a parameter so tests need not touch the process environment).
    pub fn parse(
        text: &str,
        origin: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| {
            let (line, column) = e.span().map(|s| line_col(text, s.start)).unwrap_or((1, 1));
            ConfigError::Syntax {
                origin: origin.to_owned(),
                line,
                column,
                message: e.message().to_owned(),
            }
        })?;
        let invalid = |section: &str, message: String| ConfigError::Invalid {
            origin: origin.to_owned(),
            line: section_line(text, section),
            message,
        };
        let s = &raw.server;
        if s.listen.is_empty() && s.unix_socket_dir.is_none() {
            return Err(invalid(
                "server",
                "nothing to listen on: set server.listen or server.unix_socket_dir".into(),
            ));
        }
        if s.max_packet_size < 1024 {
            return Err(invalid(
                "server",
                "server.max_packet_size must be at least 1024 bytes".into(),
            ));
        }
        for (key, v) in [
            ("client_login_timeout", s.client_login_timeout),
            ("auth_failure_window", s.auth_failure_window),
            ("shutdown_timeout", s.shutdown_timeout),
            ("server_idle_timeout", raw.pool.server_idle_timeout),
            ("server_lifetime", raw.pool.server_lifetime),
            ("server_connect_timeout", raw.pool.server_connect_timeout),
            ("query_wait_timeout", raw.pool.query_wait_timeout),
            ("server_reset_timeout", raw.pool.server_reset_timeout),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(
                    "server",
                    format!("{key} must be a number of seconds ≥ 0"),
                ));
            }
        }
        let (open, close) = (s.shard_open_busy, s.shard_close_busy);
        if !(open > 0.0
            && open <= 1.0
            && close >= 0.0
            && close < open
            && s.shard_open_idle_cores.is_finite()
            && s.shard_open_idle_cores >= 0.0)
        {
            return Err(invalid(
                "server",
                "server.shard_open_busy must be in (0, 1], server.shard_close_busy in [0, shard_open_busy) and server.shard_open_idle_cores ≥ 0".into(),
            ));
        }
        if raw.pool.pool_size == 0 {
            return Err(invalid("pool", "pool.pool_size must be at least 1".into()));
        }
        let mut databases = BTreeMap::new();
        for (name, d) in raw.databases {
            let section = format!("databases.{name}");
            if d.pool_size == Some(0) {
                return Err(invalid(
                    &section,
                    format!("{section}.pool_size must be at least 1"),
                ));
            }
            databases.insert(
                name.clone(),
                Database {
                    family: IpFamily::Any,
                    dbname: d.dbname.unwrap_or_else(|| name.clone()),
                    client_tls: d.client_tls,
                    auth_query: d.auth_user.map(|user| AuthQuery {
                        user,
                        query: d
                            .auth_query
                            .unwrap_or_else(|| DEFAULT_AUTH_QUERY.to_owned()),
                        cache_ttl: secs(d.auth_query_cache_ttl.unwrap_or(10.0)),
                    }),
                    tls: UpstreamTlsSettings {
                        mode: d.sslmode,
                        rootcert: d.sslrootcert,
                        cert: d.sslcert,
                        key: d.sslkey,
                        sni: d.sslsni,
                    },
                    name,
                    host: d.host,
                    port: d.port,
                    pool_mode: d.pool_mode,
                    pool_size: d.pool_size,
                    min_pool_size: d.min_pool_size,
                    max_client_conn: d.max_client_conn,
                },
            );
        }
        let mut users = BTreeMap::new();
        for (name, u) in raw.users {
            let section = format!("users.{name}");
            let user = resolve_user(&name, u, env).map_err(|m| invalid(&section, m))?;
            users.insert(name, user);
        }
        let t = &raw.tls;
        if t.cert_file.is_some() != t.key_file.is_some() {
            return Err(invalid(
                "tls",
                "tls.cert_file and tls.key_file go together".into(),
            ));
        }
        let overrides_need_tls = databases
            .values()
            .map(|d: &Database| d.client_tls)
            .chain(users.values().map(|u: &User| u.client_tls))
            .any(|m| m.is_some_and(|m| m != ClientTls::Disable));
        if (t.mode() != ClientTls::Disable || overrides_need_tls) && t.cert_file.is_none() {
            return Err(invalid(
                "tls",
                "tls.client_tls needs a certificate: set tls.cert_file and tls.key_file".into(),
            ));
        }
        for d in databases.values() {
            if let Some(aq) = &d.auth_query {
                if !users.contains_key(&aq.user) {
                    return Err(invalid(
                        &format!("databases.{}", d.name),
                        format!(
                            "databases.{}.auth_user: \"{}\" is not a configured user",
                            d.name, aq.user
                        ),
                    ));
                }
            }
        }
        if t.ca_file.is_none() {
            if let Some((name, _)) = users
                .iter()
                .find(|(_, u): &(&String, &User)| matches!(u.auth, ClientAuth::Cert))
            {
                return Err(invalid(
                    &format!("users.{name}"),
                    format!("users.{name}: auth_method = \"cert\" needs tls.ca_file"),
                ));
            }
        }
        if let Some(bad) = databases.keys().find(|n| n.contains(':')) {
            return Err(invalid(
                "databases",
                format!("database name \"{bad}\" contains ':', which Shoal keeps for tenants"),
            ));
        }
        // The API needs a store; a store alone serves the tenants it holds.
        let store = raw
            .store
            .or_else(|| raw.api.as_ref().map(|_| StoreSection::default()));
        Ok(Config {
            server: raw.server,
            tls: raw.tls,
            pool: raw.pool,
            databases,
            users,
            api: raw.api,
            store,
            tenants: raw.tenants,
            metrics: raw.metrics,
            admin: raw.admin,
            source: None,
        })
    }

    /// Effective settings for the pool serving `user` on `db`: user overrides database, which
    /// overrides `[pool]`.
    pub fn pool_settings(&self, db: &Database, user: &User) -> PoolSettings {
        let p = &self.pool;
        PoolSettings {
            mode: user.pool_mode.or(db.pool_mode).unwrap_or(p.pool_mode),
            size: user.pool_size.or(db.pool_size).unwrap_or(p.pool_size),
            min_size: db.min_pool_size.unwrap_or(p.min_pool_size),
            max_client_conn: user
                .max_client_conn
                .or(db.max_client_conn)
                .unwrap_or(p.max_client_conn),
            idle_timeout: secs(p.server_idle_timeout),
            lifetime: secs(p.server_lifetime),
            connect_timeout: secs(p.server_connect_timeout),
            wait_timeout: secs(p.query_wait_timeout),
            reset_query: p.server_reset_query.clone(),
            reset_timeout: secs(p.server_reset_timeout),
            max_prepared_statements: p.max_prepared_statements,
            stats_period: p.stats_period,
            client_idle_timeout: secs(p.client_idle_timeout),
            slow_query: secs(p.slow_query_threshold),
        }
    }
}

fn resolve_user(
    name: &str,
    u: UserSection,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<User, String> {
    let from_env = |var: &Option<String>, key: &str| -> Result<Option<String>, String> {
        match var {
            None => Ok(None),
            Some(v) => env(v)
                .map(Some)
                .ok_or_else(|| format!("users.{name}.{key} names {v}, which is not set")),
        }
    };
    let password = match (
        u.password.clone(),
        from_env(&u.password_env, "password_env")?,
    ) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "users.{name}: give either password or password_env, not both"
            ))
        }
        (a, b) => a.or(b),
    };
    let method = u.auth_method.unwrap_or(AuthMethod::ScramSha256);
    let auth = match (method, &password, &u.secret) {
        (AuthMethod::Trust, _, _) => ClientAuth::Trust,
        (AuthMethod::Cert, _, None) => ClientAuth::Cert,
        (AuthMethod::Cert, _, Some(_)) => {
            return Err(format!(
                "users.{name}: auth_method = \"cert\" takes no secret (the certificate is the credential)"
            ))
        }
        (_, Some(_), Some(_)) => {
            return Err(format!(
                "users.{name}: give either a password or a secret, not both"
            ))
        }
        (_, None, None) => {
            return Err(format!(
                "users.{name}: no password, password_env or secret (or set auth_method = \"trust\")"
            ))
        }
        (AuthMethod::ScramSha256, Some(p), None) => ClientAuth::Scram(Verifier::from_password(p)),
        (AuthMethod::Md5, Some(p), None) => ClientAuth::Md5(md5::stored_secret(name, p)),
        (AuthMethod::ScramSha256, None, Some(s)) => {
            ClientAuth::Scram(Verifier::parse(s).map_err(|e| format!("users.{name}.secret: {e}"))?)
        }
        (AuthMethod::Md5, None, Some(s)) if md5::is_stored_secret(s) => {
            ClientAuth::Md5(s.to_ascii_lowercase())
        }
        (AuthMethod::Md5, None, Some(_)) => {
            return Err(format!(
                "users.{name}.secret: md5 authentication needs an 'md5…' secret (35 characters)"
            ))
        }
    };
    let server_password = match (
        u.server_password.clone(),
        from_env(&u.server_password_env, "server_password_env")?,
    ) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "users.{name}: give either server_password or server_password_env, not both"
            ))
        }
        (a, b) => a.or(b).or(password),
    };
    Ok(User {
        name: name.to_owned(),
        auth,
        server_user: u.server_user.unwrap_or_else(|| name.to_owned()),
        server_password,
        client_tls: u.client_tls,
        passthrough: None,
        max_client_conn: None,
        pool_mode: u.pool_mode,
        pool_size: u.pool_size,
    })
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, column)
}

/// The line of a `[section]` header (1 if absent), so semantic errors point at the file.
fn section_line(text: &str, section: &str) -> usize {
    let quoted = section
        .split_once('.')
        .map(|(a, b)| format!("{a}.\"{b}\""))
        .unwrap_or_default();
    text.lines()
        .position(|l| {
            let t = l.trim();
            t == format!("[{section}]") || (!quoted.is_empty() && t == format!("[{quoted}]"))
        })
        .map_or(1, |i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn embedded_default_is_valid() {
        let c = Config::parse(EMBEDDED_DEFAULT, "default", &no_env).unwrap();
        assert!(!c.databases.is_empty());
        assert!(!c.users.is_empty());
    }

    #[test]
    fn syntax_errors_carry_line_and_column() {
        let err = Config::parse("[server]\nlisten = [\"nope\"]\n", "f.toml", &no_env).unwrap_err();
        let s = err.to_string();
        assert!(s.starts_with("f.toml:2:"), "{s}");
        let err = Config::parse("[pool]\nbogus = 1\n", "f.toml", &no_env).unwrap_err();
        assert!(err.to_string().contains("bogus"), "{err}");
    }

    #[test]
    fn semantic_errors_point_at_the_section() {
        let text = "[databases.app]\n\n[users.bob]\nauth_method = \"md5\"\n";
        let err = Config::parse(text, "f.toml", &no_env)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("f.toml:3:"), "{err}");
        assert!(err.contains("no password"), "{err}");
    }

    #[test]
    fn passwords_from_environment() {
        let text = "[users.bob]\npassword_env = \"BOB_PW\"\n";
        let env = |k: &str| (k == "BOB_PW").then(|| "pw".to_string());
        let c = Config::parse(text, "f", &env).unwrap();
        assert_eq!(c.users["bob"].server_password.as_deref(), Some("pw"));
        assert!(Config::parse(text, "f", &no_env).is_err());
    }

    #[test]
    fn overrides_layer() {
        let text = "[pool]\npool_size = 7\n[databases.a]\npool_mode = \"session\"\n[users.u]\nauth_method = \"trust\"\npool_size = 3\n";
        let c = Config::parse(text, "f", &no_env).unwrap();
        let s = c.pool_settings(&c.databases["a"], &c.users["u"]);
        assert_eq!(s.mode, PoolMode::Session);
        assert_eq!(s.size, 3);
        assert_eq!(c.databases["a"].dbname, "a");
    }
}
