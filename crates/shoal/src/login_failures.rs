//! Failed logins per (client address, user name): each failure after the first waits a little
//! longer before it is answered, and `auth_failure_ban` failures within
//! `auth_failure_window` ban that pair for the rest of the window. Password guessing slows to
//! a crawl while other clients, and the same user from other addresses, are unaffected.
//! Unknown users count like known ones (nothing tells them apart).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Delay before answering the n-th failure (n ≥ 2), doubling up to [`MAX_DELAY`].
const FIRST_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_secs(2);
/// Pairs remembered; past it the oldest windows are dropped.
const MAX_TRACKED: usize = 100_000;

struct Entry {
    failures: u32,
    since: Instant,
}

pub struct LoginFailures {
    ban_after: u32,
    window: Duration,
    by_key: Mutex<HashMap<(IpAddr, String), Entry>>,
    /// Pairs in `by_key`, kept in step under its lock: while none failed (the usual case)
    /// a login checks and clears without taking the lock or building a key.
    tracked: AtomicUsize,
}

impl LoginFailures {
    pub fn new(ban_after: u32, window: Duration) -> LoginFailures {
        LoginFailures {
            ban_after,
            window,
            by_key: Mutex::new(HashMap::new()),
            tracked: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(IpAddr, String), Entry>> {
        self.by_key.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// If the pair is banned, how long it still is.
    pub fn banned(&self, addr: IpAddr, user: &str) -> Option<Duration> {
        if self.ban_after == 0 || self.tracked.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let map = self.lock();
        let e = map.get(&(addr, user.to_owned()))?;
        let left = self.window.checked_sub(e.since.elapsed())?;
        (e.failures >= self.ban_after && !left.is_zero()).then_some(left)
    }

    /// Records a failure; returns how long to wait before answering it.
    pub fn failed(&self, addr: IpAddr, user: &str) -> Duration {
        let mut map = self.lock();
        if map.len() >= MAX_TRACKED {
            let window = self.window;
            map.retain(|_, e| e.since.elapsed() < window);
        }
        let e = map.entry((addr, user.to_owned())).or_insert(Entry {
            failures: 0,
            since: Instant::now(),
        });
        if e.since.elapsed() >= self.window {
            e.failures = 0;
            e.since = Instant::now();
        }
        e.failures += 1;
        let delay = match e.failures {
            1 => Duration::ZERO,
            n => (FIRST_DELAY * 2u32.saturating_pow(n.min(16) - 2)).min(MAX_DELAY),
        };
        self.tracked.store(map.len(), Ordering::Relaxed);
        delay
    }

    /// A successful login forgets the pair's failures.
    pub fn succeeded(&self, addr: IpAddr, user: &str) {
        if self.tracked.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut map = self.lock();
        map.remove(&(addr, user.to_owned()));
        self.tracked.store(map.len(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn failures_slow_down_then_ban_for_the_window() {
        let f = LoginFailures::new(3, Duration::from_secs(60));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        assert_eq!(f.failed(a, "u"), Duration::ZERO);
        assert_eq!(f.failed(a, "u"), FIRST_DELAY);
        assert!(f.banned(a, "u").is_none());
        assert_eq!(f.failed(a, "u"), FIRST_DELAY * 2);
        assert!(f.banned(a, "u").is_some(), "third failure bans");
        assert!(
            f.banned(b, "u").is_none(),
            "other addresses are not affected"
        );
        assert!(f.banned(a, "v").is_none(), "other users are not affected");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(f.banned(a, "u").is_none(), "the ban ends with the window");
        f.failed(a, "w");
        f.succeeded(a, "w");
        assert_eq!(f.failed(a, "w"), Duration::ZERO, "success forgets");
    }

    #[tokio::test(start_paused = true)]
    async fn the_lock_free_fast_path_sees_new_failures() {
        let f = LoginFailures::new(2, Duration::from_secs(60));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        f.failed(a, "u");
        f.succeeded(a, "u");
        assert_eq!(
            f.tracked.load(Ordering::Relaxed),
            0,
            "nothing left to track"
        );
        assert!(f.banned(a, "u").is_none());
        f.failed(a, "u");
        f.failed(a, "u");
        assert!(
            f.banned(a, "u").is_some(),
            "failures after a quiet spell still ban"
        );
        f.succeeded(a, "other");
        assert!(
            f.banned(a, "u").is_some(),
            "another pair's success forgets nothing"
        );
    }
}
