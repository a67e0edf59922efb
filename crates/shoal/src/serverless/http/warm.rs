//! Logged-in sessions that HTTP queries left clean, kept a few seconds for the next query
//! with the same connection string: a serverless function sends the same credentials on
//! every query, and a login is most of a one-shot query's cost (a session started on a
//! shard, the password checked, four messages each way).
//!
//! Only a session whose statements were all plain DML or queries (the same analysis that
//! decides a server's hygiene: no `SET`, `set_config`, temporary table, advisory lock,
//! `LISTEN`, `PREPARE`) is kept, so the next query finds the session as a fresh login
//! would. They are keyed by a digest of user, password, database and application name
//! under a random per-process key, so only the same credentials find one. A kept session
//! is a client like any other (it counts in `max_client_conn`), so few are kept and not for
//! long, and a login that a client limit would refuse ends them all first (see
//! [`crate::admission::Spare`]). A session is given up a minute after its login, so a
//! changed password stops working for HTTP queries within that minute.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::exchange::Exchange;
use super::request::Login;

/// How long a session waits for the next query.
const IDLE_FOR: Duration = Duration::from_secs(10);
/// A session is not kept past this age (counted from its login).
const LIVES_FOR: Duration = Duration::from_secs(60);
/// Sessions kept per connection string, and in all.
const PER_KEY: usize = 8;
const IN_ALL: usize = 256;

struct Kept {
    exchange: Exchange,
    since: Instant,
}

/// Kept sessions by key, and how many in all.
type ByKey = (HashMap<[u8; 32], Vec<Kept>>, usize);

pub struct Warm {
    salt: [u8; 32],
    kept: Mutex<ByKey>,
}

impl Default for Warm {
    fn default() -> Self {
        let mut salt = [0u8; 32];
        rand::fill(&mut salt[..]);
        Warm {
            salt,
            kept: Mutex::new((HashMap::new(), 0)),
        }
    }
}

impl Warm {
    pub fn key(&self, login: &Login) -> [u8; 32] {
        crate::passwords::keyed_digest(&[
            &self.salt,
            login.user.as_bytes(),
            login.password.as_bytes(),
            login.database.as_bytes(),
            login.application_name.as_deref().unwrap_or("").as_bytes(),
        ])
    }

    /// A kept session for `key` that is still quiet (nothing arrived from it meanwhile:
    /// a session told to end, by an idle timeout or a shutdown, says so and closes).
    pub fn take(&self, key: &[u8; 32]) -> Option<Exchange> {
        let mut g = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        let (by_key, count) = &mut *g;
        let list = by_key.get_mut(key)?;
        let mut found = None;
        while let Some(mut k) = list.pop() {
            *count -= 1;
            if k.since.elapsed() < IDLE_FOR && k.exchange.is_quiet() {
                found = Some(k.exchange);
                break;
            }
        }
        if list.is_empty() {
            by_key.remove(key);
        }
        found
    }

    /// Keeps `exchange` for the next query with `key`, unless too many are kept or it has
    /// lived long enough (then it ends).
    pub async fn put(&self, key: [u8; 32], exchange: Exchange) {
        if exchange.logged_in_at.elapsed() >= LIVES_FOR {
            return exchange.terminate().await;
        }
        let refused = {
            let mut g = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            let (by_key, count) = &mut *g;
            let list = by_key.entry(key).or_default();
            if list.len() >= PER_KEY || *count >= IN_ALL {
                Some(exchange)
            } else {
                list.push(Kept {
                    exchange,
                    since: Instant::now(),
                });
                *count += 1;
                None
            }
        };
        if let Some(exchange) = refused {
            exchange.terminate().await;
        }
    }

    /// Ends the sessions that waited too long (run every few seconds).
    pub fn sweep(&self) {
        let stale: Vec<Kept> = {
            let mut g = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            let (by_key, count) = &mut *g;
            let mut stale = Vec::new();
            by_key.retain(|_, list| {
                let (old, fresh): (Vec<Kept>, Vec<Kept>) =
                    list.drain(..).partition(|k| k.since.elapsed() >= IDLE_FOR);
                stale.extend(old);
                *list = fresh;
                !list.is_empty()
            });
            *count -= stale.len();
            stale
        };
        // Dropped outside the lock: each session reads the end of its stream and ends.
        drop(stale);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.kept.lock().unwrap().1
    }
}

impl crate::admission::Spare for Warm {
    fn kept(&self) -> usize {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).1
    }

    fn shed(&self) -> usize {
        let all = {
            let mut g = self.kept.lock().unwrap_or_else(|e| e.into_inner());
            g.1 = 0;
            std::mem::take(&mut g.0)
        };
        // Dropped outside the lock, as in `sweep`.
        all.into_values().map(|list| list.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn login(password: &str) -> Login {
        Login {
            user: "app".into(),
            password: password.into(),
            database: "db".into(),
            application_name: None,
        }
    }

    #[tokio::test]
    async fn kept_for_the_same_credentials_only() {
        let warm = Warm::default();
        let (a, b) = (warm.key(&login("one")), warm.key(&login("two")));
        assert_ne!(a, b);
        assert_eq!(a, warm.key(&login("one")));
        let (ours, _session) = tokio::io::duplex(64);
        warm.put(a, Exchange::new(ours, 1024)).await;
        assert!(warm.take(&b).is_none(), "another password finds nothing");
        assert!(warm.take(&a).is_some());
        assert!(warm.take(&a).is_none(), "taken once");
        assert_eq!(warm.len(), 0);
    }

    #[tokio::test]
    async fn a_session_that_spoke_or_ended_is_not_reused() {
        use tokio::io::AsyncWriteExt;
        let warm = Warm::default();
        let key = warm.key(&login("one"));
        let (ours, mut session) = tokio::io::duplex(64);
        warm.put(key, Exchange::new(ours, 1024)).await;
        session.write_all(b"E").await.unwrap();
        assert!(warm.take(&key).is_none(), "bytes arrived while it waited");
        let (ours, session) = tokio::io::duplex(64);
        warm.put(key, Exchange::new(ours, 1024)).await;
        drop(session);
        assert!(warm.take(&key).is_none(), "its session ended");
        assert_eq!(warm.len(), 0);
    }

    #[tokio::test]
    async fn bounded_per_key() {
        let warm = Warm::default();
        let key = warm.key(&login("one"));
        let mut sessions = Vec::new();
        for _ in 0..PER_KEY + 3 {
            let (ours, session) = tokio::io::duplex(64);
            sessions.push(session);
            warm.put(key, Exchange::new(ours, 1024)).await;
        }
        assert_eq!(warm.len(), PER_KEY);
        warm.sweep();
        assert_eq!(warm.len(), PER_KEY, "none waited too long yet");
    }
}
