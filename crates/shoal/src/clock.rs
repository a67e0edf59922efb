//! A coarse clock for pool bookkeeping: milliseconds since start, advanced by one task on a
//! short tick, so the per-transaction path reads an atomic instead of asking the OS. It runs
//! on tokio's clock, so tests with paused time (`tokio::time::pause`) control it too.
// The clock's ticker runs on the main runtime.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();
static NOW_MS: AtomicU64 = AtomicU64::new(0);

/// Resolution of [`now_ms`].
pub const TICK: Duration = Duration::from_millis(50);

/// Milliseconds since the clock started, accurate to [`TICK`].
pub fn now_ms() -> u64 {
    NOW_MS.load(Ordering::Relaxed)
}

/// Milliseconds since the Unix epoch on the wall clock, for times shown to people (a
/// system call: not for the hot path).
pub fn epoch_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Microseconds on the system's monotonic clock, for timing queries and transactions: one
/// vDSO read and integer arithmetic, where `Instant::duration_since` adds a checked,
/// nanosecond-normalising subtraction and a 128-bit conversion per measurement (several per
/// transaction on the relay's path). Only differences between two readings mean anything.
pub fn mono_us() -> u64 {
    match nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC) {
        Ok(t) => t.tv_sec() as u64 * 1_000_000 + t.tv_nsec() as u64 / 1_000,
        // CLOCK_MONOTONIC exists on every Linux; a failure would only flatten timings.
        Err(_) => 0,
    }
}

fn refresh() {
    let start = START.get_or_init(Instant::now);
    NOW_MS.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
}

/// Starts the ticking task (once per process; later calls do nothing).
pub fn start() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        refresh();
        tokio::spawn(async {
            let mut tick = tokio::time::interval(TICK);
            loop {
                tick.tick().await;
                refresh();
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::mono_us;

    #[test]
    fn the_monotonic_microsecond_clock_measures_what_std_measures() {
        let (a, std_a) = (mono_us(), std::time::Instant::now());
        std::thread::sleep(std::time::Duration::from_millis(3));
        let (b, std_b) = (mono_us(), std::time::Instant::now());
        let ours = b - a;
        let theirs = std_b.duration_since(std_a).as_micros() as u64;
        assert!(ours >= 3_000, "{ours} µs over a 3 ms sleep");
        // Both read CLOCK_MONOTONIC; the readings were a few instructions apart.
        assert!(ours.abs_diff(theirs) < 1_000, "{ours} vs {theirs}");
    }
}
