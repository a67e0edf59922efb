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

pub fn config(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("key", Text),
        ("value", Text),
        ("default", Text),
        ("changeable", Text),
    ]);
    let c = app.routes.config();
    let d = crate::config::PoolSection::default();
    let s = &app.config.server;
    let rows: Vec<(&str, String, String, bool)> = vec![
        (
            "listen_addr",
            format!("{:?}", s.listen),
            String::new(),
            false,
        ),
        (
            "max_client_conn",
            s.max_client_conn.to_string(),
            "10000".into(),
            false,
        ),
        (
            "pool_mode",
            format!("{:?}", c.pool.pool_mode).to_lowercase(),
            "transaction".into(),
            true,
        ),
        (
            "default_pool_size",
            c.pool.pool_size.to_string(),
            d.pool_size.to_string(),
            true,
        ),
        (
            "min_pool_size",
            c.pool.min_pool_size.to_string(),
            d.min_pool_size.to_string(),
            true,
        ),
        (
            "server_idle_timeout",
            c.pool.server_idle_timeout.to_string(),
            d.server_idle_timeout.to_string(),
            true,
        ),
        (
            "server_lifetime",
            c.pool.server_lifetime.to_string(),
            d.server_lifetime.to_string(),
            true,
        ),
        (
            "server_connect_timeout",
            c.pool.server_connect_timeout.to_string(),
            d.server_connect_timeout.to_string(),
            true,
        ),
        (
            "query_wait_timeout",
            c.pool.query_wait_timeout.to_string(),
            d.query_wait_timeout.to_string(),
            true,
        ),
        (
            "server_reset_query",
            c.pool.server_reset_query.clone(),
            d.server_reset_query.clone(),
            true,
        ),
        (
            "client_idle_timeout",
            c.pool.client_idle_timeout.to_string(),
            d.client_idle_timeout.to_string(),
            true,
        ),
        (
            "max_prepared_statements",
            c.pool.max_prepared_statements.to_string(),
            d.max_prepared_statements.to_string(),
            true,
        ),
        (
            "stats_period",
            c.pool.stats_period.to_string(),
            d.stats_period.to_string(),
            true,
        ),
        (
            "client_login_timeout",
            s.client_login_timeout.to_string(),
            "15".into(),
            false,
        ),
        (
            "max_packet_size",
            s.max_packet_size.to_string(),
            "67108864".into(),
            false,
        ),
        (
            "shutdown_timeout",
            s.shutdown_timeout.to_string(),
            "30".into(),
            false,
        ),
        (
            "client_tls",
            format!("{:?}", app.tls.mode).to_lowercase(),
            String::new(),
            false,
        ),
    ];
    for (k, v, def, ch) in rows {
        r.row(vec![t(k), t(v), t(def), t(if ch { "yes" } else { "no" })]);
    }
    r
}
