//! Limits on what a database's (or tenant's) clients may ask of it, and a user's: a cap on
//! `statement_timeout`, a rate of queries per second with a burst, and a number of
//! transactions running at once. Keys: `max_statement_timeout`, `rate_limit`, `rate_burst`,
//! `max_concurrency`, `limit_wait` (a database's or tenant's); `rate_limit`, `rate_burst`,
//! `max_concurrency` (a user's).

use std::time::Duration;

/// The limit keys as written (a `[databases.NAME]` section's, a tenant's, or a user's).
#[derive(Debug, Default, Clone, Copy)]
pub struct LimitKeys<'a> {
    pub max_statement_timeout: Option<&'a str>,
    pub rate_limit: Option<f64>,
    pub rate_burst: Option<f64>,
    pub max_concurrency: Option<usize>,
    pub limit_wait: Option<&'a str>,
}

/// Queries per second, and how many may come at once above it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    pub per_second: f64,
    pub burst: f64,
}

/// Limits, validated.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Limits {
    /// Statements run at most this long (a database's or tenant's only).
    pub statement_timeout: Option<Duration>,
    pub rate: Option<Rate>,
    /// Transactions running at once.
    pub concurrency: Option<usize>,
    /// How long a client over a limit waits before it is refused (zero: refused at once).
    pub wait: Duration,
}

/// How long a client over a limit waits unless told otherwise.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

impl Limits {
    pub fn any(&self) -> bool {
        self.statement_timeout.is_some() || self.rate.is_some() || self.concurrency.is_some()
    }
}

/// Validates the keys; errors name the key (`{section}.rate_limit`).
pub fn validate(section: &str, k: &LimitKeys<'_>) -> Result<Limits, String> {
    let mut l = Limits {
        wait: DEFAULT_WAIT,
        ..Limits::default()
    };
    if let Some(t) = k.max_statement_timeout {
        let d = super::duration::parse(t)
            .map_err(|e| format!("{section}.max_statement_timeout: {e}"))?;
        if d < Duration::from_millis(1) {
            return Err(format!("{section}.max_statement_timeout: at least 1ms"));
        }
        l.statement_timeout = Some(d);
    }
    if let Some(r) = k.rate_limit {
        if !(r.is_finite() && r > 0.0) {
            return Err(format!(
                "{section}.rate_limit: a number of queries per second above 0"
            ));
        }
        let burst = k.rate_burst.unwrap_or(r.max(1.0));
        if !(burst.is_finite() && burst >= 1.0) {
            return Err(format!(
                "{section}.rate_burst: a number of queries, at least 1"
            ));
        }
        l.rate = Some(Rate {
            per_second: r,
            burst,
        });
    } else if k.rate_burst.is_some() {
        return Err(format!("{section}.rate_burst: only with rate_limit"));
    }
    if let Some(c) = k.max_concurrency {
        if c == 0 {
            return Err(format!("{section}.max_concurrency: at least 1"));
        }
        l.concurrency = Some(c);
    }
    if let Some(w) = k.limit_wait {
        l.wait = super::duration::parse(w).map_err(|e| format!("{section}.limit_wait: {e}"))?;
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_and_named() {
        let l = validate(
            "databases.app",
            &LimitKeys {
                max_statement_timeout: Some("30s"),
                rate_limit: Some(100.0),
                rate_burst: None,
                max_concurrency: Some(4),
                limit_wait: Some("0s"),
            },
        )
        .unwrap();
        assert_eq!(l.statement_timeout, Some(Duration::from_secs(30)));
        assert_eq!(
            l.rate,
            Some(Rate {
                per_second: 100.0,
                burst: 100.0
            })
        );
        assert_eq!((l.concurrency, l.wait), (Some(4), Duration::ZERO));
        assert!(l.any());
        let bad = |k: LimitKeys<'_>| validate("databases.app", &k).unwrap_err();
        assert!(bad(LimitKeys {
            rate_limit: Some(0.0),
            ..Default::default()
        })
        .starts_with("databases.app.rate_limit"));
        assert!(bad(LimitKeys {
            rate_burst: Some(5.0),
            ..Default::default()
        })
        .contains("only with rate_limit"));
        assert!(bad(LimitKeys {
            max_concurrency: Some(0),
            ..Default::default()
        })
        .contains("max_concurrency"));
        assert!(bad(LimitKeys {
            max_statement_timeout: Some("soon"),
            ..Default::default()
        })
        .contains("max_statement_timeout"));
        let none = validate("d", &LimitKeys::default()).unwrap();
        assert!(!none.any());
        assert_eq!(none.wait, DEFAULT_WAIT);
    }
}
