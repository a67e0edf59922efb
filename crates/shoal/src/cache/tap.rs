//! The cache's side of its database's change stream (see [`crate::wal`]): every committed
//! change to a table the cache keeps results of, from any client of the database (through
//! Shoal or not, by triggers too), bumps the table's version (see [`super::freshness`]).
//!
//! The stream is the database's one stream on this node, shared with Realtime's Postgres
//! Changes: one slot and one publication. Which tables may be followed is the database's
//! catalogue's to say ([`crate::analysis::catalogue`]). A table is covered once the stream
//! carries its changes: the capture adds it to the publication, then writes a marker to the
//! WAL; when the marker comes back, every transaction that committed before the addition
//! has been passed, and every later change to the table will be. Whenever the stream stops,
//! nothing is covered and everything kept before is dropped (the epoch moves), since
//! changes in between are not seen.

use std::sync::atomic::Ordering;

use super::freshness::{Freshness, BY_RESET, BY_STREAM};
use crate::analysis::catalogue::Relation;
use crate::server::Upstream;
use crate::wal::{Cover, Tap};

impl Tap for Freshness {
    fn upstream(&self) -> Upstream {
        self.upstream.clone()
    }

    fn to_cover(&self, pending: &[String]) -> Vec<Cover> {
        let wanted: Vec<_> = self
            .tables()
            .into_iter()
            .filter(|t| {
                t.wanted.load(Ordering::Acquire)
                    && !t.covered()
                    && !t.refused.load(Ordering::Acquire)
                    && !pending.contains(&t.name)
            })
            .collect();
        if wanted.is_empty() {
            return Vec::new();
        }
        let catalogue = self.catalogue();
        let mut covers = Vec::new();
        for t in wanted {
            match catalogue.relations.get(&t.name) {
                Some(Relation {
                    cacheable: true,
                    qualified,
                    ..
                }) => covers.push(Cover {
                    name: t.name.clone(),
                    qualified: qualified.clone(),
                }),
                // Not a table the stream can follow.
                Some(_) => {}
                // Made since the catalogue was read: looked at again on the next tick.
                None => self.want_catalogue(),
            }
        }
        covers
    }

    fn refused(&self, name: &str, why: &str) {
        tracing::warn!(database = %self.label, table = %name, error = %why, "cannot add a table to the change stream's publication; its results are not cached");
        if let Some(t) = self.known_table(name) {
            t.refused.store(true, Ordering::Release);
        }
    }

    fn covered(&self, name: &str) {
        if let Some(t) = self.known_table(name) {
            t.set_covered(true);
        }
    }

    fn committed(&self, tables: &[&str]) {
        for name in tables {
            self.changed(name, BY_STREAM);
        }
    }

    fn started(&self, slot: &str) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.connected = true;
        s.last_error = None;
        s.slot = Some(slot.to_owned());
        drop(s);
        tracing::info!(database = %self.label, slot, "cache change stream started");
    }

    fn lost(&self, why: Option<&str>) {
        for t in self.tables() {
            t.set_covered(false);
        }
        self.reset(BY_RESET);
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let was = s.connected;
        s.connected = false;
        s.slot = None;
        if let Some(why) = why {
            s.last_error = Some(why.to_owned());
        }
        drop(s);
        match why {
            Some(why) => {
                tracing::warn!(database = %self.label, error = %why, "cache change stream lost; nothing is served from the cache until it is back");
            }
            None if was => {
                tracing::info!(database = %self.label, "cache change stream stopped; nothing is served from the cache until it runs again");
            }
            None => {}
        }
    }

    fn confirmed(&self, lsn: u64) {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .confirmed_lsn = lsn;
    }
}
