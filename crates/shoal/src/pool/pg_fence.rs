//! Fencing that PostgreSQL enforces (cluster). etcd decides who owns a pool, and an owner
//! checks its lease before each checkout, but a check in the owner cannot stop an owner
//! that is paused between the check and its write (SIGSTOP, a stalled VM): on resuming, it
//! sends what its clients queued on servers PostgreSQL still serves, after the next owner
//! began. So the next owner makes PostgreSQL refuse the old one before it serves.
//!
//! The record lives in PostgreSQL's advisory locks, in a namespace of the pool's own (the
//! first key of the two-key form, from the pool's name; see [`namespace`]), all held by one
//! idle connection per owned pool, the *mark* (`application_name` "shoal fence"):
//!
//! - the mark holds `(ns, 0)`: "this session's node owns the pool";
//! - for each server the owner opens, the mark takes `(ns, pid)` before the server serves
//!   anyone (*enlisting*), and lets it go when the server closes; the mark, not the server,
//!   holds it, so nothing a client runs (`DISCARD ALL`, `pg_advisory_unlock_all()`) can
//!   hide a server;
//! - enlisting first takes `(ns, FREEZE)` shared for its own transaction, and fails when it
//!   cannot.
//!
//! A new owner, on a fresh mark: takes `(ns, FREEZE)` exclusively, so no old mark can
//! enlist any more; reads every session holding or awaiting a lock in the namespace (old
//! marks) and every pid they enlisted; terminates them all and waits until PostgreSQL shows
//! none; takes `(ns, 0)`; lets `FREEZE` go; and only then serves. An old owner that resumes
//! finds its servers and its mark gone, and cannot enlist a new server: it never runs a
//! statement after its successor started, and the cluster never holds more than
//! `pool_size` servers of the pool (beside the owner's mark).
//!
//! Terminating a backend needs the role that opened it (or `pg_signal_backend`): the mark
//! logs in as the pool's own upstream user, as the old owner's servers did.

use std::sync::Arc;
use std::time::Duration;

use crate::server::{ServerConn, ServerError, Upstream};

/// The second key of the lock that stops enlisting while a new owner takes over: above any
/// process id (Linux's `pid_max` is at most 2^22), so never a server's.
const FREEZE: i32 = i32::MAX;
/// The second key of the owner's lock.
const OWNER: i32 = 0;
/// How often PostgreSQL is asked whether the terminated sessions are gone.
const POLL: Duration = Duration::from_millis(20);
/// The mark's `application_name`, so a DBA sees what it is.
pub const MARK_NAME: &str = "shoal fence";

#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    #[error("PostgreSQL: {0}")]
    Server(#[from] ServerError),
    #[error("{0} sessions of the pool's previous owner did not end within {1:?}")]
    Lingering(usize, Duration),
    #[error("another node is taking the pool over at PostgreSQL")]
    Superseded,
    #[error("PostgreSQL gave an answer the fence cannot read: {0}")]
    Answer(String),
}

/// The first key of the pool's locks: FNV-1a of its name, as every node computes it alike,
/// kept positive (PostgreSQL shows it as an `oid`).
pub fn namespace(pool: &str) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in pool.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (h & 0x7fff_ffff) as i32
}

/// Every session but this one holding or awaiting a lock of namespace `$1` in this database,
/// and every server process id they enlisted; of those, the live ones of this role.
const STRAYS: &str = "WITH ours AS (
    SELECT l.pid AS holder, l.objid::text::bigint AS k2 FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.objsubid = 2
      AND l.classid::text::bigint = $1::bigint
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.pid <> pg_backend_pid()),
  strays AS (
    SELECT holder AS pid FROM ours
    UNION SELECT k2::int FROM ours WHERE k2 > 0 AND k2 < 2147483647)
SELECT coalesce(string_agg(a.pid::text, ',' ORDER BY a.pid), '')
FROM pg_stat_activity a JOIN strays s ON s.pid = a.pid
WHERE a.pid <> pg_backend_pid() AND a.datname = current_database()
  AND a.usename = current_user";

/// This node's hold on a pool at PostgreSQL (see the module's doc).
pub struct Mark {
    conn: tokio::sync::Mutex<Option<Box<ServerConn>>>,
    ns: String,
    /// The mark's own process id.
    pub pid: i32,
    /// Sessions of earlier owners this take-over ended (their marks and servers).
    pub ended: usize,
    timeout: Duration,
}

impl Mark {
    /// Takes `pool` over at PostgreSQL through `up`: whatever an earlier owner opened is
    /// ended before this returns. `timeout` bounds each step (connecting, each lock, the
    /// wait for terminated sessions to go).
    pub async fn take_over(
        up: &Upstream,
        pool: &str,
        timeout: Duration,
    ) -> Result<Mark, FenceError> {
        let extra = [("application_name", MARK_NAME)];
        let mut conn = ServerConn::connect_with(up, timeout, &extra).await?;
        let ns = namespace(pool).to_string();
        // An idle session another setting would end (`idle_session_timeout`, PostgreSQL 14
        // and later) must live as long as the ownership; older servers lack the setting.
        let lock_timeout = format!(
            "SET statement_timeout = 0; SET lock_timeout = {}",
            timeout.as_millis().max(1)
        );
        conn.simple_query(&lock_timeout).await?;
        let _ = conn.simple_query("SET idle_session_timeout = 0").await;
        conn.query_row(
            "SELECT pg_advisory_lock($1::int4, $2::int4)",
            &[&ns, &FREEZE.to_string()],
        )
        .await?;
        let strays = match conn.query_row(STRAYS, &[&ns]).await? {
            Some(row) => row.into_iter().next().flatten().unwrap_or_default(),
            None => String::new(),
        };
        let mut ended = 0;
        if !strays.is_empty() {
            let n = strays.split(',').count();
            ended = n;
            tracing::warn!(
                pool,
                sessions = n,
                "ending the sessions of the pool's previous owner at PostgreSQL"
            );
            end_sessions(&mut conn, &strays, timeout).await?;
        }
        conn.query_row(
            "SELECT pg_advisory_lock($1::int4, $2::int4)",
            &[&ns, &OWNER.to_string()],
        )
        .await?;
        conn.query_row(
            "SELECT pg_advisory_unlock($1::int4, $2::int4)",
            &[&ns, &FREEZE.to_string()],
        )
        .await?;
        Ok(Mark {
            pid: conn.process_id,
            ended,
            conn: tokio::sync::Mutex::new(Some(Box::new(conn))),
            ns,
            timeout,
        })
    }

    /// Records server `pid` as this owner's, before it serves anyone. Fails when a new
    /// owner is taking over, or the mark is gone (ended by one, or by PostgreSQL).
    pub async fn enlist(&self, pid: i32) -> Result<(), FenceError> {
        let sql = "SELECT CASE WHEN pg_try_advisory_xact_lock_shared($1::int4, $2::int4) \
                   THEN pg_try_advisory_lock($1::int4, $3::int4) ELSE false END";
        let pid = pid.to_string();
        let row = self
            .query(sql, &[&self.ns, &FREEZE.to_string(), &pid])
            .await?;
        match row.as_deref() {
            Some([Some(t)]) if t == "t" => Ok(()),
            Some([Some(f)]) if f == "f" => Err(FenceError::Superseded),
            other => Err(FenceError::Answer(format!("{other:?}"))),
        }
    }

    /// Forgets server `pid` (it closed), so a process id PostgreSQL reuses is nobody's.
    pub async fn discharge(&self, pid: i32) {
        let sql = "SELECT pg_advisory_unlock($1::int4, $2::int4)";
        if let Err(e) = self.query(sql, &[&self.ns, &pid.to_string()]).await {
            tracing::debug!(error = %e, pid, "fence mark could not forget a closed server");
        }
    }

    /// Runs one statement on the mark, bounded by the timeout; a mark that failed once is
    /// closed for good (its locks went with it, or soon will).
    async fn query(
        &self,
        sql: &str,
        params: &[&str],
    ) -> Result<Option<Vec<Option<String>>>, FenceError> {
        let mut slot = self.conn.lock().await;
        let Some(conn) = slot.as_mut() else {
            return Err(FenceError::Server(ServerError::Protocol(
                "the fence mark's connection is closed".into(),
            )));
        };
        let r = match crate::timer::timeout(self.timeout, conn.query_row(sql, params)).await {
            Ok(r) => r.map_err(FenceError::from),
            Err(_) => Err(FenceError::Server(ServerError::ConnectTimeout(format!(
                "fence mark {}",
                self.pid
            )))),
        };
        if r.is_err() {
            *slot = None;
        }
        r
    }
}

/// Terminates the sessions `pids` (comma-separated) and waits until PostgreSQL shows none
/// of them, within `timeout`.
async fn end_sessions(
    conn: &mut ServerConn,
    pids: &str,
    timeout: Duration,
) -> Result<(), FenceError> {
    let list = format!("{{{pids}}}");
    conn.query_row(
        "SELECT count(pg_terminate_backend(p)) FROM unnest($1::int[]) p",
        &[&list],
    )
    .await?;
    let started = std::time::Instant::now();
    loop {
        let left = conn
            .query_row(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1::int[])",
                &[&list],
            )
            .await?
            .and_then(|r| r.into_iter().next().flatten())
            .unwrap_or_default();
        let left: usize = left.parse().map_err(|_| FenceError::Answer(left.clone()))?;
        if left == 0 {
            return Ok(());
        }
        if started.elapsed() >= timeout {
            return Err(FenceError::Lingering(left, timeout));
        }
        crate::timer::sleep(POLL).await;
    }
}

/// Where a pool stands with its mark.
#[derive(Default)]
pub(super) enum MarkSlot {
    /// No mark is needed: a single node, or a replica's pool (reads cannot be duplicated).
    #[default]
    NotNeeded,
    Held(Arc<Mark>),
    /// The pool's mark was given up: no server may be opened until it is taken over again.
    Lost,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_namespace_is_the_same_everywhere_and_positive() {
        assert_eq!(namespace("app/app"), namespace("app/app"));
        assert_ne!(namespace("app/app"), namespace("app/other"));
        for name in ["", "a", "tenant:x/y", "é/ü"] {
            assert!(namespace(name) >= 0);
        }
        // FNV-1a's published value for "a", kept positive.
        assert_eq!(namespace("a"), (0xe40c_292c_u32 & 0x7fff_ffff) as i32);
    }
}
