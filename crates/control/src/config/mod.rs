//! The TOML configuration: validation with line numbers, the validated form the rest of
//! Shoal reads, and the embedded default used when no file is given. The sections as written
//! (schema and defaults) are in `sections` and `service`.
//!
//! Every key is documented in `docs/configuration.md`; keep the two in step.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use shoal_wire::{md5, scram::Verifier};

pub mod cache;
mod checks;
mod cluster;
pub mod duration;
pub mod limits;
pub mod pgbouncer;
pub mod reading;
pub mod replicas;
pub mod rules;
mod sections;
mod service;
pub mod words;
pub use cluster::{host_name, Cluster, ClusterSection, ClusterTls};
pub use sections::*;
pub use service::{
    AcceptPlain, AdminSection, ApiSection, MetricsSection, ServerlessSection, StoreSection,
    TenantsSection,
};

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
    /// Several problems, each on a line of its own, in the order of the file.
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"))]
    Several(Vec<ConfigError>),
}

impl ConfigError {
    /// One error for `problems` (at least one): itself when alone, else [`ConfigError::Several`].
    fn all(mut problems: Vec<ConfigError>) -> ConfigError {
        problems.sort_by_key(|p| match p {
            ConfigError::Syntax { line, .. } | ConfigError::Invalid { line, .. } => *line,
            _ => 0,
        });
        if problems.len() == 1 {
            problems.remove(0)
        } else {
            ConfigError::Several(problems)
        }
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
    realtime: Option<service::RealtimeSection>,
    store: Option<StoreSection>,
    #[serde(default)]
    tenants: TenantsSection,
    #[serde(default)]
    metrics: MetricsSection,
    #[serde(default)]
    admin: AdminSection,
    cluster: Option<ClusterSection>,
    serverless: Option<service::ServerlessSection>,
}

/// How Shoal checks a client's password. Secrets are kept only in the form the method needs.
#[derive(Clone)]
pub enum ClientAuth {
    /// Boxed: a login carries its `User`, and the verifier is most of one.
    Scram(Box<Verifier>),
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
    /// Overrides the database's `read_routing` (where it lists replicas).
    pub read_routing: Option<replicas::ReadRouting>,
    /// Query rules for this user, beside its database's (shared: a login carries a `User`,
    /// and few have rules).
    pub rules: Option<std::sync::Arc<Vec<rules::Rule>>>,
    /// Turns the database's result cache off (or on) for this user.
    pub cache: Option<bool>,
    /// The user's own rate and concurrency limits (shared: a login carries a `User`).
    pub limits: Option<std::sync::Arc<limits::Limits>>,
    /// Overrides the database's and `[tls] client_tls` for this user.
    pub client_tls: Option<ClientTls>,
    /// Upstream login without a password (users found by auth_query).
    pub passthrough: Option<std::sync::Arc<Passthrough>>,
    /// Overrides the database's `max_client_conn` (tenant users' `max_clients`).
    pub max_client_conn: Option<usize>,
    /// Presented to PostgreSQL instead of the database's client certificate (boxed: a
    /// login carries a `User`, and few have one).
    pub upstream_cert: Option<Box<UpstreamCert>>,
}

impl User {
    /// A user known only by name and check (auth_query's, a refused login's): it logs in
    /// upstream as itself, with nothing configured.
    pub fn named(name: &str, auth: ClientAuth) -> User {
        User {
            name: name.to_owned(),
            auth,
            server_user: name.to_owned(),
            server_password: None,
            pool_mode: None,
            pool_size: None,
            read_routing: None,
            rules: None,
            cache: None,
            limits: None,
            client_tls: None,
            passthrough: None,
            max_client_conn: None,
            upstream_cert: None,
        }
    }
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
    /// Overrides `[pool] server_reset`.
    pub server_reset: Option<ServerReset>,
    /// Read replicas, and which reads go to them.
    pub replicas: replicas::Replicas,
    /// Query rules for every client of this database.
    pub rules: Vec<rules::Rule>,
    /// The result cache of its pools.
    pub cache: cache::Cache,
    /// Limits on all its clients together.
    pub limits: limits::Limits,
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
    /// The realtime WebSocket service (`None`: off).
    pub realtime: Option<service::RealtimeSection>,
    pub store: Option<StoreSection>,
    pub tenants: TenantsSection,
    pub metrics: MetricsSection,
    pub admin: AdminSection,
    /// This node's cluster (`None`: a single node).
    pub cluster: Option<Cluster>,
    /// The WebSocket front door for serverless drivers (`None`: off).
    pub serverless: Option<ServerlessSection>,
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
    /// When a transaction-mode server is cleaned before another client gets it.
    pub server_reset: ServerReset,
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
    /// The database's (or tenant's) `max_statement_timeout`: servers start with it, and a
    /// request running past it is cancelled.
    pub statement_timeout: Option<Duration>,
}

/// The `[databases."*"]` entry: where a database name no other entry lists goes, with the
/// client's database name passed through (PgBouncer's `*`).
pub const WILDCARD_DATABASE: &str = "*";

impl Config {
    /// The database a client's name reaches through `[databases."*"]`, when no entry lists
    /// it: the wildcard's settings, named and connecting as the client asked.
    pub fn wildcard_database(&self, name: &str) -> Option<Database> {
        if name == WILDCARD_DATABASE || name.is_empty() || self.databases.contains_key(name) {
            return None;
        }
        let mut db = self.databases.get(WILDCARD_DATABASE)?.clone();
        db.name = name.to_owned();
        db.dbname = name.to_owned();
        Some(db)
    }
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
        let doc: toml::Table = toml::from_str(text).map_err(|e| {
            let (line, column) = e.span().map(|s| line_col(text, s.start)).unwrap_or((1, 1));
            ConfigError::Syntax {
                origin: origin.to_owned(),
                line,
                column,
                message: e.message().to_owned(),
            }
        })?;
        // Every key serde refuses, then every rule the rest breaks: all told in one run.
        let (raw, refused) = reading::read_every::<RawConfig, _>(&toml::Value::Table(doc));
        let mut problems = Problems {
            text,
            origin,
            refused: refused
                .iter()
                .filter(|p| !p.unknown_key)
                .map(reading::Problem::path_text)
                .collect(),
            list: refused
                .iter()
                .map(|p| ConfigError::Invalid {
                    origin: origin.to_owned(),
                    line: reading::toml_line(text, &p.path).unwrap_or(1),
                    message: format!("{}: {}", p.path_text(), p.message),
                })
                .collect(),
        };
        let Some(raw) = raw else {
            return Err(ConfigError::all(problems.list));
        };
        checks::server(&raw, &mut problems);
        let mut databases = BTreeMap::new();
        for (name, d) in raw.databases {
            if let Some(d) = checks::database(name, d, env, &mut problems) {
                databases.insert(d.name.clone(), d);
            }
        }
        let mut users = BTreeMap::new();
        for (name, u) in raw.users {
            let section = format!("users.{name}");
            match resolve_user(&name, u, env) {
                Ok(user) => {
                    users.insert(name, user);
                }
                Err(m) => problems.add(&section, m),
            }
        }
        checks::tls_and_auth(&raw.tls, &databases, &users, &mut problems);
        if let Some(bad) = databases.keys().find(|n| n.contains(':')) {
            problems.add(
                "databases",
                format!("database name \"{bad}\" contains ':', which Shoal keeps for tenants"),
            );
        }
        let listen_port = raw.server.listen.first().map(|a| a.port());
        let cluster = match raw.cluster.map(|c| c.resolve(listen_port, env)) {
            Some(Ok(c)) => Some(c),
            Some(Err(m)) => {
                problems.add("cluster", m);
                None
            }
            None => None,
        };
        if let Some(rt) = &raw.realtime {
            checks::realtime(rt, &mut problems);
        }
        // The API needs a store; a store alone serves the tenants it holds.
        let store = raw
            .store
            .or_else(|| raw.api.as_ref().map(|_| StoreSection::default()));
        if !problems.list.is_empty() {
            return Err(ConfigError::all(problems.list));
        }
        Ok(Config {
            server: raw.server,
            tls: raw.tls,
            pool: raw.pool,
            databases,
            users,
            api: raw.api,
            realtime: raw.realtime,
            store,
            tenants: raw.tenants,
            metrics: raw.metrics,
            admin: raw.admin,
            cluster,
            serverless: raw.serverless,
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
            server_reset: db.server_reset.unwrap_or(p.server_reset),
            reset_timeout: secs(p.server_reset_timeout),
            max_prepared_statements: p.max_prepared_statements,
            stats_period: p.stats_period,
            client_idle_timeout: secs(p.client_idle_timeout),
            slow_query: secs(p.slow_query_threshold),
            statement_timeout: db.limits.statement_timeout,
        }
    }
}

/// `sslpassword` or the variable `sslpassword_env` names (not both).
fn key_password(
    section: &str,
    inline: &Option<String>,
    var: &Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<KeyPassword>, String> {
    let from_env = match var {
        None => None,
        Some(v) => Some(
            env(v)
                .ok_or_else(|| format!("{section}.sslpassword_env names {v}, which is not set"))?,
        ),
    };
    match (inline, from_env) {
        (Some(_), Some(_)) => Err(format!(
            "{section}: give either sslpassword or sslpassword_env, not both"
        )),
        (a, b) => Ok(a.clone().or(b).map(KeyPassword)),
    }
}

/// The TLS settings a user's server logins use: its database's, with the user's own client
/// certificate when it has one.
pub fn upstream_tls_for(db: &Database, user: &User) -> UpstreamTlsSettings {
    let mut tls = db.tls.clone();
    if let Some(c) = &user.upstream_cert {
        tls.cert = Some(c.cert.clone());
        tls.key = Some(c.key.clone());
        tls.key_password = c.key_password.clone();
    }
    tls
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
        (AuthMethod::ScramSha256, Some(p), None) => {
            ClientAuth::Scram(Box::new(Verifier::from_password(p)))
        }
        (AuthMethod::Md5, Some(p), None) => ClientAuth::Md5(md5::stored_secret(name, p)),
        (AuthMethod::ScramSha256, None, Some(s)) => {
            ClientAuth::Scram(Box::new(
                Verifier::parse(s).map_err(|e| format!("users.{name}.secret: {e}"))?,
            ))
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
    let section = format!("users.{name}");
    let upstream_cert = match (u.sslcert, u.sslkey) {
        (Some(cert), Some(key)) => Some(Box::new(UpstreamCert {
            cert,
            key,
            key_password: key_password(&section, &u.sslpassword, &u.sslpassword_env, env)?,
        })),
        (None, None) if u.sslpassword.is_none() && u.sslpassword_env.is_none() => None,
        _ => {
            return Err(format!(
                "{section}: sslcert and sslkey go together (sslpassword only with them)"
            ))
        }
    };
    Ok(User {
        name: name.to_owned(),
        auth,
        upstream_cert,
        server_user: u.server_user.unwrap_or_else(|| name.to_owned()),
        server_password,
        client_tls: u.client_tls,
        passthrough: None,
        max_client_conn: None,
        pool_mode: u.pool_mode,
        pool_size: u.pool_size,
        read_routing: u.read_routing,
        cache: u.cache,
        limits: user_limits(&section, u.rate_limit, u.rate_burst, u.max_concurrency)?,
        rules: Some(rules::validate(&format!("users.{name}.rules"), &u.rules)?)
            .filter(|r| !r.is_empty())
            .map(std::sync::Arc::new),
    })
}

/// A user's own limits (`None` when it has none).
pub fn user_limits(
    section: &str,
    rate_limit: Option<f64>,
    rate_burst: Option<f64>,
    max_concurrency: Option<usize>,
) -> Result<Option<std::sync::Arc<limits::Limits>>, String> {
    let l = limits::validate(
        section,
        &limits::LimitKeys {
            rate_limit,
            rate_burst,
            max_concurrency,
            ..Default::default()
        },
    )?;
    Ok(l.any().then(|| std::sync::Arc::new(l)))
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
    (line, column)
}

/// The problems found in one file, in the order found.
struct Problems<'a> {
    text: &'a str,
    origin: &'a str,
    /// The paths of the keys serde refused (`server.listen[0]`).
    refused: Vec<String>,
    list: Vec<ConfigError>,
}

impl Problems<'_> {
    /// A rule `section` breaks. A section with a refused key is read without it, so what
    /// its rules say then follows from the refusal (an address refused leaves nothing to
    /// listen on): it is not told twice.
    fn add(&mut self, section: &str, message: String) {
        let follows = self.refused.iter().any(|r| {
            r == section
                || r.strip_prefix(section)
                    .is_some_and(|rest| rest.starts_with(['.', '[']))
        });
        if !follows {
            self.list.push(ConfigError::Invalid {
                origin: self.origin.to_owned(),
                line: section_line(self.text, section),
                message,
            });
        }
    }
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
mod tests;
