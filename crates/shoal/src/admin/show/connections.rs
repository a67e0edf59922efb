//! `SHOW CLIENTS` and `SERVERS`: one row per connection, PgBouncer's columns.

use super::{n, sorted_pools, t, time_ago, Int, Kind, ResultSet, Text};
use crate::app::App;

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
