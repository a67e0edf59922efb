//! Sessions of a pool with read replicas: which backend runs the client's next unit of
//! work, and the guard that keeps a replica's transaction to what was proven to read.
//!
//! With `read_routing = "split"` a transaction goes to a replica only when its first unit
//! (a Query, or extended messages up to their Sync) is wholly buffered and proven
//! read-only. While it runs there, each further unit is proven before it is passed on; one
//! that is not stays in the client's buffer (`Outbound::held`), the transaction ends at its
//! boundary, and that unit starts the next transaction, on the primary. Inside a block the
//! client opened `READ ONLY` the transaction cannot move: each unit is proven all the same,
//! and one that is not is refused (`25006`) rather than trusted. `READ ONLY` is a promise
//! PostgreSQL enforces on the primary, not a proof: `SET TRANSACTION READ WRITE`, or a
//! `COMMIT` followed by a write in the same string, would otherwise reach the replica.

use std::sync::Arc;

use shoal_wire::frontend::tag as fe;
use shoal_wire::sqlstate;

use super::flow::Flow;
use super::outbound::Outbound;
use super::Session;
use crate::config::replicas::{ReadRouting, ReplicaFallback};
use crate::error::ErrorKind;
use crate::pool::Pool;
use crate::prepared::ClientStatements;
use crate::seam::{Features as _, ReadTarget, ReadUnit as Unit, WriteTarget};
use crate::Plugged;

/// [`Outbound::cleared`] of a unit passed whole (inside a `READ ONLY` block).
const UNTIL_UNIT_END: u32 = u32::MAX;

/// Where the client's next transaction runs.
enum Backend {
    Primary,
    /// A replica's pool, and how many messages at the head of the client's buffer were
    /// proven to read.
    Replica(Arc<Pool>, u32),
    /// The replica promoted in place of the configured primary (failover).
    Writer(Arc<Pool>),
    /// A read with no replica usable, and `replica_fallback = "error"`.
    NoReplica,
    /// The configured primary is a standby now and no replica was promoted.
    NoPrimary,
}

impl Session {
    /// The pool for the client's next unit when it is not the client's own (a replica's,
    /// with the number of messages proven to read, or a promoted replica's), or `None` when
    /// the client was told there is none. The first transactions after a start wait for the
    /// first check of the replicas.
    pub(super) async fn next_backend(
        &mut self,
    ) -> Result<Option<(Option<Arc<Pool>>, Option<u32>)>, super::SessionError> {
        if let Some(set) = Plugged::replicas(&self.pool) {
            if self.routing().0 != ReadRouting::Primary {
                Plugged::replicas_checked(set, &self.pool, self.pool.settings.connect_timeout)
                    .await;
            }
        }
        Ok(Some(match self.backend() {
            Backend::Primary => (None, None),
            Backend::Replica(pool, proven) => (Some(pool), Some(proven)),
            Backend::Writer(pool) => (Some(pool), None),
            Backend::NoReplica => {
                self.refuse_read().await?;
                return Ok(None);
            }
            Backend::NoPrimary => {
                self.refuse_write().await?;
                return Ok(None);
            }
        }))
    }

    /// The backend for the unit at the head of the client's buffer.
    fn backend(&self) -> Backend {
        let Some(set) = Plugged::replicas(&self.pool) else {
            return Backend::Primary;
        };
        Plugged::start_replicas(set, &self.pool);
        let (routing, fallback) = self.routing();
        // A fill for the cache reads where the versions it records are true: the primary.
        let filling = self.extras.as_ref().is_some_and(|x| x.capture.is_some());
        let read = match routing {
            _ if filling => None,
            ReadRouting::Primary => None,
            ReadRouting::Replicas => Some(0),
            ReadRouting::Split => match unit(
                &self.pool,
                &self.cbuf,
                self.statements.as_deref(),
                super::encoding_of(&self.extras),
            ) {
                Unit::Reads { messages } => Some(messages),
                Unit::Writes | Unit::Incomplete => None,
            },
        };
        if let Some(proven) = read {
            let wrote_at = self.extras.as_ref().map_or(0, |x| x.wrote_at);
            match Plugged::choose_read(set, &self.pool, wrote_at, fallback) {
                ReadTarget::Replica(pool) => return Backend::Replica(pool, proven),
                ReadTarget::NoReplica => return Backend::NoReplica,
                ReadTarget::Primary => {}
            }
        }
        match Plugged::write_target(set) {
            WriteTarget::Configured | WriteTarget::Promoted(None) => Backend::Primary,
            WriteTarget::Promoted(Some(p)) => Backend::Writer(p),
            WriteTarget::Nowhere => Backend::NoPrimary,
        }
    }

    /// Where this client's transactions go: its `target_session_attrs`, else its pool's
    /// `read_routing` and `replica_fallback`.
    pub(super) fn routing(&self) -> (ReadRouting, ReplicaFallback) {
        let target = self.extras.as_ref().and_then(|x| x.target);
        if let Some(r) = target.and_then(|t| t.routing()) {
            return r;
        }
        match Plugged::replicas(&self.pool) {
            Some(set) => Plugged::replica_routing(set),
            None => (ReadRouting::Primary, ReplicaFallback::Primary),
        }
    }

    /// Whether `pool` (a lease's) takes writes now: the client's own pool, or the replica
    /// promoted in its primary's place.
    pub(super) fn takes_writes(&self, pool: &Arc<Pool>) -> bool {
        Arc::ptr_eq(pool, &self.pool)
            || Plugged::replicas(&self.pool).is_some_and(|r| {
                matches!(Plugged::write_target(r), WriteTarget::Promoted(Some(w)) if Arc::ptr_eq(&w, pool))
            })
    }

    /// Bans the replica `pool` after a failure in real traffic.
    pub(super) fn ban_replica(&self, pool: &Arc<Pool>) {
        if let Some(set) = Plugged::replicas(&self.pool) {
            Plugged::ban_replica(set, pool);
        }
    }

    /// Tells a client that no host takes writes now.
    pub(super) async fn refuse_write(&mut self) -> Result<(), super::SessionError> {
        self.app.metrics.rejected(ErrorKind::ServerUnavailable);
        self.fail_unit(
            sqlstate::CONNECTION_FAILURE,
            &format!(
                "pool \"{}\": no primary: the configured primary is in recovery and no replica was promoted; writes are refused until one is",
                self.pool.name
            ),
        )
        .await
    }

    /// Tells a client whose read found no usable replica (with `replica_fallback =
    /// "error"`).
    pub(super) async fn refuse_read(&mut self) -> Result<(), super::SessionError> {
        self.app.metrics.rejected(ErrorKind::ServerUnavailable);
        self.fail_unit(
            sqlstate::CONNECTION_FAILURE,
            &format!(
                "pool \"{}\": no read replica is usable now (all down, banned or lagging past max_replica_lag) and replica_fallback = \"error\"",
                self.pool.name
            ),
        )
        .await
    }
}

/// What the unit at the head of `buf` (the client's buffered messages) comes to.
fn unit(
    pool: &Pool,
    buf: &[u8],
    statements: Option<&ClientStatements>,
    enc: shoal_wire::sql::ClientEncoding,
) -> Unit {
    let Some(set) = Plugged::replicas(pool) else {
        return Unit::Writes;
    };
    Plugged::read_unit(set, buf, statements, enc)
}

/// What becomes of a client message while a transaction may only read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Take {
    /// Proven (or part of a unit that was): it goes on.
    Pass,
    /// Not proven: it waits for the primary (or, on the primary, counts as a write).
    Hold,
    /// Inside a block on a replica, a unit not proven to read: refused, since the
    /// transaction cannot move to the primary.
    Refuse,
}

/// The refusal of [`Take::Refuse`].
pub(super) const REFUSED_ON_REPLICA: &str = "cannot run this statement in a READ ONLY transaction on a read replica: Shoal cannot prove it only reads (a write, SET TRANSACTION READ WRITE, a COMMIT followed by more, or a function, operator, cast or view not proven), and the transaction cannot move to the primary; run it outside a READ ONLY block";

/// Whether the client message at the head of `buf` (with type `tag`) may go to the replica
/// this transaction runs on (`Outbound::reads_only`), or, on the primary of a split pool,
/// whether it is proven to read (`Outbound::track_writes`).
pub(super) fn replica_may_take(
    pool: &Pool,
    buf: &[u8],
    statements: Option<&ClientStatements>,
    tag: u8,
    flow: &Flow,
    out: &mut Outbound,
    enc: shoal_wire::sql::ClientEncoding,
) -> Take {
    let ends_unit = matches!(tag, fe::SYNC | fe::QUERY | fe::FUNCTION_CALL);
    let in_block = flow.status != b'I' && (flow.is_idle() || out.in_block_unit);
    if in_block && out.reads_only && out.cleared != UNTIL_UNIT_END {
        // The transaction cannot move: each message is proven as it comes, and one that
        // is not is refused; the server then skips the rest of its unit, which passes.
        out.in_block_unit = !ends_unit;
        let n = shoal_wire::frame::next_frame_len(buf, u32::MAX as usize)
            .ok()
            .flatten()
            .unwrap_or(buf.len());
        let proven = Plugged::replicas(pool)
            .is_some_and(|set| Plugged::message_reads(set, &buf[..n], statements, enc));
        if proven {
            return Take::Pass;
        }
        if !ends_unit {
            out.cleared = UNTIL_UNIT_END;
        }
        return Take::Refuse;
    }
    if out.cleared == 0 {
        match unit(pool, buf, statements, enc) {
            Unit::Reads { messages } => out.cleared = messages,
            // On the primary, a block's units pass as they are (its first was a write).
            _ if in_block => out.cleared = UNTIL_UNIT_END,
            Unit::Writes | Unit::Incomplete => return Take::Hold,
        }
    }
    if out.cleared == UNTIL_UNIT_END {
        if ends_unit {
            out.cleared = 0;
            out.in_block_unit = false;
        }
    } else {
        out.cleared -= 1;
    }
    Take::Pass
}

/// The pool a session-mode client of `pool` takes its one server from: a replica's when
/// all its reads go to replicas (`read_routing = "replicas"`, or its
/// `target_session_attrs`), else the one that takes writes. A session cannot be split:
/// `"split"` keeps it on the primary.
pub(super) async fn session_backend(
    pool: &Arc<Pool>,
    target: Option<crate::config::replicas::TargetSessionAttrs>,
) -> Result<Arc<Pool>, super::SessionError> {
    let Some(set) = Plugged::replicas(pool) else {
        return Ok(pool.clone());
    };
    Plugged::start_replicas(set, pool);
    let (routing, fallback) = target
        .and_then(|t| t.routing())
        .unwrap_or_else(|| Plugged::replica_routing(set));
    Plugged::replicas_checked(set, pool, pool.settings.connect_timeout).await;
    if routing == ReadRouting::Replicas {
        match Plugged::choose_read(set, pool, 0, fallback) {
            ReadTarget::Replica(p) => return Ok(p),
            ReadTarget::NoReplica => {
                return Err(super::SessionError::fatal(
                    ErrorKind::ServerUnavailable,
                    sqlstate::CONNECTION_FAILURE,
                    format!(
                        "pool \"{}\": no read replica is usable now (all down, banned or lagging past max_replica_lag)",
                        pool.name
                    ),
                ))
            }
            ReadTarget::Primary => {}
        }
    }
    match Plugged::write_target(set) {
        WriteTarget::Promoted(p) => Ok(p.unwrap_or_else(|| pool.clone())),
        WriteTarget::Nowhere => Err(super::SessionError::fatal(
            ErrorKind::ServerUnavailable,
            sqlstate::CONNECTION_FAILURE,
            format!(
                "pool \"{}\": no primary: the configured primary is in recovery and no replica was promoted",
                pool.name
            ),
        )),
        WriteTarget::Configured => Ok(pool.clone()),
    }
}
