//! Returning freed heap memory to the operating system.
//!
//! A connect storm leaves the heap full of freed login state interleaved with the small,
//! long-lived state of idle clients; glibc keeps those pages. `malloc_trim` gives back every
//! whole free page, so after a storm the process shrinks towards what its clients really
//! hold. It runs on the blocking pool, every few seconds, only when clients came or went.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How often to look.
const PERIOD: Duration = Duration::from_secs(5);

/// Spawns the trimming task; `churn` is a counter that grows with every client that comes or
/// goes, so a steady state costs nothing.
pub fn start(churn: &'static AtomicU64) {
    tokio::spawn(async move {
        let mut seen = churn.load(Ordering::Relaxed);
        let mut tick = tokio::time::interval(PERIOD);
        loop {
            tick.tick().await;
            let now = churn.load(Ordering::Relaxed);
            if now != seen {
                seen = now;
                let _ = tokio::task::spawn_blocking(trim).await;
            }
        }
    });
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn trim() {
    // SAFETY: malloc_trim has no preconditions; it only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim() {}
