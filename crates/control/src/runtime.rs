//! The control plane's runtime, and the one way onto it: `spawn`. The data plane's shard
//! runtimes have no tokio time driver (see the pooler's `timer` module), so a task that uses tokio's
//! timers, or a third-party async client that does (hyper, tokio-postgres, tonic), panics
//! there. Tasks that are not a client's own — pool upkeep, store and API work — are spawned
//! here instead of on whichever shard happened to start them.

use std::future::Future;
use std::sync::OnceLock;

static CONTROL: OnceLock<tokio::runtime::Handle> = OnceLock::new();

/// Names the control runtime (once, at startup, from a task running on it).
pub fn set(handle: tokio::runtime::Handle) {
    let _ = CONTROL.set(handle);
}

/// Whether [`spawn`] can run a task here: a control runtime was named, or this thread is
/// in a runtime (not so in unit tests of plain structures).
pub fn available() -> bool {
    CONTROL.get().is_some() || tokio::runtime::Handle::try_current().is_ok()
}

/// Runs `task` on the control runtime (on the current one where none was named, as in
/// tests that run Shoal's parts in one runtime).
pub fn spawn<F>(task: F) -> tokio::task::JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match CONTROL.get() {
        Some(h) => h.spawn(task),
        None => tokio::spawn(task),
    }
}

#[cfg(test)]
mod tests {
    /// A task using tokio's timers, spawned from a runtime without a time driver (as a
    /// shard's), runs on the control runtime instead of panicking.
    #[test]
    fn timers_run_on_the_control_runtime_whoever_spawns() {
        // Kept for the rest of the test process: other tests' pools spawn onto it too.
        let control: &'static tokio::runtime::Runtime = Box::leak(Box::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap(),
        ));
        super::set(control.handle().clone());
        let shard = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        let done = shard.block_on(async {
            super::spawn(async {
                #[allow(clippy::disallowed_methods)]
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                42
            })
            .await
        });
        assert_eq!(done.unwrap(), 42);
    }
}
