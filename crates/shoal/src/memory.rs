//! The heap: which allocator Shoal runs on, and returning freed memory to the operating
//! system.
//!
//! Every connected client holds a tokio task and an I/O registration, both aligned to 128
//! bytes (cache-line padding). glibc serves such allocations with `memalign`, which carves
//! an oversized chunk and leaves the unaligned ends as small free fragments between
//! long-lived objects: after a 19,000-client connect storm that was ~500 bytes of RSS per idle
//! client on top of the ~850 it really holds. jemalloc's size classes (256, 384, ...) are
//! naturally aligned, so those objects pack without gaps; it is the global allocator wherever
//! it builds (everywhere but MSVC), for the binary and the test suite alike, unless the
//! `jemalloc` feature is left out (scripts/quickstart's build, which skips its C build).
//!
//! A connect storm also leaves pages of freed login state (and a wave of relayed clients
//! parking, their relays' state). jemalloc returns dirty pages after a decay period, but only
//! when the arena sees activity; a fleet of idle clients may give it none. So once churn stops,
//! a task asks jemalloc to purge every arena. Not while it goes on: the arenas are active then
//! and decay runs, and a purge would hand back pages the next logins fault in again (a cluster
//! node resuming and parking clients all the time would purge every few seconds).
// The allocator's housekeeping runs on the main runtime.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// How often to look.
const PERIOD: Duration = Duration::from_secs(5);

/// Spawns the purging task; `churn` is a counter that grows with every client that comes,
/// goes or parks. It purges once a period with no churn follows one with some.
pub fn start(churn: &'static AtomicU64) {
    tokio::spawn(async move {
        let mut seen = churn.load(Ordering::Relaxed);
        let mut churned = false;
        let mut tick = tokio::time::interval(PERIOD);
        loop {
            tick.tick().await;
            let now = churn.load(Ordering::Relaxed);
            if now != seen {
                seen = now;
                churned = true;
            } else if std::mem::take(&mut churned) {
                let _ = tokio::task::spawn_blocking(purge).await;
            }
        }
    });
}

/// Returns every arena's unused dirty pages to the operating system.
fn purge() {
    let rc = purge_arenas();
    if rc != 0 {
        tracing::debug!(errno = rc, "jemalloc purge failed");
    }
}

/// `mallctl("arena.<MALLCTL_ARENAS_ALL>.purge")`; 0 on success, else an errno.
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[allow(unsafe_code)]
fn purge_arenas() -> i32 {
    // SAFETY: the name is NUL-terminated; a control that neither reads nor writes takes null
    // pointers and a zero length, as passed here.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            c"arena.4096.purge".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    }
}

/// Without jemalloc (a quick build), glibc's malloc gives back what it can.
#[cfg(all(not(feature = "jemalloc"), target_env = "gnu"))]
#[allow(unsafe_code)]
fn purge_arenas() -> i32 {
    // SAFETY: malloc_trim only walks glibc's own arenas; it takes no pointer.
    unsafe { libc::malloc_trim(0) };
    0
}

#[cfg(any(
    target_env = "msvc",
    all(not(feature = "jemalloc"), not(target_env = "gnu"))
))]
fn purge_arenas() -> i32 {
    0
}

#[cfg(test)]
mod tests {
    /// The purge control exists under this name (a typo would only show as a debug log).
    #[test]
    fn purge_control_is_accepted() {
        drop(vec![0u8; 1 << 20]);
        assert_eq!(super::purge_arenas(), 0);
    }
}
