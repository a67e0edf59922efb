//! Listening sockets: TCP with a real backlog (tokio's default of 128 drops connections in a
//! connect storm), `TCP_NODELAY` and keepalive for accepted sockets, and a Unix socket named
//! the way libpq looks for it (`.s.PGSQL.<port>`).
//!
//! On Linux an accepted socket inherits `TCP_NODELAY` and the keepalive settings of its
//! listening socket, so they are set once per listener ([`set_client_options`]) instead of with
//! four system calls per connection; elsewhere each accepted socket is set up on its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, SockRef, Socket, TcpKeepalive, Type};
use tokio::net::{TcpListener, UnixListener};

use crate::app::App;
use crate::net::Stream;

pub fn bind_tcp(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    TcpListener::from_std(bind_tcp_std(addr, backlog, false)?)
}

/// A listening socket not yet registered with a runtime; `reuse_port` lets several (one
/// per shard) share the address, the kernel spreading new connections over them.
pub fn bind_tcp_std(
    addr: SocketAddr,
    backlog: u32,
    reuse_port: bool,
) -> std::io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(backlog.min(i32::MAX as u32) as i32)?;
    Ok(socket.into())
}

/// Fails when another process listens on `addr`. Sockets that share an address through
/// `SO_REUSEPORT` would let a second Shoal join the first's group without error, get nothing
/// while the first runs, and silently take every connection when it exits: a socket bound
/// without `SO_REUSEPORT` cannot share the address with any listener, so its bind tells.
/// (Replacing a running process goes through `--upgrade-socket`, which binds nothing.)
pub fn ensure_not_served(addr: SocketAddr) -> std::io::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    let probe = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    probe.set_reuse_address(true)?;
    if addr.is_ipv6() {
        probe.set_only_v6(true)?;
    }
    match probe.bind(&addr.into()) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(std::io::Error::new(
            e.kind(),
            "another process is already listening on this address (to replace a running Shoal \
             without dropping clients, start the new one with --upgrade-socket)",
        )),
        other => other,
    }
}

pub fn bind_unix(
    dir: &std::path::Path,
    port: u16,
    backlog: u32,
) -> std::io::Result<(UnixListener, PathBuf)> {
    let path = dir.join(format!(".s.PGSQL.{port}"));
    let _ = std::fs::remove_file(&path);
    let socket = Socket::new(Domain::UNIX, Type::STREAM, None)?;
    socket.set_nonblocking(true)?;
    socket.bind(&socket2::SockAddr::unix(&path)?)?;
    socket.listen(backlog.min(i32::MAX as u32) as i32)?;
    Ok((UnixListener::from_std(socket.into())?, path))
}

/// Sets what client sockets need on `socket`: a listener (whose accepted sockets inherit it,
/// on Linux) or an accepted socket. Listeners taken over from a previous process get this
/// process's settings too.
pub fn set_client_options(
    socket: SockRef<'_>,
    server: &crate::config::ServerSection,
) -> std::io::Result<()> {
    socket.set_tcp_nodelay(true)?;
    if server.tcp_keepalive {
        let ka = TcpKeepalive::new()
            .with_time(Duration::from_secs_f64(server.tcp_keepalive_idle.max(1.0)))
            .with_interval(Duration::from_secs_f64(
                server.tcp_keepalive_interval.max(1.0),
            ));
        socket.set_tcp_keepalive(&ka)?;
    } else {
        socket.set_keepalive(false)?;
    }
    Ok(())
}

/// Whether accepted sockets inherit the listener's options (see the module doc).
const INHERITS_OPTIONS: bool = cfg!(target_os = "linux");

fn tune(stream: &tokio::net::TcpStream, app: &App) {
    if !INHERITS_OPTIONS {
        let _ = set_client_options(SockRef::from(stream), &app.config.server);
    }
}

/// Serves a just-accepted client on another shard's runtime (its socket registered there).
/// The socket joins the target's reactor from here, so the task spawned there is the
/// session's own future (no wrapper holding more state for the client's whole life).
fn hand_over(
    target: &tokio::runtime::Handle,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    app: Arc<App>,
) {
    let moved = stream.into_std().and_then(|std| {
        let _target = target.enter();
        tokio::net::TcpStream::from_std(std)
    });
    match moved {
        Ok(s) => {
            target.spawn(crate::session::serve(app, Stream::Tcp(s), Some(peer)));
        }
        Err(e) => tracing::warn!(error = %e, "cannot move a new client to its shard"),
    }
}

/// Accepts until shutdown; each client gets its own task. `steer` is set for shard 0's socket
/// of a per-core group: its loop keeps the kernel giving new connections to open shards only
/// ([`crate::reuseport`]).
pub async fn accept_tcp(listener: TcpListener, app: Arc<App>, steer: bool) {
    let mut shutdown = app.lifecycle.shutdown.clone();
    let mut steered = 0;
    loop {
        if steer {
            steer_to_open(&listener, app.shards.open(), &mut steered);
        }
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    tune(&stream, &app);
                    app.metrics.accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let here = crate::shard::current();
                    match app.shards.placement_for_new(here).and_then(|s| app.shards.handle(s)) {
                        // Accepted on a closed shard: the client lives on an open one.
                        Some(target) => {
                            app.shards.note_handed_over();
                            hand_over(target, stream, peer, app.clone())
                        }
                        None => {
                            tokio::spawn(crate::session::serve(app.clone(), Stream::Tcp(stream), Some(peer)));
                        }
                    }
                }
                Err(e) => {
                    // Out of descriptors and similar: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    crate::timer::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.changed() => return,
        }
    }
}

/// Tells the kernel how many shards are open, when that changed since it was last told.
fn steer_to_open(listener: &TcpListener, open: usize, steered: &mut usize) {
    if open != *steered {
        *steered = open;
        if let Err(e) = crate::reuseport::steer(listener, open) {
            tracing::debug!(error = %e, "cannot steer new connections: closed shards hand them over");
        }
    }
}

pub async fn accept_unix(listener: UnixListener, app: Arc<App>) {
    let mut shutdown = app.lifecycle.shutdown.clone();
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => {
                    app.metrics.accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::spawn(crate::session::serve(app.clone(), Stream::Unix(stream), None));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    crate::timer::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.changed() => return,
        }
    }
}

/// A service's listener: the one a previous process handed over, or a new one bound to
/// `addr`. The error names the setting (`key`, as `"api.listen"`) that asked for it.
pub async fn bind_or_inherit(
    inherited: Option<tokio::net::TcpListener>,
    addr: std::net::SocketAddr,
    key: &str,
) -> std::io::Result<tokio::net::TcpListener> {
    match inherited {
        Some(l) => Ok(l),
        None => tokio::net::TcpListener::bind(addr).await.map_err(|e| {
            std::io::Error::new(e.kind(), format!("cannot listen on {addr} ({key}): {e}"))
        }),
    }
}

#[cfg(test)]
mod tests {
    use socket2::SockRef;

    use crate::config::ServerSection;

    /// The sockets clients arrive on must have `TCP_NODELAY` (or every reply waits for an
    /// ACK) and the configured keepalive, whether set per listener or per socket.
    #[tokio::test]
    async fn accepted_sockets_get_nodelay_and_the_configured_keepalive() {
        let server = ServerSection {
            tcp_keepalive_idle: 77.0,
            tcp_keepalive_interval: 13.0,
            ..ServerSection::default()
        };
        let std = super::bind_tcp_std("127.0.0.1:0".parse().unwrap(), 16, false).expect("bind");
        super::set_client_options(SockRef::from(&std), &server).expect("tune");
        let listener = tokio::net::TcpListener::from_std(std).expect("register");
        let addr = listener.local_addr().expect("addr");
        let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (accepted, _) = listener.accept().await.expect("accept");
        if !super::INHERITS_OPTIONS {
            super::set_client_options(SockRef::from(&accepted), &server).expect("tune accepted");
        }
        let s = SockRef::from(&accepted);
        assert!(s.tcp_nodelay().expect("nodelay"));
        assert!(s.keepalive().expect("keepalive"));
        assert_eq!(s.tcp_keepalive_time().expect("idle").as_secs(), 77);
        assert_eq!(s.tcp_keepalive_interval().expect("interval").as_secs(), 13);
    }

    #[tokio::test]
    async fn keepalive_can_be_turned_off() {
        let server = ServerSection {
            tcp_keepalive: false,
            ..ServerSection::default()
        };
        let std = super::bind_tcp_std("127.0.0.1:0".parse().unwrap(), 16, false).expect("bind");
        super::set_client_options(SockRef::from(&std), &server).expect("tune");
        let listener = tokio::net::TcpListener::from_std(std).expect("register");
        let _client = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (accepted, _) = listener.accept().await.expect("accept");
        let s = SockRef::from(&accepted);
        assert!(s.tcp_nodelay().expect("nodelay"));
        assert!(!s.keepalive().expect("keepalive"));
    }
}
