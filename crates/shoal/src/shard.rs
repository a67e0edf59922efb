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
//! CPU per transaction than it gives. Only the first [`open`] shards take clients; a monitor
//! ([`monitor`]) opens one more when every open shard is busier than `open_at` (fraction of
//! wall time spent running tasks) and closes the last when the open shards' work would fit in
//! one fewer at `close_at`. Clients accepted on a closed shard are handed to an open one, and
//! idle transaction-mode clients (no server, no buffer) move to balance the open shards at
//! the moment they go idle ([`placement`]); servers follow their clients at checkout.

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

/// What the monitor decides from: each open shard's busy fraction over the last interval and
/// the machine's idle cores over the same time.
#[derive(Debug, Clone, Copy)]
pub struct Thresholds {
    /// Every open shard busier than this (and a core free): open one more.
    pub open_at: f64,
    /// Open shards' total work fits in one fewer at this: close the last.
    pub close_at: f64,
    /// Idle cores the machine must have for a new shard to be worth opening.
    pub idle_cores: f64,
}

/// The packing decision, pure: how many shards should be open next. A shard opens only when
/// every open one is busy *and* a core is free for it (on a machine whose cores PostgreSQL and
/// the clients already use, another pooler thread only competes with them); the last closes
/// when the work would fit in fewer, or when the machine is saturated while the open shards
/// are not (the pooler is not what limits throughput then).
pub fn next_open(busy: &[f64], open: usize, shards: usize, idle: f64, t: Thresholds) -> usize {
    let busy = &busy[..open.min(busy.len())];
    if busy.is_empty() {
        return open.max(1);
    }
    let all_busy = busy.iter().all(|&b| b > t.open_at);
    if open < shards && all_busy && idle >= t.idle_cores {
        return open + 1;
    }
    let total: f64 = busy.iter().sum();
    let saturated = idle < t.idle_cores / 5.0;
    if open > 1 && (total < t.close_at * (open - 1) as f64 || (saturated && !all_busy)) {
        return open - 1;
    }
    open
}

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

/// Monitor intervals a change must be called for in a row before it is made (1 s at 200 ms).
pub const SUSTAINED: u32 = 5;

/// Opens and closes shards as their load says, every `every`, until the process ends. A
/// change is made only once the same one was called for over [`SUSTAINED`] intervals in a
/// row: a burst (a login storm, a benchmark's first second) does not make clients move back
/// and forth.
// Runs on the main runtime (tokio's timers work there).
#[allow(clippy::disallowed_methods)]
pub async fn monitor(t: Thresholds, every: std::time::Duration) {
    let n = count();
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get()) as f64;
    let busy_of = |i: usize| {
        handle(i).map_or(std::time::Duration::ZERO, |h| {
            h.metrics().worker_total_busy_duration(0)
        })
    };
    let mut last: Vec<std::time::Duration> = (0..n).map(busy_of).collect();
    let mut last_cpu = machine_jiffies();
    let mut at = std::time::Instant::now();
    // The change called for, and for how many intervals in a row.
    let mut pending = (0usize, 0u32);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = std::time::Instant::now();
        let wall = now.duration_since(at).as_secs_f64().max(1e-3);
        let busy: Vec<f64> = (0..n)
            .map(|i| {
                let b = busy_of(i);
                let f = b.saturating_sub(last[i]).as_secs_f64() / wall;
                last[i] = b;
                f
            })
            .collect();
        at = now;
        let open = open();
        // The machine's idle cores matter only to open a shard when every open one is busy,
        // or to close one of several: reading /proc/stat five times a second costs an idle
        // node more than the rest of this loop, so a lone shard not busy skips it.
        if open == 1 && busy.first().is_none_or(|&b| b <= t.open_at) {
            last_cpu = None;
            pending = (open, 0);
            continue;
        }
        let cpu = machine_jiffies();
        if last_cpu.is_none() && cpu.is_some() {
            // The first look after a pause: the next interval says how idle the machine is.
            last_cpu = cpu;
            continue;
        }
        // Without /proc, assume a core is free (the thresholds on busy time still apply).
        let idle = match (last_cpu, cpu) {
            (Some((i0, t0)), Some((i1, t1))) if t1 > t0 => {
                cores * (i1.saturating_sub(i0)) as f64 / (t1 - t0) as f64
            }
            _ => cores,
        };
        last_cpu = cpu;
        let next = next_open(&busy, open, n, idle, t);
        if next == open {
            pending = (open, 0);
            continue;
        }
        pending = if pending.0 == next {
            (next, pending.1 + 1)
        } else {
            (next, 1)
        };
        if pending.1 >= SUSTAINED {
            tracing::info!(open = next, busy = ?busy, idle_cores = idle, "per-core data plane: {} shard(s) open", next);
            OPEN.store(next, Ordering::Relaxed);
            pending = (next, 0);
        }
    }
}

/// Starts `n` shard threads, each a single-threaded runtime with I/O and [`crate::timer`]'s
/// timers only. Returns once every runtime is up.
pub fn start(n: usize, packing: bool) -> std::io::Result<()> {
    set_count(n);
    let _ = CLIENTS.set((0..n).map(|_| AtomicUsize::new(0)).collect());
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
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(std::future::pending::<()>());
            })?;
        handles.push(rx.recv().map_err(std::io::Error::other)??);
    }
    let _ = HANDLES.set(handles);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{next_open, Thresholds};

    const T: Thresholds = Thresholds {
        open_at: 0.75,
        close_at: 0.35,
        idle_cores: 0.5,
    };

    #[test]
    fn shards_open_under_load_with_a_free_core_and_close_when_it_fits_in_fewer() {
        // One shard, busy, a core free: open a second; not busy: stay.
        assert_eq!(next_open(&[0.9, 0.0], 1, 2, 1.0, T), 2);
        assert_eq!(next_open(&[0.5, 0.0], 1, 2, 1.0, T), 1);
        // Busy, but the machine has no core to give (the database and clients use them).
        assert_eq!(next_open(&[0.9, 0.0], 1, 2, 0.2, T), 1);
        // All open: cannot open more.
        assert_eq!(next_open(&[0.9, 0.9], 2, 2, 1.0, T), 2);
        // Two open, one of them idle: not every open shard is busy, and the total (0.8) does
        // not fit in one at 0.35: stay.
        assert_eq!(next_open(&[0.8, 0.0, 0.0], 2, 3, 1.0, T), 2);
        // Two open, little total work: close one.
        assert_eq!(next_open(&[0.2, 0.1], 2, 2, 1.0, T), 1);
        // Two open, half busy each, the machine saturated: the pooler does not limit
        // throughput, its second thread only competes: close.
        assert_eq!(next_open(&[0.45, 0.45], 2, 2, 0.05, T), 1);
        // Saturated by the pooler itself (every shard busy): keep.
        assert_eq!(next_open(&[0.9, 0.9], 2, 2, 0.05, T), 2);
        // Never below one.
        assert_eq!(next_open(&[0.0], 1, 1, 1.0, T), 1);
        assert_eq!(next_open(&[], 1, 2, 1.0, T), 1);
    }
}
