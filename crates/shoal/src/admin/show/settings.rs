//! `SHOW DATABASES`, `USERS` and `CONFIG`: what Shoal was told.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{n, t, Int, ResultSet, Text};
use crate::app::App;
use crate::pool::Pool;

pub fn databases(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("name", Text),
        ("host", Text),
        ("port", Int),
        ("database", Text),
        ("force_user", Text),
        ("pool_size", Int),
        ("min_pool_size", Int),
        ("reserve_pool", Int),
        ("server_lifetime", Int),
        ("pool_mode", Text),
        ("max_connections", Int),
        ("current_connections", Int),
        ("paused", Int),
        ("disabled", Int),
    ]);
    let config = app.routes.config();
    let pools = app.routes.pools();
    let current = |name: &str| -> (usize, bool) {
        let mine: Vec<&Arc<Pool>> = pools.iter().filter(|p| p.database() == name).collect();
        (
            mine.iter()
                .map(|p| p.stats.servers.load(Ordering::Relaxed))
                .sum(),
            !mine.is_empty() && mine.iter().all(|p| p.is_paused()),
        )
    };
    for d in config.databases.values() {
        let (conns, paused) = current(&d.name);
        r.row(vec![
            t(d.name.clone()),
            t(d.host.clone()),
            n(d.port),
            t(d.dbname.clone()),
            None,
            n(d.pool_size.unwrap_or(config.pool.pool_size)),
            n(d.min_pool_size.unwrap_or(config.pool.min_pool_size)),
            n(0),
            n(config.pool.server_lifetime as u64),
            t(d.pool_mode.unwrap_or(config.pool.pool_mode).name()),
            n(0),
            n(conns),
            n(u8::from(paused)),
            n(0),
        ]);
    }
    let mut ids = app.routes.tenants.ids();
    ids.sort();
    for id in ids {
        let Some(route) = app.routes.tenants.get(&id) else {
            continue;
        };
        let d = &route.database;
        let (conns, paused) = current(&d.name);
        r.row(vec![
            t(d.name.clone()),
            t(d.host.clone()),
            n(d.port),
            t(d.dbname.clone()),
            None,
            n(route
                .tenant
                .default_pool_size
                .unwrap_or(crate::tenant::model::DEFAULT_POOL_SIZE)),
            n(0),
            n(0),
            n(config.pool.server_lifetime as u64),
            t("transaction"),
            n(route
                .tenant
                .default_max_clients
                .unwrap_or(crate::tenant::model::DEFAULT_MAX_CLIENTS)),
            n(conns),
            n(u8::from(paused)),
            n(u8::from(route.tenant.banned)),
        ]);
    }
    r
}

pub fn users(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[("name", Text), ("pool_mode", Text)]);
    let config = app.routes.config();
    for u in config.users.values() {
        r.row(vec![
            t(u.name.clone()),
            u.pool_mode.map(|m| m.name().to_owned()),
        ]);
    }
    r
}

/// `SHOW CONFIG`: the settings PgBouncer's console lists that Shoal has, what is in effect
/// and the default; `changeable` says whether `RELOAD` changes it.
pub fn config(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("key", Text),
        ("value", Text),
        ("default", Text),
        ("changeable", Text),
    ]);
    let c = app.routes.config();
    let (p, d) = (&c.pool, crate::config::PoolSection::default());
    let (s, ds) = (&app.config.server, crate::config::ServerSection::default());
    let mut row = |key: &str, value: String, default: String, changeable: bool| {
        let changeable = if changeable { "yes" } else { "no" };
        r.row(vec![t(key), t(value), t(default), t(changeable)]);
    };
    let lower = |v: &dyn std::fmt::Debug| format!("{v:?}").to_lowercase();
    row(
        "listen_addr",
        format!("{:?}", s.listen),
        String::new(),
        false,
    );
    let n = |v: &dyn std::fmt::Display| v.to_string();
    row(
        "max_client_conn",
        n(&s.max_client_conn),
        n(&ds.max_client_conn),
        false,
    );
    row("pool_mode", lower(&p.pool_mode), lower(&d.pool_mode), true);
    row("default_pool_size", n(&p.pool_size), n(&d.pool_size), true);
    row(
        "min_pool_size",
        n(&p.min_pool_size),
        n(&d.min_pool_size),
        true,
    );
    row(
        "server_idle_timeout",
        n(&p.server_idle_timeout),
        n(&d.server_idle_timeout),
        true,
    );
    row(
        "server_lifetime",
        n(&p.server_lifetime),
        n(&d.server_lifetime),
        true,
    );
    let connect = (&p.server_connect_timeout, &d.server_connect_timeout);
    row("server_connect_timeout", n(connect.0), n(connect.1), true);
    row(
        "query_wait_timeout",
        n(&p.query_wait_timeout),
        n(&d.query_wait_timeout),
        true,
    );
    let reset = (p.server_reset_query.clone(), d.server_reset_query.clone());
    row("server_reset_query", reset.0, reset.1, true);
    row(
        "client_idle_timeout",
        n(&p.client_idle_timeout),
        n(&d.client_idle_timeout),
        true,
    );
    let prepared = (&p.max_prepared_statements, &d.max_prepared_statements);
    row(
        "max_prepared_statements",
        n(prepared.0),
        n(prepared.1),
        true,
    );
    row("stats_period", n(&p.stats_period), n(&d.stats_period), true);
    let login = (&s.client_login_timeout, &ds.client_login_timeout);
    row("client_login_timeout", n(login.0), n(login.1), false);
    row(
        "max_packet_size",
        n(&s.max_packet_size),
        n(&ds.max_packet_size),
        false,
    );
    row(
        "shutdown_timeout",
        n(&s.shutdown_timeout),
        n(&ds.shutdown_timeout),
        false,
    );
    row("client_tls", lower(&app.tls.mode), String::new(), false);
    r
}
