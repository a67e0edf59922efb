//! The client listeners: each accepting on its shard (per-core data plane) or on this
//! runtime.

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use super::Started;
use crate::app::App;
use crate::listener;
use crate::upgrade::Role;

/// Starts accepting on every client listener; returns the Unix sockets' paths (removed at
/// exit unless handed over).
pub(super) fn clients(
    app: &Arc<App>,
    unix: Vec<(tokio::net::UnixListener, PathBuf)>,
    tcp: Vec<tokio::net::TcpListener>,
    mut shard_tcp: Vec<(usize, std::net::TcpListener)>,
    started: &mut Started,
) -> std::io::Result<Vec<PathBuf>> {
    let mut unix_paths = Vec::new();
    for (l, path) in unix {
        tracing::info!(path = %path.display(), "listening");
        let line = format!("unix {}", path.display());
        started.add(Role::Unix { path: path.clone() }, l.as_raw_fd(), line);
        unix_paths.push(path);
        match app.shards.handle(0) {
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
    for l in tcp {
        let addr = l.local_addr()?;
        listener::set_client_options(socket2::SockRef::from(&l), &app.config.server)?;
        tracing::info!(%addr, "listening");
        started.add(Role::Tcp { shard: 0 }, l.as_raw_fd(), format!("tcp {addr}"));
        let steer = app.shards.count() > 1;
        match app.shards.handle(0) {
            Some(_) => {
                // Shard 0 accepts on it, in its runtime, as the other shards on theirs.
                shard_tcp.push((0, l.into_std()?));
            }
            None => {
                tokio::spawn(listener::accept_tcp(l, app.clone(), steer));
            }
        }
    }
    // The shards accept on their own sockets, in their own runtimes.
    for (shard, l) in shard_tcp {
        if shard > 0 {
            listener::set_client_options(socket2::SockRef::from(&l), &app.config.server)?;
            started.sockets.push((Role::Tcp { shard }, l.as_raw_fd()));
        }
        let steer = shard == 0 && app.shards.count() > 1;
        let Some(handle) = app.shards.handle(shard) else {
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
    Ok(unix_paths)
}
