//! `SHOW POOLS`, `STATS`, `LISTS` and `TOTALS`: what the pools hold and have done.

use std::sync::atomic::Ordering;

use super::{mode, n, sorted_pools, t, Int, ResultSet, Text};
use crate::app::App;

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
