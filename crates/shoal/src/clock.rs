//! A coarse clock for pool bookkeeping: milliseconds since start, advanced by one task on a
//! short tick, so the per-transaction path reads an atomic instead of asking the OS. It runs
//! on tokio's clock, so tests with paused time (`tokio::time::pause`) control it too.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use tokio::time::Instant;

static START: OnceLock<Instant> = OnceLock::new();
static NOW_MS: AtomicU64 = AtomicU64::new(0);

/// Resolution of [`now_ms`].
pub const TICK: Duration = Duration::from_millis(50);

/// Milliseconds since the clock started, accurate to [`TICK`].
pub fn now_ms() -> u64 {
    NOW_MS.load(Ordering::Relaxed)
}

fn refresh() {
    let start = START.get_or_init(Instant::now);
    NOW_MS.store(start.elapsed().as_millis() as u64, Ordering::Relaxed);
}

/// Starts the ticking task (once per process; later calls do nothing).
pub fn start() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        refresh();
        tokio::spawn(async {
            let mut tick = tokio::time::interval(TICK);
            loop {
                tick.tick().await;
                refresh();
            }
        });
    });
}
