//! A checked-out server and the ways back: checked in as it is at a boundary, cleaned or
//! closed when its client let go of it in the middle of something (see
//! [`crate::disposition`]), closed when dropped.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::permits::Permit;
use super::Pool;
use crate::disposition::{decide, CloseReason, Disposition, ServerState};
use crate::server::{ServerConn, ServerError};

/// A checked-out server. Dropping it without [`Pool::checkin`] closes the connection (a
/// broken or abandoned server is never reused); either way it gives its pool permit back.
pub struct Lease {
    conn: Option<Box<ServerConn>>,
    pool: Arc<Pool>,
}

impl std::ops::Deref for Lease {
    type Target = ServerConn;
    fn deref(&self) -> &ServerConn {
        self.conn
            .as_ref()
            .expect("a lease holds its connection until dropped")
    }
}

impl std::ops::DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut ServerConn {
        self.conn
            .as_mut()
            .expect("a lease holds its connection until dropped")
    }
}

/// In what state a client leaves the server it held, for [`Lease::release`].
#[derive(Debug, Clone, Copy)]
pub struct Leaving {
    /// Replies are still owed (a query may be running, a batch is unsynced, a COPY is open).
    pub busy: bool,
    /// A client message is only partly written to the server.
    pub partial: bool,
    /// A transaction block is open.
    pub in_transaction: bool,
    /// Run the pool's `server_reset_query` (session mode).
    pub reset: bool,
}

impl Lease {
    /// `conn` for a client, holding `permit` of `pool`'s until dropped.
    pub(super) fn new(pool: &Arc<Pool>, conn: Box<ServerConn>, permit: Permit<'_>) -> Lease {
        permit.keep();
        Lease {
            conn: Some(conn),
            pool: pool.clone(),
        }
    }

    /// The server, taken for checkin (the permit stays until the lease drops).
    pub(super) fn take_conn(&mut self) -> Option<Box<ServerConn>> {
        self.conn.take()
    }

    /// The pool the server belongs to (a replica's, when a transaction reads there).
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// The way back to the pool: a healthy server at a boundary goes back as it is.
    pub fn checkin(self) {
        let pool = self.pool.clone();
        pool.checkin(self);
    }

    /// The client left (or broke the protocol) while holding this server: make it clean
    /// before anyone else gets it, or close it. A server with a query possibly running gets
    /// a CancelRequest and is closed; an open transaction is rolled back; in session mode the
    /// reset query runs; all of it bounded by `server_reset_timeout`.
    pub async fn release(mut self, how: Leaving) {
        let reset_query = self.pool.settings.reset_query.clone();
        let state = ServerState {
            busy: how.busy,
            partial_message: how.partial,
            in_transaction: how.in_transaction,
            reset: how.reset && !reset_query.is_empty(),
            expired: self.pool.past_lifetime(&self),
            pool_ended: self.pool.ended().is_some(),
            ..ServerState::default()
        };
        // A server that ran a client's LISTEN stops listening before anyone else has it.
        let listens = self.session.take_listens();
        let (rollback, reset) = match decide(&state) {
            Disposition::CheckIn if !listens => return self.checkin(),
            Disposition::CheckIn => (false, false),
            Disposition::Clean { rollback, reset } => (rollback, reset),
            Disposition::Close(reason) => return self.close(reason),
        };
        let timeout = self.pool.settings.reset_timeout;
        let clean = async {
            if rollback {
                self.simple_query("ROLLBACK").await?;
            }
            if listens {
                self.simple_query("UNLISTEN *").await?;
            }
            if reset {
                self.reset_session(&reset_query).await?;
            }
            Ok::<(), ServerError>(())
        };
        match crate::timer::timeout(timeout, clean).await {
            Ok(Ok(())) => self.checkin(),
            _ => self.close(CloseReason::Lost),
        }
    }

    /// Closes the server for `reason` (after a CancelRequest when a request may still run).
    pub fn close(self, reason: CloseReason) {
        tracing::debug!(pool = %self.pool.name, server = self.id, reason = reason.label(), "closing a server");
        if reason.cancel_first() {
            let target = self.cancel_target();
            drop(self);
            tokio::spawn(crate::server::forward(target));
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.stats.servers.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!(pool = %self.pool.name, server = conn.id, "discarding server connection");
            tokio::spawn(conn.close());
        }
        // After the connection is idle again (checkin), so the waiter handed the permit
        // finds it.
        self.pool.permits.release();
    }
}
