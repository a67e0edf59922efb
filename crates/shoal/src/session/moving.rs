//! Idle transaction-mode clients moving between shards of the per-core data plane (see
//! [`crate::shard`]).

use super::{serve_transaction_mode, Session};
use crate::net::Stream;

/// Moves an idle transaction-mode client to shard `target`: its socket leaves this shard's
/// reactor and joins the target's, where a new task goes on serving it. Gives the session
/// back if it cannot move (it then stays here).
pub(super) fn move_to(mut session: Session, target: usize) -> Result<(), Box<Session>> {
    let app = session.app.clone();
    let Some(handle) = app.shards.handle(target) else {
        return Err(Box::new(session));
    };
    let tcp = match std::mem::replace(&mut session.stream, Stream::Upgrading) {
        Stream::Tcp(tcp) => tcp,
        other => {
            session.stream = other;
            return Err(Box::new(session));
        }
    };
    use std::os::fd::AsRawFd;
    let fd = tcp.as_raw_fd();
    if let Some(x) = session.extras.as_mut() {
        // The idle timer belongs to this shard's clock; the next wait starts a new one.
        x.idle_timer = None;
    }
    // Registered with the target's reactor from here, so the new task is the session's own
    // future and nothing more (a wrapper would keep a second copy of the session).
    let moved = tcp.into_std().and_then(|std| {
        let _target = handle.enter();
        tokio::net::TcpStream::from_std(std)
    });
    match moved {
        Ok(s) => {
            tracing::debug!(
                conn = session.id,
                from = crate::shard::current(),
                to = target,
                "client moves to another shard"
            );
            session.stream = Stream::Tcp(s);
            app.shards.client_left(crate::shard::current());
            app.shards.client_arrived(target);
            handle.spawn(serve_transaction_mode(session));
        }
        Err(e) => {
            // The socket is gone with the error: forget its descriptor before anything can
            // reuse the number; the session ends here.
            session.app.lifecycle.client_fds.remove(fd);
            session.pool.client_fds.remove(fd);
            tracing::warn!(conn = session.id, error = %e, "cannot move a client between shards");
        }
    }
    Ok(())
}
