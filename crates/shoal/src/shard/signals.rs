//! What the packing reads each interval: every shard thread's time runnable (on a CPU or in
//! the run queue, from `/proc/self/task/<tid>/schedstat`; tokio's busy time where that file
//! cannot be read) and the queries answered, counted per shard so that counting costs a
//! shard no shared cache line.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A counter alone on its cache line (two, for the adjacent-line prefetcher).
#[repr(align(128))]
struct Padded(AtomicU64);

static ANSWERED: OnceLock<Box<[Padded]>> = OnceLock::new();
static TIDS: OnceLock<Box<[AtomicI32]>> = OnceLock::new();

pub(super) fn init(n: usize) {
    let _ = ANSWERED.set((0..n).map(|_| Padded(AtomicU64::new(0))).collect());
    let _ = TIDS.set((0..n).map(|_| AtomicI32::new(0)).collect());
}

/// Records the calling thread as shard `i`'s (called on the shard thread as it starts).
pub(super) fn note_thread(i: usize) {
    if let Some(t) = TIDS.get().and_then(|t| t.get(i)) {
        t.store(nix::unistd::gettid().as_raw(), Ordering::Relaxed);
    }
}

/// A query answered (a ReadyForQuery relayed to its client) on this thread's shard.
pub fn note_answered() {
    if let Some(c) = ANSWERED.get().and_then(|a| a.get(super::current())) {
        c.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn answered() -> u64 {
    ANSWERED
        .get()
        .map_or(0, |a| a.iter().map(|c| c.0.load(Ordering::Relaxed)).sum())
}

/// Time on a CPU plus time waiting for one, in nanoseconds: the first two fields of a
/// `schedstat` file.
pub(super) fn parse_schedstat(text: &str) -> Option<u64> {
    let mut f = text.split_ascii_whitespace().map(|x| x.parse::<u64>());
    let (on_cpu, waiting) = (f.next()?.ok()?, f.next()?.ok()?);
    Some(on_cpu.saturating_add(waiting))
}

fn runnable(i: usize) -> Option<u64> {
    let tid = TIDS.get()?.get(i)?.load(Ordering::Relaxed);
    if tid == 0 {
        return None;
    }
    parse_schedstat(&std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?)
}

fn busy(i: usize) -> Duration {
    super::handle(i).map_or(Duration::ZERO, |h| {
        h.metrics().worker_total_busy_duration(0)
    })
}

/// One interval's signals.
pub(super) struct Interval {
    /// Each shard's fraction of the interval runnable.
    pub demand: Vec<f64>,
    /// Queries answered per second.
    pub work: f64,
    /// Every open shard nearly idle by tokio's clock: the caller may skip reading the machine.
    pub quiet: bool,
}

/// Last interval's counters.
pub(super) struct Seen {
    runnable: Vec<Option<u64>>,
    busy: Vec<Duration>,
    answered: u64,
    at: Instant,
}

/// Below this busy fraction (tokio's clock) a lone shard is quiet: its run-queue time is not
/// read, nor the machine's idle time (five reads a second cost an idle node more than the
/// rest of the monitor).
const QUIET: f64 = 0.05;

impl Seen {
    pub fn new(n: usize) -> Seen {
        Seen {
            runnable: (0..n).map(runnable).collect(),
            busy: (0..n).map(busy).collect(),
            answered: answered(),
            at: Instant::now(),
        }
    }

    pub fn next(&mut self, open: usize) -> Interval {
        let now = Instant::now();
        let wall = now.duration_since(self.at).as_secs_f64().max(1e-3);
        self.at = now;
        let n = self.busy.len();
        let busy: Vec<f64> = (0..n)
            .map(|i| {
                let b = busy(i);
                let f = b.saturating_sub(self.busy[i]).as_secs_f64() / wall;
                self.busy[i] = b;
                f
            })
            .collect();
        let quiet = busy[..open.min(n)].iter().all(|&b| b < QUIET);
        let demand = (0..n)
            .map(|i| {
                let (before, now) = if quiet {
                    (None, None)
                } else {
                    (self.runnable[i], runnable(i))
                };
                self.runnable[i] = now;
                match (before, now) {
                    (Some(a), Some(b)) => (b.saturating_sub(a) as f64 / 1e9 / wall).min(1.0),
                    _ => busy[i],
                }
            })
            .collect();
        let total = answered();
        let work = total.saturating_sub(self.answered) as f64 / wall;
        self.answered = total;
        Interval {
            demand,
            work,
            quiet,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_schedstat;

    #[test]
    fn schedstat_gives_time_on_a_cpu_and_in_the_run_queue() {
        assert_eq!(parse_schedstat("1500 2500 7\n"), Some(4000));
        assert_eq!(parse_schedstat("1500\n"), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
        assert_eq!(parse_schedstat(""), None);
    }
}
