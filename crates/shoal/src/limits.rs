//! Rate and concurrency limits on a database's (or tenant's) clients together, and on one
//! user's: queries per second as a token bucket with a burst, and transactions running at
//! once as a semaphore. A client over a limit waits its turn for up to `limit_wait`, then
//! is refused with `53400`; with `limit_wait = "0s"` it is refused at once.
//!
//! Queries are counted as they are answered: a transaction takes one token to start, and the
//! rest of its queries are charged when it ends, so a long transaction is paid for by the
//! client's next one rather than held up in the middle. A reply from the result cache is a
//! query too.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use shoal_control::config::limits::{Limits, Rate};

/// One scope's limits (a database's or a tenant's, or a user's), shared by its pools.
#[derive(Debug)]
pub struct Limiter {
    pub config: Limits,
    /// Says whose limit it is, in refusals (`tenant "acme"`, `user "bob"`).
    pub label: String,
    bucket: Option<Mutex<Bucket>>,
    slots: Option<Arc<tokio::sync::Semaphore>>,
    /// Clients waiting for a slot now.
    waiting: std::sync::atomic::AtomicUsize,
}

#[derive(Debug)]
struct Bucket {
    rate: Rate,
    tokens: f64,
    /// When `tokens` was last brought up to date ([`crate::clock::mono_us`]).
    at_us: u64,
}

impl Bucket {
    fn refill(&mut self, now_us: u64) {
        let elapsed = now_us.saturating_sub(self.at_us) as f64 / 1e6;
        self.tokens = (self.tokens + elapsed * self.rate.per_second).min(self.rate.burst);
        self.at_us = now_us;
    }

    /// Takes a token, now or after the returned wait; `None` when the wait would pass
    /// `most` (nothing is taken then).
    fn reserve(&mut self, now_us: u64, most: Duration) -> Option<Duration> {
        self.refill(now_us);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Some(Duration::ZERO);
        }
        let wait = Duration::from_secs_f64((1.0 - self.tokens) / self.rate.per_second);
        if wait > most {
            return None;
        }
        self.tokens -= 1.0;
        Some(wait)
    }
}

pub use crate::seam::Refusal;

impl Limiter {
    pub fn new(config: Limits, label: String) -> Limiter {
        Limiter {
            bucket: config.rate.map(|rate| {
                Mutex::new(Bucket {
                    rate,
                    tokens: rate.burst,
                    at_us: crate::clock::mono_us(),
                })
            }),
            slots: config
                .concurrency
                .map(|n| Arc::new(tokio::sync::Semaphore::new(n))),
            config,
            label,
            waiting: Default::default(),
        }
    }

    /// Clients waiting for a slot now (for SHOW LIMITS).
    pub fn waiting(&self) -> usize {
        self.waiting.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn bucket(&self) -> Option<std::sync::MutexGuard<'_, Bucket>> {
        self.bucket
            .as_ref()
            .map(|b| b.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn rate_refusal(&self) -> Refusal {
        let r = self.config.rate.expect("a rate limit");
        Refusal(format!(
            "rate limit exceeded for {}: {} queries per second (burst {}); try again later",
            self.label, r.per_second, r.burst
        ))
    }

    /// Transactions running now (for SHOW LIMITS).
    pub fn running(&self) -> usize {
        match (&self.slots, self.config.concurrency) {
            (Some(s), Some(n)) => n.saturating_sub(s.available_permits()),
            _ => 0,
        }
    }

    /// Tokens left now.
    pub fn tokens(&self) -> Option<f64> {
        self.bucket().map(|mut b| {
            b.refill(crate::clock::mono_us());
            b.tokens
        })
    }
}

/// The limits a pool's clients are held to: their database's (or tenant's), and their
/// user's.
#[derive(Debug)]
pub struct PoolLimits {
    pub database: Option<Arc<Limiter>>,
    pub user: Option<Arc<Limiter>>,
    pub wait: Duration,
}

/// Slots held while a transaction runs.
pub struct Running(#[allow(dead_code)] Vec<tokio::sync::OwnedSemaphorePermit>);

impl PoolLimits {
    fn scopes(&self) -> impl Iterator<Item = &Arc<Limiter>> {
        self.database.iter().chain(self.user.iter())
    }

    /// A query may start: takes a token from every bucket, waiting for one when needed.
    pub async fn admit_query(&self) -> Result<(), Refusal> {
        let now = crate::clock::mono_us();
        let mut wait = Duration::ZERO;
        let mut taken: Vec<&Arc<Limiter>> = Vec::new();
        for l in self.scopes() {
            let Some(mut b) = l.bucket() else { continue };
            match b.reserve(now, self.wait) {
                Some(w) => {
                    wait = wait.max(w);
                    drop(b);
                    taken.push(l);
                }
                None => {
                    drop(b);
                    // Nothing is taken from the others either.
                    for t in taken {
                        if let Some(mut b) = t.bucket() {
                            b.tokens += 1.0;
                        }
                    }
                    return Err(l.rate_refusal());
                }
            }
        }
        if !wait.is_zero() {
            crate::timer::sleep(wait).await;
        }
        Ok(())
    }

    /// A transaction may start: a slot of every concurrency limit, waiting up to the pool's
    /// `limit_wait` for each.
    pub async fn admit_transaction(&self) -> Result<Running, Refusal> {
        let mut held = Vec::new();
        for l in self.scopes() {
            let Some(slots) = &l.slots else { continue };
            let permit = match slots.clone().try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) if self.wait.is_zero() => None,
                Err(_) => {
                    use std::sync::atomic::Ordering::Relaxed;
                    l.waiting.fetch_add(1, Relaxed);
                    let p = crate::timer::timeout(self.wait, slots.clone().acquire_owned()).await;
                    l.waiting.fetch_sub(1, Relaxed);
                    p.ok().and_then(Result::ok)
                }
            };
            match permit {
                Some(p) => held.push(p),
                None => {
                    return Err(Refusal(format!(
                        "too many transactions at once for {}: max_concurrency is {}{}",
                        l.label,
                        l.config.concurrency.unwrap_or(0),
                        if self.wait.is_zero() {
                            String::new()
                        } else {
                            format!(", and none ended within limit_wait ({:?})", self.wait)
                        }
                    )))
                }
            }
        }
        Ok(Running(held))
    }

    /// A transaction answered `queries` queries in all (one was taken to start it).
    pub fn charge(&self, queries: u64) {
        if queries <= 1 {
            return;
        }
        let extra = (queries - 1) as f64;
        for l in self.scopes() {
            if let Some(mut b) = l.bucket() {
                // Debt is bounded: a client cannot be owed more than a burst's wait.
                b.tokens = (b.tokens - extra).max(-b.rate.burst);
            }
        }
    }

    pub fn has_concurrency(&self) -> bool {
        self.scopes().any(|l| l.slots.is_some())
    }

    pub fn has_rate(&self) -> bool {
        self.scopes().any(|l| l.bucket.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_burst_then_its_rate() {
        let mut b = Bucket {
            rate: Rate {
                per_second: 10.0,
                burst: 3.0,
            },
            tokens: 3.0,
            at_us: 0,
        };
        let most = Duration::from_millis(250);
        for _ in 0..3 {
            assert_eq!(b.reserve(0, most), Some(Duration::ZERO));
        }
        // The next token comes in 100 ms: waited for.
        let w = b.reserve(0, most).unwrap();
        assert!((w.as_secs_f64() - 0.1).abs() < 1e-9, "{w:?}");
        // Two queued: the next is 200 ms away, then 300 ms (past the most).
        assert!(b.reserve(0, most).is_some());
        assert_eq!(b.reserve(0, most), None);
        // A second later, full again (never past the burst).
        assert_eq!(b.reserve(1_300_000, most), Some(Duration::ZERO));
        assert!(b.tokens <= 3.0);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_refused_query_takes_no_token_from_the_other_scope() {
        let db = Arc::new(Limiter::new(
            Limits {
                rate: Some(Rate {
                    per_second: 1.0,
                    burst: 5.0,
                }),
                ..Default::default()
            },
            "tenant \"t\"".into(),
        ));
        let user = Arc::new(Limiter::new(
            Limits {
                rate: Some(Rate {
                    per_second: 0.001,
                    burst: 1.0,
                }),
                ..Default::default()
            },
            "user \"u\"".into(),
        ));
        let l = PoolLimits {
            database: Some(db.clone()),
            user: Some(user),
            wait: Duration::ZERO,
        };
        l.admit_query().await.unwrap();
        let e = l.admit_query().await.unwrap_err();
        assert!(e.0.contains("user \"u\""), "{e:?}");
        assert!(db.tokens().unwrap() > 3.9, "refunded");
    }
}
