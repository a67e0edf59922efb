//! Starting and stopping a Shoal process: bind every listener, accept until told to stop,
//! then drain — running transactions may finish within `shutdown_timeout`.
// Control plane: runs on the main runtime, which has tokio's time driver.
#![allow(clippy::disallowed_methods)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use crate::app::App;
use crate::config::{secs, Config};
use crate::listener;

/// Listening sockets, bound by the caller (so an embedder or a test can choose them; see
/// [`bind`]).
#[derive(Default)]
pub struct Listeners {
    pub tcp: Vec<tokio::net::TcpListener>,
    /// Unix sockets with their paths (removed at exit).
    pub unix: Vec<(tokio::net::UnixListener, PathBuf)>,
    /// The API's and the metrics' listeners when inherited from a previous process
    /// (otherwise bound from `[api]` and `[metrics]`).
    pub api: Option<tokio::net::TcpListener>,
    pub metrics: Option<tokio::net::TcpListener>,
    pub realtime: Option<tokio::net::TcpListener>,
    /// Listening sockets of the other shards (per-core data plane), by shard.
    pub shard_tcp: Vec<(usize, std::net::TcpListener)>,
}

impl Listeners {
    /// Sockets handed over by a previous process ([`crate::upgrade`]).
    pub fn inherited(i: crate::upgrade::Inherited) -> std::io::Result<Listeners> {
        let tcp = |l: std::net::TcpListener| -> std::io::Result<tokio::net::TcpListener> {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        };
        let mut out = Listeners::default();
        let shards = crate::shard::count();
        // Each socket goes to the shard that had it (modulo this process's shard count), so
        // every address's shard-0 socket steers its own group, however many addresses.
        for (old_shard, l) in i.tcp {
            match old_shard % shards {
                0 => out.tcp.push(tcp(l)?),
                s => out.shard_tcp.push((s, l)),
            }
        }
        for (l, path) in i.unix {
            l.set_nonblocking(true)?;
            out.unix
                .push((tokio::net::UnixListener::from_std(l)?, path));
        }
        out.api = i.api.map(tcp).transpose()?;
        out.realtime = i.realtime.map(tcp).transpose()?;
        out.metrics = i.metrics.map(tcp).transpose()?;
        Ok(out)
    }
}

/// Binds every listener the configuration names. Fails with the address that could not be
/// bound.
pub fn bind(config: &Config) -> std::io::Result<Listeners> {
    let s = &config.server;
    let mut l = Listeners::default();
    let shards = crate::shard::count();
    for addr in &s.listen {
        let failed = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))
        };
        if shards == 1 {
            l.tcp
                .push(listener::bind_tcp(*addr, s.listen_backlog).map_err(failed)?);
            continue;
        }
        // One socket per shard on the same address (a port of 0 is chosen by the first).
        listener::ensure_not_served(*addr).map_err(failed)?;
        let first = listener::bind_tcp_std(*addr, s.listen_backlog, true).map_err(failed)?;
        let bound = first.local_addr()?;
        l.tcp.push(tokio::net::TcpListener::from_std(first)?);
        for shard in 1..shards {
            let other = listener::bind_tcp_std(bound, s.listen_backlog, true).map_err(failed)?;
            l.shard_tcp.push((shard, other));
        }
    }
    if let Some(dir) = &s.unix_socket_dir {
        let port = l
            .tcp
            .first()
            .and_then(|t| t.local_addr().ok())
            .map_or(6432, |a| a.port());
        match listener::bind_unix(dir, port, s.listen_backlog) {
            Ok(u) => l.unix.push(u),
            // The embedded default's socket is where PgBouncer's is on Debian, for `psql -p
            // 6432 pgbouncer`; a machine without that directory (or a user who may not write
            // there) still gets the TCP listener.
            Err(e) if config.source.is_none() => tracing::warn!(
                dir = %dir.display(),
                error = %e,
                "no Unix socket: the directory is missing or not writable"
            ),
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("cannot listen on {}: {e}", dir.display()),
                ))
            }
        }
    }
    Ok(l)
}

/// Binds the configured listeners (or, with `upgrade_socket`, takes them over from a
/// running process) and serves (see [`serve_on`]).
pub async fn serve(
    config: Config,
    ready_file: Option<&Path>,
    upgrade_socket: Option<&Path>,
    stop: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    serve_from(config, ready_file, upgrade_socket, Box::pin(stop)).await
}

/// What stops a server. Boxed, like [`Served`], so that the whole server is compiled once, in
/// this crate, rather than again in every binary (and every test) that brings its own kind of
/// stop: an async function's body is compiled where its future is polled, and a future boxed
/// by a function that is not generic is polled through a vtable made here.
type Stop<'a> = std::pin::Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
type Served<'a> = std::pin::Pin<Box<dyn Future<Output = std::io::Result<()>> + Send + 'a>>;

fn serve_from<'a>(
    config: Config,
    ready_file: Option<&'a Path>,
    upgrade_socket: Option<&'a Path>,
    stop: Stop<'a>,
) -> Served<'a> {
    Box::pin(serve_taking_over(config, ready_file, upgrade_socket, stop))
}

async fn serve_taking_over(
    config: Config,
    ready_file: Option<&Path>,
    upgrade_socket: Option<&Path>,
    stop: Stop<'_>,
) -> std::io::Result<()> {
    let takeover = match upgrade_socket {
        Some(p) => crate::upgrade::take_over(p)?,
        None => None,
    };
    let (listeners, takeover) = match takeover {
        Some(t) => {
            let crate::upgrade::Takeover { inherited, control } = t;
            (Listeners::inherited(inherited)?, Some(control))
        }
        None => (bind(&config)?, None),
    };
    let upgrade = upgrade_socket.map(|p| Upgrade {
        path: p.to_owned(),
        confirm: takeover,
    });
    serve_with(config, listeners, ready_file, upgrade, stop).await
}

/// [`serve_with`], boxed here (see [`Stop`]).
fn serve_boxed<'a>(
    config: Config,
    listeners: Listeners,
    ready_file: Option<&'a Path>,
    stop: Stop<'a>,
) -> Served<'a> {
    Box::pin(serve_with(config, listeners, ready_file, None, stop))
}

/// Zero-downtime upgrade state: the control socket's path, and the line to the previous
/// process when this one took its sockets over.
struct Upgrade {
    path: PathBuf,
    confirm: Option<std::os::unix::net::UnixStream>,
}

/// Serves on `listeners` until `stop` resolves, then shuts down gracefully. Once every
/// listener is accepting, their addresses are written to `ready_file`, if given (atomically:
/// the file appears complete).
pub async fn serve_on(
    config: Config,
    listeners: Listeners,
    ready_file: Option<&Path>,
    stop: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    serve_boxed(config, listeners, ready_file, Box::pin(stop)).await
}

async fn serve_with(
    config: Config,
    mut listeners: Listeners,
    ready_file: Option<&Path>,
    upgrade: Option<Upgrade>,
    stop: Stop<'_>,
) -> std::io::Result<()> {
    use crate::upgrade::Role;
    use std::os::fd::AsRawFd;
    crate::control::set(tokio::runtime::Handle::current());
    crate::clock::start();
    crate::memory::start(&crate::app::CHURN);
    let (tx, rx) = watch::channel(false);
    let app = App::new(config, rx).map_err(std::io::Error::other)?;
    if let Some(c) = app.config.cluster.clone() {
        // The streams peers open: relayed clients, and realtime's fabric.
        let handlers = crate::cluster::Handlers::new(|app, stream, what| {
            tokio::spawn(crate::session::serve_relayed(app, stream, what));
        })
        .on(crate::realtime::fabric::OPENING, |app, stream, _| {
            crate::control::spawn(crate::realtime::fabric::receive(app, stream));
        });
        let node = crate::cluster::start(&app, c, handlers)
            .await
            .map_err(std::io::Error::other)?;
        let _ = app.cluster.set(node);
    }
    tokio::spawn(reload_on_sighup(app.clone()));
    let mut unix_paths = Vec::new();
    let mut ready = String::new();
    // The sockets a later process would take over (they stay open while their tasks run).
    let mut sockets: Vec<(Role, std::os::fd::RawFd)> = Vec::new();
    for (l, path) in listeners.unix {
        tracing::info!(path = %path.display(), "listening");
        ready.push_str(&format!("unix {}\n", path.display()));
        sockets.push((Role::Unix { path: path.clone() }, l.as_raw_fd()));
        unix_paths.push(path);
        match crate::shard::handle(0) {
            // The per-core data plane: shard 0 accepts on it.
            Some(shard0) => {
                let l = l.into_std()?;
                let app = app.clone();
                shard0.spawn(async move {
                    match tokio::net::UnixListener::from_std(l) {
                        Ok(l) => listener::accept_unix(l, app).await,
                        Err(e) => tracing::error!(error = %e, "shard 0 cannot accept"),
                    }
                });
            }
            None => {
                tokio::spawn(listener::accept_unix(l, app.clone()));
            }
        }
    }
    for l in listeners.tcp {
        let addr = l.local_addr()?;
        listener::set_client_options(socket2::SockRef::from(&l), &app.config.server)?;
        tracing::info!(%addr, "listening");
        ready.push_str(&format!("tcp {addr}\n"));
        sockets.push((Role::Tcp { shard: 0 }, l.as_raw_fd()));
        let steer = crate::shard::count() > 1;
        match crate::shard::handle(0) {
            Some(_) => {
                // Shard 0 accepts on it, in its runtime, as the other shards on theirs.
                listeners.shard_tcp.push((0, l.into_std()?));
            }
            None => {
                tokio::spawn(listener::accept_tcp(l, app.clone(), steer));
            }
        }
    }
    // The shards accept on their own sockets, in their own runtimes.
    for (shard, l) in listeners.shard_tcp {
        if shard > 0 {
            listener::set_client_options(socket2::SockRef::from(&l), &app.config.server)?;
            sockets.push((Role::Tcp { shard }, l.as_raw_fd()));
        }
        let steer = shard == 0 && crate::shard::count() > 1;
        let Some(handle) = crate::shard::handle(shard) else {
            let app = app.clone();
            tokio::spawn(async move {
                if let Ok(l) = tokio::net::TcpListener::from_std(l) {
                    listener::accept_tcp(l, app, false).await
                }
            });
            continue;
        };
        let app = app.clone();
        handle.spawn(async move {
            match tokio::net::TcpListener::from_std(l) {
                Ok(l) => listener::accept_tcp(l, app, steer).await,
                Err(e) => tracing::error!(shard, error = %e, "a shard cannot accept"),
            }
        });
    }
    let metrics_token = app
        .config
        .metrics
        .token_env
        .as_ref()
        .and_then(|e| std::env::var(e).ok())
        .filter(|t| !t.is_empty());
    if let Some((api, fd)) = start_tenants(&app, metrics_token.clone(), listeners.api).await? {
        ready.push_str(&format!("api {api}\n"));
        sockets.push((Role::Api, fd));
    }
    let realtime = crate::realtime::start(&app, listeners.realtime.take()).await?;
    if let Some((addr, fd, _)) = &realtime {
        ready.push_str(&format!("realtime {addr}\n"));
        sockets.push((Role::Realtime, *fd));
    }
    if let Some(addr) = app.config.metrics.listen {
        let listener = match listeners.metrics {
            Some(l) => l,
            None => tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot listen on {addr} (metrics.listen): {e}"),
                )
            })?,
        };
        sockets.push((Role::Metrics, listener.as_raw_fd()));
        let addr = listener.local_addr()?;
        tracing::info!(%addr, "metrics listening");
        ready.push_str(&format!("metrics {addr}\n"));
        tokio::spawn(crate::api::serve(
            listener,
            crate::api::ops::router(app.clone(), metrics_token),
        ));
    }
    if let Some(path) = ready_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &ready)?;
        std::fs::rename(&tmp, path)?;
    }
    if let Some(u) = upgrade {
        if let Some(mut previous) = u.confirm {
            // Accepting now: the previous process may drain and leave, handing its idle
            // clients over on the same line.
            use std::io::Write;
            if previous.write_all(b"ok\n").is_ok() {
                let adopting = app.clone();
                crate::handoff::receive(
                    previous,
                    tokio::runtime::Handle::current(),
                    move |fd, image| crate::session::adopt(adopting.clone(), fd, image),
                );
            }
        }
        tokio::spawn(crate::upgrade::serve_control(u.path, sockets, app.clone()));
    }
    tokio::select! {
        _ = stop => {}
        _ = app.lifecycle.shutdown_request.notified() => tracing::info!("shutdown requested (admin console or upgrade)"),
    }
    let _ = tx.send(true);
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
    let mut last_churn = crate::app::CHURN.load(Ordering::Relaxed);
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
        let churn = crate::app::CHURN.load(Ordering::Relaxed);
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
    if let Some((_, _, service)) = &realtime {
        // Realtime sockets were told to reconnect (1012) when the shutdown began; their
        // close frames go out before the process does.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while service.sockets() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    for pool in app.routes.pools() {
        pool.close_idle().await;
    }
    // After a hand-over the Unix sockets belong to the new process.
    if !app.lifecycle.handed_over.load(Ordering::SeqCst) {
        for p in unix_paths {
            let _ = std::fs::remove_file(p);
        }
    }
    tracing::info!(
        disconnected = app.admission.clients.load(Ordering::Relaxed),
        "stopped; idle clients are disconnected"
    );
    Ok(())
}

/// Opens the tenant store (when configured), loads its tenants into routing, follows a
/// shared store's changes, closes unused tenant pools, and serves the management API (when
/// configured). Returns the API's address.
async fn start_tenants(
    app: &std::sync::Arc<App>,
    metrics_token: Option<String>,
    inherited: Option<tokio::net::TcpListener>,
) -> std::io::Result<Option<(std::net::SocketAddr, std::os::fd::RawFd)>> {
    let Some(section) = app.config.store.clone() else {
        return Ok(None);
    };
    let store = crate::tenant::store::Store::open(&section)
        .await
        .map_err(std::io::Error::other)?;
    let shared = store.shared_url().map(str::to_owned);
    let service = std::sync::Arc::new(crate::tenant::service::TenantService::new(
        app.routes.clone(),
        store,
        &section.data_dir,
    ));
    let n = service.sync_all().await.map_err(std::io::Error::other)?;
    tracing::info!(tenants = n, store = %redact_url(&section.url()), "tenant store opened");
    if let Some(url) = shared {
        tokio::spawn(crate::tenant::service::follow_shared_store(
            service.clone(),
            url,
            section.tls_settings(),
            secs(section.resync_interval.max(1.0)),
        ));
    }
    let idle = secs(app.config.tenants.pool_idle_close);
    let routes_app = app.clone();
    tokio::spawn(async move {
        let mut tick =
            tokio::time::interval(Duration::from_secs(5).min(idle.max(Duration::from_millis(200))));
        loop {
            tick.tick().await;
            let closed = routes_app.routes.close_unused_tenant_pools(idle);
            if closed > 0 {
                tracing::debug!(closed, "closed unused tenant pools");
            }
        }
    });
    let Some(api) = app.config.api.clone() else {
        return Ok(None);
    };
    let auth = crate::api::auth::ApiAuth::from_env(
        &api.jwt_secret_env,
        api.token_env.as_deref(),
        &section.data_dir,
    )?;
    let listener = match inherited {
        Some(l) => l,
        None => tokio::net::TcpListener::bind(api.listen)
            .await
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot listen on {} (api.listen): {e}", api.listen),
                )
            })?,
    };
    let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    let addr = listener.local_addr()?;
    tracing::info!(%addr, dashboard = %format!("http://{addr}/ui"), "management API listening");
    let auth = std::sync::Arc::new(auth);
    let router = crate::api::router(service.clone(), auth.clone())
        .merge(crate::api::ops::router(app.clone(), metrics_token))
        .merge(crate::ui::router(app.clone(), service, auth));
    tokio::spawn(crate::api::serve(listener, router));
    Ok(Some((addr, fd)))
}

/// A store URL for the log, without its password.
fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..s + 3], &url[at..])
        }
        _ => url.to_owned(),
    }
}

/// SIGHUP re-reads the TLS certificate and key files; a bad file is refused (logged) and the
/// certificates in use stay. Connections already made are untouched.
async fn reload_on_sighup(app: std::sync::Arc<App>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        match app.reload() {
            Ok(what) => {
                tracing::info!(config = %what, "SIGHUP: configuration reloaded; TLS certificates reloaded")
            }
            Err(e) => {
                tracing::error!(error = %e, "SIGHUP: configuration not reloaded; the old one (and the old TLS certificates) stay")
            }
        }
    }
}
