//! Who gets in: connections logging in (per address too), logged-in clients against
//! `max_client_conn`, failed logins with their delays and bans, and the stable answer for
//! users that do not exist. A handle of its own, so the counts a client holds for its
//! lifetime keep this alive and nothing else of the App.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct Admission {
    /// Clients logged in, those other nodes relay here included.
    pub clients: AtomicUsize,
    /// Of `clients`, the sessions other nodes of a cluster relay here. They are not counted
    /// against `max_client_conn`: they are those nodes' connections, bounded by those nodes'
    /// limits, and an owner counting them would cap every node's clients of its pools (a
    /// million-client connect storm had the owner refuse its own clients).
    pub relayed_in: AtomicUsize,
    /// Connections still logging in (handshake and authentication), for
    /// `max_logins_in_progress`: counted apart so slow or idle unauthenticated sockets cannot
    /// lock logged-in users out.
    pub logins: AtomicUsize,
    /// Logins in progress per client address, for `max_logins_per_address`.
    logins_by_addr: Mutex<HashMap<IpAddr, u32>>,
    max_logins_in_progress: usize,
    max_logins_per_address: usize,
    /// Failed logins, for delays and bans.
    pub login_failures: crate::login_failures::LoginFailures,
    /// A per-process secret that makes the fake SCRAM salt of an unknown user stable within
    /// this process and unpredictable outside it.
    mock_secret: [u8; 16],
    /// Sessions Shoal keeps logged in on its own account, ended to make room for a client
    /// a client limit would refuse (set when the serverless front door starts).
    pub spare: std::sync::OnceLock<Arc<dyn Spare>>,
}

/// Logged-in sessions kept idle by Shoal itself (the serverless front door's HTTP sessions,
/// kept for the next query with the same credentials). They count as clients, so a client
/// limit could refuse a real client for them: a login that meets a limit ends them first.
pub trait Spare: Send + Sync {
    /// How many are kept now.
    fn kept(&self) -> usize;
    /// Ends them all (each leaves once its task sees its stream close); how many.
    fn shed(&self) -> usize;
}

/// Grows with every client that connects or leaves, and every relayed client parked (which
/// frees its relay's state, the most it holds): [`crate::memory`] purges after such changes.
pub static CHURN: AtomicU64 = AtomicU64::new(0);

/// Counts a client for as long as it lives (until a session takes the count over).
pub struct ClientGuard(Arc<Admission>);

impl ClientGuard {
    /// Hands the count to the session, which releases it with [`Admission::client_left`]
    /// (saving the session a field: idle clients are many).
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
    admission: Arc<Admission>,
    addr: Option<IpAddr>,
}

impl Drop for LoginGuard {
    fn drop(&mut self) {
        self.admission.logins.fetch_sub(1, Ordering::Relaxed);
        if let Some(ip) = self.addr {
            let mut by_addr = self.admission.lock_by_addr();
            if let Some(c) = by_addr.get_mut(&ip) {
                *c -= 1;
                if *c == 0 {
                    shoal_cluster::tables::remove(&mut by_addr, &ip);
                }
            }
        }
    }
}

impl Admission {
    pub fn new(server: &crate::config::ServerSection) -> Admission {
        Admission {
            clients: AtomicUsize::new(0),
            relayed_in: AtomicUsize::new(0),
            logins: AtomicUsize::new(0),
            logins_by_addr: Mutex::new(HashMap::new()),
            max_logins_in_progress: server.max_logins_in_progress,
            max_logins_per_address: server.max_logins_per_address,
            login_failures: crate::login_failures::LoginFailures::new(
                server.auth_failure_ban,
                crate::config::secs(server.auth_failure_window),
            ),
            mock_secret: rand::random(),
            spare: std::sync::OnceLock::new(),
        }
    }

    /// Whether sessions kept on Shoal's own account could make room for a client.
    pub fn has_spare(&self) -> bool {
        self.spare.get().is_some_and(|s| s.kept() > 0)
    }

    /// A client limit refuses a login while `full` holds: ends the kept sessions, if there
    /// are any, and waits (briefly) for them to leave. Whether `full` no longer holds.
    pub async fn make_room(&self, full: impl Fn() -> bool) -> bool {
        const WAIT: std::time::Duration = std::time::Duration::from_millis(200);
        let Some(spare) = self.spare.get() else {
            return false;
        };
        if spare.shed() == 0 {
            return !full();
        }
        let deadline = std::time::Instant::now() + WAIT;
        while full() {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            crate::timer::sleep(std::time::Duration::from_millis(1)).await;
        }
        true
    }

    fn lock_by_addr(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, u32>> {
        self.logins_by_addr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Clients connected to this node and logged in (what `max_client_conn` bounds).
    pub fn connected_clients(&self) -> usize {
        let relayed = self.relayed_in.load(Ordering::Relaxed);
        self.clients.load(Ordering::Relaxed).saturating_sub(relayed)
    }

    pub fn client_left(&self) {
        self.clients.fetch_sub(1, Ordering::Relaxed);
        CHURN.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a logged-in client; returns the guard and how many are logged in now.
    pub fn client_guard(self: &Arc<Self>) -> (ClientGuard, usize) {
        let n = self.clients.fetch_add(1, Ordering::Relaxed) + 1;
        CHURN.fetch_add(1, Ordering::Relaxed);
        (ClientGuard(self.clone()), n)
    }

    /// Counts a connection as logging in, or says which limit refuses it.
    pub fn begin_login(self: &Arc<Self>, addr: Option<IpAddr>) -> Result<LoginGuard, String> {
        let n = self.logins.fetch_add(1, Ordering::Relaxed) + 1;
        let mut guard = LoginGuard {
            admission: self.clone(),
            addr: None,
        };
        if n > self.max_logins_in_progress {
            return Err(format!(
                "too many connections are logging in: server.max_logins_in_progress ({}) reached",
                self.max_logins_in_progress
            ));
        }
        let Some(ip) = addr.filter(|_| self.max_logins_per_address > 0) else {
            return Ok(guard);
        };
        let mut by_addr = self.lock_by_addr();
        let count = by_addr.entry(ip).or_insert(0);
        if *count as usize >= self.max_logins_per_address {
            return Err(format!(
                "too many connections from {ip} are logging in: server.max_logins_per_address ({}) reached",
                self.max_logins_per_address
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
}
