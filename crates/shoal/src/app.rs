//! State shared by every session: the configuration, the pools, the cancel keys, the client
//! count and the shutdown signal.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::cancel::CancelRegistry;
use crate::config::{Config, Database, User};
use crate::pool::Pool;
use crate::server::Upstream;

pub struct App {
    pub config: Config,
    pools: Mutex<HashMap<(String, String), Arc<Pool>>>,
    pub cancels: Arc<CancelRegistry>,
    /// Clients connected (past the TCP accept), for `max_client_conn`.
    pub clients: AtomicUsize,
    /// Clients holding a server (in a transaction, or in session mode): shutdown waits for
    /// these; idle clients are simply disconnected.
    pub active: AtomicUsize,
    next_conn_id: AtomicU64,
    pub shutdown: watch::Receiver<bool>,
}

/// Counts a client for as long as it lives (until a session takes the count over).
pub struct ClientGuard(Arc<App>);

impl ClientGuard {
    /// Hands the count to the session, which releases it with [`App::client_left`] (saving
    /// the session a field: idle clients are many).
    pub fn into_session(self) {
        std::mem::forget(self);
    }
}

impl Drop for ClientGuard {
    fn drop(&mut self) {
        self.0.client_left();
    }
}

/// Grows with every client that connects or leaves (for [`crate::trim`]).
pub static CHURN: AtomicU64 = AtomicU64::new(0);

impl App {
    pub fn new(config: Config, shutdown: watch::Receiver<bool>) -> Arc<App> {
        Arc::new(App {
            config,
            pools: Mutex::new(HashMap::new()),
            cancels: Arc::new(CancelRegistry::default()),
            clients: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            next_conn_id: AtomicU64::new(1),
            shutdown,
        })
    }

    pub fn client_left(&self) {
        self.clients.fetch_sub(1, Ordering::Relaxed);
        CHURN.fetch_add(1, Ordering::Relaxed);
    }

    pub fn next_conn_id(&self) -> u64 {
        self.next_conn_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn client_guard(self: &Arc<Self>) -> (ClientGuard, usize) {
        let n = self.clients.fetch_add(1, Ordering::Relaxed) + 1;
        CHURN.fetch_add(1, Ordering::Relaxed);
        (ClientGuard(self.clone()), n)
    }

    pub fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    /// The pool for a (database, user) pair, created on first use.
    pub fn pool_for(&self, db: &Database, user: &User) -> Arc<Pool> {
        let mut pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools
            .entry((db.name.clone(), user.name.clone()))
            .or_insert_with(|| {
                let settings = self.config.pool_settings(db, user);
                Pool::new(
                    format!("{}/{}", db.name, user.name),
                    settings,
                    Upstream {
                        host: db.host.clone(),
                        port: db.port,
                        dbname: db.dbname.clone(),
                        user: user.server_user.clone(),
                        password: user.server_password.clone(),
                    },
                )
            })
            .clone()
    }

    pub fn pools(&self) -> Vec<Arc<Pool>> {
        let pools = self.pools.lock().unwrap_or_else(|e| e.into_inner());
        pools.values().cloned().collect()
    }
}
