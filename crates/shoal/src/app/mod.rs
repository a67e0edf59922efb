//! State shared by every session: the configuration, the routes and their pools, the cancel
//! keys, the client counts and the shutdown signal.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use crate::cancel::CancelRegistry;
use crate::config::Config;

pub struct App {
    /// The configuration Shoal started with (listeners and process-wide settings).
    pub config: Config,
    /// Users, databases and their pools: where each login goes.
    /// Shared with the tenant service, which needs nothing else of the App.
    pub routes: Arc<crate::route::Registry>,
    pub cancels: Arc<CancelRegistry>,
    /// Clients logged in, for `max_client_conn`.
    pub clients: AtomicUsize,
    /// Connections still logging in (handshake and authentication), for
    /// `max_logins_in_progress`: counted apart so slow or idle unauthenticated sockets cannot
    /// lock logged-in users out.
    pub logins: AtomicUsize,
    /// Logins in progress per client address, for `max_logins_per_address`.
    logins_by_addr: Mutex<HashMap<IpAddr, u32>>,
    /// Clients holding a server (in a transaction, or in session mode): shutdown waits for
    /// these; idle clients are simply disconnected.
    pub active: AtomicUsize,
    next_conn_id: AtomicU64,
    pub shutdown: watch::Receiver<bool>,
    /// Logged-in clients' sockets, for the shutdown notice.
    pub client_fds: crate::net::ClientFds,
    /// Client-facing TLS.
    pub tls: crate::tls::TlsState,
    /// Failed logins, for delays and bans.
    pub login_failures: crate::login_failures::LoginFailures,
    /// The admin console's `SHUTDOWN`: `run` stops as on SIGTERM.
    pub shutdown_request: tokio::sync::Notify,
    /// A new process took over the listening sockets (see [`crate::upgrade`]).
    pub handed_over: std::sync::atomic::AtomicBool,
    /// The line idle clients are handed to that process on (see [`crate::handoff`]).
    pub handoff: std::sync::OnceLock<crate::handoff::Sender>,
    /// Shutdown has reached idle clients: each is told `57P01` and closed. (Until then a
    /// client between transactions keeps its connection, so one that has just logged in
    /// is not cut before its first query.)
    pub closing_clients: std::sync::atomic::AtomicBool,
    /// Process-wide counters (connections, TLS, authentication).
    pub metrics: crate::metrics::ProcessMetrics,
    /// Secrets found by auth_query.
    pub secrets: crate::auth_query::SecretCache,
    /// A per-process secret that makes the fake SCRAM salt of an unknown user stable within
    /// this process and unpredictable outside it.
    mock_secret: [u8; 16],
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

/// Counts a connection logging in for as long as the login lasts.
pub struct LoginGuard {
    app: Arc<App>,
    addr: Option<IpAddr>,
}

impl Drop for LoginGuard {
    fn drop(&mut self) {
        self.app.logins.fetch_sub(1, Ordering::Relaxed);
        if let Some(ip) = self.addr {
            let mut by_addr = self
                .app
                .logins_by_addr
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if let Some(c) = by_addr.get_mut(&ip) {
                *c -= 1;
                if *c == 0 {
                    by_addr.remove(&ip);
                }
            }
        }
    }
}

/// Grows with every client that connects or leaves (for [`crate::memory`]).
pub static CHURN: AtomicU64 = AtomicU64::new(0);

impl App {
    /// Fails when a TLS certificate or key cannot be loaded (naming the file).
    pub fn new(
        config: Config,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Arc<App>, crate::tls::TlsError> {
        let tls = crate::tls::TlsState::load(&config.tls)?;
        let login_failures = crate::login_failures::LoginFailures::new(
            config.server.auth_failure_ban,
            crate::config::secs(config.server.auth_failure_window),
        );
        Ok(Arc::new(App {
            tls,
            login_failures,
            secrets: Default::default(),
            metrics: Default::default(),
            shutdown_request: tokio::sync::Notify::new(),
            handed_over: std::sync::atomic::AtomicBool::new(false),
            handoff: std::sync::OnceLock::new(),
            closing_clients: std::sync::atomic::AtomicBool::new(false),
            mock_secret: rand::random(),
            routes: Arc::new(crate::route::Registry::new(config.clone())),
            config,
            cancels: Arc::new(CancelRegistry::default()),
            clients: AtomicUsize::new(0),
            logins: AtomicUsize::new(0),
            logins_by_addr: Mutex::new(HashMap::new()),
            active: AtomicUsize::new(0),
            next_conn_id: AtomicU64::new(1),
            shutdown,
            client_fds: Default::default(),
        }))
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

    /// Counts a connection as logging in, or says which limit refuses it.
    pub fn begin_login(self: &Arc<Self>, addr: Option<IpAddr>) -> Result<LoginGuard, String> {
        let s = &self.config.server;
        let n = self.logins.fetch_add(1, Ordering::Relaxed) + 1;
        let mut guard = LoginGuard {
            app: self.clone(),
            addr: None,
        };
        if n > s.max_logins_in_progress {
            return Err(format!(
                "too many connections are logging in: server.max_logins_in_progress ({}) reached",
                s.max_logins_in_progress
            ));
        }
        let Some(ip) = addr.filter(|_| s.max_logins_per_address > 0) else {
            return Ok(guard);
        };
        let mut by_addr = self
            .logins_by_addr
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let count = by_addr.entry(ip).or_insert(0);
        if *count as usize >= s.max_logins_per_address {
            return Err(format!(
                "too many connections from {ip} are logging in: server.max_logins_per_address ({}) reached",
                s.max_logins_per_address
            ));
        }
        *count += 1;
        guard.addr = Some(ip);
        Ok(guard)
    }

    /// Seed of the fake SCRAM salt for a user that does not exist.
    pub fn unknown_user_seed(&self, name: &str) -> Vec<u8> {
        let mut seed = self.mock_secret.to_vec();
        seed.extend_from_slice(name.as_bytes());
        seed
    }

    /// Re-reads the configuration file: pools, users, databases and timeouts change for new
    /// logins (pool sizes in place), TLS certificates are re-read; clients stay connected. An
    /// invalid file changes nothing. `[server]` settings (listeners, process limits) need a
    /// restart.
    pub fn reload(&self) -> Result<String, String> {
        let Some(path) = self.routes.config().source.clone() else {
            self.tls
                .reload(&self.config.tls)
                .map_err(|e| e.to_string())?;
            return Ok("no configuration file (embedded default): TLS certificates re-read".into());
        };
        let fresh = Config::from_file(&path).map_err(|e| e.to_string())?;
        crate::tls::TlsState::load(&fresh.tls).map_err(|e| e.to_string())?;
        self.tls.reload(&fresh.tls).map_err(|e| e.to_string())?;
        let summary = format!(
            "{}: {} database(s), {} user(s)",
            path.display(),
            fresh.databases.len(),
            fresh.users.len()
        );
        self.routes.replace_config(fresh);
        Ok(summary)
    }

    pub fn shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }
}
