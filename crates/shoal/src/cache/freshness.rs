//! How fresh cached results of one database are: a version per table, bumped whenever the
//! table may have changed, and an epoch bumped when anything may have changed unseen.
//!
//! An entry records the versions of the tables it read (and the epoch) as they were before
//! its statement was sent; it is served only while they are all unchanged. So a change
//! seen at any time after the fill began makes the entry useless, whenever the fill ends:
//! no lock orders fills against invalidations, and an invalidation costs one atomic add.
//!
//! Who bumps: a write relayed through Shoal, before its commit reaches the client (see
//! `session::relay`), and the database's change stream (see [`super::tap`]) for every
//! committed change from anywhere. A table is *covered* once the stream is known to carry
//! its changes; only covered tables' results are kept. When the stream is lost, nothing is
//! covered and the epoch moves on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use crate::analysis::catalogue::{Catalogue, Source};
use crate::server::Upstream;
use crate::wal::{Captures, DbKey};

/// One table name's state (by name without schema: a change to `a.t` counts for `b.t`
/// too, which only costs a refill).
#[derive(Debug)]
pub struct Table {
    pub name: String,
    version: AtomicU64,
    /// The change stream carries this table's changes.
    covered: AtomicBool,
    /// A result reading it was wanted: the stream task is to cover it.
    pub(super) wanted: AtomicBool,
    /// Covering it failed for good (no privilege to add it to the publication).
    pub(super) refused: AtomicBool,
}

impl Table {
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    pub fn covered(&self) -> bool {
        self.covered.load(Ordering::Acquire)
    }

    pub(super) fn set_covered(&self, covered: bool) {
        self.covered.store(covered, Ordering::Release);
    }

    pub fn bump(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
    }
}

/// Why the stream is not covering tables, for SHOW CACHE.
#[derive(Debug, Clone, Default)]
pub struct StreamState {
    pub connected: bool,
    pub last_error: Option<String>,
    /// Position confirmed to the server.
    pub confirmed_lsn: u64,
    pub slot: Option<String>,
}

pub struct Freshness {
    /// `host:port/dbname`, for logs and SHOW CACHE.
    pub label: String,
    pub upstream: Upstream,
    epoch: AtomicU64,
    tables: RwLock<HashMap<String, Arc<Table>, foldhash::fast::RandomState>>,
    /// The database's catalogue: which results may be kept, what a write touches. A new
    /// reading that differs moves the epoch (see [`Freshness::epoch`]).
    pub catalogue: Arc<Source>,
    /// Where the database's change stream is registered for (see [`crate::wal`]).
    captures: Weak<Captures>,
    key: DbKey,
    /// Wakes the stream's task: a table to cover (set once the stream is asked for).
    pub(super) wake: std::sync::OnceLock<Arc<tokio::sync::Notify>>,
    pub(super) state: Mutex<StreamState>,
    /// Changes the stream saw, by cause (`stream`, `truncate`).
    pub(super) invalidations: [AtomicU64; 3],
    started: std::sync::Once,
}

/// Indexes into [`Freshness::invalidations`].
pub const BY_WRITE: usize = 0;
pub const BY_STREAM: usize = 1;
pub const BY_RESET: usize = 2;

impl Freshness {
    /// The freshness of database `key`, whose changes come from the stream `captures` runs
    /// for it.
    pub fn new(
        key: DbKey,
        upstream: Upstream,
        catalogue: Arc<Source>,
        captures: &Arc<Captures>,
    ) -> Arc<Freshness> {
        Arc::new(Freshness {
            label: format!("{}:{}/{}", key.0, key.1, key.2),
            upstream,
            epoch: AtomicU64::new(1),
            tables: RwLock::default(),
            catalogue,
            captures: Arc::downgrade(captures),
            key,
            wake: std::sync::OnceLock::new(),
            state: Mutex::default(),
            invalidations: Default::default(),
            started: std::sync::Once::new(),
        })
    }

    /// Asks for the database's change stream (once), and starts the catalogue's task.
    pub fn start(self: &Arc<Self>) {
        self.catalogue.start();
        self.started.call_once(|| {
            let Some(captures) = self.captures.upgrade() else {
                return;
            };
            let me: Arc<dyn crate::wal::Tap> = self.clone();
            let wake = captures.attach(self.key.clone(), Arc::downgrade(&me));
            let _ = self.wake.set(wake);
        });
    }

    /// Moves when anything may have changed unseen, and when the catalogue changed (a
    /// policy that makes a table's results depend on a setting, a function made volatile):
    /// the sum of two counters that only grow.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire) + self.catalogue.generation()
    }

    /// Everything may have changed: no entry made before now is served (`cause`: a write
    /// through Shoal that could touch anything, or [`BY_RESET`]: the stream was lost).
    pub fn reset(&self, cause: usize) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.invalidations[cause].fetch_add(1, Ordering::Relaxed);
    }

    /// The state of table `name`, made on first use.
    pub fn table(&self, name: &str) -> Arc<Table> {
        if let Some(t) = self.read_tables().get(name) {
            return t.clone();
        }
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        tables
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(Table {
                    name: name.to_owned(),
                    version: AtomicU64::new(1),
                    covered: AtomicBool::new(false),
                    wanted: AtomicBool::new(false),
                    refused: AtomicBool::new(false),
                })
            })
            .clone()
    }

    /// The table `name`, if any result or change named it.
    pub fn known_table(&self, name: &str) -> Option<Arc<Table>> {
        self.read_tables().get(name).cloned()
    }

    pub fn tables(&self) -> Vec<Arc<Table>> {
        self.read_tables().values().cloned().collect()
    }

    fn read_tables(
        &self,
    ) -> std::sync::RwLockReadGuard<'_, HashMap<String, Arc<Table>, foldhash::fast::RandomState>>
    {
        self.tables.read().unwrap_or_else(|e| e.into_inner())
    }

    /// A change to table `name` was seen (`cause`: [`BY_WRITE`] or [`BY_STREAM`]).
    pub fn changed(&self, name: &str, cause: usize) {
        if let Some(t) = self.known_table(name) {
            t.bump();
        }
        self.invalidations[cause].fetch_add(1, Ordering::Relaxed);
    }

    /// Asks the stream task to cover `table`.
    pub fn want(&self, table: &Table) {
        if !table.wanted.swap(true, Ordering::AcqRel) {
            if let Some(w) = self.wake.get() {
                w.notify_one();
            }
        }
    }

    /// The catalogue's reading of the moment.
    pub fn catalogue(&self) -> Arc<Catalogue> {
        self.catalogue.current()
    }

    /// Asks for the catalogue to be read again (a statement named a relation it lacks).
    pub fn want_catalogue(&self) {
        self.catalogue.want();
    }

    pub fn stream_state(&self) -> StreamState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn invalidations(&self, cause: usize) -> u64 {
        self.invalidations[cause].load(Ordering::Relaxed)
    }
}

/// The versions an entry's statement read, taken before it was sent.
#[derive(Debug)]
pub struct Snapshot {
    pub epoch: u64,
    pub tables: Box<[(Arc<Table>, u64)]>,
}

impl Snapshot {
    /// The versions of `tables` now, or `None` when one is not covered.
    pub fn take(freshness: &Freshness, tables: &[Arc<Table>]) -> Option<Snapshot> {
        let epoch = freshness.epoch();
        let mut taken = Vec::with_capacity(tables.len());
        for t in tables {
            if !t.covered() {
                return None;
            }
            taken.push((t.clone(), t.version()));
        }
        Some(Snapshot {
            epoch,
            tables: taken.into(),
        })
    }

    /// Whether nothing it depends on changed since it was taken.
    pub fn current(&self, freshness: &Freshness) -> bool {
        self.epoch == freshness.epoch()
            && self
                .tables
                .iter()
                .all(|(t, v)| t.covered() && t.version() == *v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn freshness() -> Arc<Freshness> {
        let catalogue = Source::new("test".into(), Upstream::nowhere(), Duration::from_secs(1));
        let key = ("test".into(), 5432, "test".into());
        Freshness::new(key, Upstream::nowhere(), catalogue, &Arc::default())
    }

    #[test]
    fn a_change_after_the_snapshot_makes_it_stale_whenever_it_ends() {
        let f = freshness();
        let t = f.table("items");
        let u = f.table("users");
        assert!(
            Snapshot::take(&f, std::slice::from_ref(&t)).is_none(),
            "not covered yet"
        );
        t.set_covered(true);
        u.set_covered(true);
        let s = Snapshot::take(&f, &[t.clone(), u.clone()]).unwrap();
        assert!(s.current(&f));
        f.changed("other", BY_STREAM);
        assert!(s.current(&f), "another table changed");
        f.changed("users", BY_WRITE);
        assert!(!s.current(&f));
        let s = Snapshot::take(&f, std::slice::from_ref(&t)).unwrap();
        f.reset(BY_RESET);
        assert!(!s.current(&f), "the epoch moved");
        let s = Snapshot::take(&f, std::slice::from_ref(&t)).unwrap();
        t.set_covered(false);
        assert!(!s.current(&f), "the stream no longer covers it");
        t.set_covered(true);
        let s = Snapshot::take(&f, std::slice::from_ref(&t)).unwrap();
        let reading = |version: &str| Catalogue {
            loaded: true,
            version: version.into(),
            ..Catalogue::default()
        };
        f.catalogue.set(reading("1"));
        assert!(!s.current(&f), "the first reading of the catalogue");
        let s = Snapshot::take(&f, std::slice::from_ref(&t)).unwrap();
        f.catalogue.set(reading("1"));
        assert!(s.current(&f), "read again, unchanged");
        f.catalogue.set(reading("2"));
        assert!(!s.current(&f), "the catalogue changed");
    }
}
