//! What a pooled server's session holds beyond its connection, with one owner: the client
//! parameters and SETs applied on it, whether a client left state behind (and which client),
//! the statements it has prepared and the replies it still owes. Every change goes through
//! these methods, so "is this server right for the next client?" has one answer.
//!
//! Pure bookkeeping: [`crate::server::ServerConn::prepare_for`] turns a [`Plan`] into the
//! SQL it sends.

use std::collections::VecDeque;

use crate::prepared::{Expect, ServerStatements};

#[derive(Default, Debug)]
pub struct ServerSession {
    /// Client parameters applied (sorted by name); compared with the next client's.
    applied: Vec<(String, String)>,
    /// A client left session state here that Shoal does not replay.
    dirty: bool,
    /// The client whose state that is (connection id; 0: none or unknown).
    dirty_owner: u64,
    /// [`crate::sets::SessionSets::fingerprint`] of the SETs replayed here (0: none).
    sets_applied: u64,
    /// The client whose transaction last ran here since the session was last reset (0:
    /// none): with `server_reset = "always"`, any other client gets the server cleaned.
    last_client: u64,
    statements: ServerStatements,
    expect: VecDeque<Expect>,
    /// A client's carried `LISTEN` ran here: the server listens until it is unlistened,
    /// which happens before it goes back to the pool (the pool's listener delivers).
    listens: bool,
    /// A live client whose state the last plan cleaned away (0: none): it is told at its
    /// next statement (see [`crate::pool::Pool::state_lost`]).
    evicted: u64,
}

/// What an idle server is to a client about to take it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// It holds this client's own state: the client gets its session back as it left it.
    Own,
    /// It holds no client's state.
    Clean,
    /// It holds the state of a client that has left (or of no known client): nobody
    /// loses anything when it is cleaned.
    Orphaned,
    /// It holds another, live client's state, which would be cleaned away.
    Other,
}

/// What a server needs before a client's transaction runs on it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// `DISCARD ALL`: another client's state, or Shoal's statement records, must go.
    pub clean: bool,
    /// `RESET ALL` before applying parameters (the previous client's are in force).
    pub reset_params: bool,
    /// Apply the client's startup parameters.
    pub apply_params: bool,
    /// Replay the client's held SETs.
    pub replay_sets: bool,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        *self == Plan::default()
    }
}

impl ServerSession {
    /// Whether a client left state here that a clean would lose.
    pub fn holds_state(&self) -> bool {
        self.dirty
    }

    /// What this server is to `client` (0: a client not yet identified).
    pub fn fit(&self, client: u64) -> Fit {
        match (self.dirty, self.dirty_owner) {
            (false, _) => Fit::Clean,
            (true, owner) if owner == client && client != 0 => Fit::Own,
            (true, 0) => Fit::Orphaned,
            (true, _) => Fit::Other,
        }
    }

    /// The client whose state this is has left: the state is nobody's now.
    pub fn owner_left(&mut self, client: u64) {
        if self.dirty_owner == client {
            self.dirty_owner = 0;
        }
    }

    /// The live client whose state the last plan cleaned away, once.
    pub fn take_evicted(&mut self) -> u64 {
        std::mem::take(&mut self.evicted)
    }

    /// A client's message leaves state behind.
    pub fn mark_dirty(&mut self) {
        self.dirty = true;
    }

    /// The transaction of `client` ended here: state left now is that client's.
    pub fn transaction_ended(&mut self, client: u64) {
        if self.dirty && self.dirty_owner == 0 {
            self.dirty_owner = client;
        }
        self.last_client = client;
    }

    /// What the server needs for `client` (0: a client not yet identified, as at login),
    /// with startup `params` and held SETs of fingerprint `sets` (0: none); with `always`,
    /// a server another client used is cleaned whatever Shoal saw. Records the result as if
    /// done: if doing it fails, the caller drops the server.
    pub fn plan(
        &mut self,
        client: u64,
        params: &[(String, String)],
        sets: u64,
        always: bool,
    ) -> Plan {
        let mut plan = Plan::default();
        if client != 0 && self.dirty && self.dirty_owner == client {
            // The state here is this client's own (its temporary tables, its SETs as they
            // stand): it gets its session back as it left it.
            self.sets_applied = sets;
        }
        plan.clean = self.statements.needs_clean
            || (self.dirty && (self.dirty_owner == 0 || self.dirty_owner != client))
            || (self.sets_applied != 0 && self.sets_applied != sets)
            || (always && self.last_client != 0 && self.last_client != client);
        if plan.clean {
            let owner = self.dirty_owner;
            self.reset();
            if self.dirty_was(owner, client) {
                self.evicted = owner;
            }
        }
        if plan.clean || self.applied[..] != *params {
            plan.reset_params = !plan.clean && !self.applied.is_empty();
            plan.apply_params = !params.is_empty();
            params.clone_into(&mut self.applied);
            self.sets_applied = 0;
        }
        if sets != 0 && self.sets_applied != sets {
            plan.replay_sets = true;
            self.sets_applied = sets;
        }
        if !plan.is_empty() {
            // Pooler queries are simple queries: they drop the unnamed statement.
            self.statements.unnamed_dropped();
        }
        plan
    }

    /// Whether cleaning took state from `owner`, a live client other than `client`.
    fn dirty_was(&self, owner: u64, client: u64) -> bool {
        owner != 0 && owner != client
    }

    /// The session was reset (`DISCARD ALL` or the session-mode reset query): nothing of any
    /// client is left, and no statement is prepared.
    pub fn reset(&mut self) {
        self.applied.clear();
        self.dirty = false;
        self.dirty_owner = 0;
        self.sets_applied = 0;
        self.last_client = 0;
        self.statements.clear();
    }

    /// The server answered everything Shoal translated for.
    pub fn owes_nothing(&self) -> bool {
        self.expect.is_empty()
    }

    pub fn owed(&self) -> usize {
        self.expect.len()
    }

    /// Back in the pool: nothing is owed to anyone any more.
    pub fn checked_in(&mut self) {
        self.expect.clear();
    }

    /// The reply the server owes next.
    pub fn next_owed(&self) -> Option<&Expect> {
        self.expect.front()
    }

    /// What the statement translation works on while a client holds the server: the
    /// prepared statements, the replies owed, and the dirty flag.
    pub fn translation(&mut self) -> (&mut ServerStatements, &mut VecDeque<Expect>, &mut bool) {
        (&mut self.statements, &mut self.expect, &mut self.dirty)
    }

    /// A client's `LISTEN` completed here (see `listens`).
    pub fn listened(&mut self) {
        self.listens = true;
    }

    /// Whether the server is to be unlistened before anyone else uses it; clears the mark.
    pub fn take_listens(&mut self) -> bool {
        std::mem::take(&mut self.listens)
    }

    /// Whether the next ReadyForQuery is one of Shoal's own, hidden from the client.
    pub fn ready_is_hidden(&self) -> bool {
        matches!(self.expect.front(), Some(Expect::HideSync))
    }

    /// A simple query of the pooler's ran: the unnamed statement is gone.
    pub fn unnamed_dropped(&mut self) {
        self.statements.unnamed_dropped();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(v: &str) -> Vec<(String, String)> {
        vec![("application_name".into(), v.into())]
    }

    #[test]
    fn a_fresh_server_only_gets_the_parameters() {
        let mut s = ServerSession::default();
        let p = s.plan(1, &params("a"), 0, false);
        assert_eq!(
            p,
            Plan {
                apply_params: true,
                ..Plan::default()
            }
        );
        assert!(
            s.plan(1, &params("a"), 0, false).is_empty(),
            "nothing to do twice"
        );
        let p = s.plan(2, &params("b"), 0, false);
        assert!(p.reset_params && p.apply_params && !p.clean);
    }

    /// A client that left leaves nobody's state; a live owner's state taken is recorded
    /// once, so the owner can be told.
    #[test]
    fn owners_that_left_lose_nothing_and_live_ones_are_recorded() {
        let mut s = ServerSession::default();
        s.mark_dirty();
        s.transaction_ended(1);
        assert_eq!(s.fit(1), Fit::Own);
        assert_eq!(s.fit(2), Fit::Other);
        s.owner_left(3);
        assert_eq!(s.fit(2), Fit::Other, "another client left");
        s.owner_left(1);
        assert_eq!(s.fit(2), Fit::Orphaned);
        assert!(s.plan(2, &[], 0, false).clean);
        assert_eq!(s.take_evicted(), 0, "nobody lost anything");

        s.mark_dirty();
        s.transaction_ended(2);
        assert!(s.plan(4, &[], 0, false).clean);
        assert_eq!(s.take_evicted(), 2);
        assert_eq!(s.take_evicted(), 0, "once");
    }

    #[test]
    fn dirt_is_cleaned_for_others_but_kept_for_its_owner() {
        let mut s = ServerSession::default();
        s.plan(1, &[], 0, false);
        s.mark_dirty();
        s.transaction_ended(1);
        assert!(
            s.plan(1, &[], 0, false).is_empty(),
            "client 1 gets its own state back"
        );
        let p = s.plan(2, &[], 0, false);
        assert!(p.clean, "client 2 gets a clean session");
        assert!(s.plan(2, &[], 0, false).is_empty());
        // Dirt left by a client that was never identified is cleaned for everyone.
        s.mark_dirty();
        assert!(s.plan(0, &[], 0, false).clean);
    }

    #[test]
    fn held_sets_are_replayed_and_another_clients_are_cleaned() {
        let mut s = ServerSession::default();
        let p = s.plan(1, &[], 7, false);
        assert!(p.replay_sets && !p.clean);
        assert!(s.plan(1, &[], 7, false).is_empty());
        let p = s.plan(2, &[], 0, false);
        assert!(p.clean, "client 1's SETs are in force");
        let p = s.plan(3, &[], 9, false);
        assert!(p.replay_sets && !p.clean);
    }

    #[test]
    fn always_cleans_for_every_other_client() {
        let mut s = ServerSession::default();
        assert!(!s.plan(1, &[], 0, true).clean, "a fresh server");
        s.transaction_ended(1);
        assert!(!s.plan(1, &[], 0, true).clean, "its own client again");
        assert!(
            s.plan(2, &[], 0, true).clean,
            "nothing seen, cleaned all the same"
        );
        assert!(
            !s.plan(2, &[], 0, true).clean,
            "clean until a transaction ran"
        );
        s.transaction_ended(2);
        assert!(s.plan(0, &[], 0, true).clean, "a login");
        assert!(
            !s.plan(3, &[], 0, true).clean,
            "the login's own first transaction"
        );
        s.transaction_ended(3);
        assert!(
            !s.plan(4, &[], 0, false).clean,
            "dirty mode: nothing seen, nothing done"
        );
    }
}
