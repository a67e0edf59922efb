//! Stopping: running transactions finish (within `shutdown_timeout`), then the clients left
//! are told and closed, relayed ones through the nodes relaying them, realtime sockets
//! with their close frames.
// Control plane: runs on the main runtime, which has tokio's time driver.
#![allow(clippy::disallowed_methods)]

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::app::App;
use crate::config::secs;

/// Waits, within `shutdown_timeout`, for running transactions to finish (or, when handing
/// clients over to a new process, for every client to go).
pub(super) async fn drain(app: &App) {
    let timeout = secs(app.config.server.shutdown_timeout);
    tracing::info!(
        clients = app.admission.clients.load(Ordering::Relaxed),
        active = app.lifecycle.active.load(Ordering::Relaxed),
        ?timeout,
        "shutting down: no new connections; waiting for running transactions"
    );
    let deadline = tokio::time::Instant::now() + timeout;
    // Running transactions finish; clients that just logged in get a moment to send their
    // first query (a connection per transaction, as pgbench -C, should not be cut between
    // its login and its query): wait for a quiet spell with no transaction and no login.
    let mut quiet_since = tokio::time::Instant::now();
    let mut last_churn = crate::admission::CHURN.load(Ordering::Relaxed);
    let handing_over = app.lifecycle.handoff.get().is_some();
    while tokio::time::Instant::now() < deadline {
        if handing_over {
            // Each client goes at its own transaction boundary (handed over) or leaves.
            if app.admission.clients.load(Ordering::Relaxed) == 0
                && app.admission.logins.load(Ordering::Relaxed) == 0
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let churn = crate::admission::CHURN.load(Ordering::Relaxed);
        let busy = app.lifecycle.active.load(Ordering::Relaxed) > 0
            || app.admission.logins.load(Ordering::Relaxed) > 0
            || churn != last_churn;
        last_churn = churn;
        if busy {
            quiet_since = tokio::time::Instant::now();
        } else if quiet_since.elapsed() >= Duration::from_millis(300) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Tells every client left why (57P01) and closes it; leaves the cluster; lets realtime's
/// close frames go out.
pub(super) async fn end_clients(
    app: &App,
    realtime: Option<&std::sync::Arc<shoal_realtime::edge::Service>>,
) {
    // Idle clients (and any still in a transaction past the timeout) are woken by the end of
    // their read side; each tells its client why (57P01) and closes.
    app.lifecycle.closing_clients.store(true, Ordering::SeqCst);
    let notified = app.lifecycle.client_fds.shut_reads();
    if let Some(node) = app.cluster.get() {
        // Clients relayed here have no socket to shut: their links end, and the nodes
        // relaying them tell them.
        node.leave().await;
    }
    // Statements in flight finish and their replies reach their clients first.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while app.admission.clients.load(Ordering::Relaxed) > 0
        && tokio::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::info!(notified, "clients told of the shutdown");
    if let Some(service) = realtime {
        // Realtime sockets were told to reconnect (1012) when the shutdown began; their
        // close frames go out before the process does.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while service.sockets() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
