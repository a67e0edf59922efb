//! One change stream per database on this node: whoever needs a database's committed
//! changes from its WAL (the result cache's invalidation, Postgres Changes and broadcasts
//! from the database) shares one logical replication slot and one publication there,
//! instead of each opening its own.
//!
//! This module is the seam: consumers other than Realtime's subscriptions (the cache)
//! register a [`Tap`] for their database; the capture task (which lives with Realtime's
//! Postgres Changes, in `crate::realtime::changes`) finds the taps of its database here,
//! covers the tables they ask for, and tells them of every commit. The task's side is
//! registered once at start-up as the *runner* that makes sure a database has a task, so
//! this module names neither the cache nor Realtime.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::server::Upstream;

/// A database by host, port and name.
pub type DbKey = (String, u16, String);

/// A table a tap wants covered: its name as the tap knows it, and the tables to add to
/// the publication for it (quoted for SQL).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cover {
    pub name: String,
    pub qualified: Vec<String>,
}

/// A consumer of a database's changes beside Realtime's subscriptions. Called from the
/// capture task (the control runtime); every call is short and takes no lock the data
/// plane waits on for long.
pub trait Tap: Send + Sync {
    /// Who logs in for the stream when no Realtime tenant does.
    fn upstream(&self) -> Upstream;
    /// The tables wanted and not yet covered (`pending`: those a marker is on its way for).
    fn to_cover(&self, pending: &[String]) -> Vec<Cover>;
    /// `name` could not be added to the publication (`why`): it is not followed.
    fn refused(&self, name: &str, why: &str);
    /// Every change to `name` committed from now on comes through the stream.
    fn covered(&self, name: &str);
    /// A transaction committed changes to these tables (by name without schema).
    fn committed(&self, tables: &[&str]);
    /// The stream runs, from `slot`.
    fn started(&self, slot: &str);
    /// The stream stopped (`why`: its error): changes from now on are not seen until it
    /// runs again, and nothing is covered.
    fn lost(&self, why: Option<&str>);
    /// The server was told the stream was read up to `lsn`.
    fn confirmed(&self, lsn: u64);
}

type Runner = Box<dyn Fn(&DbKey) + Send + Sync>;

struct Entry {
    taps: Vec<Weak<dyn Tap>>,
    /// Woken when a tap wants a table covered.
    wake: Arc<tokio::sync::Notify>,
}

/// The taps of each database, and the runner that gives a database its capture task.
#[derive(Default)]
pub struct Captures {
    entries: Mutex<HashMap<DbKey, Entry>>,
    runner: OnceLock<Runner>,
}

impl Captures {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<DbKey, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers `tap` for `key`'s changes and makes sure a task streams them; returns what
    /// to wake when the tap wants a table covered.
    pub fn attach(&self, key: DbKey, tap: Weak<dyn Tap>) -> Arc<tokio::sync::Notify> {
        let wake = {
            let mut entries = self.lock();
            let e = entries.entry(key.clone()).or_insert_with(|| Entry {
                taps: Vec::new(),
                wake: Arc::new(tokio::sync::Notify::new()),
            });
            e.taps.retain(|t| t.strong_count() > 0);
            e.taps.push(tap);
            e.wake.clone()
        };
        if let Some(run) = self.runner.get() {
            run(&key);
        }
        wake
    }

    /// The live taps of `key`.
    pub fn taps(&self, key: &DbKey) -> Vec<Arc<dyn Tap>> {
        let mut entries = self.lock();
        let Some(e) = entries.get_mut(key) else {
            return Vec::new();
        };
        e.taps.retain(|t| t.strong_count() > 0);
        let live = e.taps.iter().filter_map(Weak::upgrade).collect::<Vec<_>>();
        if e.taps.is_empty() {
            entries.remove(key);
        }
        live
    }

    /// What wakes `key`'s task when a tap wants a table covered.
    pub fn wake(&self, key: &DbKey) -> Arc<tokio::sync::Notify> {
        self.lock()
            .entry(key.clone())
            .or_insert_with(|| Entry {
                taps: Vec::new(),
                wake: Arc::new(tokio::sync::Notify::new()),
            })
            .wake
            .clone()
    }

    /// Sets what gives a database its task (once, at start-up), and runs it for the
    /// databases taps were attached to before.
    pub fn set_runner(&self, run: impl Fn(&DbKey) + Send + Sync + 'static) {
        if self.runner.set(Box::new(run)).is_err() {
            return;
        }
        let keys: Vec<DbKey> = self.lock().keys().cloned().collect();
        if let Some(run) = self.runner.get() {
            for k in &keys {
                run(k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Nothing;
    impl Tap for Nothing {
        fn upstream(&self) -> Upstream {
            Upstream::nowhere()
        }
        fn to_cover(&self, _: &[String]) -> Vec<Cover> {
            Vec::new()
        }
        fn refused(&self, _: &str, _: &str) {}
        fn covered(&self, _: &str) {}
        fn committed(&self, _: &[&str]) {}
        fn started(&self, _: &str) {}
        fn lost(&self, _: Option<&str>) {}
        fn confirmed(&self, _: u64) {}
    }

    fn key(db: &str) -> DbKey {
        ("h".into(), 5432, db.into())
    }

    #[test]
    fn taps_are_found_while_they_live_and_the_runner_hears_of_each_database() {
        let c = Captures::default();
        let early: Arc<dyn Tap> = Arc::new(Nothing);
        c.attach(key("a"), Arc::downgrade(&early));
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        c.set_runner(move |_| {
            r.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(
            ran.load(Ordering::Relaxed),
            1,
            "run for the earlier tap's database"
        );
        let late: Arc<dyn Tap> = Arc::new(Nothing);
        c.attach(key("b"), Arc::downgrade(&late));
        assert_eq!(ran.load(Ordering::Relaxed), 2);
        assert_eq!(c.taps(&key("a")).len(), 1);
        assert!(c.taps(&key("c")).is_empty());
        drop(early);
        assert!(c.taps(&key("a")).is_empty(), "a dropped tap is gone");
    }
}
