//! `SHOW …` result sets, with PgBouncer's column names where a column exists in both, so
//! tools written for PgBouncer's console (exporters, dashboards) read Shoal's unchanged.

use std::sync::Arc;

use crate::app::App;
use crate::pool::Pool;

mod connections;
mod nodes;
mod pools;
mod settings;

use connections::{clients, servers};
use nodes::nodes;
use pools::{lists, pools, stats, totals};
use settings::{config, databases, users};
use Kind::{Int, Text};

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

fn mode(p: &Pool) -> &'static str {
    p.settings.mode.name()
}

/// Every pool with servers: routing's, and their replicas' (`database@host:port`).
fn sorted_pools(app: &App) -> Vec<Arc<Pool>> {
    let mut pools = crate::features::with_replica_pools(app.routes.pools());
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
