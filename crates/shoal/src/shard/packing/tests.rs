//! The packing replayed on simulated machines whose answers to each open-shard count come
//! from recordings (`bench/shard-signals`, 2 cores) or from the 16-core runs reported in
//! issue 55.

use super::{Packer, Reading, Thresholds, SUSTAINED, TRIAL_MAX};

/// The defaults of `[server]`.
const T: Thresholds = Thresholds {
    open_at: 0.75,
    close_at: 0.35,
    idle_cores: 0.5,
};

/// What the machine shows with `open` shards open: each open shard's demand, idle cores, and
/// queries answered per second.
struct Machine {
    shards: usize,
    signals: Box<dyn Fn(usize) -> (f64, f64, f64)>,
}

/// Runs the packing for `intervals` and returns how many intervals it spent at each open
/// count. The work jitters by ±1.5 % from one interval to the next, as pgbench's does.
fn replay(m: &Machine, intervals: usize) -> Vec<usize> {
    let jitter = [1.0, 1.015, 0.985, 1.01, 0.99];
    replay_with(m, intervals, |i| jitter[i % 5])
}

/// [`replay`] on a noisy machine: each interval's work strays uniformly by up to `spread`
/// (a shared 2-core VM: 10-30 % from one 200 ms interval to the next), drawn from a fixed
/// seed so that a run repeats.
fn replay_noisy(m: &Machine, intervals: usize, spread: f64, seed: u64) -> Vec<usize> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    replay_with(m, intervals, move |_| {
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let u = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
        1.0 + spread * (2.0 * u - 1.0)
    })
}

fn replay_with(m: &Machine, intervals: usize, mut jitter: impl FnMut(usize) -> f64) -> Vec<usize> {
    let mut p = Packer::new(m.shards, T);
    let mut time_at = vec![0; m.shards + 1];
    let mut demand = vec![0.0; m.shards];
    for i in 0..intervals {
        let open = p.open();
        time_at[open] += 1;
        let (d, idle, work) = (m.signals)(open);
        demand.iter_mut().for_each(|x| *x = 0.0);
        demand[..open].iter_mut().for_each(|x| *x = d);
        p.step(&Reading {
            demand: &demand,
            idle_cores: idle,
            work: work * jitter(i),
        });
    }
    time_at
}

/// `bench/shard-signals --clients 500,50 --duration 10` on a 2-core machine
/// (bench/results/shard-signals-20261127.txt): means over each timed run, one shard open
/// (packing) and two (packing off).
fn two_cores(clients: usize) -> Machine {
    let signals: Box<dyn Fn(usize) -> (f64, f64, f64)> = match clients {
        50 => Box::new(|open| match open {
            1 => (0.34 + 0.62, 0.14, 20185.0),
            _ => (0.21 + 0.71, 0.11, 17474.0),
        }),
        _ => Box::new(|open| match open {
            1 => (0.28 + 0.40, 0.11, 15577.0),
            _ => (0.15 + 0.46, 0.10, 17336.0),
        }),
    };
    Machine { shards: 2, signals }
}

#[test]
fn on_two_busy_cores_one_shard_stays_when_a_second_does_less_work() {
    let time_at = replay(&two_cores(50), 3000);
    // Trials of a second shard fail and back off: almost all the time one shard is open.
    assert!(
        time_at[2] * 50 < time_at[1],
        "two shards open {} of {} intervals",
        time_at[2],
        time_at[1] + time_at[2]
    );
}

#[test]
fn on_two_busy_cores_a_second_shard_stays_when_it_does_more_work() {
    let time_at = replay(&two_cores(500), 3000);
    assert!(
        time_at[2] > time_at[1] * 20,
        "one shard open {} of {} intervals",
        time_at[1],
        time_at[1] + time_at[2]
    );
}

#[test]
fn on_two_noisy_busy_cores_chance_does_not_keep_a_second_shard() {
    // With 30 % noise a second shard that does 13 % less work sometimes measures as doing
    // more over a second; judged as a measurement, it is not kept for that.
    for seed in 1..=5 {
        let time_at = replay_noisy(&two_cores(50), 3000, 0.3, seed);
        assert!(
            time_at[2] * 20 < time_at[1],
            "seed {seed}: two shards open {} of {} intervals",
            time_at[2],
            time_at[1] + time_at[2]
        );
    }
}

#[test]
fn on_two_noisy_busy_cores_a_second_shard_that_does_more_work_mostly_stays() {
    // 11 % more work through 15 % noise: found by measuring longer.
    for seed in 1..=5 {
        let time_at = replay_noisy(&two_cores(500), 3000, 0.15, seed);
        assert!(
            time_at[2] > time_at[1] * 3,
            "seed {seed}: one shard open {} of {} intervals",
            time_at[1],
            time_at[1] + time_at[2]
        );
    }
}

#[test]
fn a_load_still_ramping_up_is_not_read_as_a_trial_s_gain() {
    // A benchmark starts: quiet, then its work climbs for 3 s to its plateau. A second shard
    // does 13 % less work at any load, which a baseline taken on the climb would hide.
    let mut p = Packer::new(2, T);
    let mut at_two = 0;
    for i in 0..400 {
        let (demand, load) = match i {
            0..20 => (0.02, 0.0),
            20..35 => (0.95, 20_000.0 * (0.4 + 0.6 * (i - 20) as f64 / 15.0)),
            _ => (0.95, 20_000.0),
        };
        let work = if p.open() == 2 { load * 0.87 } else { load };
        p.step(&Reading {
            demand: &[demand, demand],
            idle_cores: 0.05,
            work,
        });
        at_two += usize::from(p.open() == 2);
    }
    // At most one trial, once the climb is over, which fails.
    assert!(
        at_two <= 2 + TRIAL_MAX as usize,
        "two shards open {at_two} of 400 intervals"
    );
}

/// Issue 55's 16-core run at 1,250 clients: PostgreSQL and pgbench keep 12 or more cores
/// busy, the open shards run 30-50 % of the time by their own clock and wait in the run queue
/// for much of the rest, and the work grows with each shard opened up to about ten (150.6k
/// tps with all sixteen open against 84.6k with five).
fn sixteen_cores(idle: f64) -> Machine {
    Machine {
        shards: 16,
        signals: Box::new(move |open| {
            let work = 17_000.0 * open.min(9) as f64 + 500.0 * open.saturating_sub(9) as f64;
            (0.4 + 0.5, idle, work)
        }),
    }
}

#[test]
fn on_sixteen_cores_starved_shards_open_while_a_core_is_free() {
    let time_at = replay(&sixteen_cores(2.5), 1000);
    // Direct opens each sustained second, doubling while the two free cores allow (1, 2, 4,
    // 6, ... 16): all sixteen are open within 8 seconds.
    let first_all = 8 * SUSTAINED as usize + 1;
    assert!(time_at[16] >= 1000 - first_all, "{time_at:?}");
    assert_eq!(time_at[3] + time_at[5] + time_at[7], 0, "{time_at:?}");
}

#[test]
fn load_arriving_at_once_on_free_cores_opens_shards_by_doubling() {
    let idle = Machine {
        shards: 16,
        // More cores than shards: the machine never saturates.
        signals: Box::new(|open| (0.95, 20.0 - open as f64, 20_000.0 * open as f64)),
    };
    let time_at = replay(&idle, 200);
    // 1, 2, 4, 8, 16: four sustained seconds.
    assert!(time_at[16] >= 200 - 4 * SUSTAINED as usize, "{time_at:?}");
    assert_eq!(time_at.iter().filter(|&&n| n > 0).count(), 5, "{time_at:?}");
}

#[test]
fn on_sixteen_saturated_cores_shards_open_as_long_as_they_bring_work() {
    let time_at = replay(&sixteen_cores(0.05), 5000);
    // Trials open shards while each brings more than 4 % more work (up to nine; the tenth
    // brings 3 %), and trials of one fewer fail: the packing spends most of its time at nine.
    let at_nine_or_more: usize = time_at[9..].iter().sum();
    let below_five: usize = time_at[..5].iter().sum();
    assert!(at_nine_or_more > 4000, "{time_at:?}");
    assert!(below_five < 300, "{time_at:?}");
}

#[test]
fn on_sixteen_saturated_noisy_cores_undecided_trials_do_not_wear_shards_away() {
    // An undecided trial of one fewer keeps the fewer: with 20 % noise that must not drift
    // the packing down, since each shard up to nine brings 12 % or more.
    for seed in 1..=3 {
        let time_at = replay_noisy(&sixteen_cores(0.05), 5000, 0.2, seed);
        let at_eight_or_more: usize = time_at[8..].iter().sum();
        assert!(at_eight_or_more > 4500, "seed {seed}: {time_at:?}");
    }
}

#[test]
fn shards_close_when_their_work_fits_in_fewer() {
    let quiet = Machine {
        shards: 4,
        signals: Box::new(|_| (0.05, 3.0, 100.0)),
    };
    let mut p = Packer::new(4, T);
    // The same reading, interval after interval.
    let hold = |p: &mut Packer, demand: f64, work: f64| {
        for _ in 0..(3 * SUSTAINED) {
            p.step(&Reading {
                demand: &[demand; 4],
                idle_cores: 3.0,
                work,
            });
        }
    };
    // Open all four under demand with free cores...
    hold(&mut p, 0.9, 10_000.0);
    assert_eq!(p.open(), 4);
    // ...then quiet: back to one, a shard a second.
    hold(&mut p, 0.05, 100.0);
    assert_eq!(p.open(), 1);
    // And a quiet machine never opens a second.
    assert_eq!(replay(&quiet, 500)[1], 500);
}

#[test]
fn a_burst_shorter_than_a_second_changes_nothing() {
    let mut p = Packer::new(2, T);
    for i in 0..100 {
        // Demand in bursts of four intervals, then quiet.
        let d = if i % 6 < 4 { 0.95 } else { 0.1 };
        p.step(&Reading {
            demand: &[d, 0.0],
            idle_cores: 1.0,
            work: 1000.0,
        });
        assert_eq!(p.open(), 1);
    }
}

#[test]
fn a_failed_trial_is_tried_again_at_once_when_the_load_changes() {
    let mut p = Packer::new(2, T);
    let step = |p: &mut Packer, open_work: [f64; 2]| {
        let w = open_work[p.open() - 1];
        p.step(&Reading {
            demand: &[0.9, 0.9],
            idle_cores: 0.05,
            work: w,
        });
    };
    // A second shard does less: the trial fails and backs off.
    for _ in 0..(SUSTAINED as usize + 20) {
        step(&mut p, [1000.0, 900.0]);
    }
    assert_eq!(p.open(), 1);
    assert!(!p.trying());
    // Within the backoff, the same load tries nothing.
    for _ in 0..20 {
        step(&mut p, [1000.0, 900.0]);
        assert!(!p.trying());
    }
    // The load doubles (more clients): a trial starts within a sustained second, and a
    // second shard that now brings more work stays (but for trials of one fewer, which fail
    // and back off).
    for _ in 0..(2 * SUSTAINED as usize + 2) {
        step(&mut p, [2000.0, 2600.0]);
    }
    assert_eq!(p.open(), 2);
    let mut at_two = 0;
    for _ in 0..300 {
        step(&mut p, [2000.0, 2600.0]);
        at_two += usize::from(p.open() == 2);
    }
    assert!(at_two > 270, "{at_two} of 300 intervals at two shards");
}
