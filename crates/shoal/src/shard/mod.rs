//! Shards of the per-core data plane (`[server] runtime = "per_core"`): one single-threaded
//! runtime per core, each accepting on its own `SO_REUSEPORT` socket, so a client's session,
//! and the servers it mostly uses, are polled by one thread and woken without a futex.
//!
//! A thread knows its shard through a thread-local set when its runtime starts; outside a
//! shard (the control thread, the multi-threaded runtime, tests) everything is shard 0 of 1.
//!
//! Every shard is a thread of its own, its runtime built with I/O only: no tokio time driver
//! (its work at each park is measurable per transaction; the shard's timers are
//! [`crate::timer`]'s), no signal or process driver. The process's main thread runs the
//! control plane (API, metrics, reloads, the monitor below) on a full runtime.
//!
//! Shards open as load needs them (*packing*): on a machine whose cores are shared with
//! PostgreSQL and the clients, a second pooler thread that mostly sleeps and wakes costs more
//! CPU per transaction than it gives, while on a many-core machine too few starve. Only the
//! first [`open`] shards take clients; [`monitor`] reads each shard's demand (time runnable)
//! and the queries answered every interval, and [`Packer`] decides. Clients accepted on a
//! closed shard are handed to an open one, and idle transaction-mode clients (no server, no
//! buffer) move to balance the open shards at the moment they go idle ([`placement`]);
//! servers follow their clients at checkout.

use std::cell::{Cell, OnceCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    static ON_SHARD: Cell<bool> = const { Cell::new(false) };
    /// The set this thread is a shard of: what it counts its answers in. A thread belongs to
    /// one set for its life, so two processes' worth of shards (two nodes in one test) never
    /// mix.
    static MINE: OnceCell<Arc<Shards>> = const { OnceCell::new() };
}

/// [`reactor`] of a thread that is no shard's.
pub const NO_SHARD: usize = usize::MAX;

/// The shard this thread serves (0 off the shards).
pub fn current() -> usize {
    CURRENT.with(|c| c.get())
}

/// The shard whose reactor a socket made on this thread joins: [`current`] on a shard,
/// [`NO_SHARD`] elsewhere (a server opened by the control thread moves to the first shard
/// that checks it out).
pub fn reactor() -> usize {
    if ON_SHARD.with(|c| c.get()) {
        current()
    } else {
        NO_SHARD
    }
}

/// A query answered (a ReadyForQuery relayed to its client) on this thread's shard; not
/// counted off the shards, where no packing reads it.
pub fn note_answered() {
    MINE.with(|m| {
        if let Some(s) = m.get() {
            s.signals.answered(current());
        }
    });
}

/// The shard threads of one data plane, and what they share: which of them take clients,
/// how many clients each holds. Held by the [`crate::app::App`] (not a process global), so
/// each node in a process has its own.
pub struct Shards {
    handles: Vec<tokio::runtime::Handle>,
    /// Shards taking clients now (see the module doc); all of them when packing is off.
    open: AtomicUsize,
    /// Clients living on each shard.
    clients: Box<[AtomicUsize]>,
    /// Clients accepted on a closed shard and handed to an open one (few while the kernel is
    /// steered to open shards, see [`crate::reuseport`]).
    handed_over: AtomicU64,
    signals: signals::Counters,
    /// Dropped to end the shard threads (see [`Shards::stop`]).
    stops: Mutex<Vec<tokio::sync::oneshot::Sender<()>>>,
    stopped: AtomicBool,
}

impl Shards {
    /// No shard threads: everything runs on the caller's runtime as shard 0 of 1 (the
    /// multi-threaded data plane, embedders, tests).
    pub fn none() -> Arc<Shards> {
        Arc::new(Shards::with_threads(Vec::new(), 1))
    }

    fn with_threads(handles: Vec<tokio::runtime::Handle>, open: usize) -> Shards {
        let n = handles.len().max(1);
        Shards {
            handles,
            open: AtomicUsize::new(open),
            clients: (0..n).map(|_| AtomicUsize::new(0)).collect(),
            handed_over: AtomicU64::new(0),
            signals: signals::Counters::new(vec![0; n]),
            stops: Mutex::default(),
            stopped: AtomicBool::new(false),
        }
    }

    /// Starts `n` shard threads, each a single-threaded runtime with I/O and
    /// [`crate::timer`]'s timers only; one shard open with `packing`, all of them without.
    /// Returns once every runtime is up. The threads run until [`Shards::stop`].
    pub fn start(n: usize, packing: bool) -> std::io::Result<Arc<Shards>> {
        let n = n.max(1);
        let mut handles = Vec::with_capacity(n);
        let mut stops = Vec::with_capacity(n);
        let mut started = Vec::with_capacity(n);
        let mut tids = Vec::with_capacity(n);
        for i in 0..n {
            let (tx, rx) = std::sync::mpsc::channel();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let (set_tx, set_rx) = std::sync::mpsc::channel::<Arc<Shards>>();
            std::thread::Builder::new()
                .name(format!("shoal-shard-{i}"))
                .spawn(move || shard_thread(i, tx, set_rx, stopped))?;
            let (handle, tid) = rx.recv().map_err(std::io::Error::other)??;
            handles.push(handle);
            tids.push(tid);
            stops.push(stop);
            started.push(set_tx);
        }
        let mut shards = Shards::with_threads(handles, if packing { 1 } else { n });
        shards.signals = signals::Counters::new(tids);
        let shards = Arc::new(shards);
        *shards.stops.lock().unwrap_or_else(|e| e.into_inner()) = stops;
        for set in started {
            let _ = set.send(shards.clone());
        }
        Ok(shards)
    }

    /// Ends the shard threads: their runtimes drop whatever tasks are left (the caller
    /// drained the clients first), and the packing's monitor returns.
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Relaxed);
        self.stops.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// How many shards pools keep idle lists for.
    pub fn count(&self) -> usize {
        self.clients.len()
    }

    /// Shards taking clients now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed).clamp(1, self.count())
    }

    /// The runtime of shard `i` (none without shard threads).
    pub fn handle(&self, i: usize) -> Option<&tokio::runtime::Handle> {
        self.handles.get(i)
    }

    /// The open shard the `nth` thing spread round robin goes to.
    pub fn round_robin(&self, nth: usize) -> usize {
        nth % self.open()
    }

    pub fn note_handed_over(&self) {
        self.handed_over.fetch_add(1, Ordering::Relaxed);
    }

    pub fn handed_over(&self) -> u64 {
        self.handed_over.load(Ordering::Relaxed)
    }

    /// Clients on each shard now (for metrics and tests).
    pub fn client_counts(&self) -> Vec<usize> {
        self.clients
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }

    /// A client now lives on `shard`.
    pub fn client_arrived(&self, shard: usize) {
        if let Some(c) = self.clients.get(shard) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A client left `shard` (ended, or moved away).
    // `fetch_update` is renamed `try_update` in newer Rust; Shoal still builds with 1.87.
    #[allow(deprecated)]
    pub fn client_left(&self, shard: usize) {
        if let Some(c) = self.clients.get(shard) {
            let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    fn clients_on(&self, i: usize) -> usize {
        self.clients.get(i).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The open shard with the fewest clients.
    fn least_loaded(&self) -> usize {
        (0..self.open())
            .min_by_key(|&i| self.clients_on(i))
            .unwrap_or(0)
    }

    /// Where a client just accepted on shard `here` should live, when not here: on a closed
    /// shard, the least loaded open one.
    pub fn placement_for_new(&self, here: usize) -> Option<usize> {
        (self.count() > 1 && here >= self.open()).then(|| self.least_loaded())
    }

    /// Where a client going idle on shard `here` should move, if anywhere: off a closed
    /// shard, or from an open shard holding clearly more clients than the least loaded one.
    pub fn placement(&self, here: usize) -> Option<usize> {
        if self.count() == 1 {
            return None;
        }
        let target = self.least_loaded();
        if here >= self.open() {
            return Some(target);
        }
        let (mine, least) = (self.clients_on(here), self.clients_on(target));
        (target != here && mine > least + 2.max(mine / 8)).then_some(target)
    }
}

/// A shard thread's life: build its runtime, say so, learn its set, run until stopped.
fn shard_thread(
    i: usize,
    started: std::sync::mpsc::Sender<std::io::Result<(tokio::runtime::Handle, i32)>>,
    set: std::sync::mpsc::Receiver<Arc<Shards>>,
    stopped: tokio::sync::oneshot::Receiver<()>,
) {
    CURRENT.with(|c| c.set(i));
    ON_SHARD.with(|c| c.set(true));
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    if let Err(e) = rt.block_on(async { crate::timer::install() }) {
        let _ = started.send(Err(e));
        return;
    }
    let tid = nix::unistd::gettid().as_raw();
    let _ = started.send(Ok((rt.handle().clone(), tid)));
    // Nothing is spawned here before the set exists: `start` hands the handles out only
    // after every thread has its set.
    let Ok(shards) = set.recv() else {
        return;
    };
    MINE.with(|m| {
        let _ = m.set(shards);
    });
    rt.block_on(async {
        let _ = stopped.await;
    });
}

mod packing;
mod signals;

pub use packing::{Packer, Reading, Thresholds, SUSTAINED};

/// Idle and total jiffies of the machine (the first line of `/proc/stat`).
fn machine_jiffies() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((idle, v.iter().take(8).sum()))
}

/// Opens and closes shards as [`Packer`] decides from each interval's signals, every
/// `every`, until the shards stop.
// Runs on the main runtime (tokio's timers work there).
#[allow(clippy::disallowed_methods)]
pub async fn monitor(shards: Arc<Shards>, t: Thresholds, every: std::time::Duration) {
    let n = shards.count();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get()) as f64;
    let mut packer = Packer::new(n, t);
    let mut seen = signals::Seen::new(&shards);
    let mut last_cpu = machine_jiffies();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if shards.stopped.load(Ordering::Relaxed) {
            return;
        }
        let open = shards.open();
        let interval = seen.next(&shards, open);
        let cpu = if interval.quiet {
            None
        } else {
            machine_jiffies()
        };
        // Without /proc, assume a core is free (the thresholds on demand still apply).
        let idle = match (last_cpu, cpu) {
            (Some((i0, t0)), Some((i1, t1))) if t1 > t0 => {
                cores * (i1.saturating_sub(i0)) as f64 / (t1 - t0) as f64
            }
            _ => cores,
        };
        last_cpu = cpu;
        let was_trying = packer.trying();
        let next = packer.step(&Reading {
            demand: &interval.demand,
            idle_cores: idle,
            work: interval.work,
        });
        if next != open {
            let trial = match (packer.trying(), was_trying) {
                (true, _) => "started",
                (false, true) => "failed",
                (false, false) => "none",
            };
            tracing::info!(open = next, trial, demand = ?&interval.demand[..open], idle_cores = idle, work = interval.work, "per-core data plane: {} shard(s) open", next);
            shards.open.store(next, Ordering::Relaxed);
        }
    }
}
