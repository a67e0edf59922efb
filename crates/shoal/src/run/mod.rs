//! Starting and stopping a Shoal process: bind every listener, start the services in order
//! (the cluster, the client listeners, tenants and the API, realtime, metrics), accept
//! until told to stop, then drain — running transactions may finish within
//! `shutdown_timeout` — and end what is left.
//!
//! - `accept`: the client listeners, each accepting on its shard.
//! - `tenants`: the tenant store and the management API.
//! - `stop`: the drain, and telling the clients left.
// Control plane: runs on the main runtime, which has tokio's time driver.
#![allow(clippy::disallowed_methods)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::sync::watch;

mod accept;
mod stop;
mod tenants;

use crate::app::App;
use crate::config::Config;
use crate::listener;
use crate::shard::Shards;

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
    pub serverless: Option<tokio::net::TcpListener>,
    /// Listening sockets of the other shards (per-core data plane), by shard.
    pub shard_tcp: Vec<(usize, std::net::TcpListener)>,
}

impl Listeners {
    /// Sockets handed over by a previous process ([`crate::upgrade`]).
    pub fn inherited(
        i: crate::upgrade::Inherited,
        shards: &crate::shard::Shards,
    ) -> std::io::Result<Listeners> {
        let tcp = |l: std::net::TcpListener| -> std::io::Result<tokio::net::TcpListener> {
            l.set_nonblocking(true)?;
            tokio::net::TcpListener::from_std(l)
        };
        let mut out = Listeners::default();
        let shards = shards.count();
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
        out.serverless = i.serverless.map(tcp).transpose()?;
        out.metrics = i.metrics.map(tcp).transpose()?;
        Ok(out)
    }
}

/// The shard threads `[server]` asks for: one per core (or `worker_threads`) for the per-core
/// data plane, none for the multi-threaded one (its clients live on the caller's runtime).
pub fn start_shards(config: &Config) -> std::io::Result<Arc<Shards>> {
    let s = &config.server;
    if s.runtime != crate::config::Runtime::PerCore {
        return Ok(Shards::none());
    }
    let n = match s.worker_threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let shards = Shards::start(n, s.shard_packing)?;
    tracing::info!(shards = n, packing = s.shard_packing, "per-core data plane");
    Ok(shards)
}

/// Binds every listener the configuration names, one socket per shard on each address.
/// Fails with the address that could not be bound.
pub fn bind(config: &Config, shards: &Shards) -> std::io::Result<Listeners> {
    let s = &config.server;
    let mut l = Listeners::default();
    let open = shards.open();
    let shards = shards.count();
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
        for shard in 1..shards {
            let other = listener::bind_tcp_std(bound, s.listen_backlog, true).map_err(failed)?;
            l.shard_tcp.push((shard, other));
        }
        // Steered before anyone can connect: until shard 0's accept loop first runs, the
        // kernel would otherwise spread connections over closed shards' sockets too.
        if let Err(e) = crate::reuseport::steer(&first, open) {
            tracing::debug!(error = %e, "cannot steer new connections: closed shards hand them over");
        }
        l.tcp.push(tokio::net::TcpListener::from_std(first)?);
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
    let shards = start_shards(&config)?;
    let bound = match takeover {
        Some(t) => {
            let crate::upgrade::Takeover { inherited, control } = t;
            Listeners::inherited(inherited, &shards).map(|l| (l, Some(control)))
        }
        None => bind(&config, &shards).map(|l| (l, None)),
    };
    let served = match bound {
        Ok((listeners, takeover)) => {
            let upgrade = upgrade_socket.map(|p| Upgrade {
                path: p.to_owned(),
                confirm: takeover,
            });
            serve_with(config, shards.clone(), listeners, ready_file, upgrade, stop).await
        }
        Err(e) => Err(e),
    };
    shards.stop();
    served
}

/// [`serve_with`], boxed here (see [`Stop`]).
fn serve_boxed<'a>(
    config: Config,
    shards: Arc<Shards>,
    listeners: Listeners,
    ready_file: Option<&'a Path>,
    stop: Stop<'a>,
) -> Served<'a> {
    Box::pin(serve_with(
        config, shards, listeners, ready_file, None, stop,
    ))
}

/// Zero-downtime upgrade state: the control socket's path, and the line to the previous
/// process when this one took its sockets over.
struct Upgrade {
    path: PathBuf,
    confirm: Option<std::os::unix::net::UnixStream>,
}

/// Serves on `listeners` (bound for `shards`: see [`bind`]) until `stop` resolves, then
/// shuts down gracefully; clients live on `shards`, which the caller stops after. Once every
/// listener is accepting, their addresses are written to `ready_file`, if given (atomically:
/// the file appears complete).
pub async fn serve_on(
    config: Config,
    shards: Arc<Shards>,
    listeners: Listeners,
    ready_file: Option<&Path>,
    stop: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    serve_boxed(config, shards, listeners, ready_file, Box::pin(stop)).await
}

async fn serve_with(
    config: Config,
    shards: Arc<Shards>,
    mut listeners: Listeners,
    ready_file: Option<&Path>,
    upgrade: Option<Upgrade>,
    stop: Stop<'_>,
) -> std::io::Result<()> {
    use crate::upgrade::Role;
    crate::control::set(tokio::runtime::Handle::current());
    crate::clock::start();
    crate::memory::start(&crate::admission::CHURN);
    let (tx, rx) = watch::channel(false);
    let app = App::on_shards(config, rx, shards).map_err(std::io::Error::other)?;
    start_packing(&app);
    start_cluster(&app).await?;
    tokio::spawn(reload_on_sighup(app.clone()));
    let mut started = Started::default();
    let unix_paths = accept::clients(
        &app,
        std::mem::take(&mut listeners.unix),
        std::mem::take(&mut listeners.tcp),
        std::mem::take(&mut listeners.shard_tcp),
        &mut started,
    )?;
    let metrics_token = app
        .config
        .metrics
        .token_env
        .as_ref()
        .and_then(|e| std::env::var(e).ok())
        .filter(|t| !t.is_empty());
    let api = tenants::start_tenants(&app, metrics_token.clone(), listeners.api.take()).await?;
    if let Some((addr, fd)) = api {
        started.add(Role::Api, fd, format!("api {addr}"));
    }
    let realtime = crate::realtime::start(&app, listeners.realtime.take()).await?;
    match &realtime {
        Some((addr, fd, _)) => started.add(Role::Realtime, *fd, format!("realtime {addr}")),
        None => crate::realtime::start_taps(&app),
    }
    let serverless = crate::serverless::start(&app, listeners.serverless.take()).await?;
    if let Some((addr, fd)) = serverless {
        started.add(Role::Serverless, fd, format!("serverless {addr}"));
    }
    start_metrics(&app, listeners.metrics.take(), metrics_token, &mut started).await?;
    if let Some(path) = ready_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &started.ready)?;
        std::fs::rename(&tmp, path)?;
    }
    if let Some(u) = upgrade {
        take_clients_from_previous(&app, u, started.sockets);
    }
    tokio::select! {
        _ = stop => {}
        _ = app.lifecycle.shutdown_request.notified() => tracing::info!("shutdown requested (admin console or upgrade)"),
    }
    let _ = tx.send(true);
    stop::drain(&app).await;
    stop::end_clients(&app, realtime.as_ref().map(|r| &r.2)).await;
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

/// What the listeners started so far wrote to the ready file, and the sockets a later
/// process would take over (they stay open while their tasks run).
#[derive(Default)]
pub(super) struct Started {
    ready: String,
    sockets: Vec<(crate::upgrade::Role, std::os::fd::RawFd)>,
}

impl Started {
    pub(super) fn add(&mut self, role: crate::upgrade::Role, fd: std::os::fd::RawFd, line: String) {
        self.ready.push_str(&line);
        self.ready.push('\n');
        self.sockets.push((role, fd));
    }
}

/// Opens and closes shards as the load needs them (`shard_packing`), on this runtime.
fn start_packing(app: &App) {
    let s = &app.config.server;
    if !s.shard_packing || app.shards.count() < 2 {
        return;
    }
    let thresholds = crate::shard::Thresholds {
        open_at: s.shard_open_busy,
        close_at: s.shard_close_busy,
        idle_cores: s.shard_open_idle_cores,
    };
    tokio::spawn(crate::shard::monitor(
        app.shards.clone(),
        thresholds,
        std::time::Duration::from_millis(200),
    ));
}

/// Joins the cluster, when configured, before any client is accepted.
async fn start_cluster(app: &std::sync::Arc<App>) -> std::io::Result<()> {
    let Some(c) = app.config.cluster.clone() else {
        return Ok(());
    };
    // The streams peers open: relayed clients, and realtime's fabric.
    // Weak: the App holds the node, which holds these.
    let weak = std::sync::Arc::downgrade(app);
    let relayed = weak.clone();
    let handlers = crate::cluster::Handlers::new(move |stream, what| {
        if let Some(app) = relayed.upgrade() {
            tokio::spawn(crate::session::serve_relayed(app, stream, what));
        }
    })
    .on(crate::realtime::fabric::OPENING, move |stream, _| {
        if let Some(app) = weak.upgrade() {
            crate::control::spawn(crate::realtime::fabric::receive(app, stream));
        }
    });
    let host = crate::cluster::Host {
        routes: app.routes.clone(),
        cancels: app.cancels.clone(),
        admission: app.admission.clone(),
        shards: app.shards.clone(),
    };
    let node = crate::cluster::start(host, c, handlers)
        .await
        .map_err(std::io::Error::other)?;
    let _ = app.cluster.set(node);
    Ok(())
}

/// Serves `/metrics` (and the ops routes) on `[metrics] listen`, when configured.
async fn start_metrics(
    app: &std::sync::Arc<App>,
    inherited: Option<tokio::net::TcpListener>,
    token: Option<String>,
    started: &mut Started,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let Some(addr) = app.config.metrics.listen else {
        return Ok(());
    };
    let listener = listener::bind_or_inherit(inherited, addr, "metrics.listen").await?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, "metrics listening");
    started.add(
        crate::upgrade::Role::Metrics,
        listener.as_raw_fd(),
        format!("metrics {addr}"),
    );
    tokio::spawn(crate::api::serve(
        listener,
        crate::api::ops::router(app.clone(), token),
    ));
    Ok(())
}

/// An upgrade: once this process accepts, the previous one may drain and leave, handing its
/// idle clients over on the same line; this one serves the upgrade control socket.
fn take_clients_from_previous(
    app: &std::sync::Arc<App>,
    u: Upgrade,
    sockets: Vec<(crate::upgrade::Role, std::os::fd::RawFd)>,
) {
    if let Some(mut previous) = u.confirm {
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
