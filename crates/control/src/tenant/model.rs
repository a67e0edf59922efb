//! A tenant as operators write it: Supavisor's JSON field names and meanings (its provisioning
//! scripts work unchanged), plus a few optional fields of Shoal's. Pure data and validation;
//! no I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::replicas::{
    MaxLagSection, ReadRouting, ReplicaFallback, ReplicaKeys, ReplicaSection, Replicas,
};
use crate::config::PoolMode;

/// Supavisor's defaults.
pub const DEFAULT_POOL_SIZE: usize = 15;
pub const DEFAULT_MAX_CLIENTS: usize = 1000;

/// One tenant: a database on a PostgreSQL server, who may use it, and how.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Tenant {
    /// Taken from the URL; a body may repeat it (it must then match).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub external_id: String,
    #[serde(default)]
    pub db_host: String,
    #[serde(default = "default_port")]
    pub db_port: u16,
    #[serde(default)]
    pub db_database: String,
    #[serde(default)]
    pub ip_version: IpVersion,
    /// `true`: only the listed users may log in. `false`: other users are looked up with
    /// `auth_query`, run as the manager user.
    #[serde(default)]
    pub require_user: bool,
    #[serde(default)]
    pub auth_query: Option<String>,
    #[serde(default)]
    pub users: Vec<TenantUser>,
    #[serde(default)]
    pub default_pool_size: Option<usize>,
    #[serde(default)]
    pub default_max_clients: Option<usize>,
    /// Seconds an idle client may stay connected (0: forever).
    #[serde(default, deserialize_with = "crate::config::duration::whole_seconds")]
    pub client_idle_timeout: u64,
    /// Connect to PostgreSQL over TLS.
    #[serde(default)]
    pub upstream_ssl: bool,
    /// `peer`: verify the server's certificate (against `upstream_tls_ca`); `none`: don't.
    #[serde(default)]
    pub upstream_verify: Option<UpstreamVerify>,
    /// PEM CA certificate(s) for `upstream_verify = "peer"`.
    #[serde(default)]
    pub upstream_tls_ca: Option<String>,
    /// Clients must use TLS.
    #[serde(default)]
    pub enforce_ssl: bool,
    /// Clients connecting with this TLS server name reach this tenant.
    #[serde(default)]
    pub sni_hostname: Option<String>,
    /// CIDRs clients may connect from.
    #[serde(default = "default_allow_list")]
    pub allow_list: Vec<String>,
    #[serde(default)]
    pub banned: bool,
    #[serde(default)]
    pub ban_reason: Option<String>,
    /// RFC 3339 time the ban ends.
    #[serde(default)]
    pub banned_until: Option<String>,
    /// ParameterStatus values reported to clients before a server has been reached.
    #[serde(default)]
    pub default_parameter_status: BTreeMap<String, String>,
    #[serde(default)]
    pub feature_flags: serde_json::Map<String, serde_json::Value>,
    /// Shoal: seconds a secret found by auth_query is trusted (default 10).
    #[serde(default, deserialize_with = "crate::config::duration::opt_seconds")]
    pub auth_query_cache_ttl: Option<f64>,
    /// Shoal: `always` cleans a server before every other client gets it (see
    /// `[pool] server_reset`); default `[pool]`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_reset: Option<crate::config::ServerReset>,
    /// Shoal: read replicas of the tenant's database (see `docs/replicas.md`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<TenantReplica>,
    /// Shoal: `primary` (default), `split` or `replicas`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_routing: Option<ReadRouting>,
    /// Shoal: as `[databases.NAME] max_replica_lag` (`"5s"`, `"16MB"`, seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_replica_lag: Option<MaxLagSection>,
    /// Shoal: `primary` (default) or `error`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_fallback: Option<ReplicaFallback>,
    /// Shoal: query rules for every client of the tenant (as `[[databases.NAME.rules]]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub query_rules: Vec<crate::config::rules::RuleSection>,
    /// Shoal: the result cache, as `[databases.NAME] cache` and its keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<bool>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::config::duration::opt_text"
    )]
    pub cache_ttl: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_all_reads: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cache_fingerprints: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_max_memory: Option<String>,
    /// Shoal: limits on all the tenant's clients together (as `[databases.NAME]`'s).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::config::duration::opt_text"
    )]
    pub max_statement_timeout: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_burst: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<usize>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::config::duration::opt_text"
    )]
    pub limit_wait: Option<String>,
    /// Realtime: the secret the tenant's JWTs are signed with (HS256/384/512); realtime is
    /// on for the tenant when it has one. Write-only: never serialized back out of the API
    /// (the store seals it at rest).
    #[serde(default, skip_serializing)]
    pub jwt_secret: Option<String>,
    /// Realtime: a JWK set whose keys (picked by a token's `kid`) verify the tenant's
    /// RS/PS/ES/EdDSA tokens, or HS ones with `oct` keys. Write-only and sealed at rest,
    /// like `jwt_secret` (an `oct` key is a secret).
    #[serde(default, skip_serializing)]
    pub jwt_jwks: Option<serde_json::Value>,
    /// Realtime: channels one socket may join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_channels_per_client: Option<usize>,
    /// Realtime: the largest broadcast payload, in KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_payload_size_in_kb: Option<usize>,
    /// Realtime: sockets connected at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_users: Option<usize>,
    /// Realtime: messages from clients per second, all sockets together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_events_per_second: Option<u32>,
    /// Realtime: channel joins per second, all sockets together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_joins_per_second: Option<u32>,
    /// Realtime: bytes of broadcast payloads from clients per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes_per_second: Option<u64>,
    /// Realtime: only private channels may be joined.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub private_only: bool,
}

/// Checks that `jwks` is a JWK set of keys with a `kid` each that tokens can be verified
/// with; the reason when it is not.
pub fn check_jwks(jwks: &serde_json::Value) -> Result<(), String> {
    use jsonwebtoken::jwk::Jwk;
    let keys = jwks
        .get("keys")
        .and_then(|k| k.as_array())
        .ok_or("must be a JWK set: {\"keys\": [...]}")?;
    if keys.is_empty() {
        return Err("has no keys".into());
    }
    for (i, k) in keys.iter().enumerate() {
        let jwk = serde_json::from_value::<Jwk>(k.clone())
            .map_err(|e| format!("keys[{i}] is not a JWK Shoal can use: {e}"))?;
        if jwk.common.key_id.is_none() {
            return Err(format!(
                "keys[{i}] has no kid (tokens pick their key by kid)"
            ));
        }
        jsonwebtoken::DecodingKey::from_jwk(&jwk).map_err(|e| format!("keys[{i}]: {e}"))?;
    }
    Ok(())
}

impl Tenant {
    /// The tenant's limits, validated as a config database's are.
    pub fn limits(&self) -> Result<crate::config::limits::Limits, String> {
        crate::config::limits::validate(
            "tenant",
            &crate::config::limits::LimitKeys {
                max_statement_timeout: self.max_statement_timeout.as_deref(),
                rate_limit: self.rate_limit,
                rate_burst: self.rate_burst,
                max_concurrency: self.max_concurrency,
                limit_wait: self.limit_wait.as_deref(),
            },
        )
    }

    /// The tenant's result cache, validated as a config database's is.
    pub fn cache(&self) -> Result<crate::config::cache::Cache, String> {
        crate::config::cache::validate(
            "tenant",
            &crate::config::cache::CacheKeys {
                cache: self.cache,
                cache_ttl: self.cache_ttl.as_deref(),
                cache_all_reads: self.cache_all_reads,
                cache_fingerprints: &self.cache_fingerprints,
                cache_max_memory: self.cache_max_memory.as_deref(),
            },
        )
    }
}

/// A read replica of a tenant's database.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TenantReplica {
    pub db_host: String,
    #[serde(default = "default_port")]
    pub db_port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zone: Option<String>,
}

impl Tenant {
    /// The tenant's replicas, validated as a config database's are.
    pub fn replicas(&self) -> Result<Replicas, String> {
        let hosts: Vec<ReplicaSection> = self
            .replicas
            .iter()
            .map(|r| ReplicaSection {
                host: r.db_host.clone(),
                port: r.db_port,
                weight: r.weight.unwrap_or(1),
                zone: r.zone.clone(),
            })
            .collect();
        crate::config::replicas::validate(
            "tenant",
            &ReplicaKeys {
                replicas: &hosts,
                read_routing: self.read_routing,
                max_replica_lag: self.max_replica_lag.as_ref(),
                replica_fallback: self.replica_fallback,
                replica_check_interval: None,
                replica_ban_time: None,
                prefer_zone: None,
            },
        )
    }
}

/// A user of a tenant.
#[derive(Clone, Serialize, Deserialize, PartialEq)]
pub struct TenantUser {
    #[serde(default)]
    pub db_user: String,
    /// Write-only: never serialized back out of the API.
    #[serde(default, skip_serializing)]
    pub db_password: Option<String>,
    #[serde(default)]
    pub pool_size: Option<usize>,
    #[serde(default)]
    pub mode_type: ModeType,
    #[serde(default)]
    pub max_clients: Option<usize>,
    /// The user that runs `auth_query`.
    #[serde(default)]
    pub is_manager: bool,
    /// Shoal: overrides the tenant's `read_routing` for this user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_routing: Option<ReadRouting>,
    /// Shoal: this user's own limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_burst: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<usize>,
}

impl std::fmt::Debug for TenantUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantUser")
            .field("db_user", &self.db_user)
            .field("is_manager", &self.is_manager)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum IpVersion {
    #[default]
    Auto,
    V4,
    V6,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ModeType {
    #[default]
    Transaction,
    Session,
}

impl From<ModeType> for PoolMode {
    fn from(m: ModeType) -> PoolMode {
        match m {
            ModeType::Transaction => PoolMode::Transaction,
            ModeType::Session => PoolMode::Session,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamVerify {
    None,
    Peer,
}

fn default_port() -> u16 {
    5432
}

fn default_allow_list() -> Vec<String> {
    vec!["0.0.0.0/0".into(), "::/0".into()]
}

/// What is wrong with a tenant, field by field (`users[0].db_user`, …).
pub type FieldErrors = BTreeMap<String, Vec<String>>;

/// A tenant id usable as a DNS label (SNI) and a user-name suffix: lowercase letters, digits
/// and hyphens, 1–63 characters, not starting or ending with a hyphen.
pub fn valid_external_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-')
}

impl Tenant {
    /// A tenant as the API's JSON gives it, with every problem at once: each field whose
    /// value is refused (in words: "a port between 1 and 65535, not \"x\""), and every rule
    /// the other fields break. A field that follows from a refused one is not told twice.
    /// `id` is the tenant's id from the URL, which a body need not repeat.
    pub fn from_json(v: &serde_json::Value, id: &str) -> Result<Tenant, FieldErrors> {
        let (got, mut errors) = Tenant::read_json(v);
        let Some(mut t) = got else {
            return Err(errors);
        };
        if t.external_id.is_empty() {
            t.external_id = id.to_owned();
        }
        let refused: Vec<String> = errors.keys().cloned().collect();
        if let Err(more) = t.validate() {
            for (field, messages) in more {
                let follows = refused.iter().any(|r| {
                    r == &field
                        || field.starts_with(&format!("{r}."))
                        || field.starts_with(&format!("{r}["))
                });
                if !follows {
                    errors.entry(field).or_default().extend(messages);
                }
            }
        }
        if errors.is_empty() {
            Ok(t)
        } else {
            Err(errors)
        }
    }

    /// The tenant the JSON's readable fields make, if they make one, and every field whose
    /// value is refused; no rule checked yet (see [`Tenant::validate`]).
    pub fn read_json(v: &serde_json::Value) -> (Option<Tenant>, FieldErrors) {
        let (got, refused) = crate::config::reading::read_every::<Tenant, _>(v);
        let mut errors = FieldErrors::new();
        for p in &refused {
            errors
                .entry(p.path_text())
                .or_default()
                .push(p.message.clone());
        }
        (got, errors)
    }

    /// Checks every field; the errors name the fields.
    pub fn validate(&self) -> Result<(), FieldErrors> {
        let mut errors = FieldErrors::new();
        let mut add = |field: &str, msg: &str| {
            errors
                .entry(field.to_owned())
                .or_default()
                .push(msg.to_owned())
        };
        if !valid_external_id(&self.external_id) {
            add(
                "external_id",
                "must be 1-63 lowercase letters, digits or hyphens, not starting or ending with a hyphen",
            );
        }
        self.check_upstream(&mut add);
        self.check_users(&mut add);
        self.check_defaults(&mut add);
        self.check_upstream_tls(&mut add);
        self.check_realtime(&mut add);
        self.check_access(&mut add);
        self.check_features(&mut add);
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// Where the tenant's PostgreSQL is.
    fn check_upstream(&self, add: &mut impl FnMut(&str, &str)) {
        if self.db_host.trim().is_empty() {
            add("db_host", "can't be blank");
        } else if self.db_host.len() > 253 || self.db_host.contains(['/', ' ', '\0']) {
            add("db_host", "is not a host name or address");
        }
        if self.db_port == 0 {
            add("db_port", "must be between 1 and 65535");
        }
        if self.db_database.is_empty() {
            add("db_database", "can't be blank");
        } else if self.db_database.len() > 63 || self.db_database.contains('\0') {
            add("db_database", "is not a PostgreSQL database name");
        }
    }

    /// The users: names, passwords, sizes, and the one that runs `auth_query`.
    fn check_users(&self, add: &mut impl FnMut(&str, &str)) {
        if self.users.is_empty() {
            add("users", "at least one user is needed");
        }
        if self.users.len() > 1000 {
            add("users", "at most 1000 users");
        }
        let mut seen = std::collections::BTreeSet::new();
        for (i, u) in self.users.iter().enumerate() {
            let f = |name: &str| format!("users[{i}].{name}");
            if u.db_user.is_empty() || u.db_user.len() > 63 || u.db_user.contains('\0') {
                add(&f("db_user"), "must be 1-63 characters");
            } else if !seen.insert(u.db_user.as_str()) {
                add(&f("db_user"), "is listed twice");
            }
            match &u.db_password {
                None => add(&f("db_password"), "can't be blank"),
                Some(p) if p.is_empty() || p.len() > 1024 || p.contains('\0') => {
                    add(&f("db_password"), "must be 1-1024 characters")
                }
                Some(_) => {}
            }
            if u.pool_size == Some(0) || u.pool_size.is_some_and(|n| n > 10_000) {
                add(&f("pool_size"), "must be between 1 and 10000");
            }
            if u.max_clients == Some(0) {
                add(&f("max_clients"), "must be at least 1");
            }
        }
        let managers = self.users.iter().filter(|u| u.is_manager).count();
        if !self.require_user && managers == 0 {
            add(
                "users",
                "require_user is false: one user must be is_manager (it runs auth_query)",
            );
        }
        if managers > 1 {
            add("users", "at most one user may be is_manager");
        }
    }

    /// The defaults for users and `auth_query`.
    fn check_defaults(&self, add: &mut impl FnMut(&str, &str)) {
        if self.default_pool_size == Some(0) || self.default_pool_size.is_some_and(|n| n > 10_000) {
            add("default_pool_size", "must be between 1 and 10000");
        }
        if self.default_max_clients == Some(0) {
            add("default_max_clients", "must be at least 1");
        }
        if let Some(q) = &self.auth_query {
            if q.trim().is_empty() || q.len() > 4096 {
                add("auth_query", "must be a query of 1-4096 characters");
            }
        }
    }

    /// TLS to the tenant's PostgreSQL.
    fn check_upstream_tls(&self, add: &mut impl FnMut(&str, &str)) {
        if self.upstream_verify == Some(UpstreamVerify::Peer) {
            if !self.upstream_ssl {
                add("upstream_verify", "\"peer\" needs upstream_ssl = true");
            }
            match &self.upstream_tls_ca {
                None => add(
                    "upstream_tls_ca",
                    "can't be blank when upstream_verify is \"peer\"",
                ),
                Some(pem) if !pem.contains("-----BEGIN CERTIFICATE-----") => {
                    add("upstream_tls_ca", "is not a PEM certificate")
                }
                Some(_) => {}
            }
        }
        if let Some(sni) = &self.sni_hostname {
            let ok = !sni.is_empty()
                && sni.len() <= 253
                && sni
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
            if !ok {
                add("sni_hostname", "is not a host name");
            }
        }
    }

    /// Realtime: JWT keys and the per-tenant limits.
    fn check_realtime(&self, add: &mut impl FnMut(&str, &str)) {
        if let Some(jwks) = &self.jwt_jwks {
            if let Err(why) = check_jwks(jwks) {
                add("jwt_jwks", &why);
            }
        }
        if self
            .jwt_secret
            .as_ref()
            .is_some_and(|s| s.is_empty() || s.len() > 4096)
        {
            add("jwt_secret", "must be 1-4096 characters");
        }
        for (field, zero) in [
            (
                "max_channels_per_client",
                self.max_channels_per_client == Some(0),
            ),
            (
                "max_payload_size_in_kb",
                self.max_payload_size_in_kb == Some(0),
            ),
            ("max_concurrent_users", self.max_concurrent_users == Some(0)),
            (
                "max_events_per_second",
                self.max_events_per_second == Some(0),
            ),
            ("max_joins_per_second", self.max_joins_per_second == Some(0)),
            ("max_bytes_per_second", self.max_bytes_per_second == Some(0)),
        ] {
            if zero {
                add(field, "must be at least 1 (leave it out for no limit)");
            }
        }
    }

    /// Who may connect: the allow list and a ban.
    fn check_access(&self, add: &mut impl FnMut(&str, &str)) {
        if self.allow_list.is_empty() {
            add(
                "allow_list",
                "at least one CIDR is needed (0.0.0.0/0 and ::/0 allow all)",
            );
        }
        for (i, c) in self.allow_list.iter().enumerate() {
            if c.parse::<ipnet::IpNet>().is_err() {
                add(
                    &format!("allow_list[{i}]"),
                    "is not a CIDR (e.g. 10.0.0.0/8)",
                );
            }
        }
        if let Some(t) = &self.banned_until {
            if humantime::parse_rfc3339_weak(t).is_err() {
                add(
                    "banned_until",
                    "is not an RFC 3339 time (e.g. 2030-01-01T00:00:00Z)",
                );
            }
        }
        if let Some(r) = &self.ban_reason {
            if r.len() > 1024 {
                add("ban_reason", "at most 1024 characters");
            }
        }
        if self
            .auth_query_cache_ttl
            .is_some_and(|t| !(0.0..=86_400.0).contains(&t))
        {
            add(
                "auth_query_cache_ttl",
                "must be between 0 and 86400 seconds",
            );
        }
        for (k, v) in &self.default_parameter_status {
            if k.is_empty() || k.contains('\0') || v.contains('\0') || k.len() + v.len() > 1024 {
                add(
                    "default_parameter_status",
                    "names and values must be short text",
                );
                break;
            }
        }
    }

    /// Replicas, query rules, limits and the cache, checked as the config file's are.
    fn check_features(&self, add: &mut impl FnMut(&str, &str)) {
        if let Err(e) = self.replicas() {
            add("replicas", e.trim_start_matches("tenant."));
        }
        if let Err(e) = crate::config::rules::validate("query_rules", &self.query_rules) {
            add("query_rules", &e);
        }
        for (field, e) in
            [("limits", self.limits().err())]
                .into_iter()
                .chain(self.users.iter().map(|u| {
                    (
                        "users",
                        crate::config::user_limits(
                            "users",
                            u.rate_limit,
                            u.rate_burst,
                            u.max_concurrency,
                        )
                        .err(),
                    )
                }))
        {
            if let Some(e) = e {
                let e = e.trim_start_matches("tenant.");
                let key = e.split(':').next().unwrap_or(field);
                add(key, e.split_once(": ").map_or(e, |(_, m)| m));
            }
        }
        if let Err(e) = self.cache() {
            let e = e.trim_start_matches("tenant.");
            let field = e.split(':').next().unwrap_or("cache");
            add(field, e.split_once(": ").map_or(e, |(_, m)| m));
        }
    }

    /// Whether a ban is in force at `now` (seconds since the epoch).
    pub fn banned_at(&self, now: std::time::SystemTime) -> bool {
        if !self.banned {
            return false;
        }
        match self
            .banned_until
            .as_deref()
            .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
        {
            Some(until) => now < until,
            None => true,
        }
    }

    /// The manager user (runs auth_query).
    pub fn manager(&self) -> Option<&TenantUser> {
        self.users.iter().find(|u| u.is_manager)
    }
}

#[cfg(test)]
mod tests;
