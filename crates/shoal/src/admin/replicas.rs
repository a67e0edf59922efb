//! The console's `SHOW REPLICAS`, `SHOW RULES`, `SHOW CACHE`, `SHOW CATALOGUES` and
//! `SHOW LIMITS`: the feature layers' state, per pool.

use super::show::{n, t, Kind::Int, Kind::Text, ResultSet};
use crate::app::App;
use crate::features::PoolFeatures;

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
    for b in
        crate::replicas::status::rows(&crate::features::each(&pools, |f| f.replicas().cloned()))
    {
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

/// `SHOW CACHE`: each pool's result cache, what it holds and did, and its database's
/// change stream.
pub fn show_cache(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("pool", Text),
        ("database", Text),
        ("entries", Int),
        ("bytes", Int),
        ("max_bytes", Int),
        ("hits", Int),
        ("misses", Int),
        ("fills", Int),
        ("waits", Int),
        ("stale", Int),
        ("not_cached", Int),
        ("unkept", Int),
        ("evictions", Int),
        ("stream", Text),
        ("covered_tables", Int),
        ("invalidated_by_writes", Int),
        ("invalidated_by_stream", Int),
        ("resets", Int),
    ]);
    let mut pools = app.routes.pools();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    for c in crate::cache::status::rows(&crate::features::each(&pools, |f| f.cache())) {
        r.row(vec![
            t(c.pool),
            t(c.database),
            n(c.entries),
            n(c.bytes),
            n(c.max_bytes),
            n(c.hits),
            n(c.misses),
            n(c.fills),
            n(c.waits),
            n(c.stale),
            n(c.passed),
            n(c.unkept),
            n(c.evictions),
            t(c.stream),
            n(c.covered),
            n(c.invalidations[0]),
            n(c.invalidations[1]),
            n(c.invalidations[2]),
        ]);
    }
    r
}

/// `SHOW CATALOGUES`: the catalogue each pool's rules, cache or replica split judge by
/// (one per database, shared), and how its reading goes.
pub fn show_catalogues(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("pool", Text),
        ("database", Text),
        ("read", Text),
        ("generation", Int),
        ("readings", Int),
        ("version_checks", Int),
        ("last_error", Text),
    ]);
    let mut pools = app.routes.pools();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    for p in pools {
        let c = p.catalogue();
        if !c.running() {
            continue;
        }
        let s = c.status();
        r.row(vec![
            t(p.name.clone()),
            t(c.label.clone()),
            t(if s.loaded { "yes" } else { "no" }),
            n(s.generation),
            n(s.readings),
            n(s.checks),
            s.last_error,
        ]);
    }
    r
}

/// `SHOW LIMITS`: each pool's limits, one row per scope (its database's or tenant's, its
/// user's), with the tokens left and the transactions running and waiting.
pub fn show_limits(app: &App) -> ResultSet {
    let mut r = ResultSet::new(&[
        ("pool", Text),
        ("scope", Text),
        ("max_statement_timeout_ms", Int),
        ("rate_limit", Text),
        ("rate_burst", Text),
        ("tokens", Text),
        ("max_concurrency", Int),
        ("running", Int),
        ("waiting", Int),
    ]);
    let mut pools = app.routes.pools();
    pools.sort_by(|a, b| a.name.cmp(&b.name));
    for p in pools {
        let cap = p.settings.statement_timeout.map(|d| d.as_millis() as u64);
        let Some(limits) = p.limits() else {
            if let Some(ms) = cap {
                r.row(vec![
                    t(p.name.clone()),
                    t("database"),
                    n(ms),
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                ]);
            }
            continue;
        };
        for l in limits.database.iter().chain(limits.user.iter()) {
            let rate = l.config.rate;
            r.row(vec![
                t(p.name.clone()),
                t(l.label.clone()),
                cap.and_then(n),
                rate.and_then(|r| t(r.per_second.to_string())),
                rate.and_then(|r| t(r.burst.to_string())),
                l.tokens().and_then(|v| t(format!("{v:.1}"))),
                l.config.concurrency.and_then(n),
                n(l.running()),
                n(l.waiting()),
            ]);
        }
    }
    r
}
