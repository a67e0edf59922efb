//! A coarse clock for pool bookkeeping: milliseconds since start, read from the kernel's
//! coarse monotonic clock (a vDSO read of a value the timer interrupt updates, no system
//! call; a few milliseconds of resolution). It used to be an atomic advanced by a task every
//! 50 ms, which woke an idle node twenty times a second for nothing: in a cluster of 55 idle
//! nodes that was a third of their CPU.

use std::sync::OnceLock;

static START_MS: OnceLock<u64> = OnceLock::new();

/// Microseconds on `clock` (a vDSO read). Both clocks read here exist on every Linux; a
/// failure would only flatten timings.
fn read_us(clock: nix::time::ClockId) -> u64 {
    nix::time::clock_gettime(clock).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000 + t.tv_nsec() as u64 / 1_000
    })
}

fn coarse_ms() -> u64 {
    read_us(nix::time::ClockId::CLOCK_MONOTONIC_COARSE) / 1_000
}

/// Milliseconds since the clock started, accurate to a few milliseconds.
pub fn now_ms() -> u64 {
    coarse_ms().saturating_sub(*START_MS.get_or_init(coarse_ms))
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
    read_us(nix::time::ClockId::CLOCK_MONOTONIC)
}

/// Starts the clock (its zero); later calls do nothing.
pub fn start() {
    START_MS.get_or_init(coarse_ms);
}

#[cfg(test)]
mod tests {
    use super::{mono_us, now_ms};

    #[test]
    fn the_coarse_clock_advances_with_time() {
        let a = now_ms();
        std::thread::sleep(std::time::Duration::from_millis(30));
        let b = now_ms();
        // Its resolution is a timer tick (at most 10 ms).
        assert!((20..1_000).contains(&(b - a)), "{a} then {b}");
    }

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
