//! The console's `SHOW REPLICAS` and `SHOW RULES`: the feature layers' state, per pool.

use super::show::{n, t, Kind::Int, Kind::Text, ResultSet};
use crate::app::App;

/// `SHOW REPLICAS`: every backend of each pool with replicas, its role and state as last
/// checked, its lag and the reads routed to it.
pub fn show(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("pool", Text),
        ("host", Text),
        ("port", Int),
        ("role", Text),
        ("state", Text),
        ("writer", Text),
        ("lag_ms", Int),
        ("lag_bytes", Int),
        ("reads", Int),
        ("bans", Int),
        ("servers", Int),
        ("in_use", Int),
    ]);
    let mut pools = app.routes.pools();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    for b in crate::replicas::status::rows(&pools) {
        r.row(vec![
            t(b.pool),
            t(b.host),
            n(b.port),
            t(b.role),
            t(b.state),
            t(if b.writer { "yes" } else { "no" }),
            b.lag_ms.and_then(n),
            b.lag_bytes.and_then(n),
            n(b.reads),
            n(b.bans),
            n(b.servers),
            n(b.in_use),
        ]);
    }
    r
}

/// `SHOW RULES`: every query rule of every pool, with the statements it matched.
pub fn show_rules(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("pool", Text),
        ("rule", Text),
        ("matches", Text),
        ("action", Text),
        ("matched", Int),
    ]);
    let mut pools = app.routes.pools();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    for p in pools {
        let Some(rules) = p.rules() else { continue };
        for (rule, matched) in rules.counts() {
            r.row(vec![
                t(p.name.clone()),
                t(rule.name.clone()),
                t(rule.matcher_text()),
                t(match rule.action {
                    crate::config::rules::Action::Deny => "deny",
                    crate::config::rules::Action::Log => "log",
                }),
                n(matched),
            ]);
        }
    }
    r
}
