//! Keeping one database's catalogue current, off the data path: one task on the control
//! runtime, one connection as the user of the pool that first needed it, started when a
//! feature that judges statements against the catalogue is put in force.
//!
//! The catalogue is read in full at once when DDL passes through Shoal, within a second
//! when a feature meets a name it lacks (a table made since), and when the version check
//! (every [`CHECK_EVERY`], one cheap query; see [`super::row::VERSION`]) finds that someone
//! changed it directly on the server. Until the first reading, every feature fails closed
//! (no replica, no cache, function rules refuse what they cannot check).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use super::Catalogue;
use crate::server::{ServerConn, ServerError, Upstream};

/// How often the version check runs while nothing says the catalogue changed.
pub const CHECK_EVERY: Duration = Duration::from_secs(2);
/// The least time between two readings a feature asked for (a name it lacks).
const WANTED_EVERY_MS: u64 = 1000;
/// The longest wait before trying again after a failure.
const RETRY_AT_MOST: Duration = Duration::from_secs(5);

pub struct Source {
    /// `host:port/dbname`, for logs and the console.
    pub label: String,
    upstream: Upstream,
    timeout: Duration,
    current: RwLock<Arc<Catalogue>>,
    /// Read at least once (what every transaction of a new pool's first moments asks).
    ever_read: AtomicBool,
    /// Moves each time a reading differs from the one before.
    generation: AtomicU64,
    /// Readings and version checks done, for the console and tests.
    readings: AtomicU64,
    checks: AtomicU64,
    last_error: Mutex<Option<String>>,
    /// Wakes the task.
    wake: tokio::sync::Notify,
    /// Wakes those waiting for the first reading.
    read: tokio::sync::Notify,
    /// DDL passed through Shoal: read at once.
    stale: AtomicBool,
    /// A feature met a name the catalogue lacks.
    wanted: AtomicBool,
    started: std::sync::Once,
}

/// What the console shows of a source.
#[derive(Debug, Clone)]
pub struct Status {
    pub loaded: bool,
    pub generation: u64,
    pub readings: u64,
    pub checks: u64,
    pub last_error: Option<String>,
}

impl Source {
    /// A source read through `upstream`, each query bounded by `timeout`; nothing is read
    /// until [`start`](Self::start).
    pub fn new(label: String, upstream: Upstream, timeout: Duration) -> Arc<Source> {
        Arc::new(Source {
            label,
            upstream,
            // The whole catalogue is one query that may take a while on a large database.
            timeout: timeout.max(Duration::from_secs(10)),
            current: RwLock::default(),
            ever_read: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            readings: AtomicU64::new(0),
            checks: AtomicU64::new(0),
            last_error: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
            read: tokio::sync::Notify::new(),
            stale: AtomicBool::new(false),
            wanted: AtomicBool::new(false),
            started: std::sync::Once::new(),
        })
    }

    /// The reading of the moment (empty, not [`loaded`](Catalogue::loaded), before the
    /// first).
    pub fn current(&self) -> Arc<Catalogue> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Moves each time the catalogue is found changed: what was decided on the one before
    /// (kept results, remembered verdicts) is to be decided again.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Starts keeping it current (once; where no runtime runs, as in unit tests, never).
    pub fn start(self: &Arc<Self>) {
        if !crate::control::available() {
            return;
        }
        self.started.call_once(|| {
            crate::control::spawn(run(Arc::downgrade(self)));
        });
    }

    /// Whether it is being kept current (a feature needs it).
    pub fn running(&self) -> bool {
        self.started.is_completed()
    }

    /// DDL passed through Shoal: read again now.
    pub fn changed(&self) {
        self.stale.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// A feature met a name the catalogue lacks: read again soon.
    pub fn want(&self) {
        if !self.wanted.swap(true, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// Waits (up to `timeout`) for the first reading.
    pub async fn loaded(&self, timeout: Duration) {
        if self.ever_read.load(Ordering::Acquire) {
            return;
        }
        let read = self.read.notified();
        let mut read = std::pin::pin!(read);
        read.as_mut().enable();
        if self.ever_read.load(Ordering::Acquire) {
            return;
        }
        let _ = crate::timer::timeout(timeout, read).await;
    }

    pub fn status(&self) -> Status {
        Status {
            loaded: self.current().loaded,
            generation: self.generation(),
            readings: self.readings.load(Ordering::Relaxed),
            checks: self.checks.load(Ordering::Relaxed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }

    /// A source that is never read, holding `c` (for tests of what features decide).
    #[cfg(test)]
    pub fn fixed(c: Catalogue) -> Arc<Source> {
        let s = Source::new("test".into(), Upstream::nowhere(), Duration::from_secs(1));
        s.set(c);
        s
    }

    /// Puts a reading in place.
    pub fn set(&self, c: Catalogue) {
        let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
        if !current.loaded || current.version != c.version {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        *current = Arc::new(c);
        drop(current);
        self.ever_read.store(true, Ordering::Release);
        self.readings.fetch_add(1, Ordering::Relaxed);
        self.read.notify_waiters();
    }
}

#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("reading the catalogue timed out")]
    TimedOut,
    #[error("the catalogue query returned something unexpected")]
    Unexpected,
}

/// The task: reads and checks until no pool holds the source.
async fn run(weak: Weak<Source>) {
    let mut conn: Option<ServerConn> = None;
    let mut last_read = 0u64;
    let mut retry = Duration::from_millis(100);
    loop {
        let Some(s) = weak.upgrade() else { return };
        let now = crate::clock::now_ms();
        let since = now.saturating_sub(last_read);
        let wanted = s.wanted.load(Ordering::Acquire);
        let read_now = !s.current().loaded
            || s.stale.swap(false, Ordering::AcqRel)
            || (wanted && since >= WANTED_EVERY_MS);
        let result = if read_now {
            read(&s, &mut conn).await
        } else {
            check(&s, &mut conn).await
        };
        let mut delay = CHECK_EVERY;
        match result {
            Ok(did_read) => {
                if did_read {
                    last_read = crate::clock::now_ms();
                }
                retry = Duration::from_millis(100);
                *s.last_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
            }
            Err(e) => {
                conn = None;
                let message = e.to_string();
                let mut last = s.last_error.lock().unwrap_or_else(|e| e.into_inner());
                if last.as_deref() != Some(message.as_str()) {
                    tracing::warn!(database = %s.label, error = %message, "cannot read the catalogue; statements it would prove safe go to the primary, are not cached, or are refused by function rules until it is read");
                }
                *last = Some(message);
                delay = retry;
                retry = (retry * 2).min(RETRY_AT_MOST);
            }
        }
        if s.wanted.load(Ordering::Acquire) {
            let wait = WANTED_EVERY_MS.saturating_sub(crate::clock::now_ms() - last_read);
            delay = delay.min(Duration::from_millis(wait));
        }
        let _ = crate::timer::timeout(delay, s.wake.notified()).await;
    }
}

/// Reads the whole catalogue (`Ok(true)`).
async fn read(s: &Source, conn: &mut Option<ServerConn>) -> Result<bool, ReadError> {
    s.wanted.store(false, Ordering::Release);
    let text = first_column(s, conn, &super::row::query()).await?;
    let c = Catalogue::from_text(&text).ok_or(ReadError::Unexpected)?;

    if s.current().loaded && s.current().version != c.version {
        tracing::debug!(database = %s.label, "the catalogue changed; read again");
    }
    s.set(c);
    Ok(true)
}

/// Checks the version, and reads the whole catalogue when it moved.
async fn check(s: &Source, conn: &mut Option<ServerConn>) -> Result<bool, ReadError> {
    let version = first_column(s, conn, super::row::VERSION).await?;
    s.checks.fetch_add(1, Ordering::Relaxed);
    if version == s.current().version {
        return Ok(false);
    }
    read(s, conn).await
}

async fn first_column(
    s: &Source,
    conn: &mut Option<ServerConn>,
    sql: &str,
) -> Result<String, ReadError> {
    let row = crate::timer::timeout(s.timeout, async {
        if conn.is_none() {
            *conn = Some(ServerConn::connect(&s.upstream, s.timeout).await?);
        }
        let c = conn.as_mut().expect("connected above");
        c.query_row(sql, &[]).await
    })
    .await
    .map_err(|_| ReadError::TimedOut)??;
    row.and_then(|r| r.into_iter().next().flatten())
        .ok_or(ReadError::Unexpected)
}
