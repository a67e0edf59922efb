//! What the packing reads each interval: every shard thread's time runnable (on a CPU or in
//! the run queue, from `/proc/self/task/<tid>/schedstat`; tokio's busy time where that file
//! cannot be read) and the queries answered, counted per shard so that counting costs a
//! shard no shared cache line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Shards;

/// A counter alone on its cache line (two, for the adjacent-line prefetcher).
#[repr(align(128))]
struct Padded(AtomicU64);

/// Each shard's queries answered, and its thread's id (0 where there is no thread).
pub(super) struct Counters {
    answered: Box<[Padded]>,
    tids: Box<[i32]>,
}

impl Counters {
    pub fn new(tids: Vec<i32>) -> Counters {
        Counters {
            answered: tids.iter().map(|_| Padded(AtomicU64::new(0))).collect(),
            tids: tids.into(),
        }
    }

    /// A query answered on shard `i`.
    pub fn answered(&self, i: usize) {
        if let Some(c) = self.answered.get(i) {
            c.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn total(&self) -> u64 {
        self.answered
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .sum()
    }

    fn runnable(&self, i: usize) -> Option<u64> {
        let tid = *self.tids.get(i)?;
        if tid == 0 {
            return None;
        }
        parse_schedstat(&std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?)
    }
}

/// Time on a CPU plus time waiting for one, in nanoseconds: the first two fields of a
/// `schedstat` file.
pub(super) fn parse_schedstat(text: &str) -> Option<u64> {
    let mut f = text.split_ascii_whitespace().map(|x| x.parse::<u64>());
    let (on_cpu, waiting) = (f.next()?.ok()?, f.next()?.ok()?);
    Some(on_cpu.saturating_add(waiting))
}

fn busy(shards: &Shards, i: usize) -> Duration {
    shards.handle(i).map_or(Duration::ZERO, |h| {
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
    pub fn new(shards: &Shards) -> Seen {
        let n = shards.count();
        Seen {
            runnable: (0..n).map(|i| shards.signals.runnable(i)).collect(),
            busy: (0..n).map(|i| busy(shards, i)).collect(),
            answered: shards.signals.total(),
            at: Instant::now(),
        }
    }

    pub fn next(&mut self, shards: &Shards, open: usize) -> Interval {
        let now = Instant::now();
        let wall = now.duration_since(self.at).as_secs_f64().max(1e-3);
        self.at = now;
        let n = self.busy.len();
        let busy: Vec<f64> = (0..n)
            .map(|i| {
                let b = busy(shards, i);
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
                    (self.runnable[i], shards.signals.runnable(i))
                };
                self.runnable[i] = now;
                match (before, now) {
                    (Some(a), Some(b)) => (b.saturating_sub(a) as f64 / 1e9 / wall).min(1.0),
                    _ => busy[i],
                }
            })
            .collect();
        let total = shards.signals.total();
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
