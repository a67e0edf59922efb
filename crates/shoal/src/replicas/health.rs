//! The checker of a pool's replicas: on each `replica_check_interval`, every replica's role
//! (`pg_is_in_recovery()`) and replay position, the primary's WAL position, and from them
//! each replica's lag. (The primary's catalogue, which the read-only proof reads, is the
//! database's: see [`crate::analysis::catalogue`].)
//!
//! Lag in time is how old the state a replica shows is: the time since the primary was at
//! the position the replica has replayed, from the primary positions this checker saw
//! (so within one check interval). PostgreSQL's `pg_last_xact_replay_timestamp()` would
//! call a replica of an idle primary late, and any write after a quiet minute a minute
//! late.
//! Runs on the control runtime, one connection per backend kept open between checks (as
//! the pool's user, so it sees what the pool's servers see).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use super::{Member, ReplicaSet, Role, Writer};
use crate::pool::Pool;
use crate::server::{ServerConn, ServerError, Upstream};

/// One question for every backend: whether it is a standby, and where its WAL is (a
/// primary's insert position: every commit it acknowledged is at or below it; a standby's
/// replay position).
const CHECK: &str = "SELECT pg_is_in_recovery(), CASE WHEN pg_is_in_recovery() \
     THEN COALESCE(pg_last_wal_replay_lsn(), '0/0') ELSE pg_current_wal_insert_lsn() END::text";

/// A check's connection, opened on demand and dropped when it fails.
struct Probe {
    upstream: Upstream,
    conn: Option<ServerConn>,
}

impl Probe {
    async fn row(
        &mut self,
        sql: &str,
        timeout: Duration,
    ) -> Result<Vec<Option<String>>, ServerError> {
        let r = crate::timer::timeout(timeout, async {
            if self.conn.is_none() {
                self.conn = Some(ServerConn::connect(&self.upstream, timeout).await?);
            }
            let conn = self.conn.as_mut().expect("connected above");
            conn.query_row(sql, &[]).await
        })
        .await;
        match r {
            Ok(Ok(Some(row))) => Ok(row),
            Ok(Ok(None)) => Err(ServerError::Protocol("the check returned no row".into())),
            Ok(Err(e)) => {
                self.conn = None;
                Err(e)
            }
            Err(_) => {
                self.conn = None;
                Err(ServerError::ConnectTimeout("replica check".into()))
            }
        }
    }
}

/// What one check of a backend found: its role and WAL position, and when it was asked.
struct Answer {
    asked: u64,
    role: Role,
    lsn: Option<u64>,
    error: Option<ServerError>,
}

impl Probe {
    async fn check(&mut self, timeout: Duration) -> Answer {
        // Taken before the question: every commit acknowledged before it is at or below
        // the position a primary answers with.
        let asked = crate::clock::now_ms();
        match self.row(CHECK, timeout).await {
            Ok(row) => {
                let col = |i: usize| row.get(i).cloned().flatten().unwrap_or_default();
                Answer {
                    asked,
                    role: if col(0) == "t" {
                        Role::Replica
                    } else {
                        Role::Primary
                    },
                    lsn: parse_lsn(&col(1)),
                    error: None,
                }
            }
            Err(e) => Answer {
                asked,
                role: Role::Down,
                lsn: None,
                error: Some(e),
            },
        }
    }
}

/// Checks until the set (or its primary pool) is gone.
pub async fn run(set: Weak<ReplicaSet>, primary: Weak<Pool>) {
    let (interval, mut probes, mut primary_probe) = {
        let (Some(s), Some(p)) = (set.upgrade(), primary.upgrade()) else {
            return;
        };
        let probes: Vec<Probe> = s
            .members
            .iter()
            .map(|m| Probe {
                upstream: m.pool.upstream.clone(),
                conn: None,
            })
            .collect();
        let primary_probe = Probe {
            upstream: p.upstream.clone(),
            conn: None,
        };
        (s.config.check_interval, probes, primary_probe)
    };
    let mut tick = crate::timer::interval(interval);
    let mut seen = Positions::default();
    loop {
        tick.tick().await;
        let (Some(set), Some(primary)) = (set.upgrade(), primary.upgrade()) else {
            return;
        };
        let timeout = primary.settings.connect_timeout.max(interval);
        let configured = primary_probe.check(timeout).await;
        let mut answers = Vec::with_capacity(probes.len());
        for probe in probes.iter_mut() {
            answers.push(probe.check(timeout).await);
        }
        let writer = set.elect(configured.role, |i| answers[i].role);
        let writes_at = match writer {
            Writer::Configured => Some(&configured),
            Writer::Member(i) => answers.get(i),
            Writer::Nowhere => None,
        };
        if let Some(Answer {
            asked,
            lsn: Some(lsn),
            ..
        }) = writes_at
        {
            seen.note(*asked, *lsn);
        }
        for (m, a) in set.members.iter().zip(answers) {
            judge(&set, m, a, &seen);
        }
        set.note_checked();
    }
}

/// The primary's WAL positions as the checker saw them, oldest first: for each, when it
/// was first and last seen (milliseconds on [`crate::clock::now_ms`], taken as each
/// question was sent).
#[derive(Default)]
struct Positions(VecDeque<Seen>);

#[derive(Clone, Copy)]
struct Seen {
    first: u64,
    last: u64,
    lsn: u64,
}

/// Positions kept: enough for the longest lag worth telling apart at a fine interval.
const POSITIONS_KEPT: usize = 4096;

impl Positions {
    fn note(&mut self, at_ms: u64, lsn: u64) {
        if let Some(back) = self.0.back_mut() {
            if back.lsn == lsn {
                // Nothing written since: the primary is still there.
                back.last = at_ms;
                return;
            }
        }
        if self.0.len() == POSITIONS_KEPT {
            self.0.pop_front();
        }
        self.0.push_back(Seen {
            first: at_ms,
            last: at_ms,
            lsn,
        });
    }

    /// How far behind a replica that replayed up to `replayed` is: WAL bytes, and
    /// milliseconds since the primary moved past that position (`None` each when the
    /// primary's position is not known).
    fn lag(&self, replayed: u64, now_ms: u64) -> (Option<u64>, Option<u64>) {
        let Some(newest) = self.0.back() else {
            return (None, None);
        };
        if replayed >= newest.lsn {
            return (Some(0), Some(0));
        }
        // The first position past what the replica replayed: the primary got there then,
        // so the replica's state is at least that old.
        let since = self
            .0
            .iter()
            .find(|s| s.lsn > replayed)
            .map(|s| s.first)
            .unwrap_or(now_ms);
        (
            Some(newest.lsn - replayed),
            Some(now_ms.saturating_sub(since)),
        )
    }

    /// The latest moment whose committed state a replica that replayed up to `replayed`
    /// shows in full: the last time the primary was seen at or below that position (0:
    /// none seen). A commit acknowledged before it is visible there.
    fn fresh_as_of(&self, replayed: u64) -> u64 {
        self.0
            .iter()
            .rev()
            .find(|s| s.lsn <= replayed)
            .map_or(0, |s| s.last)
    }
}

/// Updates a replica's state from its check.
fn judge(set: &ReplicaSet, m: &Member, a: Answer, seen: &Positions) {
    if let Some(e) = &a.error {
        if m.role() != Role::Down {
            tracing::warn!(pool = %m.pool.name, error = %crate::logsafe::Escaped(e), "replica unreachable");
        }
        m.role.store(Role::Down as u8, Ordering::Relaxed);
        m.ban(set.ban_ms(), "check failed");
        return;
    }
    let was = Role::from_u8(m.role.swap(a.role as u8, Ordering::Relaxed));
    if was != a.role {
        tracing::info!(pool = %m.pool.name, from = was.label(), to = a.role.label(), "replica role");
    }
    if a.role != Role::Replica {
        return;
    }
    let (bytes, ms) = match a.lsn {
        Some(replayed) => seen.lag(replayed, crate::clock::now_ms()),
        None => (None, None),
    };
    m.fresh_as_of
        .store(a.lsn.map_or(0, |r| seen.fresh_as_of(r)), Ordering::Relaxed);
    m.lag_bytes
        .store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    m.lag_ms.store(ms.unwrap_or(u64::MAX), Ordering::Relaxed);
    let limit = set.config.max_lag;
    let lagging = limit
        .time
        .is_some_and(|t| ms.is_some_and(|x| x > t.as_millis() as u64))
        || limit.bytes.is_some_and(|b| bytes.is_some_and(|x| x > b));
    if m.lagging.swap(lagging, Ordering::Relaxed) != lagging {
        if lagging {
            tracing::warn!(pool = %m.pool.name, lag_ms = ms, lag_bytes = bytes, "replica lags past max_replica_lag: no reads until it catches up");
        } else {
            tracing::info!(pool = %m.pool.name, lag_ms = ms, "replica caught up");
        }
    }
}

/// A WAL position as PostgreSQL writes it (`16/B374D848`).
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.split_once('/')?;
    Some((u64::from_str_radix(hi, 16).ok()? << 32) | u64::from_str_radix(lo, 16).ok()?)
}

#[cfg(test)]
mod tests {
    use super::{parse_lsn, Positions};

    #[test]
    fn lag_is_the_age_of_the_state_a_replica_shows() {
        let mut p = Positions::default();
        assert_eq!(p.lag(5, 1000), (None, None), "primary not seen yet");
        p.note(1000, 100);
        p.note(1100, 100);
        p.note(2000, 300);
        p.note(3000, 500);
        // Caught up: no lag, however long ago the primary last wrote.
        assert_eq!(p.lag(500, 60_000), (Some(0), Some(0)));
        // At 300: the primary moved past it at 3000.
        assert_eq!(p.lag(300, 3500), (Some(200), Some(500)));
        // Between 100 and 300: behind since the primary passed 100 (at 2000).
        assert_eq!(p.lag(150, 3500), (Some(350), Some(1500)));
        // Older than anything seen: at least as old as the oldest position.
        assert_eq!(p.lag(50, 3500), (Some(450), Some(2500)));
    }

    #[test]
    fn a_replica_is_fresh_as_of_the_last_time_the_primary_was_where_it_replayed() {
        let mut p = Positions::default();
        p.note(1000, 100);
        p.note(1100, 100);
        p.note(2000, 300);
        assert_eq!(p.fresh_as_of(50), 0, "older than anything seen");
        assert_eq!(
            p.fresh_as_of(100),
            1100,
            "the primary stayed at 100 until 1100"
        );
        assert_eq!(p.fresh_as_of(299), 1100);
        assert_eq!(p.fresh_as_of(300), 2000);
        p.note(2500, 300);
        assert_eq!(p.fresh_as_of(400), 2500);
    }

    #[test]
    fn wal_positions_read_as_numbers() {
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(parse_lsn("16/B374D848"), Some((0x16 << 32) | 0xB374D848));
        assert_eq!(parse_lsn("x"), None);
        assert_eq!(parse_lsn("1/zz"), None);
    }
}
