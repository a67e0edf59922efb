//! Shards of the per-core data plane (`[server] runtime = "per_core"`): one single-threaded
//! runtime per core, each accepting on its own `SO_REUSEPORT` socket, so a client's session,
//! and the servers it mostly uses, are polled by one thread and woken without a futex.
//!
//! A thread knows its shard through a thread-local set when its runtime starts; outside a
//! shard (the default multi-threaded runtime, tests) everything is shard 0 of 1.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

static COUNT: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

/// How many shards pools keep idle lists for (set once, before pools exist).
pub fn count() -> usize {
    COUNT.load(Ordering::Relaxed).max(1)
}

pub fn set_count(n: usize) {
    COUNT.store(n.max(1), Ordering::Relaxed);
}

/// The shard this thread serves.
pub fn current() -> usize {
    CURRENT.with(|c| c.get()).min(count() - 1)
}

/// Marks this thread as serving shard `i` (called as each shard's runtime thread starts).
pub fn enter(i: usize) {
    CURRENT.with(|c| c.set(i));
}

static HANDLES: std::sync::OnceLock<Vec<tokio::runtime::Handle>> = std::sync::OnceLock::new();

/// The runtimes of shards 1.. (shard 0 is the thread that runs `run::serve`).
pub fn handles() -> &'static [tokio::runtime::Handle] {
    HANDLES.get().map(Vec::as_slice).unwrap_or(&[])
}

/// Starts `n - 1` shard threads, each a single-threaded runtime; the caller's thread is
/// shard 0. Returns once every runtime is up.
pub fn start(n: usize) -> std::io::Result<()> {
    set_count(n);
    enter(0);
    let mut handles = Vec::new();
    for i in 1..n {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("shoal-shard-{i}"))
            .spawn(move || {
                enter(i);
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let _ = tx.send(Ok(rt.handle().clone()));
                rt.block_on(std::future::pending::<()>());
            })?;
        handles.push(rx.recv().map_err(std::io::Error::other)??);
    }
    let _ = HANDLES.set(handles);
    Ok(())
}
