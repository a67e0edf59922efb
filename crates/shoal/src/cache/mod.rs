//! The query result cache: the replies to read-only statements kept per pool and served
//! again without a server, for as long as nothing they read can have changed.
//!
//! - Which statements ([`analysis`]): one plain query, proven to only read, calling only
//!   IMMUTABLE functions, reading only plain tables the change stream follows; then only
//!   those the pool opts in (a `/* shoal:cache */` hint, a listed fingerprint, or
//!   `cache_all_reads`). Outside transaction blocks, by clients not listening.
//! - The key ([`unit`]): the client's session parameters and held `SET`s (so role,
//!   `search_path` and every other setting), then the unit of messages itself with names
//!   taken out: the statement text and parameter types, the parameter values and formats,
//!   the result formats. The pool is the cache's own (one per pool: tenant, user, mode).
//! - Freshness ([`freshness`]): each entry holds the table versions taken before its
//!   statement was sent, and is served only while they stand.
//! - No stampede: one client fills a key while the others with the same key wait for it.
//! - Bounded: a pool's entries weigh their bytes, up to `cache_max_memory`, evicted by
//!   moka's TinyLFU; each entry lives at most its TTL.

pub mod analysis;
pub mod capture;
pub mod freshness;
pub mod status;
mod tap;
pub mod unit;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use shoal_control::config::cache::Cache as CacheConfig;

use crate::prepared::ClientStatements;
use analysis::{ForCache, NotKept, Touches};
pub use capture::Capture;
use freshness::{Freshness, Snapshot, Table};

/// How long a client waits for another client filling the same key before it runs the
/// statement itself.
pub const FILL_WAIT: Duration = Duration::from_secs(5);

/// One kept reply.
pub struct Entry {
    /// Every message the client got for the unit, up to its ReadyForQuery.
    pub reply: Bytes,
    snapshot: Snapshot,
    ttl: Duration,
}

/// A pool's counters, for SHOW CACHE and `/metrics`.
#[derive(Default)]
pub struct Stats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub fills: AtomicU64,
    /// Served units the cache could not keep (see [`NotKept`]), or that were not opted in.
    pub passed: AtomicU64,
    /// Lookups that found an entry something had changed under.
    pub stale: AtomicU64,
    /// Clients that waited for another's fill.
    pub waits: AtomicU64,
    /// Replies too large or of a kind that is never kept (errors, notices).
    pub unkept_replies: AtomicU64,
    pub evictions: Arc<AtomicU64>,
}

pub struct QueryCache {
    pub config: CacheConfig,
    fingerprints: HashSet<String>,
    pub freshness: Arc<Freshness>,
    /// The pool's statement analysis (shared with its rules and replica split).
    analyses: Arc<crate::analysis::Analyses>,
    store: moka::sync::Cache<Box<[u8]>, Arc<Entry>>,
    filling: Mutex<HashMap<Box<[u8]>, Arc<tokio::sync::Notify>, foldhash::fast::RandomState>>,
    pub stats: Stats,
    /// A reply larger than this is not kept.
    pub max_entry: usize,
}

/// An entry's weight: its key, its reply, and what moka and the entry keep beside them.
#[allow(clippy::borrowed_box)]
fn weigh(key: &Box<[u8]>, entry: &Arc<Entry>) -> u32 {
    (key.len() + entry.reply.len() + 160).min(u32::MAX as usize) as u32
}

struct ByTtl;

impl moka::Expiry<Box<[u8]>, Arc<Entry>> for ByTtl {
    fn expire_after_create(
        &self,
        _: &Box<[u8]>,
        entry: &Arc<Entry>,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(entry.ttl)
    }
}

/// A unit the cache may answer: its key, its length at the head of the client's buffer,
/// the tables its result depends on, and how long the result lives.
pub struct Candidate {
    pub key: Vec<u8>,
    pub len: usize,
    /// The unit's unnamed Parse body (see [`unit::Unit::unnamed_parse`]).
    pub unnamed_parse: Option<std::ops::Range<usize>>,
    tables: Vec<Arc<Table>>,
    ttl: Duration,
}

/// What a client with a cache miss does.
pub enum Fill {
    /// It runs the statement and keeps the reply.
    Lead(Box<Capture>),
    /// Another client is filling the key: wait for it.
    Wait(Arc<tokio::sync::Notify>),
    /// It runs the statement, and nothing is kept (a table is not covered yet).
    Skip,
}

impl QueryCache {
    pub fn new(
        config: CacheConfig,
        freshness: Arc<Freshness>,
        analyses: Arc<crate::analysis::Analyses>,
    ) -> QueryCache {
        let evictions = Arc::new(AtomicU64::new(0));
        let counted = evictions.clone();
        let store = moka::sync::Cache::builder()
            .max_capacity(config.max_memory)
            .weigher(weigh)
            .expire_after(ByTtl)
            .eviction_listener(move |_, _, cause| {
                if cause == moka::notification::RemovalCause::Size {
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            })
            .build();
        QueryCache {
            fingerprints: config.fingerprints.iter().cloned().collect(),
            max_entry: (config.max_memory / 8).min(16 << 20) as usize,
            config,
            freshness,
            analyses,
            store,
            filling: Mutex::default(),
            stats: Stats {
                evictions,
                ..Stats::default()
            },
        }
    }

    /// The unit at the head of `buf` as a cache candidate, with `prefix` (the client's
    /// settings) at the head of its key; `None` when its reply is not to be kept.
    pub fn candidate(
        &self,
        buf: &[u8],
        statements: Option<&ClientStatements>,
        prefix: Vec<u8>,
    ) -> Option<Candidate> {
        let mut key = prefix;
        let u = unit::read(buf, statements, &mut key)?;
        let pass = || {
            self.stats.passed.fetch_add(1, Ordering::Relaxed);
            None
        };
        if u.time_word || analysis::has_time_word(u.text) {
            return pass();
        }
        let hint = analysis::hint(u.text);
        // Only UTF8 clients come here (see `session::cached`).
        let parsed = self.analyses.of_utf8(u.text);
        if hint.is_none() && !self.config.all_reads && !self.listed(&parsed) {
            return pass();
        }
        let catalogue = self.freshness.catalogue();
        let names = match parsed.keepable(&catalogue) {
            Ok(n) => n,
            Err(why) => {
                if why == NotKept::Relation || !catalogue.loaded {
                    // A table made since the catalogue was read, perhaps.
                    self.freshness.want_catalogue();
                }
                return pass();
            }
        };
        let tables = names.iter().map(|n| self.freshness.table(n)).collect();
        Some(Candidate {
            key,
            len: u.len,
            unnamed_parse: u.unnamed_parse,
            tables,
            ttl: hint.flatten().unwrap_or(self.config.ttl),
        })
    }

    /// Whether the statement's fingerprint (with or without its schemas) is listed.
    fn listed(&self, parsed: &shoal_wire::statement::Analysis) -> bool {
        !self.fingerprints.is_empty()
            && parsed.facts.as_ref().is_ok_and(|f| {
                f.fingerprints
                    .iter()
                    .any(|fp| self.fingerprints.contains(fp))
            })
    }

    /// The kept reply for `key`, if it is still current.
    pub fn lookup(&self, key: &[u8]) -> Option<Bytes> {
        let entry = self.store.get(key)?;
        if entry.snapshot.current(&self.freshness) {
            return Some(entry.reply.clone());
        }
        self.stats.stale.fetch_add(1, Ordering::Relaxed);
        self.store.invalidate(key);
        None
    }

    /// A miss on `c`: whether this client fills it, waits for another, or neither.
    pub fn begin_fill(self: &Arc<Self>, c: &Candidate) -> Fill {
        let mut filling = self.filling.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = filling.get(c.key.as_slice()) {
            return Fill::Wait(n.clone());
        }
        // Taken before the statement is sent: a change seen from now on makes it stale.
        let Some(snapshot) = Snapshot::take(&self.freshness, &c.tables) else {
            drop(filling);
            for t in &c.tables {
                if !t.covered() {
                    self.freshness.want(t);
                }
            }
            self.freshness.start();
            return Fill::Skip;
        };
        let notify = Arc::new(tokio::sync::Notify::new());
        let key: Box<[u8]> = c.key.as_slice().into();
        filling.insert(key.clone(), notify.clone());
        drop(filling);
        Fill::Lead(Box::new(Capture::new(self.clone(), key, snapshot, c.ttl)))
    }

    /// Whether a client is still filling `key`.
    pub fn filling(&self, key: &[u8]) -> bool {
        self.filling
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(key)
    }

    /// A fill ended (kept or not): waiters look again.
    fn fill_ended(&self, key: &[u8]) {
        let n = self
            .filling
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        if let Some(n) = n {
            n.notify_waiters();
        }
    }

    fn keep(&self, key: Box<[u8]>, reply: Bytes, snapshot: Snapshot, ttl: Duration) {
        self.stats.fills.fetch_add(1, Ordering::Relaxed);
        self.store.insert(
            key,
            Arc::new(Entry {
                reply,
                snapshot,
                ttl,
            }),
        );
    }

    /// What the text of a statement a client runs (outside a proof of reading) does to
    /// kept results.
    /// What the statement `text`, in the client's encoding `enc`, may write to kept results
    /// (everything, when it cannot be read as the server reads it).
    pub fn touches(&self, text: &[u8], enc: shoal_wire::sql::ClientEncoding) -> Touches {
        let catalogue = self.freshness.catalogue();
        if !catalogue.loaded {
            return Touches::Everything;
        }
        match self.analyses.of(text, enc) {
            Ok(a) => a.touches(&catalogue),
            Err(_) => Touches::Everything,
        }
    }

    /// Drops every entry.
    pub fn purge(&self) {
        self.store.invalidate_all();
    }

    pub fn entries(&self) -> u64 {
        self.store.run_pending_tasks();
        self.store.entry_count()
    }

    pub fn bytes(&self) -> u64 {
        self.store.weighted_size()
    }
}

/// What a transaction's statements did to kept results, applied when it ends (before the
/// client hears of its end).
#[derive(Debug, Default)]
pub enum Touched {
    #[default]
    Nothing,
    Tables(Vec<String>),
    Everything,
}

impl Touched {
    pub fn add(&mut self, t: Touches) {
        match (std::mem::take(self), t) {
            (Touched::Everything, _) | (_, Touches::Everything) => *self = Touched::Everything,
            (before, Touches::Nothing) => *self = before,
            (Touched::Nothing, Touches::Tables(t)) => *self = Touched::Tables(t),
            (Touched::Tables(mut a), Touches::Tables(b)) => {
                a.extend(b);
                a.sort();
                a.dedup();
                *self = Touched::Tables(a);
            }
        }
    }

    pub fn is_nothing(&self) -> bool {
        matches!(self, Touched::Nothing)
    }

    /// Applies what was touched to `freshness`, and forgets it.
    pub fn apply(&mut self, freshness: &Freshness) {
        match std::mem::take(self) {
            Touched::Nothing => {}
            Touched::Tables(names) => {
                for n in names {
                    freshness.changed(&n, freshness::BY_WRITE);
                }
            }
            Touched::Everything => freshness.reset(freshness::BY_WRITE),
        }
    }
}
