//! Reading the pool's catalogue for its query rules, off the data path: what functions run
//! behind the database's own operators, casts and views ([`crate::analysis::calls`]). Read
//! when a rule set naming functions takes effect, again a minute later, and at once after
//! DDL passes through Shoal; a session's first transaction waits for the first read (up to
//! the pool's connect timeout).

use std::sync::{Arc, Weak};
use std::time::Duration;

use super::QueryRules;
use crate::analysis::calls::{Calls, CATALOGUE};

use crate::server::{ServerConn, Upstream};

/// How often the catalogue is read again while nothing says it changed.
const EVERY: Duration = Duration::from_secs(60);

/// Keeps `rules`' catalogue current for as long as the rule set is in force.
pub fn keep_current(rules: &Arc<QueryRules>, upstream: Upstream, timeout: Duration) {
    let weak = Arc::downgrade(rules);
    crate::control::spawn(run(weak, upstream, timeout));
}

async fn run(rules: Weak<QueryRules>, upstream: Upstream, timeout: Duration) {
    let mut conn: Option<ServerConn> = None;
    let mut delay = Duration::from_millis(100);
    loop {
        let Some(r) = rules.upgrade() else { return };
        let stale = r.stale.clone();
        match read(&mut conn, &upstream, timeout).await {
            Some(calls) => {
                r.set_calls(calls);
                delay = EVERY;
            }
            None => {
                conn = None;
                tracing::warn!(host = %upstream.host, "cannot read the catalogue for the query rules; statements whose operators, casts or views cannot be checked are refused until it is read");
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
        drop(r);
        let _ = crate::timer::timeout(delay, stale.notified()).await;
    }
}

async fn read(
    conn: &mut Option<ServerConn>,
    upstream: &Upstream,
    timeout: Duration,
) -> Option<Calls> {
    let row = crate::timer::timeout(timeout, async {
        if conn.is_none() {
            *conn = Some(ServerConn::connect(upstream, timeout).await.ok()?);
        }
        conn.as_mut()?.query_row(CATALOGUE, &[]).await.ok()?
    })
    .await
    .ok()??;
    Calls::from_row(row.first()?.as_deref()?)
}
