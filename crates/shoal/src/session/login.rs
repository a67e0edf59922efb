//! From a connection's first byte to a logged-in client: handshake, limits, authentication,
//! the pool, the ParameterStatus values to report and the cancel key, all bounded by
//! `client_login_timeout`.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::BytesMut;
use shoal_wire::backend;
use shoal_wire::sqlstate;

use super::entry::{console_peer, destination, enter, placed, Destination, PoolClient};
use super::{auth, finish, handshake, Session, SessionError};
use crate::admission::ClientGuard;
use crate::app::App;
use crate::cancel::Registration;
use crate::config::{ClientAuth, User};
use crate::error::ErrorKind;
use crate::logsafe::Escaped;
use crate::net::Stream;
use crate::params::StartupRequest;
use crate::pool::Lease;
use crate::route::{RouteError, RouteRequest, Routed};

/// Handshake, authentication and login, bounded by `client_login_timeout`. Reports its own
/// failures; returns the logged-in session.
pub(super) async fn login_phase(
    app: Arc<App>,
    mut stream: Stream,
    peer: Option<std::net::SocketAddr>,
) -> Option<(Session, Option<Box<Lease>>)> {
    let id = app.lifecycle.next_conn_id();
    tracing::debug!(conn = id, "client connected");
    // Asked of the kernel (a system call) only if `accept` did not say.
    let peer = peer.or_else(|| stream.peer_addr());
    let logging_in = match app.admission.begin_login(peer.map(|a| a.ip())) {
        Ok(g) => g,
        Err(message) => {
            let e = SessionError::fatal(
                ErrorKind::ClientLimit,
                sqlstate::TOO_MANY_CONNECTIONS,
                message,
            );
            Box::pin(finish(id, &mut stream, Err(e))).await;
            return None;
        }
    };
    let login_timeout = crate::config::secs(app.config.server.client_login_timeout);
    let r = match crate::timer::timeout(login_timeout, login(&app, &mut stream, peer)).await {
        Err(_) => Err(SessionError::fatal(
            crate::error::ErrorKind::LoginTimeout,
            sqlstate::PROTOCOL_VIOLATION,
            "client did not finish logging in within client_login_timeout",
        )),
        Ok(r) => r,
    };
    drop(logging_in);
    match r {
        Ok(Some(Outcome::Admin(user, access))) => {
            let (guard, _) = app.admission.client_guard();
            Box::pin(crate::admin::serve(app.clone(), &mut stream, user, access)).await;
            drop(guard);
            None
        }
        Ok(Some(Outcome::Relay(relayed))) => {
            let guard = counted(&app, id, &mut stream).await?;
            // Relayed by a task of its own, so that this login's state is freed: a relayed
            // client may stay for long, mostly idle.
            tokio::spawn(super::relayed::relay_out(super::relayed::Relaying {
                app,
                id,
                stream,
                relayed: *relayed,
                _guard: guard,
            }));
            None
        }
        Ok(Some(Outcome::Pool(done))) => {
            let guard = counted(&app, id, &mut stream).await?;
            if app.config.server.log_connections {
                tracing::info!(conn = id, pool = %done.pool.name, peer = %stream.describe_peer(done.peer), "client logged in");
            } else {
                tracing::debug!(conn = id, pool = %done.pool.name, "client logged in");
            }
            Some(Session::new(&app, id, guard, stream, *done))
        }
        Ok(None) => None,
        Err(e) => {
            app.metrics.rejected(e.kind());
            Box::pin(finish(id, &mut stream, Err(e))).await;
            None
        }
    }
}

/// Counts a logged-in client, unless others logged in meanwhile took the last place
/// (then the client is told and `None` returned).
async fn counted(app: &Arc<App>, id: u64, stream: &mut Stream) -> Option<ClientGuard> {
    let (guard, _) = app.admission.client_guard();
    if app.admission.connected_clients() <= app.config.server.max_client_conn {
        return Some(guard);
    }
    Box::pin(over_max(app, id, stream, guard)).await
}

/// [`counted`] past `max_client_conn`: room made by ending the sessions Shoal keeps on its
/// own account, or the client told. (Boxed apart: a rare path that would grow every
/// login's future.)
async fn over_max(
    app: &Arc<App>,
    id: u64,
    stream: &mut Stream,
    guard: ClientGuard,
) -> Option<ClientGuard> {
    let max = app.config.server.max_client_conn;
    let admission = &app.admission;
    if admission
        .make_room(|| admission.connected_clients() > max)
        .await
    {
        return Some(guard);
    }
    drop(guard);
    let e = SessionError::fatal(
        ErrorKind::ClientLimit,
        sqlstate::TOO_MANY_CONNECTIONS,
        format!("too many client connections: server.max_client_conn ({max}) reached"),
    );
    finish(id, stream, Err(e)).await;
    None
}

/// Where a login ends up.
pub(super) enum Outcome {
    Pool(Box<LoggedIn>),
    /// The admin console (a user allowed in by `[admin]`).
    Admin(String, crate::admin::Access),
    /// Another node owns the pool (cluster): the client is relayed there.
    Relay(Box<Relayed>),
}

/// A client authenticated here whose pool another node owns.
pub(super) struct Relayed {
    /// Counts the client in this node's view of the pool (`SHOW POOLS`).
    pub(super) pool: PoolClient,
    pub(super) open: Box<crate::cluster::open::HeldOpen>,
    /// Where the relay starts: the node to open the client's stream at, and the end of
    /// authentication to send before the owner's reply (taken when it starts).
    pub(super) opening: Option<Box<crate::cluster::pipe::Opening>>,
}

/// A logged-in client, ready for its pool mode's loop.
pub(super) struct LoggedIn {
    pub(super) pool: PoolClient,
    pub(super) params: Vec<(String, String)>,
    pub(super) cancel: Registration,
    /// The server a session-mode client keeps.
    pub(super) lease: Option<Lease>,
    /// The client's address, for the login's log line: carried here rather than kept by
    /// the login's future across its awaits, which would grow every login in flight.
    pub(super) peer: Option<std::net::SocketAddr>,
    /// `target_session_attrs`, when the client gave one.
    pub(super) target: Option<crate::config::replicas::TargetSessionAttrs>,
    /// How the client's text is read, as the server reported at login.
    pub(super) encoding: shoal_wire::sql::ClientEncoding,
}

/// What a client asks for, and what is known of it before it proves who it is.
pub(super) struct Request {
    pub(super) startup: StartupRequest,
    /// The TLS server name (SNI) it connected with.
    pub(super) server_name: Option<String>,
    pub(super) peer: Option<std::net::SocketAddr>,
    /// The reply being composed: AuthenticationOk and what follows go out in one write.
    pub(super) out: BytesMut,
}

impl Request {
    fn ip(&self) -> Option<std::net::IpAddr> {
        self.peer.map(|a| a.ip())
    }

    fn route(&self) -> RouteRequest<'_> {
        RouteRequest {
            user: &self.startup.user,
            database: &self.startup.database,
            server_name: self.server_name.as_deref(),
            reference: self.startup.reference.as_deref(),
            addr: self.ip(),
        }
    }
}

/// The steps of a login, each a function of what the last one found: request → admit →
/// resolve → credentials → authenticate → destination → enter.
///
/// The steps that await much, and only some logins take (the handshake, authentication,
/// an auth_query lookup, a server for new parameters), are boxed inside, so a login in
/// flight holds only the state of its current step. Few boxes per login matter as much: in
/// a connect storm thousands of logins allocate and free them between the sessions that
/// stay, and each freed box left in a page beside a live session is memory idle clients
/// later pay for.
async fn login(
    app: &Arc<App>,
    stream: &mut Stream,
    peer: Option<std::net::SocketAddr>,
) -> Result<Option<Outcome>, SessionError> {
    let Some(mut req) = request(app, stream, peer).await? else {
        return Ok(None);
    };
    admit(app, &req)?;
    let routed = resolve(app, &req).await?;
    let peer_admin = console_peer(stream, &req, &routed);
    let found = if peer_admin {
        Ok(Cow::Owned(User::named(&routed.user, ClientAuth::Trust)))
    } else {
        credentials(app, &routed).await?
    };
    require_tls(app, stream, &routed, &found)?;
    let user = Box::pin(authenticate(app, stream, &mut req, &routed, found)).await?;
    let to = destination(app, &req, &routed, &user, peer_admin)?;
    let to = match (to, app.cluster.get()) {
        (Destination::Pool(pool), Some(node)) => Box::pin(placed(node, &req, pool, &user)).await?,
        (to, _) => to,
    };
    // Not needed past here: dropped now, they take no room in this future across the
    // awaits below.
    drop(user);
    drop(routed);
    enter(app, stream, &mut req, to).await.map(Some)
}

/// The handshake, and the startup packet read as a request; `None` when the connection
/// was only a cancel request (or ended before asking anything).
async fn request(
    app: &Arc<App>,
    stream: &mut Stream,
    peer: Option<std::net::SocketAddr>,
) -> Result<Option<Request>, SessionError> {
    let Some(startup) = Box::pin(handshake::negotiate(stream, app)).await? else {
        return Ok(None);
    };
    let minor = startup.minor;
    let startup = StartupRequest::from_startup(startup).map_err(|e| {
        let (kind, code) = match e {
            crate::params::ParamError::NoUser => {
                (ErrorKind::Routing, sqlstate::INVALID_AUTHORIZATION)
            }
            crate::params::ParamError::BadTarget(_) => {
                (ErrorKind::ClientProtocol, sqlstate::INVALID_PARAMETER_VALUE)
            }
            _ => (ErrorKind::ClientProtocol, sqlstate::PROTOCOL_VIOLATION),
        };
        SessionError::fatal(kind, code, e.to_string())
    })?;
    // Sized for the usual reply (AuthenticationOk, a dozen ParameterStatus, BackendKeyData,
    // ReadyForQuery), so composing it does not reallocate.
    let mut out = BytesMut::with_capacity(1024);
    if minor > 0 || !startup.unrecognized.is_empty() {
        let names: Vec<&str> = startup.unrecognized.iter().map(String::as_str).collect();
        backend::negotiate_protocol_version(&mut out, 3 << 16, &names);
        stream.write_all(&out).await?;
        out.clear();
    }
    let server_name = match &*stream {
        Stream::Tls(s) => crate::tls::server_name(s).map(str::to_owned),
        _ => None,
    };
    Ok(Some(Request {
        startup,
        server_name,
        peer,
        out,
    }))
}

/// Process-wide limits that refuse a login before anything is looked up.
fn admit(app: &App, req: &Request) -> Result<(), SessionError> {
    // Logins accepted before shutdown began complete (the drain waits for them); only once
    // idle clients are being closed is it too late.
    if app.lifecycle.closing_clients.load(Ordering::Relaxed) {
        return Err(SessionError::fatal(
            ErrorKind::Shutdown,
            sqlstate::CANNOT_CONNECT_NOW,
            "Shoal is shutting down",
        ));
    }
    let max = app.config.server.max_client_conn;
    // (Sessions Shoal keeps on its own account make room once the client has logged in.)
    if app.admission.connected_clients() >= max && !app.admission.has_spare() {
        return Err(SessionError::fatal(
            ErrorKind::ClientLimit,
            sqlstate::TOO_MANY_CONNECTIONS,
            format!("too many client connections: server.max_client_conn ({max}) reached"),
        ));
    }
    if let Some(left) = req
        .ip()
        .and_then(|a| app.admission.login_failures.banned(a, &req.startup.user))
    {
        return Err(SessionError::fatal(
            ErrorKind::Auth,
            sqlstate::INVALID_AUTHORIZATION,
            format!(
                "too many failed logins for this user from this address: try again in {} s",
                left.as_secs().max(1)
            ),
        ));
    }
    Ok(())
}

pub(super) fn refused(e: RouteError) -> SessionError {
    SessionError::fatal(e.kind(), e.code(), e.to_string())
}

/// Which tenant or database, and which user entry, the request names.
pub(super) async fn resolve(app: &App, req: &Request) -> Result<Routed, SessionError> {
    match app.routes.resolve(&req.route()) {
        Ok(r) => Ok(r),
        Err(e) => {
            tracing::info!(user = %Escaped(&req.startup.user), reason = %Escaped(&e), "login refused before authentication");
            if let (Some(a), RouteError::UnknownTenant(_)) = (req.ip(), &e) {
                // Probing for tenant names is rate-limited like guessing passwords.
                let delay = app.admission.login_failures.failed(a, &req.startup.user);
                crate::timer::sleep(delay).await;
            }
            Err(refused(e))
        }
    }
}

/// Who the user is: configured (config file or tenant), or found by the database's
/// auth_query. An unknown user is not an error yet: it is refused like a wrong password.
pub(super) async fn credentials<'a>(
    app: &App,
    routed: &'a Routed,
) -> Result<Result<Cow<'a, User>, RouteError>, SessionError> {
    if let Some(user) = routed.configured_user() {
        return Ok(Ok(Cow::Borrowed(user)));
    }
    let unknown = Err(RouteError::UnknownUser(routed.user.clone()));
    let Some(db) = routed.database() else {
        return Ok(unknown);
    };
    let (Some(aq), Some(auth_user)) = (&db.auth_query, routed.auth_user()) else {
        return Ok(unknown);
    };
    let timeout = crate::config::secs(app.routes.config().pool.server_connect_timeout);
    // Boxed: the lookup may open a server connection, a large future that every login would
    // otherwise carry while only auth_query users need it.
    match Box::pin(app.secrets.user(&auth_user, timeout, db, aq, &routed.user)).await {
        Ok(Some(user)) => Ok(Ok(Cow::Owned(user))),
        Ok(None) => Ok(unknown),
        Err(e) => {
            tracing::warn!(database = %db.name, error = %Escaped(&e), "auth_query failed");
            Err(SessionError::fatal(
                ErrorKind::ServerUnavailable,
                sqlstate::CONNECTION_FAILURE,
                format!(
                    "cannot look up the user: the auth_query of database \"{}\" failed",
                    db.name
                ),
            ))
        }
    }
}

/// The TLS requirement: the user's, else the database's (a tenant's `enforce_ssl`), else
/// `[tls] client_tls` — checked before any password is exchanged.
fn require_tls(
    app: &App,
    stream: &Stream,
    routed: &Routed,
    found: &Result<Cow<'_, User>, RouteError>,
) -> Result<(), SessionError> {
    let db_tls = routed.database().and_then(|d| d.client_tls);
    let mode = found
        .as_ref()
        .ok()
        .and_then(|u| u.client_tls)
        .or(db_tls)
        .unwrap_or(app.tls.mode);
    if mode == crate::config::ClientTls::Require && !stream.is_encrypted() {
        return Err(SessionError::fatal(
            ErrorKind::Routing,
            sqlstate::INVALID_AUTHORIZATION,
            "TLS is required: connect with sslmode=require (or stricter)",
        ));
    }
    Ok(())
}

/// The password exchange. Failures count towards the address's login delays and bans; an
/// unknown user is answered like a wrong password (no probing which users exist). What
/// authentication ends with (AuthenticationOk) waits in `req.out` for the rest of the reply.
async fn authenticate<'a>(
    app: &App,
    stream: &mut Stream,
    req: &mut Request,
    routed: &Routed,
    found: Result<Cow<'a, User>, RouteError>,
) -> Result<Cow<'a, User>, SessionError> {
    let result = match found {
        Ok(user) => {
            let end_point = if stream.is_tls() {
                app.tls.end_point(req.server_name.as_deref())
            } else {
                None
            };
            // The serverless front door asks for the password in cleartext, as its
            // driver sends it (see `crate::serverless`).
            let cleartext = matches!(stream, Stream::Http(..))
                || matches!(stream, Stream::WebSocket(..))
                    && app
                        .config
                        .serverless
                        .as_ref()
                        .is_some_and(|s| s.cleartext_password);
            let r = if cleartext {
                // Boxed: rare beside TCP logins, and kept out of every login's size.
                Box::pin(auth::cleartext(stream, &user, &app.passwords, &mut req.out)).await
            } else {
                auth::authenticate(stream, &user, end_point.as_deref(), &mut req.out).await
            };
            match r {
                Ok(client_key) => Ok(with_passthrough(user, client_key)),
                Err(e) => {
                    if let Some(d) = routed.database().filter(|d| d.auth_query.is_some()) {
                        // The password may have changed in PostgreSQL: look again next time.
                        app.secrets.forget(&d.name, &routed.user);
                    }
                    Err(e)
                }
            }
        }
        Err(e) => {
            tracing::info!(user = %Escaped(&req.startup.user), reason = %Escaped(&e), "login refused");
            let seed = app.admission.unknown_user_seed(&req.startup.user);
            Err(Box::pin(auth::refuse_unknown(stream, &routed.user, &seed)).await)
        }
    };
    match result {
        Ok(user) => {
            if let Some(a) = req.ip() {
                app.admission.login_failures.succeeded(a, &req.startup.user);
            }
            Ok(user)
        }
        Err(e) => {
            if let (Some(a), true) = (req.ip(), e.kind() == crate::error::ErrorKind::Auth) {
                let delay = app.admission.login_failures.failed(a, &req.startup.user);
                crate::timer::sleep(delay).await;
            }
            Err(e)
        }
    }
}

/// A user from auth_query logs in upstream with the secret its client just proved
/// (passthrough): the SCRAM client key, or the MD5 secret.
pub(super) fn with_passthrough<'a>(
    mut user: Cow<'a, User>,
    client_key: Option<[u8; 32]>,
) -> Cow<'a, User> {
    if user.server_password.is_some() || user.passthrough.is_some() {
        return user;
    }
    let passthrough = match (&user.auth, client_key) {
        (crate::config::ClientAuth::Scram(v), Some(k)) => {
            Some(Arc::new(crate::config::Passthrough::Scram {
                client_key: k,
                verifier: v.to_text().into(),
            }))
        }
        (crate::config::ClientAuth::Md5(s), _) => {
            Some(Arc::new(crate::config::Passthrough::Md5(s.clone())))
        }
        _ => None,
    };
    if passthrough.is_some() {
        user.to_mut().passthrough = passthrough;
    }
    user
}
