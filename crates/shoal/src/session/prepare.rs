//! Making a checked-out server's session what its client expects (transaction mode): clean
//! what another client left, apply the client's startup parameters and held SETs — in one
//! write, bounded by `server_reset_timeout`.

use std::time::Duration;

use bytes::BytesMut;
use shoal_wire::frontend;

use crate::pool::Lease;
use crate::server::ServerError;
use crate::sets;

/// Makes a server's session what this client expects: nothing a previous client left, its
/// startup parameters, and its session `SET`s. Costs nothing when the server already matches;
/// otherwise one write and one wait, bounded by `server_reset_timeout` (a server that does
/// not answer in time is closed by the caller).
pub(super) async fn prepare_server(
    lease: &mut Lease,
    client: u64,
    params: &[(String, String)],
    sets: Option<&sets::SessionSets>,
    timeout: Duration,
) -> Result<(), ServerError> {
    let want = sets.map_or(0, |s| s.fingerprint);
    let mut out = BytesMut::new();
    let mut replies = 0;
    if client != 0 && lease.session_dirty && lease.dirty_owner == client {
        // This client left the state here itself (its temporary tables, its SETs as they
        // stand): it gets its own session back as it was.
        lease.sets_applied = want;
    }
    let clean = lease.statements.needs_clean
        || (lease.session_dirty && lease.dirty_owner != client)
        || (lease.sets_applied != 0 && lease.sets_applied != want);
    if clean {
        frontend::query(&mut out, crate::params::CLEAN_SESSION_SQL);
        replies += 1;
        lease.statements.clear();
        lease.session_dirty = false;
        lease.dirty_owner = 0;
        lease.sets_applied = 0;
    }
    if clean || lease.applied[..] != *params {
        if !clean && !lease.applied.is_empty() {
            frontend::query(&mut out, "RESET ALL");
            replies += 1;
        }
        if !params.is_empty() {
            frontend::parse_bind_execute(
                &mut out,
                &crate::params::apply_statement(params.len()),
                &crate::params::apply_values(params),
            );
            replies += 1;
        }
        lease.applied = params.to_vec();
        lease.sets_applied = 0;
    }
    if let Some(s) = sets.filter(|s| s.fingerprint != 0 && lease.sets_applied != s.fingerprint) {
        frontend::query(&mut out, &s.replay_sql());
        replies += 1;
        lease.sets_applied = s.fingerprint;
    }
    if replies == 0 {
        return Ok(());
    }
    lease.statements.unnamed_dropped();
    match tokio::time::timeout(timeout, lease.run_batch(&out, replies)).await {
        Ok(r) => r,
        Err(_) => Err(ServerError::ResetTimeout(timeout)),
    }
}
