//! The rules a read configuration must keep beyond its types, section by section: each adds
//! what it finds to the [`Problems`] of the whole file, so one run tells every mistake.

use std::collections::BTreeMap;

use super::{
    cache, key_password, limits, replicas, rules, secs, service, AuthQuery, ClientAuth, ClientTls,
    Database, DatabaseSection, IpFamily, Problems, RawConfig, TlsSection, UpstreamTlsSettings,
    User, DEFAULT_AUTH_QUERY, WILDCARD_DATABASE,
};

/// `[server]` and `[pool]`: something to listen on, sizes, durations, shard packing.
pub(super) fn server(raw: &RawConfig, problems: &mut Problems<'_>) {
    let s = &raw.server;
    if s.listen.is_empty() && s.unix_socket_dir.is_none() {
        problems.add(
            "server",
            "nothing to listen on: set server.listen or server.unix_socket_dir".into(),
        );
    }
    if s.max_packet_size < 1024 {
        problems.add(
            "server",
            "server.max_packet_size must be at least 1024 bytes".into(),
        );
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
            problems.add("server", format!("{key} must be a number of seconds ≥ 0"));
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
        problems.add(
            "server",
            "server.shard_open_busy must be in (0, 1], server.shard_close_busy in [0, shard_open_busy) and server.shard_open_idle_cores ≥ 0".into(),
        );
    }
    if raw.pool.pool_size == 0 {
        problems.add("pool", "pool.pool_size must be at least 1".into());
    }
}

/// One `[databases.NAME]` section as the database it configures, or `None` (its problems
/// added) when a part of it is wrong.
pub(super) fn database(
    name: String,
    d: DatabaseSection,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Problems<'_>,
) -> Option<Database> {
    let section = format!("databases.{name}");
    if name == WILDCARD_DATABASE && d.dbname.is_some() {
        problems.add(
            &section,
            format!("{section}.dbname cannot be set: the wildcard database passes the client's database name through"),
        );
    }
    if d.pool_size == Some(0) {
        problems.add(&section, format!("{section}.pool_size must be at least 1"));
    }
    let key_password = key_password(&section, &d.sslpassword, &d.sslpassword_env, env);
    let replicas = replicas::validate(&section, &d.replica_keys());
    let rules = rules::validate(&format!("{section}.rules"), &d.rules);
    let cache = cache::validate(&section, &d.cache_keys());
    let limits = limits::validate(&section, &d.limit_keys());
    let (key_password, replicas, rules, cache, limits) =
        match (key_password, replicas, rules, cache, limits) {
            (Ok(k), Ok(r), Ok(ru), Ok(c), Ok(l)) => (k, r, ru, c, l),
            (k, r, ru, c, l) => {
                let errors = [k.err(), r.err(), ru.err(), c.err(), l.err()];
                for m in errors.into_iter().flatten() {
                    problems.add(&section, m);
                }
                return None;
            }
        };
    Some(Database {
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
            key_password,
            sni: d.sslsni,
        },
        name,
        host: d.host,
        port: d.port,
        pool_mode: d.pool_mode,
        pool_size: d.pool_size,
        min_pool_size: d.min_pool_size,
        max_client_conn: d.max_client_conn,
        server_reset: d.server_reset,
        replicas,
        rules,
        cache,
        limits,
    })
}

/// `[tls]` against what the databases and users ask of it, and each `auth_user` against the
/// users.
pub(super) fn tls_and_auth(
    t: &TlsSection,
    databases: &BTreeMap<String, Database>,
    users: &BTreeMap<String, User>,
    problems: &mut Problems<'_>,
) {
    if t.cert_file.is_some() != t.key_file.is_some() {
        problems.add("tls", "tls.cert_file and tls.key_file go together".into());
    }
    let overrides_need_tls = databases
        .values()
        .map(|d| d.client_tls)
        .chain(users.values().map(|u| u.client_tls))
        .any(|m| m.is_some_and(|m| m != ClientTls::Disable));
    if (t.mode() != ClientTls::Disable || overrides_need_tls) && t.cert_file.is_none() {
        problems.add(
            "tls",
            "tls.client_tls needs a certificate: set tls.cert_file and tls.key_file".into(),
        );
    }
    for d in databases.values() {
        if let Some(aq) = &d.auth_query {
            if !users.contains_key(&aq.user) {
                problems.add(
                    &format!("databases.{}", d.name),
                    format!(
                        "databases.{}.auth_user: \"{}\" is not a configured user",
                        d.name, aq.user
                    ),
                );
            }
        }
    }
    if t.ca_file.is_none() {
        if let Some((name, _)) = users
            .iter()
            .find(|(_, u)| matches!(u.auth, ClientAuth::Cert))
        {
            problems.add(
                &format!("users.{name}"),
                format!("users.{name}: auth_method = \"cert\" needs tls.ca_file"),
            );
        }
    }
}

/// `[realtime]`'s durations.
pub(super) fn realtime(rt: &service::RealtimeSection, problems: &mut Problems<'_>) {
    if !(rt.heartbeat_timeout.is_finite() && (1.0..=86_400.0).contains(&rt.heartbeat_timeout)) {
        problems.add(
            "realtime",
            "realtime.heartbeat_timeout must be between 1 and 86400 seconds".into(),
        );
    }
    if !(rt.resume_window.is_finite() && (0.0..=3_600.0).contains(&rt.resume_window)) {
        problems.add(
            "realtime",
            "realtime.resume_window must be between 0 and 3600 seconds".into(),
        );
    }
}
