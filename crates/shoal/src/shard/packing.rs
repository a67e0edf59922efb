//! The packing decision, pure: how many shards should be open, from what one monitor interval
//! showed. Replayed in tests on signals recorded by `bench/shard-signals`.
//!
//! A shard's *demand* is the fraction of the interval its thread was runnable: on a CPU, or
//! waiting in the run queue for one (`/proc/self/task/<tid>/schedstat`). Busy time by the
//! shard's own clock misses the waiting: on a machine whose cores PostgreSQL and the clients
//! keep busy, an open shard can be runnable all the time yet run a third of it, and the old
//! busy-fraction rule read that as room to spare while clients queued behind it.
//!
//! Every open shard in demand and a core free: open more (doubling, up to the free cores). Every open shard fairly in
//! demand and no core free: whether another thread helps (it gets the pooler a larger share of the CPUs)
//! or only competes (with PostgreSQL for the same cores) depends on the machine; the packing
//! tries it and keeps it only if the work done (queries answered per second) rises. On a
//! saturated machine with several shards open it likewise tries one fewer, and keeps that
//! if the work holds. A trial that fails is not tried again for a while (longer after each
//! failure, at once when the load changes).
//!
//! Work is noisy: on a shared 2-core machine one interval's rate strays 10-30 % from the
//! next, so a fixed 4 % gain over one second's mean was met by chance often enough that a
//! second shard doing 13 % less work (and costing 10 % more CPU per query) stayed open two
//! thirds of the time or more in a replay with 30 % noise. A trial is
//! therefore judged as a measurement: the gain must exceed its threshold by twice the
//! standard error of the difference of the two means. While the difference is within that
//! margin the trial goes on measuring, up to [`TRIAL_MAX`] intervals; still undecided then,
//! the packing keeps the fewer shards (each costs CPU per query).

use std::collections::VecDeque;

/// Monitor intervals a change must be called for in a row before it is made or tried (1 s at
/// 200 ms): a burst (a login storm, a benchmark's first second) does not move clients back and
/// forth.
pub const SUSTAINED: u32 = 5;
/// Intervals after a trial's change before its work is counted: clients move to a newly opened
/// shard only when they next go idle.
const SETTLE: u32 = 2;
/// A trial opens a shard at this share of `open_at`: a trial is measured, so it may be
/// called for on weaker evidence (on 2 cores at 500 clients one shard was runnable two thirds
/// of the time, and a second one did 11 % more work).
const TRY_SHARE: f64 = 2.0 / 3.0;
/// How much more work a shard opened on a saturated machine must bring to stay.
const GAIN: f64 = 0.04;
/// How much less work a trial with one shard fewer may do and still be kept (fewer threads
/// cost less CPU per query).
const LOSS: f64 = 0.02;
/// Intervals of work kept at the current open count: a trial's baseline.
const HISTORY: usize = 15;
/// The most intervals a trial measures (after [`SETTLE`]): 5 s at 200 ms.
const TRIAL_MAX: u32 = 25;
/// Standard errors a difference in work must clear to count: about 97 % one-sided.
const Z: f64 = 2.0;
/// Intervals before a failed trial is tried again: 10 s at 200 ms, doubling to 5 minutes.
const BACKOFF_FIRST: u64 = 50;
const BACKOFF_MAX: u64 = 1500;
/// A change of load this large (work per second, relative) makes a failed trial worth
/// trying again at once.
const LOAD_CHANGED: f64 = 0.3;

#[derive(Debug, Clone, Copy)]
pub struct Thresholds {
    /// Every open shard's demand above this: open one more (or try to).
    pub open_at: f64,
    /// Open shards' total demand fits in one fewer at this: close the last.
    pub close_at: f64,
    /// Idle cores the machine must have for a shard to open without a trial; under a fifth
    /// of it the machine counts as saturated.
    pub idle_cores: f64,
}

/// One monitor interval.
#[derive(Debug, Clone, Copy)]
pub struct Reading<'a> {
    /// Each shard's demand (all shards; only the open ones are read).
    pub demand: &'a [f64],
    /// The machine's idle cores over the interval.
    pub idle_cores: f64,
    /// Queries answered per second, all shards together.
    pub work: f64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Want {
    Stay,
    Open,
    Close,
    TryOpen,
    TryClose,
}

/// Mean and variance of a run of work readings (Welford's method).
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    n: u32,
    mean: f64,
    m2: f64,
}

impl Sample {
    fn of<'a>(xs: impl IntoIterator<Item = &'a f64>) -> Sample {
        let mut s = Sample::default();
        xs.into_iter().for_each(|&x| s.add(x));
        s
    }

    fn add(&mut self, x: f64) {
        self.n += 1;
        let d = x - self.mean;
        self.mean += d / self.n as f64;
        self.m2 += d * (x - self.mean);
    }

    /// The squared standard error of the mean.
    fn var_of_mean(&self) -> f64 {
        if self.n < 2 {
            return 0.0;
        }
        self.m2 / (self.n - 1) as f64 / self.n as f64
    }

    /// How far the difference of two means may stray by chance ([`Z`] standard errors).
    fn margin(&self, other: &Sample) -> f64 {
        Z * (self.var_of_mean() + other.var_of_mean()).sqrt()
    }
}

#[derive(Debug)]
struct Trial {
    from: usize,
    baseline: Sample,
    seen: u32,
    got: Sample,
}

/// What a trial's measurements say so far.
#[derive(Debug, PartialEq)]
enum Verdict {
    Keep,
    Revert,
    Measuring,
}

/// When a kind of trial may run again.
#[derive(Debug, Default)]
struct Backoff {
    until: u64,
    wait: u64,
    load: f64,
}

impl Backoff {
    /// Whether a trial may run now, `load` being the work at the current count: once the
    /// wait is over, or at once if the load surely moved by [`LOAD_CHANGED`] (beyond
    /// three standard errors: noise alone does not bring trials back).
    fn allows(&self, tick: u64, load: &Sample) -> bool {
        let moved = (load.mean - self.load).abs();
        tick >= self.until
            || (moved > LOAD_CHANGED * self.load.max(1.0)
                && moved > 1.5 * load.margin(&Sample::default()))
    }

    fn failed(&mut self, tick: u64, load: f64) {
        self.wait = (self.wait * 2).clamp(BACKOFF_FIRST, BACKOFF_MAX);
        self.until = tick + self.wait;
        self.load = load;
    }

    fn succeeded(&mut self) {
        *self = Backoff::default();
    }
}

/// The packing's state across intervals.
#[derive(Debug)]
pub struct Packer {
    t: Thresholds,
    shards: usize,
    open: usize,
    tick: u64,
    /// The change called for, and for how many intervals in a row.
    streak: (Want, u32),
    /// Work of the last intervals at the current open count.
    recent: VecDeque<f64>,
    trial: Option<Trial>,
    up: Backoff,
    down: Backoff,
}

impl Packer {
    pub fn new(shards: usize, t: Thresholds) -> Packer {
        Packer {
            t,
            shards: shards.max(1),
            open: 1,
            tick: 0,
            streak: (Want::Stay, 0),
            recent: VecDeque::with_capacity(HISTORY),
            trial: None,
            up: Backoff::default(),
            down: Backoff::default(),
        }
    }

    pub fn open(&self) -> usize {
        self.open
    }

    /// Whether a trial is running (its change made, its verdict not yet given).
    pub fn trying(&self) -> bool {
        self.trial.is_some()
    }

    /// Takes one interval's reading; returns how many shards should be open now.
    pub fn step(&mut self, r: &Reading) -> usize {
        self.tick += 1;
        if self.trial.is_some() {
            self.judge_trial(r.work);
            return self.open;
        }
        if self.recent.len() == HISTORY {
            self.recent.pop_front();
        }
        self.recent.push_back(r.work);
        let want = self.wants(r);
        self.streak = if self.streak.0 == want {
            (want, self.streak.1 + 1)
        } else {
            (want, 1)
        };
        if want == Want::Stay || self.streak.1 < SUSTAINED {
            return self.open;
        }
        match want {
            // Load that arrives at once (a deploy, a benchmark) is met in a few seconds, not one
            // shard a second: as many more as are open, but no more than the free cores.
            Want::Open => self.change(self.open + self.open.min((r.idle_cores as usize).max(1))),
            Want::Close => self.change(self.open - 1),
            Want::TryOpen | Want::TryClose => {
                let Some(load) = self.steady_load() else {
                    return self.open;
                };
                let (backoff, open) = if want == Want::TryOpen {
                    (&self.up, self.open + 1)
                } else {
                    (&self.down, self.open - 1)
                };
                if backoff.allows(self.tick, &load) {
                    self.start_trial(open, load);
                }
            }
            Want::Stay => {}
        }
        self.open
    }

    /// The work of the last intervals while the current want held, as a trial's baseline;
    /// none while the load is still moving (a benchmark ramping up measures as a gain for
    /// whatever is tried next). The longest such run of intervals whose older and newer
    /// halves agree within the noise and [`GAIN`].
    fn steady_load(&self) -> Option<Sample> {
        let longest = (self.streak.1 as usize).min(self.recent.len());
        (SUSTAINED as usize..=longest).rev().find_map(|len| {
            let tail = self.recent.range(self.recent.len() - len..);
            let older = Sample::of(tail.clone().take(len / 2));
            let newer = Sample::of(tail.clone().skip(len / 2));
            let moved = (newer.mean - older.mean).abs();
            let steady = moved <= (GAIN * older.mean).max(older.margin(&newer));
            steady.then(|| Sample::of(tail))
        })
    }

    fn wants(&self, r: &Reading) -> Want {
        let demand = &r.demand[..self.open.min(r.demand.len())];
        if demand.is_empty() {
            return Want::Stay;
        }
        let core_free = r.idle_cores >= self.t.idle_cores;
        if self.open < self.shards {
            if core_free && demand.iter().all(|&d| d > self.t.open_at) {
                return Want::Open;
            }
            if !core_free && demand.iter().all(|&d| d > self.t.open_at * TRY_SHARE) {
                return Want::TryOpen;
            }
        }
        let total: f64 = demand.iter().sum();
        if self.open > 1 && total < self.t.close_at * (self.open - 1) as f64 {
            return Want::Close;
        }
        let saturated = r.idle_cores < self.t.idle_cores / 5.0;
        if self.open > 1 && saturated {
            return Want::TryClose;
        }
        Want::Stay
    }

    fn change(&mut self, open: usize) {
        self.open = open.clamp(1, self.shards);
        self.streak = (Want::Stay, 0);
        self.recent.clear();
    }

    fn start_trial(&mut self, open: usize, baseline: Sample) {
        let from = self.open;
        self.change(open);
        self.trial = Some(Trial {
            from,
            baseline,
            seen: 0,
            got: Sample::default(),
        });
    }

    fn judge_trial(&mut self, work: f64) {
        let Some(trial) = self.trial.as_mut() else {
            return;
        };
        trial.seen += 1;
        if trial.seen <= SETTLE {
            return;
        }
        trial.got.add(work);
        if trial.got.n < SUSTAINED {
            return;
        }
        let opened = self.open > trial.from;
        let verdict = verdict(opened, &trial.baseline, &trial.got);
        let verdict = match verdict {
            Verdict::Measuring if trial.got.n < TRIAL_MAX => return,
            // Undecided after the longest measurement: the fewer shards.
            Verdict::Measuring if opened => Verdict::Revert,
            Verdict::Measuring => Verdict::Keep,
            v => v,
        };
        let (from, baseline) = (trial.from, trial.baseline.mean);
        self.trial = None;
        let backoff = if opened { &mut self.up } else { &mut self.down };
        if verdict == Verdict::Keep {
            backoff.succeeded();
            self.change(self.open);
        } else {
            backoff.failed(self.tick, baseline);
            self.change(from);
        }
    }
}

/// A trial's verdict from its baseline and what it measured: one shard more is kept if it
/// surely brings [`GAIN`] more work, one fewer if it surely loses no more than [`LOSS`].
fn verdict(opened: bool, baseline: &Sample, got: &Sample) -> Verdict {
    let margin = baseline.margin(got);
    let (gain, base) = (got.mean - baseline.mean, baseline.mean);
    let (keep, revert) = if opened {
        (gain - margin >= base * GAIN, gain + margin < base * GAIN)
    } else {
        (gain - margin >= -base * LOSS, gain + margin < -base * LOSS)
    };
    match (keep, revert) {
        (true, _) => Verdict::Keep,
        (_, true) => Verdict::Revert,
        _ => Verdict::Measuring,
    }
}

#[cfg(test)]
mod tests;
