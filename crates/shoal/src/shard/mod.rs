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

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

static COUNT: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    static ON_SHARD: Cell<bool> = const { Cell::new(false) };
}

/// [`reactor`] of a thread that is no shard's.
pub const NO_SHARD: usize = usize::MAX;

/// How many shards pools keep idle lists for (set once, before pools exist).
pub fn count() -> usize {
    COUNT.load(Ordering::Relaxed).max(1)
}

pub fn set_count(n: usize) {
    COUNT.store(n.max(1), Ordering::Relaxed);
}

/// The shard this thread serves.
pub fn current() -> usize {
    CURRENT.with(|c| c.get()).min(count() - 1)
}

/// Marks this thread as serving shard `i` (called as each shard's runtime thread starts).
pub fn enter(i: usize) {
    CURRENT.with(|c| c.set(i));
    ON_SHARD.with(|c| c.set(true));
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

static HANDLES: std::sync::OnceLock<Vec<tokio::runtime::Handle>> = std::sync::OnceLock::new();

/// The runtime of shard `i`, once the shards run (none unless the per-core data plane runs).
pub fn handle(i: usize) -> Option<&'static tokio::runtime::Handle> {
    HANDLES.get().and_then(|h| h.get(i))
}

/// Shards taking clients now (see the module doc); all of them when packing is off.
static OPEN: AtomicUsize = AtomicUsize::new(usize::MAX);
/// Clients living on each shard.
static CLIENTS: std::sync::OnceLock<Box<[AtomicUsize]>> = std::sync::OnceLock::new();

/// Clients accepted on a closed shard and handed to an open one (few while the kernel is
/// steered to open shards, see [`crate::reuseport`]).
static HANDED_OVER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub fn note_handed_over() {
    HANDED_OVER.fetch_add(1, Ordering::Relaxed);
}

pub fn handed_over() -> u64 {
    HANDED_OVER.load(Ordering::Relaxed)
}

pub fn open() -> usize {
    OPEN.load(Ordering::Relaxed).clamp(1, count())
}

fn clients() -> &'static [AtomicUsize] {
    CLIENTS.get().map(|c| &c[..]).unwrap_or(&[])
}

/// Clients on each shard now (for metrics and tests).
pub fn client_counts() -> Vec<usize> {
    clients()
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect()
}

/// A client now lives on `shard`.
pub fn client_arrived(shard: usize) {
    if let Some(c) = clients().get(shard) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A client left `shard` (ended, or moved away).
// `fetch_update` is renamed `try_update` in newer Rust; Shoal still builds with 1.87.
#[allow(deprecated)]
pub fn client_left(shard: usize) {
    if let Some(c) = clients().get(shard) {
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }
}

/// The open shard with the fewest clients.
fn least_loaded() -> usize {
    let open = open();
    (0..open)
        .min_by_key(|&i| clients().get(i).map_or(0, |c| c.load(Ordering::Relaxed)))
        .unwrap_or(0)
}

/// Where a client just accepted on shard `here` should live, when not here: on a closed
/// shard, the least loaded open one.
pub fn placement_for_new(here: usize) -> Option<usize> {
    (count() > 1 && here >= open()).then(least_loaded)
}

/// Where a client going idle on shard `here` should move, if anywhere: off a closed shard,
/// or from an open shard holding clearly more clients than the least loaded one.
pub fn placement(here: usize) -> Option<usize> {
    if count() == 1 {
        return None;
    }
    let target = least_loaded();
    if here >= open() {
        return Some(target);
    }
    let n = |i: usize| clients().get(i).map_or(0, |c| c.load(Ordering::Relaxed));
    let (mine, least) = (n(here), n(target));
    (target != here && mine > least + 2.max(mine / 8)).then_some(target)
}

mod packing;
mod signals;

pub use packing::{Packer, Reading, Thresholds, SUSTAINED};
pub use signals::note_answered;

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
/// `every`, until the process ends.
// Runs on the main runtime (tokio's timers work there).
#[allow(clippy::disallowed_methods)]
pub async fn monitor(t: Thresholds, every: std::time::Duration) {
    let n = count();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get()) as f64;
    let mut packer = Packer::new(n, t);
    let mut seen = signals::Seen::new(n);
    let mut last_cpu = machine_jiffies();
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let open = open();
        let interval = seen.next(open);
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
            OPEN.store(next, Ordering::Relaxed);
        }
    }
}

/// Starts `n` shard threads, each a single-threaded runtime with I/O and [`crate::timer`]'s
/// timers only. Returns once every runtime is up.
pub fn start(n: usize, packing: bool) -> std::io::Result<()> {
    set_count(n);
    let _ = CLIENTS.set((0..n).map(|_| AtomicUsize::new(0)).collect());
    signals::init(n);
    OPEN.store(if packing { 1 } else { n }, Ordering::Relaxed);
    let mut handles = Vec::new();
    for i in 0..n {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("shoal-shard-{i}"))
            .spawn(move || {
                enter(i);
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_io()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                if let Err(e) = rt.block_on(async { crate::timer::install() }) {
                    let _ = tx.send(Err(e));
                    return;
                }
                signals::note_thread(i);
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(std::future::pending::<()>());
            })?;
        handles.push(rx.recv().map_err(std::io::Error::other)??);
    }
    let _ = HANDLES.set(handles);
    Ok(())
}
