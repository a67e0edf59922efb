//! A pool's most recent slow queries, for the dashboard's pool page: noted only past
//! `slow_query_threshold`, so a pool without slow queries holds nothing.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;

/// Slow queries a pool remembers.
pub const KEEP: usize = 20;

/// A query that ran past the threshold. Its text is not kept: statements may carry
/// secrets, and keeping every query's text in case it turns out slow would cost every query.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SlowQuery {
    /// Milliseconds since the epoch, when it ended.
    pub at: u64,
    pub duration_ms: f64,
}

#[derive(Default)]
pub struct SlowLog {
    recent: Mutex<VecDeque<SlowQuery>>,
}

impl SlowLog {
    pub fn note(&self, q: SlowQuery) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if recent.len() == KEEP {
            recent.pop_back();
        }
        recent.push_front(q);
    }

    /// Newest first.
    pub fn recent(&self) -> Vec<SlowQuery> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_are_kept_first() {
        let log = SlowLog::default();
        for i in 0..(KEEP as u64 + 3) {
            log.note(SlowQuery {
                at: i,
                duration_ms: 1.0,
            });
        }
        let r = log.recent();
        assert_eq!(r.len(), KEEP);
        assert_eq!(r[0].at, KEEP as u64 + 2);
        assert_eq!(r[KEEP - 1].at, 3);
    }
}
