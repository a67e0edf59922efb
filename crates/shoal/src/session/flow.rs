//! What the protocol still owes on a server connection, as a pure state machine: the relay
//! feeds it every client message sent and every reply that matters, and asks whether the
//! server is at a true boundary (everything answered, nothing unsynced, no COPY, no open
//! transaction) — the only point where a transaction-mode server may go back to the pool.

use shoal_wire::frontend::tag as fe;

#[derive(Debug, Clone)]
pub struct Flow {
    /// ReadyForQuery messages still to come (one per Query, FunctionCall and Sync sent).
    pub pending: u32,
    /// Extended-protocol messages were sent after the last Sync.
    pub unsynced: bool,
    /// The server is in COPY FROM STDIN and waits for the client's data.
    pub copy_in: bool,
    /// Syncs sent since the last Execute: the server ignores them if that Execute starts a
    /// COPY FROM STDIN, so they must not be counted as owed ReadyForQuery messages.
    syncs_after_execute: Option<u32>,
    /// Transaction status of the last ReadyForQuery.
    pub status: u8,
    /// DDL completed in the current transaction (statements are re-planned once it ends).
    pub schema_changed: bool,
    /// The relay ended with a message only partly passed through (see
    /// [`super::outbound::Outbound::partial`]).
    pub partial: bool,
}

impl Default for Flow {
    fn default() -> Self {
        Flow {
            pending: 0,
            unsynced: false,
            copy_in: false,
            syncs_after_execute: None,
            status: b'I',
            schema_changed: false,
            partial: false,
        }
    }
}

impl Flow {
    /// The server has answered everything and no transaction is open.
    pub fn at_boundary(&self) -> bool {
        self.pending == 0 && !self.unsynced && !self.copy_in && self.status == b'I'
    }

    /// Nothing is owed or open: no reply can still come, and no COPY can be running or
    /// starting (a COPY message from the client now is one PostgreSQL would ignore).
    pub fn is_idle(&self) -> bool {
        self.pending == 0 && !self.unsynced && !self.copy_in
    }

    /// A client message is sent to the server. `Ok(false)` for Terminate (not sent); an
    /// unknown type is an error carrying it.
    #[inline]
    pub fn client(&mut self, tag: u8) -> Result<bool, u8> {
        match tag {
            fe::QUERY | fe::FUNCTION_CALL => {
                self.pending += 1;
                self.syncs_after_execute = None;
            }
            fe::SYNC => {
                if !self.copy_in {
                    self.pending += 1;
                }
                self.unsynced = false;
                if let Some(k) = self.syncs_after_execute.as_mut() {
                    *k += 1;
                }
            }
            fe::EXECUTE => {
                self.unsynced = true;
                self.syncs_after_execute = Some(0);
            }
            fe::PARSE | fe::BIND | fe::DESCRIBE | fe::CLOSE => self.unsynced = true,
            fe::FLUSH | fe::COPY_DATA => {}
            fe::COPY_DONE | fe::COPY_FAIL => self.copy_in = false,
            fe::TERMINATE => return Ok(false),
            other => return Err(other),
        }
        Ok(true)
    }

    /// An ErrorResponse: a COPY in progress is over.
    pub fn error_response(&mut self) {
        self.copy_in = false;
    }

    /// CopyInResponse: the server waits for data, and ignores the Syncs that reached it
    /// after the Execute that started the COPY.
    pub fn copy_in_response(&mut self) {
        self.copy_in = true;
        if let Some(k) = self.syncs_after_execute.take() {
            self.pending = self.pending.saturating_sub(k);
        }
    }

    /// ReadyForQuery with `status`; `answered` when it answers something the client sent
    /// (not a reply to a message Shoal added and hides).
    pub fn ready_for_query(&mut self, status: u8, answered: bool) {
        self.status = status;
        if answered {
            self.pending = self.pending.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One unit of client traffic and what PostgreSQL answers it with.
    #[derive(Debug, Clone)]
    enum Unit {
        /// A simple query: one ReadyForQuery.
        Query,
        /// An extended batch (Parse, Bind, Execute) ended by Sync: one ReadyForQuery.
        Batch,
        /// Extended messages not yet synced, then Flush.
        Unsynced,
        /// COPY FROM STDIN over the extended protocol: Execute, Sync (ignored by the server),
        /// CopyInResponse, data, CopyDone, Sync: one ReadyForQuery.
        CopyIn,
    }

    fn unit() -> impl Strategy<Value = Unit> {
        prop_oneof![
            Just(Unit::Query),
            Just(Unit::Batch),
            Just(Unit::Unsynced),
            Just(Unit::CopyIn)
        ]
    }

    proptest! {
        /// Whatever the client pipelines, the server is at a boundary exactly when every
        /// reply owed has arrived, nothing is left unsynced, and the last status is idle.
        #[test]
        fn boundary_only_when_everything_is_answered(
            units in proptest::collection::vec(unit(), 1..12),
            statuses in proptest::collection::vec(prop_oneof![Just(b'I'), Just(b'T')], 12),
        ) {
            let mut f = Flow::default();
            let mut owed = 0u32;
            for u in &units {
                match u {
                    Unit::Query => {
                        f.client(fe::QUERY).unwrap();
                        owed += 1;
                    }
                    Unit::Batch => {
                        for t in [fe::PARSE, fe::BIND, fe::EXECUTE, fe::SYNC] {
                            f.client(t).unwrap();
                        }
                        owed += 1;
                    }
                    Unit::Unsynced => {
                        f.client(fe::BIND).unwrap();
                        f.client(fe::FLUSH).unwrap();
                    }
                    Unit::CopyIn => {
                        f.client(fe::BIND).unwrap();
                        f.client(fe::EXECUTE).unwrap();
                        f.client(fe::SYNC).unwrap();
                        f.copy_in_response();
                        prop_assert!(!f.at_boundary(), "in COPY");
                        f.client(fe::COPY_DATA).unwrap();
                        f.client(fe::COPY_DONE).unwrap();
                        f.client(fe::SYNC).unwrap();
                        owed += 1;
                    }
                }
            }
            // Only a Sync ends an extended batch (a simple query does not): Shoal keeps the
            // server until the client syncs.
            let unsynced_tail = units.iter().fold(false, |open, u| match u {
                Unit::Unsynced => true,
                Unit::Batch | Unit::CopyIn => false,
                Unit::Query => open,
            });
            prop_assert_eq!(f.pending, owed);
            for i in 0..owed {
                prop_assert!(!f.at_boundary(), "replies still owed");
                let last = i + 1 == owed;
                let status = if last { b'I' } else { statuses[i as usize % statuses.len()] };
                f.ready_for_query(status, true);
            }
            prop_assert_eq!(f.at_boundary(), !unsynced_tail);
            // A hidden ReadyForQuery (a reply to Shoal's own Sync) answers nothing.
            f.ready_for_query(b'I', false);
            prop_assert_eq!(f.pending, 0);
            if !unsynced_tail {
                f.ready_for_query(b'T', true);
                prop_assert!(!f.at_boundary(), "inside a transaction block");
            }
        }
    }

    #[test]
    fn terminate_and_unknown_messages() {
        let mut f = Flow::default();
        assert_eq!(f.client(fe::TERMINATE), Ok(false));
        assert_eq!(f.client(b'?'), Err(b'?'));
    }
}
