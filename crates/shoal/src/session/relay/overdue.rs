//! The relay's backstop for `max_statement_timeout`.

use std::pin::Pin;

/// The backstop of `max_statement_timeout`: PostgreSQL ends a statement past it itself
/// (servers start with it as their `statement_timeout`), but a client may raise its own
/// setting (`SET`, `set_config`, a function's `SET` clause). A request (a Query, or extended
/// messages up to Sync) still running [`OVERDUE_GRACE`] past the cap is cancelled by Shoal.
pub(super) struct Overdue {
    limit: Option<std::time::Duration>,
    /// The request it times (its start), and the timer.
    timer: Option<(u64, Pin<Box<crate::timer::Sleep>>)>,
    /// The request already cancelled.
    fired: Option<u64>,
}

/// How long past the cap Shoal waits for PostgreSQL's own timeout before it cancels.
const OVERDUE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

impl Overdue {
    pub(super) fn new(cap: Option<std::time::Duration>) -> Overdue {
        Overdue {
            limit: cap.map(|c| c + OVERDUE_GRACE),
            timer: None,
            fired: None,
        }
    }

    /// Times the request that started at `start` while one is running. Asked at every step
    /// of the relay: a pool without the cap pays one comparison, not a call.
    #[inline(always)]
    pub(super) fn arm(&mut self, start: Option<u64>, running: bool) {
        if let Some(limit) = self.limit {
            self.arm_capped(limit, start, running);
        }
    }

    fn arm_capped(&mut self, limit: std::time::Duration, start: Option<u64>, running: bool) {
        match start {
            Some(t) if running && self.fired != Some(t) => {
                if self.timer.as_ref().map(|w| w.0) != Some(t) {
                    let elapsed =
                        std::time::Duration::from_micros(crate::clock::mono_us().saturating_sub(t));
                    let left = limit.saturating_sub(elapsed);
                    self.timer = Some((t, Box::pin(crate::timer::sleep(left))));
                }
            }
            _ => self.timer = None,
        }
    }

    /// Whether the running request just passed the limit.
    pub(super) fn poll(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        let Some((t, sleep)) = self.timer.as_mut() else {
            return false;
        };
        if std::future::Future::poll(sleep.as_mut(), cx).is_pending() {
            return false;
        }
        self.fired = Some(*t);
        self.timer = None;
        true
    }
}
