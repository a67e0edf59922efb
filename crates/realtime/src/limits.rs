//! A tenant's realtime limits (Supabase Realtime's tenant fields) and the meters that
//! enforce them: sockets connected at once, joins, events and bytes per second.
//!
//! The meters are the tenant's own (they live in its [`crate::hub::Hub`]), so one tenant
//! running into its limits never holds up another's channels. Rates are token buckets
//! holding one second's worth: a burst up to the limit, then the limit per second.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Supabase Realtime's defaults where it has them; the per-second rates and the user count
/// are off unless set (Realtime's hosted defaults are a plan's quota, not a safety limit).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Channels one socket may have joined.
    pub max_channels: usize,
    /// Bytes of one broadcast's payload.
    pub max_payload: usize,
    /// Sockets connected at once.
    pub max_concurrent_users: Option<usize>,
    /// Messages from clients (broadcasts, presence, token updates) per second.
    pub max_events_per_second: Option<u32>,
    pub max_joins_per_second: Option<u32>,
    /// Bytes of broadcast payloads from clients per second.
    pub max_bytes_per_second: Option<u64>,
    /// Public channels are refused.
    pub private_only: bool,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_channels: 100,
            max_payload: 3000 * 1024,
            max_concurrent_users: None,
            max_events_per_second: None,
            max_joins_per_second: None,
            max_bytes_per_second: None,
            private_only: false,
        }
    }
}

/// What went over a limit; the texts are Realtime's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Over {
    #[error("Too many connected users")]
    Users,
    #[error("ClientJoinRateLimitReached: Too many joins per second")]
    Joins,
    #[error("Too many messages per second")]
    Events,
    #[error("Too many bytes per second")]
    Bytes,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(now: Instant) -> Bucket {
        Bucket {
            tokens: f64::INFINITY,
            at: now,
        }
    }

    /// Takes `n` at `rate` per second; a cost above one second's worth passes when the
    /// bucket is full (and leaves it in debt), so a big message is slowed, not barred.
    fn take(&mut self, n: f64, rate: f64, now: Instant) -> bool {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(rate);
        self.at = now;
        if self.tokens < n.min(rate) {
            return false;
        }
        self.tokens -= n;
        true
    }
}

#[derive(Debug)]
struct Buckets {
    joins: Bucket,
    events: Bucket,
    bytes: Bucket,
}

/// One tenant's limits now and the meters against them.
#[derive(Debug)]
pub struct Meter {
    limits: Mutex<Limits>,
    users: AtomicUsize,
    buckets: Mutex<Buckets>,
    /// Counts for metrics: messages from clients, joins, and refusals for a limit.
    pub messages: std::sync::atomic::AtomicU64,
    pub joins: std::sync::atomic::AtomicU64,
    pub limited: std::sync::atomic::AtomicU64,
}

impl Default for Meter {
    fn default() -> Meter {
        let now = Instant::now();
        Meter {
            limits: Mutex::default(),
            users: AtomicUsize::new(0),
            buckets: Mutex::new(Buckets {
                joins: Bucket::full(now),
                events: Bucket::full(now),
                bytes: Bucket::full(now),
            }),
            messages: Default::default(),
            joins: Default::default(),
            limited: Default::default(),
        }
    }
}

impl Meter {
    pub fn limits(&self) -> Limits {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tenant's limits as configured now (they apply to sockets already connected).
    pub fn set_limits(&self, limits: Limits) {
        *self.limits.lock().unwrap_or_else(|e| e.into_inner()) = limits;
    }

    pub fn users(&self) -> usize {
        self.users.load(Ordering::Relaxed)
    }

    /// Counts a socket in, unless the tenant has its most; undone by [`Meter::user_left`].
    // `fetch_update` is renamed `try_update` in newer Rust; Shoal still builds with 1.87.
    #[allow(deprecated)]
    pub fn admit_user(&self) -> Result<(), Over> {
        let max = self.limits().max_concurrent_users.unwrap_or(usize::MAX);
        self.users
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| self.over(Over::Users))
    }

    fn over(&self, over: Over) -> Over {
        self.limited.fetch_add(1, Ordering::Relaxed);
        over
    }

    pub fn user_left(&self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }

    pub fn join(&self) -> Result<(), Over> {
        self.joins.fetch_add(1, Ordering::Relaxed);
        let Some(rate) = self.limits().max_joins_per_second else {
            return Ok(());
        };
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        b.joins
            .take(1.0, f64::from(rate), Instant::now())
            .then_some(())
            .ok_or_else(|| self.over(Over::Joins))
    }

    /// A message from a client carrying `bytes` of payload.
    pub fn event(&self, bytes: usize) -> Result<(), Over> {
        self.events(1, bytes)
    }

    /// `count` messages carrying `bytes` of payload together (a REST batch).
    pub fn events(&self, count: usize, bytes: usize) -> Result<(), Over> {
        self.messages.fetch_add(count as u64, Ordering::Relaxed);
        let l = self.limits();
        if l.max_events_per_second.is_none() && l.max_bytes_per_second.is_none() {
            return Ok(());
        }
        let now = Instant::now();
        let mut b = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(rate) = l.max_events_per_second {
            if !b.events.take(count as f64, f64::from(rate), now) {
                return Err(self.over(Over::Events));
            }
        }
        if let Some(rate) = l.max_bytes_per_second {
            if !b.bytes.take(bytes as f64, rate as f64, now) {
                return Err(self.over(Over::Bytes));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_bucket_allows_a_second_s_worth_then_the_rate() {
        let t0 = Instant::now();
        let mut b = Bucket::full(t0);
        for _ in 0..10 {
            assert!(b.take(1.0, 10.0, t0));
        }
        assert!(!b.take(1.0, 10.0, t0));
        assert!(b.take(1.0, 10.0, t0 + Duration::from_millis(100)));
        assert!(!b.take(1.0, 10.0, t0 + Duration::from_millis(100)));
        // A cost above the rate passes on a full bucket, then waits for the debt.
        let mut b = Bucket::full(t0);
        assert!(b.take(250.0, 100.0, t0));
        assert!(!b.take(1.0, 100.0, t0 + Duration::from_millis(1000)));
        assert!(b.take(1.0, 100.0, t0 + Duration::from_millis(1600)));
    }

    #[test]
    fn meters_refuse_past_the_limits_and_only_when_set() {
        let m = Meter::default();
        for _ in 0..1000 {
            m.join().unwrap();
            m.event(1 << 20).unwrap();
            m.admit_user().unwrap();
        }
        m.set_limits(Limits {
            max_concurrent_users: Some(1001),
            max_joins_per_second: Some(2),
            max_events_per_second: Some(3),
            max_bytes_per_second: Some(100),
            ..Limits::default()
        });
        m.admit_user().unwrap();
        assert_eq!(m.admit_user(), Err(Over::Users));
        m.user_left();
        m.admit_user().unwrap();
        assert!(m.join().is_ok() && m.join().is_ok());
        assert_eq!(m.join(), Err(Over::Joins));
        assert!(m.event(10).is_ok());
        assert_eq!(m.event(100), Err(Over::Bytes));
        assert!(m.event(1).is_ok());
        assert_eq!(m.event(1), Err(Over::Events));
        assert_eq!(
            m.events(5, 0),
            Err(Over::Events),
            "a batch counts each message"
        );
    }
}
