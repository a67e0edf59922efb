//! One shard's idle servers, and which one a client gets. A server a client left its own
//! state on (a temporary table, a `WITH HOLD` cursor) goes back to that client when it comes
//! back; a clean server to anyone; another client's state is cleaned away only when nothing
//! else can be had (see [`super::Pool::checkout`]). Without such servers, the most recently
//! returned server is taken (the rest age out), and the choice costs one check.

use std::collections::VecDeque;

use crate::server::ServerConn;
use crate::server_session::Fit;

#[derive(Default)]
pub(super) struct IdleList {
    /// Oldest returned first.
    servers: VecDeque<Box<ServerConn>>,
    /// How many hold a client's state.
    holding: usize,
}

impl IdleList {
    pub(super) fn push(&mut self, conn: Box<ServerConn>) {
        if conn.session.holds_state() {
            self.holding += 1;
        }
        self.servers.push_back(conn);
    }

    pub(super) fn len(&self) -> usize {
        self.servers.len()
    }

    pub(super) fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.servers.iter().map(|c| c.id)
    }

    /// The server for `client`: one holding its own state, else the most recently returned
    /// clean one, else one whose owner has left (cleaning it takes nothing from anyone),
    /// else (only with `take_others`) the most recent holding a live client's state.
    #[inline]
    pub(super) fn take(&mut self, client: u64, take_others: bool) -> Option<Box<ServerConn>> {
        if self.holding == 0 {
            return self.servers.pop_back();
        }
        self.take_best(client, take_others)
    }

    /// [`IdleList::take`] when some servers hold a client's state.
    fn take_best(&mut self, client: u64, take_others: bool) -> Option<Box<ServerConn>> {
        let (mut clean, mut orphaned, mut other) = (None, None, None);
        for i in (0..self.servers.len()).rev() {
            match self.servers[i].session.fit(client) {
                Fit::Own => return self.remove(i),
                Fit::Clean => {
                    clean.get_or_insert(i);
                }
                Fit::Orphaned => {
                    orphaned.get_or_insert(i);
                }
                Fit::Other => {
                    other.get_or_insert(i);
                }
            }
        }
        let i = clean.or(orphaned).or(other.filter(|_| take_others))?;
        self.remove(i)
    }

    /// `client` has left: the state it left on servers here is nobody's.
    pub(super) fn owner_left(&mut self, client: u64) {
        for c in self.servers.iter_mut() {
            c.session.owner_left(client);
        }
    }

    fn remove(&mut self, i: usize) -> Option<Box<ServerConn>> {
        let conn = self.servers.remove(i)?;
        if conn.session.holds_state() {
            self.holding -= 1;
        }
        Some(conn)
    }

    /// Every server, oldest first.
    pub(super) fn drain(&mut self) -> Vec<Box<ServerConn>> {
        self.holding = 0;
        self.servers.drain(..).collect()
    }

    /// Up to `n` servers, oldest first.
    pub(super) fn drain_oldest(&mut self, n: usize) -> Vec<Box<ServerConn>> {
        let taken: Vec<_> = self.servers.drain(..n.min(self.servers.len())).collect();
        self.holding -= taken.iter().filter(|c| c.session.holds_state()).count();
        taken
    }

    /// Takes out, oldest first, the servers `remove` says go; keeps the rest in order.
    pub(super) fn sweep(
        &mut self,
        mut remove: impl FnMut(&mut ServerConn) -> bool,
    ) -> Vec<Box<ServerConn>> {
        let mut kept = VecDeque::with_capacity(self.servers.len());
        let mut gone = Vec::new();
        while let Some(mut c) = self.servers.pop_front() {
            if remove(&mut c) {
                gone.push(c);
            } else {
                kept.push_back(c);
            }
        }
        self.servers = kept;
        self.holding = self
            .servers
            .iter()
            .filter(|c| c.session.holds_state())
            .count();
        gone
    }
}
