//! Client hand-over during a zero-downtime upgrade: the process being replaced gives each
//! idle transaction-mode client, socket and session state, to the process that took its
//! listening sockets, so no client sees the upgrade (no error, no reconnect).
//!
//! After the new process confirms the takeover (see [`crate::upgrade`]), the control
//! connection between the two stays open and carries clients: for each, a 4-byte length with
//! the client's socket attached (`SCM_RIGHTS`), then a [`SessionImage`] as JSON; the new
//! process answers `y` once it serves the client, `n` if it cannot (its configuration no
//! longer has the client's pool, the cancel key is taken), and the old process keeps serving
//! that client. A client is handed over only between transactions, holding no server, so no
//! statement is ever in flight across the move. TLS clients (their session keys live in this
//! process) and session-mode clients (their server cannot move) stay and drain instead.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use serde::{Deserialize, Serialize};

/// What the new process needs to go on serving an idle client exactly where it was.
#[derive(Serialize, Deserialize)]
pub struct SessionImage {
    /// The tenant whose pool served the client, if any.
    pub tenant: Option<String>,
    /// The database (as routed) and user of its pool.
    pub database: String,
    pub user: String,
    /// An auth_query user's upstream secret (it is in no configuration).
    pub passthrough: Option<PassthroughImage>,
    /// Startup parameters, SETs held for the session.
    pub params: Vec<(String, String)>,
    pub held_sets: Vec<(String, String)>,
    /// Named prepared statements (name, Parse body) and the unnamed one's body.
    pub statements: Vec<(Vec<u8>, Vec<u8>)>,
    pub unnamed: Option<Vec<u8>>,
    /// Bytes the client sent that were read and not yet served.
    pub pending: Vec<u8>,
    /// The BackendKeyData the client was given (its cancel key).
    pub cancel_key: (i32, i32),
    pub skip_until_sync: bool,
    pub peer: Option<std::net::SocketAddr>,
    /// A Unix-socket client (else TCP).
    pub unix: bool,
    /// `target_session_attrs`, when the client gave one.
    #[serde(default)]
    pub target: Option<crate::config::replicas::TargetSessionAttrs>,
    /// How long ago the client last committed a write (milliseconds), if it wrote: the
    /// session that takes the client up reads on a replica only where that write is
    /// visible (read-your-writes). An age, not a time: it means the same on any node.
    #[serde(default)]
    pub wrote_ms_ago: Option<u64>,
}

#[derive(Serialize, Deserialize)]
pub enum PassthroughImage {
    Scram {
        client_key: Vec<u8>,
        verifier: String,
    },
    Md5(String),
}

/// Bound on one image (a client with thousands of long prepared statements still fits).
const MAX_IMAGE: usize = 64 << 20;

struct Request {
    fd: OwnedFd,
    image: Vec<u8>,
    reply: tokio::sync::oneshot::Sender<bool>,
}

/// The old process's side: a thread that writes clients to the new process, one at a time.
pub struct Sender {
    tx: std::sync::Mutex<std::sync::mpsc::Sender<Request>>,
}

impl Sender {
    pub fn start(stream: UnixStream) -> Sender {
        let (tx, rx) = std::sync::mpsc::channel::<Request>();
        let spawned = std::thread::Builder::new()
            .name("shoal-handoff".into())
            .spawn(move || send_loop(stream, rx));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start the client hand-over thread");
        }
        Sender {
            tx: std::sync::Mutex::new(tx),
        }
    }

    /// Gives the client on `fd` (a duplicate: the caller's copy closes without ending the
    /// connection) to the new process. `Some(true)`: the new process serves it now;
    /// `Some(false)`: it refused, the caller keeps serving; `None`: the line failed and the
    /// outcome is unknown, so the caller must let go of the client (two processes must never
    /// serve one socket).
    pub async fn hand(&self, fd: OwnedFd, image: &SessionImage) -> Option<bool> {
        let image = serde_json::to_vec(image).ok()?;
        let (reply, answer) = tokio::sync::oneshot::channel();
        let request = Request { fd, image, reply };
        self.tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(request)
            .ok()?;
        answer.await.ok()
    }
}

fn send_loop(mut stream: UnixStream, rx: std::sync::mpsc::Receiver<Request>) {
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(30)));
    let mut broken = false;
    for req in rx {
        if broken {
            drop(req.reply);
            continue;
        }
        match send_one(&mut stream, &req.fd, &req.image) {
            Ok(accepted) => {
                let _ = req.reply.send(accepted);
            }
            Err(e) => {
                tracing::warn!(error = %e, "client hand-over line failed");
                broken = true;
                drop(req.reply);
            }
        }
    }
}

fn send_one(stream: &mut UnixStream, fd: &OwnedFd, image: &[u8]) -> std::io::Result<bool> {
    let len = (image.len() as u32).to_be_bytes();
    crate::fdpass::send_with_fds(stream, &len, &[fd.as_raw_fd()])?;
    stream.write_all(image)?;
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer)?;
    Ok(answer[0] == b'y')
}

/// The new process's side: a thread that takes clients off the control connection and has
/// `adopt` serve each (on `handle`'s runtime), answering whether it does.
pub fn receive<F, Fut>(mut stream: UnixStream, handle: tokio::runtime::Handle, adopt: F)
where
    F: Fn(OwnedFd, SessionImage) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = bool>,
{
    // Clients come whenever they reach a boundary: no timeout on the wait.
    let _ = stream.set_read_timeout(None);
    let spawned = std::thread::Builder::new()
        .name("shoal-adopt".into())
        .spawn(move || loop {
            let (fd, image) = match receive_one(&mut stream) {
                Ok(Some(x)) => x,
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "client hand-over line failed");
                    return;
                }
            };
            let accepted = match serde_json::from_slice::<SessionImage>(&image) {
                Ok(image) => handle.block_on(adopt(fd, image)),
                Err(e) => {
                    tracing::warn!(error = %e, "a handed-over client's state does not parse");
                    false
                }
            };
            if stream
                .write_all(if accepted { b"y" } else { b"n" })
                .is_err()
            {
                return;
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the client hand-over thread");
    }
}

/// One client off the line; `None` at its end (the old process is gone).
fn receive_one(stream: &mut UnixStream) -> std::io::Result<Option<(OwnedFd, Vec<u8>)>> {
    let mut len = [0u8; 4];
    let (n, mut fds) =
        crate::fdpass::recv_with_fds(stream, &mut len, nix::sys::socket::MsgFlags::MSG_WAITALL)?;
    if n == 0 {
        return Ok(None);
    }
    if n != 4 || fds.len() != 1 {
        return Err(std::io::Error::other("malformed client hand-over"));
    }
    let n = u32::from_be_bytes(len) as usize;
    if n > MAX_IMAGE {
        return Err(std::io::Error::other("client hand-over image too large"));
    }
    let mut image = vec![0u8; n];
    stream.read_exact(&mut image)?;
    Ok(fds.pop().map(|fd| (fd, image)))
}
