//! Zero-downtime restarts and upgrades: a new Shoal process takes over the running one's
//! listening sockets through a Unix control socket (`--upgrade-socket PATH`).
//!
//! The running process listens on PATH. A new process started with the same flag connects,
//! receives every listening socket (PostgreSQL, Unix, API, metrics, realtime) with `SCM_RIGHTS`, starts
//! accepting on them, and answers `ok`; only then does the old process stop accepting. It
//! then hands each transaction-mode client over at its next transaction boundary, socket and
//! session state, on the same line (see [`crate::handoff`]); running transactions finish
//! where they started. Clients that cannot move (TLS, session mode) drain: they stay until
//! they leave or `shutdown_timeout` passes. The sockets are the same kernel objects
//! throughout, so no connection attempt is refused or lost. If the new process dies before
//! `ok`, the old one carries on.

use std::io::Read;
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What a handed-over socket is for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Role {
    /// A client listener, and the shard that accepted on it (one socket per shard and
    /// address on the per-core data plane).
    Tcp {
        #[serde(default)]
        shard: usize,
    },
    Unix {
        path: PathBuf,
    },
    Api,
    Metrics,
    Realtime,
    Serverless,
}

/// Sockets received from the previous process.
#[derive(Debug, Default)]
pub struct Inherited {
    /// With the shard each accepted on in the previous process.
    pub tcp: Vec<(usize, std::net::TcpListener)>,
    pub unix: Vec<(std::os::unix::net::UnixListener, PathBuf)>,
    pub api: Option<std::net::TcpListener>,
    pub metrics: Option<std::net::TcpListener>,
    pub realtime: Option<std::net::TcpListener>,
    pub serverless: Option<std::net::TcpListener>,
}

/// The new process's side of a takeover: the sockets, and the line to tell the old process
/// it may leave.
pub struct Takeover {
    pub inherited: Inherited,
    /// Write `ok\n` here once accepting on the sockets: the previous process then leaves.
    pub control: UnixStream,
}

/// Asks a running process at `path` for its sockets; `None` when nobody answers there (a
/// first start, or a stale socket file).
pub fn take_over(path: &Path) -> std::io::Result<Option<Takeover>> {
    let control = match UnixStream::connect(path) {
        Ok(s) => s,
        Err(_) => return Ok(None),
    };
    control.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    let mut buf = vec![0u8; 64 * 1024];
    let (n, fds) =
        crate::fdpass::recv_with_fds(&control, &mut buf, nix::sys::socket::MsgFlags::empty())?;
    let roles: Vec<Role> = serde_json::from_slice(&buf[..n])
        .map_err(|e| std::io::Error::other(format!("upgrade manifest: {e}")))?;
    if roles.len() != fds.len() {
        return Err(std::io::Error::other(format!(
            "upgrade: {} sockets described, {} received",
            roles.len(),
            fds.len()
        )));
    }
    let mut inherited = Inherited::default();
    for (role, fd) in roles.into_iter().zip(fds) {
        match role {
            Role::Tcp { shard } => inherited.tcp.push((shard, std::net::TcpListener::from(fd))),
            Role::Api => inherited.api = Some(std::net::TcpListener::from(fd)),
            Role::Metrics => inherited.metrics = Some(std::net::TcpListener::from(fd)),
            Role::Realtime => inherited.realtime = Some(std::net::TcpListener::from(fd)),
            Role::Serverless => inherited.serverless = Some(std::net::TcpListener::from(fd)),
            Role::Unix { path } => inherited
                .unix
                .push((std::os::unix::net::UnixListener::from(fd), path)),
        }
    }
    tracing::info!(
        tcp = inherited.tcp.len(),
        unix = inherited.unix.len(),
        api = inherited.api.is_some(),
        metrics = inherited.metrics.is_some(),
        realtime = inherited.realtime.is_some(),
        "took over the listening sockets of the running process"
    );
    Ok(Some(Takeover { inherited, control }))
}

/// The running process's side: serves the control socket at `path`; when a new process
/// takes the sockets and confirms, asks this one to shut down gracefully.
pub async fn serve_control(
    path: PathBuf,
    sockets: Vec<(Role, RawFd)>,
    app: std::sync::Arc<crate::app::App>,
) {
    let _ = std::fs::remove_file(&path);
    let listener = match tokio::net::UnixListener::bind(&path) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(path = %path.display(), error = %e, "cannot listen for upgrades");
            return;
        }
    };
    tracing::info!(path = %path.display(), "listening for upgrades");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        let sockets = sockets.clone();
        let handed = tokio::task::spawn_blocking(move || hand_over(stream, &sockets)).await;
        match handed {
            Ok(Ok(line)) => {
                tracing::info!(
                    "a new process took over the listening sockets: handing idle clients over, draining the rest, then leaving"
                );
                // The same line now carries idle clients to the new process.
                let _ = app
                    .lifecycle
                    .handoff
                    .set(crate::handoff::Sender::start(line));
                app.lifecycle
                    .handed_over
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                app.lifecycle.shutdown_request.notify_one();
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "upgrade attempt failed; this process carries on")
            }
            Err(e) => tracing::warn!(error = %e, "upgrade attempt failed"),
        }
    }
}

fn hand_over(mut stream: UnixStream, sockets: &[(Role, RawFd)]) -> std::io::Result<UnixStream> {
    stream.set_nonblocking(false)?;
    let roles: Vec<&Role> = sockets.iter().map(|(r, _)| r).collect();
    let manifest = serde_json::to_vec(&roles).map_err(std::io::Error::other)?;
    let fds: Vec<RawFd> = sockets.iter().map(|(_, fd)| *fd).collect();
    crate::fdpass::send_with_fds(&stream, &manifest, &fds)?;
    // Until the new process confirms it accepts, this one keeps serving.
    stream.set_read_timeout(Some(std::time::Duration::from_secs(60)))?;
    let mut ok = [0u8; 3];
    stream.read_exact(&mut ok)?;
    if &ok != b"ok\n" {
        return Err(std::io::Error::other("the new process did not confirm"));
    }
    stream.set_read_timeout(None)?;
    Ok(stream)
}
