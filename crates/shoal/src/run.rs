//! Starting and stopping a Shoal process: bind every listener, accept until told to stop,
//! then drain — running transactions may finish within `shutdown_timeout`.

use std::future::Future;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use crate::app::App;
use crate::config::{secs, Config};
use crate::listener;

/// Serves until `stop` resolves, then shuts down gracefully. Fails only if a listener cannot
/// be bound (or `ready_file` cannot be written). Once every listener is up, their addresses
/// are written to `ready_file`, if given (atomically: the file appears complete).
pub async fn serve(
    config: Config,
    ready_file: Option<&Path>,
    stop: impl Future<Output = ()>,
) -> std::io::Result<()> {
    crate::clock::start();
    crate::trim::start(&crate::app::CHURN);
    let (tx, rx) = watch::channel(false);
    let app = App::new(config, rx);
    let s = &app.config.server;
    // Bind everything before announcing anything, so "listening" means every listener is up.
    let mut tcp = Vec::new();
    for addr in &s.listen {
        let l = listener::bind_tcp(*addr, s.listen_backlog)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
        tcp.push(l);
    }
    let mut unix_paths = Vec::new();
    let mut ready = String::new();
    if let Some(dir) = &s.unix_socket_dir {
        let port = tcp
            .first()
            .and_then(|l| l.local_addr().ok())
            .map_or(6432, |a| a.port());
        let (l, path) = listener::bind_unix(dir, port, s.listen_backlog).map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {}: {e}", dir.display()))
        })?;
        tracing::info!(path = %path.display(), "listening");
        ready.push_str(&format!("unix {}\n", path.display()));
        unix_paths.push(path);
        tokio::spawn(listener::accept_unix(l, app.clone()));
    }
    for l in tcp {
        let addr = l.local_addr()?;
        tracing::info!(%addr, "listening");
        ready.push_str(&format!("tcp {addr}\n"));
        tokio::spawn(listener::accept_tcp(l, app.clone()));
    }
    if let Some(path) = ready_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &ready)?;
        std::fs::rename(&tmp, path)?;
    }
    stop.await;
    let _ = tx.send(true);
    let timeout = secs(app.config.server.shutdown_timeout);
    tracing::info!(
        clients = app.clients.load(Ordering::Relaxed),
        active = app.active.load(Ordering::Relaxed),
        ?timeout,
        "shutting down: no new connections; waiting for running transactions"
    );
    let deadline = tokio::time::Instant::now() + timeout;
    while app.active.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Idle clients (and any still in a transaction past the timeout) are woken by the end of
    // their read side; each tells its client why (57P01) and closes.
    let notified = app.client_fds.shut_reads();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while app.clients.load(Ordering::Relaxed) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::info!(notified, "clients told of the shutdown");
    for pool in app.routes.pools() {
        pool.close_idle().await;
    }
    for p in unix_paths {
        let _ = std::fs::remove_file(p);
    }
    tracing::info!(
        disconnected = app.clients.load(Ordering::Relaxed),
        "stopped; idle clients are disconnected"
    );
    Ok(())
}
