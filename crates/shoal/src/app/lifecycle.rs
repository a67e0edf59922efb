//! The process's life as its clients see it: shutdown (asked for, reaching idle clients),
//! an upgrade handing the sockets and idle clients to a new process, and the clients that
//! shutdown must wait for or reach.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use tokio::sync::watch;

pub struct Lifecycle {
    pub shutdown: watch::Receiver<bool>,
    /// The admin console's `SHUTDOWN`: `run` stops as on SIGTERM.
    pub shutdown_request: tokio::sync::Notify,
    /// Shutdown has reached idle clients: each is told `57P01` and closed. (Until then a
    /// client between transactions keeps its connection, so one that has just logged in
    /// is not cut before its first query.)
    pub closing_clients: AtomicBool,
    /// A new process took over the listening sockets (see [`crate::upgrade`]).
    pub handed_over: AtomicBool,
    /// The line idle clients are handed to that process on (see [`crate::handoff`]).
    pub handoff: OnceLock<crate::handoff::Sender>,
    /// Clients holding a server (in a transaction, or in session mode): shutdown waits for
    /// these; idle clients are simply disconnected.
    pub active: AtomicUsize,
    /// Logged-in clients' sockets, for the shutdown notice.
    pub client_fds: crate::net::ClientFds,
    next_conn_id: AtomicU64,
}

impl Lifecycle {
    pub fn new(shutdown: watch::Receiver<bool>) -> Lifecycle {
        Lifecycle {
            shutdown,
            shutdown_request: tokio::sync::Notify::new(),
            closing_clients: AtomicBool::new(false),
            handed_over: AtomicBool::new(false),
            handoff: OnceLock::new(),
            active: AtomicUsize::new(0),
            client_fds: Default::default(),
            next_conn_id: AtomicU64::new(1),
        }
    }

    pub fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// A new connection's id, for logs and the admin console.
    pub fn next_conn_id(&self) -> u64 {
        self.next_conn_id.fetch_add(1, Ordering::Relaxed)
    }
}
