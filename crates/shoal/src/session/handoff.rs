//! A transaction-mode client between transactions, handed to the process that took over the
//! listening sockets, or adopted from the process being replaced (see [`crate::handoff`]).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use bytes::BytesMut;

use super::entry::PoolClient;
use super::login::LoggedIn;
use super::{serve_transaction_mode, Extras, Session};
use crate::app::App;
use crate::config::{ClientAuth, Passthrough, User};
use crate::handoff::{PassthroughImage, SessionImage};
use crate::net::Stream;
use crate::route::{Routed, Scope};

impl Session {
    /// Hands this idle client (no server held, nothing in flight) to the new process when an
    /// upgrade is under way. True when the client is no longer this process's: the caller
    /// ends the session without a word to the client, whose socket stays open in the other
    /// process.
    pub(super) async fn try_hand_over(&mut self) -> bool {
        let Some(sender) = self.app.lifecycle.handoff.get() else {
            return false;
        };
        // A listening client stays: its notifications come through this process's listener;
        // so does one with statements naming this process's server statements.
        if self
            .extras
            .as_ref()
            .is_some_and(|x| x.stays || x.listen.is_some())
            || self.statements.as_ref().is_some_and(|s| s.has_rewritten())
        {
            return false;
        }
        let (fd, unix) = match &self.stream {
            Stream::Tcp(s) => (s.as_fd().try_clone_to_owned(), false),
            Stream::Unix(s) => (s.as_fd().try_clone_to_owned(), true),
            // TLS keys live in this process; in-process streams have no descriptor.
            _ => return false,
        };
        let Ok(fd) = fd else { return false };
        let image = self.image(unix);
        match sender.hand(fd, &image).await {
            Some(true) => {
                tracing::debug!(conn = self.id, pool = %self.pool.name, "client handed to the new process");
                true
            }
            Some(false) => {
                Extras::get(&mut self.extras).stays = true;
                false
            }
            None => {
                tracing::warn!(conn = self.id, pool = %self.pool.name, "client hand-over failed midway; letting the client go");
                true
            }
        }
    }

    pub(super) fn image(&self, unix: bool) -> SessionImage {
        let (statements, unnamed) = self
            .statements
            .as_ref()
            .map(|s| s.export())
            .unwrap_or_default();
        let held_sets = self
            .extras
            .as_ref()
            .map(|x| {
                x.sets
                    .held
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            })
            .unwrap_or_default();
        let passthrough = self.pool.upstream.passthrough.as_deref().map(|p| match p {
            Passthrough::Scram {
                client_key,
                verifier,
            } => PassthroughImage::Scram {
                client_key: client_key.to_vec(),
                verifier: verifier.to_string(),
            },
            Passthrough::Md5(s) => PassthroughImage::Md5(s.clone()),
        });
        SessionImage {
            tenant: self.pool.tenant.clone(),
            database: self.pool.route_key.0.clone(),
            user: self.pool.route_key.1.clone(),
            passthrough,
            params: self.params.to_vec(),
            held_sets,
            statements,
            unnamed,
            pending: self.cbuf.to_vec(),
            cancel_key: (self.cancel.process_id(), self.cancel.secret_key()),
            skip_until_sync: self.skip_until_sync,
            target: self.extras.as_ref().and_then(|x| x.target),
            wrote_ms_ago: self
                .extras
                .as_ref()
                .map(|x| x.wrote_at)
                .filter(|&at| at != 0)
                .map(|at| crate::clock::now_ms().saturating_sub(at)),
            peer: self
                .cancel
                .slot
                .info
                .addr
                .map(|a| std::net::SocketAddr::new(a.ip(), a.port())),
            unix,
        }
    }
}

/// Serves a client handed over by the process being replaced, from where it was: same pool,
/// parameters, SETs, prepared statements, cancel key and unread bytes. False (the old process
/// keeps the client) when this process cannot: the pool is not in its configuration, or the
/// cancel key is taken.
pub async fn adopt(app: Arc<App>, fd: OwnedFd, image: SessionImage) -> bool {
    let Some((routed, user)) = find_user(&app, &image) else {
        tracing::info!(user = %crate::logsafe::Escaped(&image.user), "a handed-over client's pool is not in this configuration; it stays with the old process");
        return false;
    };
    let Ok(pool) = app.routes.pool(&routed, &user) else {
        return false;
    };
    // A pool the new configuration puts in session mode cannot take a client between
    // transactions mid-session: it stays and drains.
    if pool.settings.mode != crate::config::PoolMode::Transaction {
        return false;
    }
    let info = crate::cancel::ClientInfo {
        pool: Arc::downgrade(&pool),
        addr: image.peer.map(Into::into),
        since_ms: crate::clock::now_ms(),
    };
    let Some(cancel) = app
        .cancels
        .register_exact(image.cancel_key.0, image.cancel_key.1, info)
    else {
        return false;
    };
    let std_stream = if image.unix {
        Std::Unix(std::os::unix::net::UnixStream::from(fd))
    } else {
        Std::Tcp(std::net::TcpStream::from(fd))
    };
    // Served on the first shard (or this runtime without the per-core data plane); the
    // shards' placement moves it later like any client.
    let handle = app
        .shards
        .handle(0)
        .cloned()
        .unwrap_or_else(tokio::runtime::Handle::current);
    let (done, started) = tokio::sync::oneshot::channel();
    handle.spawn(async move {
        let Some(stream) = std_stream.register() else {
            let _ = done.send(false);
            return;
        };
        pool.stats
            .clients
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (guard, _) = app.admission.client_guard();
        let id = app.lifecycle.next_conn_id();
        let logged_in = LoggedIn {
            pool: PoolClient(pool),
            params: image.params.clone(),
            cancel,
            lease: None,
            peer: image.peer,
            target: image.target,
            // Refined by the image's held SETs in `restore`.
            encoding: super::entry::startup_encoding(&image.params),
        };
        let (mut session, _) = Session::new(&app, id, guard, stream, logged_in);
        session.restore(image);
        tracing::debug!(conn = id, pool = %session.pool.name, "client adopted from the previous process");
        let _ = done.send(true);
        serve_transaction_mode(session).await;
    });
    started.await.unwrap_or(false)
}

/// How a client handed over reads its text: its held `SET client_encoding` (replayed on
/// every server it uses), else its startup parameter, else UTF8.
fn image_encoding(image: &SessionImage) -> shoal_wire::sql::ClientEncoding {
    use shoal_wire::sql::ClientEncoding;
    let held = image
        .held_sets
        .iter()
        .rev()
        .find(|(name, _)| name == "client_encoding" || name == "names")
        .map(|(_, sql)| {
            let value = sql.trim().trim_end_matches(';').rsplit(['=', ' ']).next();
            value.map_or(ClientEncoding::Unknown, |v| {
                ClientEncoding::from_name(v.trim_matches(|c| c == '\'' || c == '"'))
            })
        });
    held.unwrap_or_else(|| super::entry::startup_encoding(&image.params))
}

impl Session {
    /// Takes up the state an image of this client's session carries: its prepared
    /// statements, SETs, unread bytes.
    pub(super) fn restore(&mut self, image: SessionImage) {
        let encoding = image_encoding(&image);
        if encoding != shoal_wire::sql::ClientEncoding::Utf8 {
            Extras::get(&mut self.extras).encoding = encoding;
        }
        let statements = crate::prepared::ClientStatements::import(
            &self.pool.statements,
            crate::prepared::params_key(&image.params),
            image.statements,
            image.unnamed,
            // Read as UTF8 until the server reports otherwise: the image does not carry the
            // encoding, and a client of another encoding re-sends its SET on the new process.
            shoal_wire::sql::ClientEncoding::Utf8,
        );
        self.statements = Some(Box::new(statements));
        if !image.held_sets.is_empty() {
            let held = image
                .held_sets
                .into_iter()
                .map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str()))
                .collect();
            Extras::get(&mut self.extras).sets = crate::sets::SessionSets::restored(held);
        }
        self.cbuf = BytesMut::from(&image.pending[..]);
        self.skip_until_sync = image.skip_until_sync;
        if image.target.is_some() {
            Extras::get(&mut self.extras).target = image.target;
        }
        if let Some(ago) = image.wrote_ms_ago {
            // Taken as no older than it was when the image was made: never too early.
            Extras::get(&mut self.extras).wrote_at =
                crate::clock::now_ms().saturating_sub(ago).max(1);
        }
    }
}

/// The client's user as this process's configuration (or tenants) has it, with the
/// upstream secret an auth_query user logged in with.
fn find_user(app: &App, image: &SessionImage) -> Option<(Routed, User)> {
    let scope = match &image.tenant {
        Some(id) => Scope::Tenant(app.routes.tenants.get(id)?),
        None => {
            let config = app.routes.config();
            match config.wildcard_database(&image.database) {
                Some(db) => Scope::Wildcard(config, Arc::new(db)),
                None => Scope::File(config, image.database.clone()),
            }
        }
    };
    let routed = Routed {
        scope,
        user: image.user.clone(),
    };
    let passthrough = image.passthrough.as_ref().and_then(|p| match p {
        PassthroughImage::Scram {
            client_key,
            verifier,
        } => Some(Passthrough::Scram {
            client_key: client_key.as_slice().try_into().ok()?,
            verifier: verifier.as_str().into(),
        }),
        PassthroughImage::Md5(s) => Some(Passthrough::Md5(s.clone())),
    });
    let mut user = match routed.configured_user() {
        Some(u) => u.clone(),
        // An auth_query user: only its upstream secret matters now.
        None => User::named(&image.user, ClientAuth::Trust),
    };
    if let Some(p) = passthrough {
        user.passthrough = Some(Arc::new(p));
    }
    routed.database()?;
    Some((routed, user))
}

enum Std {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Std {
    /// Joins the current runtime's reactor.
    fn register(self) -> Option<Stream> {
        match self {
            Std::Tcp(s) => {
                s.set_nonblocking(true).ok()?;
                tokio::net::TcpStream::from_std(s).ok().map(Stream::Tcp)
            }
            Std::Unix(s) => {
                s.set_nonblocking(true).ok()?;
                tokio::net::UnixStream::from_std(s).ok().map(Stream::Unix)
            }
        }
    }
}
