//! The dashboard's pools: a page of the `SHOW POOLS` table (sorted and filtered on the
//! server, so a thousand pools cost the browser one page), each row with the last minute of
//! its transactions a second, and one pool's servers, waiting clients and slow queries.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::app::App;
use crate::pool::Pool;

/// Seconds a pool's sparkline covers.
pub const SPARK: usize = 60;
/// Rows a page may hold.
pub const MAX_PER_PAGE: usize = 500;

/// Every pool's transactions a second over the last [`SPARK`] seconds.
#[derive(Default)]
pub struct Sparks {
    inner: Mutex<HashMap<String, Spark>>,
}

struct Spark {
    total: u64,
    at: u64,
    rates: VecDeque<f32>,
}

impl Sparks {
    /// Takes each pool's transaction count at `at` (milliseconds); pools gone are forgotten.
    pub fn record(&self, at: u64, totals: impl Iterator<Item = (String, u64)>) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut seen = std::collections::HashSet::new();
        for (name, total) in totals {
            seen.insert(name.clone());
            match inner.get_mut(&name) {
                Some(s) => {
                    let secs = (at.saturating_sub(s.at) as f32 / 1000.0).max(0.001);
                    if s.rates.len() == SPARK {
                        s.rates.pop_front();
                    }
                    s.rates
                        .push_back(total.saturating_sub(s.total) as f32 / secs);
                    s.total = total;
                    s.at = at;
                }
                None => {
                    inner.insert(
                        name,
                        Spark {
                            total,
                            at,
                            rates: VecDeque::with_capacity(SPARK),
                        },
                    );
                }
            }
        }
        inner.retain(|k, _| seen.contains(k));
    }

    /// The pool's last rate.
    pub fn last(&self, name: &str) -> f32 {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .get(name)
            .and_then(|s| s.rates.back().copied())
            .unwrap_or(0.0)
    }

    /// The pool's rates, oldest first.
    pub fn of(&self, name: &str) -> Vec<f32> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner
            .get(name)
            .map(|s| s.rates.iter().copied().collect())
            .unwrap_or_default()
    }
}

/// One pool as the table shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PoolRow {
    pub name: String,
    pub database: String,
    pub user: String,
    pub tenant: Option<String>,
    pub mode: &'static str,
    pub size: usize,
    pub cl_active: usize,
    pub cl_waiting: usize,
    pub sv_active: usize,
    pub sv_idle: usize,
    pub sv_login: u64,
    pub transactions: u64,
    /// Transactions a second, the last second.
    pub tps: f32,
    /// The node owning it, in a cluster.
    pub owner: Option<String>,
    /// Transactions a second over the last [`SPARK`] seconds (filled for the rows sent only).
    pub spark: Vec<f32>,
}

/// Every pool with servers: routing's and their replicas'.
pub fn all(app: &App) -> Vec<Arc<Pool>> {
    crate::features::with_replica_pools(app.routes.pools())
}

/// In a cluster: this node's id and who owns which pool.
type Owners = Option<(String, shoal_cluster::membership::Owners)>;

fn owners(app: &App) -> Owners {
    app.cluster.get().map(|n| (n.id.clone(), n.owners()))
}

fn row(owners: &Owners, p: &Pool, sparks: &Sparks) -> PoolRow {
    let clients = p.stats.clients.load(Relaxed);
    let waiting = p.stats.waiting.load(Relaxed);
    let owner = owners
        .as_ref()
        .and_then(|(me, all)| match all.get(&p.name) {
            Some(o) => Some(o.clone()),
            None if p.fence.owned() => Some(me.clone()),
            None => None,
        });
    PoolRow {
        name: p.name.clone(),
        database: p.database().to_owned(),
        user: p.upstream.user.clone(),
        tenant: p.tenant.clone(),
        mode: p.settings.mode.name(),
        size: p.size(),
        cl_active: clients.saturating_sub(waiting),
        cl_waiting: waiting,
        sv_active: p.in_use(),
        sv_idle: p.idle_count(),
        sv_login: p.metrics.connecting.load(Relaxed),
        transactions: p.metrics.transaction.snapshot().1,
        tps: sparks.last(&p.name),
        owner,
        spark: Vec::new(),
    }
}

/// What the table asks for.
#[derive(Debug, Default, Deserialize)]
pub struct Ask {
    pub page: Option<usize>,
    pub per_page: Option<usize>,
    /// A column of [`PoolRow`] (`name` when absent or unknown).
    pub sort: Option<String>,
    #[serde(default)]
    pub desc: bool,
    /// Only pools whose name, database, user or tenant contains this (ignoring case).
    pub filter: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Page {
    pub data: Vec<PoolRow>,
    pub page: usize,
    pub per_page: usize,
    pub total: usize,
}

/// The page of pools `ask` wants (`Err`: what is wrong with the request).
pub fn page(app: &App, sparks: &Sparks, ask: &Ask) -> Result<Page, &'static str> {
    let per_page = ask.per_page.unwrap_or(50);
    let page = ask.page.unwrap_or(1);
    if !(1..=MAX_PER_PAGE).contains(&per_page) || page == 0 {
        return Err("page must be at least 1 and per_page between 1 and 500");
    }
    let needle = ask.filter.as_deref().unwrap_or("").trim().to_lowercase();
    let owners = owners(app);
    let mut rows: Vec<PoolRow> = all(app)
        .iter()
        .filter(|p| {
            needle.is_empty()
                || [
                    p.name.as_str(),
                    p.database(),
                    p.upstream.user.as_str(),
                    p.tenant.as_deref().unwrap_or(""),
                ]
                .iter()
                .any(|s| s.to_lowercase().contains(&needle))
        })
        .map(|p| row(&owners, p, sparks))
        .collect();
    sort(&mut rows, ask.sort.as_deref().unwrap_or("name"), ask.desc);
    let total = rows.len();
    let data = rows
        .into_iter()
        .skip((page - 1).saturating_mul(per_page))
        .take(per_page)
        .map(|mut r| {
            r.spark = sparks.of(&r.name);
            r
        })
        .collect();
    Ok(Page {
        data,
        page,
        per_page,
        total,
    })
}

/// Sorts by `column`, then by name (so equal rows keep one order from page to page).
pub fn sort(rows: &mut [PoolRow], column: &str, desc: bool) {
    use std::cmp::Ordering;
    let key = |a: &PoolRow, b: &PoolRow| -> Ordering {
        match column {
            "database" => a.database.cmp(&b.database),
            "user" => a.user.cmp(&b.user),
            "tenant" => a.tenant.cmp(&b.tenant),
            "mode" => a.mode.cmp(b.mode),
            "size" => a.size.cmp(&b.size),
            "cl_active" => a.cl_active.cmp(&b.cl_active),
            "cl_waiting" => a.cl_waiting.cmp(&b.cl_waiting),
            "sv_active" => a.sv_active.cmp(&b.sv_active),
            "sv_idle" => a.sv_idle.cmp(&b.sv_idle),
            "sv_login" => a.sv_login.cmp(&b.sv_login),
            "transactions" => a.transactions.cmp(&b.transactions),
            "tps" => a.tps.total_cmp(&b.tps),
            _ => Ordering::Equal,
        }
    };
    rows.sort_by(|a, b| {
        let o = key(a, b);
        let o = if desc { o.reverse() } else { o };
        o.then_with(|| a.name.cmp(&b.name))
    });
}

/// One server of a pool.
#[derive(Debug, Serialize)]
pub struct ServerRow {
    pub id: String,
    pub addr: String,
    pub state: &'static str,
    pub age_s: u64,
    pub pid: i32,
    pub tls: bool,
}

/// A client waiting for one of the pool's servers.
#[derive(Debug, Serialize)]
pub struct WaitingRow {
    pub addr: Option<String>,
    pub waiting_ms: u64,
}

#[derive(Debug, Serialize)]
pub struct Detail {
    pub pool: PoolRow,
    pub servers: Vec<ServerRow>,
    pub waiting: Vec<WaitingRow>,
    /// Newest first.
    pub slow_queries: Vec<crate::pool::SlowQuery>,
    /// `slow_query_threshold` in milliseconds (0: slow queries are not noted).
    pub slow_threshold_ms: u64,
}

/// Waiting clients listed at most.
const MAX_WAITING: usize = 200;

/// The pool named `name`, with its servers, waiting clients and recent slow queries.
pub fn detail(app: &App, sparks: &Sparks, name: &str) -> Option<Detail> {
    let pool = all(app).into_iter().find(|p| p.name == name)?;
    let now = crate::clock::now_ms();
    let servers = pool
        .server_list()
        .into_iter()
        .map(|(id, info, idle)| ServerRow {
            id: format!("{id:x}"),
            addr: info.addr.to_string(),
            state: if idle { "idle" } else { "active" },
            age_s: now.saturating_sub(info.created) / 1000,
            pid: info.process_id,
            tls: info.tls,
        })
        .collect();
    let mut waiting: Vec<WaitingRow> = app
        .cancels
        .clients()
        .into_iter()
        .filter(|(_, slot)| {
            slot.state() == "waiting"
                && slot
                    .info
                    .pool
                    .upgrade()
                    .is_some_and(|p| Arc::ptr_eq(&p, &pool))
        })
        .map(|(_, slot)| WaitingRow {
            addr: slot
                .info
                .addr
                .map(|a| SocketAddr::new(a.ip(), a.port()).to_string()),
            waiting_ms: now.saturating_sub(slot.info.since_ms),
        })
        .collect();
    waiting.sort_by_key(|w| std::cmp::Reverse(w.waiting_ms));
    waiting.truncate(MAX_WAITING);
    let mut row = row(&owners(app), &pool, sparks);
    row.spark = sparks.of(&row.name);
    Some(Detail {
        pool: row,
        servers,
        waiting,
        slow_queries: pool.recent_slow_queries(),
        slow_threshold_ms: pool.settings.slow_query.as_millis() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(name: &str, tps: f32, waiting: usize) -> PoolRow {
        PoolRow {
            name: name.into(),
            database: "db".into(),
            user: "u".into(),
            tenant: None,
            mode: "transaction",
            size: 1,
            cl_active: 0,
            cl_waiting: waiting,
            sv_active: 0,
            sv_idle: 0,
            sv_login: 0,
            transactions: 0,
            tps,
            owner: None,
            spark: vec![],
        }
    }

    #[test]
    fn rows_sort_by_a_column_then_by_name() {
        let mut rows = vec![r("c", 5.0, 1), r("a", 5.0, 0), r("b", 9.0, 2)];
        sort(&mut rows, "tps", true);
        let names: Vec<_> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["b", "a", "c"], "ties keep name order");
        sort(&mut rows, "cl_waiting", false);
        let names: Vec<_> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a", "c", "b"]);
        sort(&mut rows, "no such column", false);
        let names: Vec<_> = rows.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"], "an unknown column sorts by name");
    }

    #[test]
    fn sparks_are_rates_and_forget_pools_gone() {
        let s = Sparks::default();
        s.record(0, [("p".to_owned(), 0), ("q".to_owned(), 0)].into_iter());
        assert!(s.of("p").is_empty(), "the first measure only starts");
        s.record(2000, [("p".to_owned(), 10)].into_iter());
        assert_eq!(s.of("p"), vec![5.0]);
        assert!(s.of("q").is_empty(), "a pool gone is forgotten");
        for i in 0..(SPARK as u64 + 5) {
            s.record(3000 + i * 1000, [("p".to_owned(), 10 + i)].into_iter());
        }
        assert_eq!(s.of("p").len(), SPARK);
    }
}
