//! `SHOW …` result sets, with PgBouncer's column names where a column exists in both, so
//! tools written for PgBouncer's console (exporters, dashboards) read Shoal's unchanged.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::app::App;
use crate::pool::Pool;

/// A column's type as sent in RowDescription.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    Int,
}

/// A result set to send.
#[derive(Debug, Default)]
pub struct ResultSet {
    pub columns: Vec<(&'static str, Kind)>,
    pub rows: Vec<Vec<Option<String>>>,
}

impl ResultSet {
    pub(super) fn new(columns: &[(&'static str, Kind)]) -> ResultSet {
        ResultSet {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    pub(super) fn row(&mut self, values: Vec<Option<String>>) {
        debug_assert_eq!(values.len(), self.columns.len());
        self.rows.push(values);
    }
}

pub(super) fn t(s: impl Into<String>) -> Option<String> {
    Some(s.into())
}

pub(super) fn n(v: impl std::fmt::Display) -> Option<String> {
    Some(v.to_string())
}

use Kind::{Int, Text};

fn mode(p: &Pool) -> &'static str {
    p.settings.mode.name()
}

/// Every pool with servers: routing's, and their replicas' (`database@host:port`).
fn sorted_pools(app: &App) -> Vec<Arc<Pool>> {
    let mut pools = crate::replicas::status::with_replica_pools(app.routes.pools());
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    pools
}

/// A wall-clock time `ms_ago` milliseconds before now, as PgBouncer prints times.
fn time_ago(ms_ago: u64) -> String {
    let at = std::time::SystemTime::now() - std::time::Duration::from_millis(ms_ago);
    humantime::format_rfc3339_seconds(at)
        .to_string()
        .replace('T', " ")
        .replace('Z', " UTC")
}

pub fn pools(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("database", Text),
        ("user", Text),
        ("cl_active", Int),
        ("cl_waiting", Int),
        ("cl_active_cancel_req", Int),
        ("cl_waiting_cancel_req", Int),
        ("sv_active", Int),
        ("sv_active_cancel", Int),
        ("sv_being_canceled", Int),
        ("sv_idle", Int),
        ("sv_used", Int),
        ("sv_tested", Int),
        ("sv_login", Int),
        ("maxwait", Int),
        ("maxwait_us", Int),
        ("pool_mode", Text),
    ]);
    // In a cluster: which node owns each pool (a pool whose owner is another node has this
    // node's relayed clients and no servers).
    let owners = app.cluster.get().map(|n| (n.id.clone(), n.owners()));
    if owners.is_some() {
        r.columns.push(("owner", Text));
    }
    for p in sorted_pools(app) {
        let clients = p.stats.clients.load(Ordering::Relaxed);
        let waiting = p.stats.waiting.load(Ordering::Relaxed);
        let mut row = vec![
            t(p.database()),
            t(p.upstream.user.clone()),
            n(clients.saturating_sub(waiting)),
            n(waiting),
            n(0),
            n(0),
            n(p.in_use()),
            n(0),
            n(0),
            n(p.idle_count()),
            n(0),
            n(0),
            n(p.metrics.connecting.load(Ordering::Relaxed)),
            n(0),
            n(0),
            t(mode(&p)),
        ];
        if let Some((me, owners)) = &owners {
            row.push(match owners.get(&p.name) {
                Some(o) => t(o.clone()),
                None if p.fence.owned() => t(me.clone()),
                None => None,
            });
        }
        r.row(row);
    }
    r
}

/// `SHOW NODES`: the cluster's live nodes as this node sees them.
pub fn nodes(app: &App) -> Result<ResultSet, String> {
    let Some(cluster) = app.cluster.get() else {
        return Err("SHOW NODES: this Shoal is not in a cluster (no [cluster] section)".into());
    };
    let status = cluster.status();
    let mut r = ResultSet::new(&[
        ("node", Text),
        ("relay", Text),
        ("slot", Int),
        ("self", Text),
        ("clients", Int),
        ("owned_pools", Int),
        ("links", Int),
        ("relayed_clients", Int),
        ("bytes_in", Int),
        ("bytes_out", Int),
        ("rtt_us", Int),
    ]);
    for node in status.nodes {
        let me = node.id == status.node;
        r.row(vec![
            t(node.id),
            t(node.relay),
            n(node.slot),
            t(if me { "yes" } else { "no" }),
            n(node.load),
            n(node.pools.len()),
            n(node.links),
            n(node.streams),
            n(node.bytes_in),
            n(node.bytes_out),
            n(node.rtt_us),
        ]);
    }
    Ok(r)
}

pub fn stats(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("database", Text),
        ("total_server_assignment_count", Int),
        ("total_xact_count", Int),
        ("total_query_count", Int),
        ("total_received", Int),
        ("total_sent", Int),
        ("total_xact_time", Int),
        ("total_query_time", Int),
        ("total_wait_time", Int),
        ("avg_server_assignment_count", Int),
        ("avg_xact_count", Int),
        ("avg_query_count", Int),
        ("avg_recv", Int),
        ("avg_sent", Int),
        ("avg_xact_time", Int),
        ("avg_query_time", Int),
        ("avg_wait_time", Int),
    ]);
    // One row per database: its pools summed.
    let mut by_db: std::collections::BTreeMap<String, [u64; 16]> = Default::default();
    for p in app.routes.pools() {
        let s = &p.stats;
        let m = &p.metrics;
        let a = *p.averages.lock().unwrap_or_else(|e| e.into_inner());
        let xacts = s.checkouts.load(Ordering::Relaxed);
        let row = by_db.entry(p.database().to_owned()).or_default();
        let add = [
            xacts,
            xacts,
            m.queries.load(Ordering::Relaxed),
            m.bytes_in.load(Ordering::Relaxed),
            m.bytes_out.load(Ordering::Relaxed),
            m.transaction.sum_us(),
            m.query.sum_us(),
            s.wait_micros.load(Ordering::Relaxed),
            a.xact_count,
            a.xact_count,
            a.query_count,
            a.recv,
            a.sent,
            a.xact_time,
            a.query_time,
            a.wait_time,
        ];
        // Counts and totals add up over a database's pools; average times take the
        // largest pool's.
        for (i, (acc, v)) in row.iter_mut().zip(add).enumerate() {
            if i >= 13 {
                *acc = (*acc).max(v);
            } else {
                *acc += v;
            }
        }
    }
    for (db, v) in by_db {
        let mut values = vec![t(db)];
        values.extend(v.iter().map(|x| n(*x)));
        r.row(values);
    }
    r
}

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

/// `SHOW CLIENTS` and `SHOW SERVERS` share PgBouncer's columns.
const CONNECTION_COLUMNS: &[(&str, Kind)] = &[
    ("type", Text),
    ("user", Text),
    ("database", Text),
    ("state", Text),
    ("addr", Text),
    ("port", Int),
    ("local_addr", Text),
    ("local_port", Int),
    ("connect_time", Text),
    ("request_time", Text),
    ("wait", Int),
    ("wait_us", Int),
    ("close_needed", Int),
    ("ptr", Text),
    ("link", Text),
    ("remote_pid", Int),
    ("tls", Text),
];

pub fn clients(app: &App) -> ResultSet {
    let mut r = ResultSet::new(CONNECTION_COLUMNS);
    let now = crate::clock::now_ms();
    for (key, slot) in app.cancels.clients() {
        let Some(pool) = slot.info.pool.upgrade() else {
            continue;
        };
        let state = match slot.state() {
            "waiting" => "waiting",
            _ => "active",
        };
        let since = time_ago(now.saturating_sub(slot.info.since_ms));
        r.row(vec![
            t("C"),
            t(pool.upstream.user.clone()),
            t(pool.database()),
            t(state),
            slot.info.addr.map(|a| a.ip().to_string()),
            n(slot.info.addr.map_or(0, |a| a.port())),
            None,
            n(0),
            t(since.clone()),
            t(since),
            n(0),
            n(0),
            n(0),
            t(format!("{key:x}")),
            None,
            n(0),
            None,
        ]);
    }
    r
}

pub fn servers(app: &App) -> ResultSet {
    let mut r = ResultSet::new(CONNECTION_COLUMNS);
    let now = crate::clock::now_ms();
    for p in sorted_pools(app) {
        for (id, info, idle) in p.server_list() {
            r.row(vec![
                t("S"),
                t(p.upstream.user.clone()),
                t(p.database()),
                t(if idle { "idle" } else { "active" }),
                t(info.addr.ip().to_string()),
                n(info.addr.port()),
                None,
                n(0),
                t(time_ago(now.saturating_sub(info.created))),
                t(time_ago(0)),
                n(0),
                n(0),
                n(0),
                t(format!("{id:x}")),
                None,
                n(info.process_id),
                t(if info.tls { "TLS" } else { "" }),
            ]);
        }
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

pub fn lists(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[("list", Text), ("items", Int)]);
    let config = app.routes.config();
    let pools = app.routes.pools();
    let servers: usize = pools
        .iter()
        .map(|p| p.stats.servers.load(Ordering::Relaxed))
        .sum();
    let idle: usize = pools.iter().map(|p| p.idle_count()).sum();
    let items: [(&str, usize); 12] = [
        (
            "databases",
            config.databases.len() + app.routes.tenants.len(),
        ),
        ("users", config.users.len()),
        ("pools", pools.len()),
        ("free_clients", 0),
        (
            "used_clients",
            app.admission.clients.load(Ordering::Relaxed),
        ),
        (
            "login_clients",
            app.admission.logins.load(Ordering::Relaxed),
        ),
        ("free_servers", idle),
        ("used_servers", servers.saturating_sub(idle)),
        ("dns_names", 0),
        ("dns_zones", 0),
        ("dns_queries", 0),
        ("dns_pending", 0),
    ];
    for (k, v) in items {
        r.row(vec![t(k), n(v)]);
    }
    r
}

/// `SHOW TOTALS`: `SHOW STATS` over every database, as (name, value) rows. Counts, bytes and
/// their rates add up; the average times are weighted by each database's transactions (or
/// queries) a second.
pub fn totals(app: &App) -> ResultSet {
    let stats = stats(app);
    let num = |row: &[Option<String>], i: usize| -> u64 {
        row.get(i)
            .and_then(|v| v.as_deref())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let col = |name: &str| stats.columns.iter().position(|(c, _)| *c == name);
    let mut r = ResultSet::new(&[("name", Text), ("value", Int)]);
    for (i, (name, _)) in stats.columns.iter().enumerate().skip(1) {
        let weight = match *name {
            "avg_xact_time" | "avg_wait_time" => col("avg_xact_count"),
            "avg_query_time" => col("avg_query_count"),
            _ => None,
        };
        let value = match weight {
            None => stats.rows.iter().map(|row| num(row, i)).sum::<u64>(),
            Some(w) => {
                let total: u64 = stats.rows.iter().map(|row| num(row, w)).sum();
                let weighted: u64 = stats.rows.iter().map(|row| num(row, i) * num(row, w)).sum();
                weighted.checked_div(total).unwrap_or(0)
            }
        };
        r.row(vec![t(*name), n(value)]);
    }
    r
}

/// `SHOW STATE`: whether Shoal accepts work, as PgBouncer answers it.
pub fn state(app: &App) -> ResultSet {
    let yes = |b: bool| t(if b { "yes" } else { "no" });
    let paused = app.routes.paused_all();
    let mut r = ResultSet::new(&[("key", Text), ("value", Text)]);
    r.row(vec![t("active"), yes(!paused)]);
    r.row(vec![t("paused"), yes(paused)]);
    r.row(vec![t("suspended"), yes(paused)]);
    r
}

pub fn version() -> ResultSet {
    let mut r = ResultSet::new(&[("version", Text)]);
    r.row(vec![t(format!(
        "Shoal {} (console compatible with PgBouncer 1.23.1: its SHOW columns and commands; \
         no SHOW FDS, MEM or SOCKETS, and SET is refused)",
        env!("CARGO_PKG_VERSION")
    ))]);
    r
}

pub fn help() -> ResultSet {
    let mut r = ResultSet::new(&[("command", Text)]);
    for c in [
        "SHOW POOLS|STATS|TOTALS|STATE|CLIENTS|SERVERS|DATABASES|USERS|CONFIG|VERSION|LISTS|NODES|REPLICAS|RULES|CACHE|CATALOGUES|LIMITS|HELP",
        "PAUSE [db]",
        "RESUME [db]",
        "SUSPEND",
        "RELOAD",
        "KILL db",
        "RECONNECT [db]",
        "DISABLE db",
        "ENABLE db",
        "WAIT_CLOSE [db]",
        "SHUTDOWN",
    ] {
        r.row(vec![t(c)]);
    }
    r
}

/// The result set of `SHOW <what>`.
pub fn show(app: &App, what: &str) -> Result<ResultSet, String> {
    Ok(match what {
        "POOLS" => pools(app),
        "STATS" => stats(app),
        "TOTALS" => totals(app),
        "STATE" => state(app),
        "FDS" | "MEM" | "SOCKETS" | "ACTIVE_SOCKETS" => {
            return Err(format!(
                "SHOW {what} describes PgBouncer's own process (its file descriptors for an \
                 online restart, its memory caches): Shoal restarts with --upgrade-socket, and \
                 SHOW LISTS and /metrics give its counts"
            ))
        }
        "DATABASES" => databases(app),
        "USERS" => users(app),
        "CLIENTS" => clients(app),
        "SERVERS" => servers(app),
        "CONFIG" => config(app),
        "LISTS" => lists(app),
        "VERSION" => version(),
        "HELP" => help(),
        "NODES" => nodes(app)?,
        "REPLICAS" => super::replicas::show(app),
        "RULES" => super::replicas::show_rules(app),
        "CACHE" => super::replicas::show_cache(app),
        "CATALOGUES" => super::replicas::show_catalogues(app),
        "LIMITS" => super::replicas::show_limits(app),
        other => {
            return Err(format!(
                "SHOW {other} is not known: SHOW HELP lists what can be shown"
            ))
        }
    })
}
