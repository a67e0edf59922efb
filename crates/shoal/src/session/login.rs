//! From a connection's first byte to a logged-in client: handshake, limits, authentication,
//! the pool, the ParameterStatus values to report and the cancel key, all bounded by
//! `client_login_timeout`.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::BytesMut;
use shoal_wire::backend;
use shoal_wire::sqlstate;

use super::{auth, finish, handshake, Session, SessionError};
use crate::app::App;
use crate::cancel::Registration;
use crate::config::PoolMode;
use crate::error::{known_code, ClientError};
use crate::logsafe::Escaped;
use crate::net::ClientStream;
use crate::params::StartupRequest;
use crate::pool::{Lease, Pool};
use crate::route::{RouteError, RouteRequest};
use crate::server::ServerError;

/// Handshake, authentication and login, bounded by `client_login_timeout`. Reports its own
/// failures; returns the logged-in session.
pub(super) async fn login_phase(
    app: Arc<App>,
    mut stream: ClientStream,
    peer: Option<std::net::SocketAddr>,
) -> Option<(Session, Option<Box<Lease>>)> {
    let id = app.next_conn_id();
    tracing::debug!(conn = id, "client connected");
    // Asked of the kernel (a system call) only if `accept` did not say.
    let peer = peer.or_else(|| stream.peer_addr());
    let logging_in = match app.begin_login(peer.map(|a| a.ip())) {
        Ok(g) => g,
        Err(message) => {
            let e = SessionError::fatal(sqlstate::TOO_MANY_CONNECTIONS, message);
            Box::pin(finish(id, &mut stream, Err(e))).await;
            return None;
        }
    };
    let login_timeout = crate::config::secs(app.config.server.client_login_timeout);
    let r = match crate::timer::timeout(login_timeout, login(&app, &mut stream, peer)).await {
        Err(_) => Err(SessionError::fatal_kind(
            crate::error::ErrorKind::LoginTimeout,
            sqlstate::PROTOCOL_VIOLATION,
            "client did not finish logging in within client_login_timeout",
        )),
        Ok(r) => r,
    };
    drop(logging_in);
    match r {
        Ok(Some(Outcome::Admin(user, access))) => {
            let (guard, _) = app.client_guard();
            Box::pin(crate::admin::serve(app.clone(), &mut stream, user, access)).await;
            drop(guard);
            None
        }
        Ok(Some(Outcome::Pool(done))) => {
            let (guard, clients) = app.client_guard();
            let max = app.config.server.max_client_conn;
            if clients > max {
                // Others logged in meanwhile.
                drop(guard);
                let e = SessionError::fatal(
                    sqlstate::TOO_MANY_CONNECTIONS,
                    format!("too many client connections: server.max_client_conn ({max}) reached"),
                );
                Box::pin(finish(id, &mut stream, Err(e))).await;
                return None;
            }
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

/// Where a login ends up.
pub(super) enum Outcome {
    Pool(Box<LoggedIn>),
    /// The admin console (a user allowed in by `[admin]`).
    Admin(String, crate::admin::Access),
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
}

async fn login(
    app: &Arc<App>,
    stream: &mut ClientStream,
    peer: Option<std::net::SocketAddr>,
) -> Result<Option<Outcome>, SessionError> {
    // Each phase is boxed so a login in flight holds only the state of its current phase:
    // in a connect storm thousands wait here at once, and what they leave behind in the
    // heap is what idle clients later pay for.
    let Some(startup) = Box::pin(handshake::negotiate(stream, app)).await? else {
        return Ok(None);
    };
    let minor = startup.minor;
    let req = StartupRequest::from_startup(startup).map_err(|e| {
        let code = match e {
            crate::params::ParamError::NoUser => sqlstate::INVALID_AUTHORIZATION,
            _ => sqlstate::PROTOCOL_VIOLATION,
        };
        SessionError::fatal(code, e.to_string())
    })?;
    // Sized for the usual reply (AuthenticationOk, a dozen ParameterStatus, BackendKeyData,
    // ReadyForQuery), so composing it does not reallocate.
    let mut out = BytesMut::with_capacity(1024);
    if minor > 0 || !req.unrecognized.is_empty() {
        let names: Vec<&str> = req.unrecognized.iter().map(String::as_str).collect();
        backend::negotiate_protocol_version(&mut out, 3 << 16, &names);
        stream.write_all(&out).await?;
    }
    // Logins accepted before shutdown began complete (the drain waits for them); only once
    // idle clients are being closed is it too late.
    if app.closing_clients.load(Ordering::Relaxed) {
        return Err(SessionError::fatal(
            sqlstate::CANNOT_CONNECT_NOW,
            "Shoal is shutting down",
        ));
    }
    let max = app.config.server.max_client_conn;
    if app.clients.load(Ordering::Relaxed) >= max {
        return Err(SessionError::fatal(
            sqlstate::TOO_MANY_CONNECTIONS,
            format!("too many client connections: server.max_client_conn ({max}) reached"),
        ));
    }
    let server_name = match &*stream {
        ClientStream::Tls(s) => crate::tls::server_name(s).map(str::to_owned),
        _ => None,
    };
    let addr = peer.map(|a| a.ip());
    let route = RouteRequest {
        user: &req.user,
        database: &req.database,
        server_name: server_name.as_deref(),
        reference: req.reference.as_deref(),
        addr,
    };
    let refused = |e: RouteError| SessionError::fatal(e.code(), e.to_string());
    if let Some(left) = addr.and_then(|a| app.login_failures.banned(a, &req.user)) {
        return Err(SessionError::fatal(
            sqlstate::INVALID_AUTHORIZATION,
            format!(
                "too many failed logins for this user from this address: try again in {} s",
                left.as_secs().max(1)
            ),
        ));
    }
    let routed = match app.routes.resolve(&route) {
        Ok(r) => r,
        Err(e) => {
            tracing::info!(user = %Escaped(&req.user), reason = %Escaped(&e), "login refused before authentication");
            if let (Some(a), RouteError::UnknownTenant(_)) = (addr, &e) {
                // Probing for tenant names is rate-limited like guessing passwords.
                let delay = app.login_failures.failed(a, &req.user);
                crate::timer::sleep(delay).await;
            }
            return Err(refused(e));
        }
    };
    let end_point = if stream.is_tls() {
        app.tls.end_point(server_name.as_deref())
    } else {
        None
    };
    // Who the user is: configured (config file or tenant), or found by the database's
    // auth_query.
    let database = routed.database();
    let mut found = routed
        .configured_user()
        .map(Cow::Borrowed)
        .ok_or_else(|| RouteError::UnknownUser(routed.user.clone()));
    if let (Err(_), Some(db)) = (&found, database) {
        if let (Some(aq), Some(auth_user)) = (&db.auth_query, routed.auth_user()) {
            let timeout = crate::config::secs(app.routes.config().pool.server_connect_timeout);
            // Boxed: the lookup may open a server connection, a large future that every
            // login would otherwise carry (and copy) while only auth_query users need it.
            match Box::pin(app.secrets.user(&auth_user, timeout, db, aq, &routed.user)).await {
                Ok(Some(user)) => found = Ok(Cow::Owned(user)),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(database = %db.name, error = %Escaped(&e), "auth_query failed");
                    return Err(SessionError::fatal(
                        sqlstate::CONNECTION_FAILURE,
                        format!(
                            "cannot look up the user: the auth_query of database \"{}\" failed",
                            db.name
                        ),
                    ));
                }
            }
        }
    }
    // TLS requirement: the user's, else the database's (a tenant's `enforce_ssl`), else
    // `[tls] client_tls` — checked before any password is exchanged.
    let db_tls = database.and_then(|d| d.client_tls);
    let tls_mode = found
        .as_ref()
        .ok()
        .and_then(|u| u.client_tls)
        .or(db_tls)
        .unwrap_or(app.tls.mode);
    if tls_mode == crate::config::ClientTls::Require && !stream.is_tls() {
        return Err(SessionError::fatal(
            sqlstate::INVALID_AUTHORIZATION,
            "TLS is required: connect with sslmode=require (or stricter)",
        ));
    }
    let result = match found {
        Ok(mut user) => {
            // What authentication ends with (AuthenticationOk) waits in `out` to go out with
            // the session's parameters: one write, one wake-up of the client, fewer.
            out.clear();
            let r = Box::pin(auth::authenticate(
                stream,
                &user,
                end_point.as_deref(),
                &mut out,
            ))
            .await;
            match r {
                Ok(client_key) => {
                    // A user from auth_query logs in upstream with its secret (passthrough).
                    if user.server_password.is_none() && user.passthrough.is_none() {
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
                    }
                    Ok(user)
                }
                Err(e) => {
                    if let Some(d) = database.filter(|d| d.auth_query.is_some()) {
                        // The password may have changed in PostgreSQL: look again next time.
                        app.secrets.forget(&d.name, &routed.user);
                    }
                    Err(e)
                }
            }
        }
        Err(e) => {
            // Answered like a wrong password (no probing which users exist); the log says why.
            tracing::info!(user = %Escaped(&req.user), reason = %Escaped(&e), "login refused");
            let seed = app.unknown_user_seed(&req.user);
            Err(Box::pin(auth::refuse_unknown(stream, &routed.user, &seed)).await)
        }
    };
    let user = match result {
        Ok(user) => {
            if let Some(a) = addr {
                app.login_failures.succeeded(a, &req.user);
            }
            user
        }
        Err(e) => {
            if let (Some(a), true) = (addr, e.kind() == crate::error::ErrorKind::Auth) {
                let delay = app.login_failures.failed(a, &req.user);
                crate::timer::sleep(delay).await;
            }
            return Err(e);
        }
    };
    if routed.tenant().is_none()
        && crate::admin::is_console(&req.database)
        && routed.database().is_none()
    {
        let Some(access) = crate::admin::access(app, &user.name) else {
            return Err(SessionError::fatal(
                sqlstate::INVALID_AUTHORIZATION,
                format!(
                    "user \"{}\" may not use the admin console (not in [admin] users or stats_users)",
                    user.name
                ),
            ));
        };
        for (k, v) in crate::admin::PARAMS {
            backend::parameter_status(&mut out, k, v);
        }
        backend::backend_key_data(&mut out, rand::random::<i32>() & i32::MAX, rand::random());
        backend::ready_for_query(&mut out, b'I');
        stream.write_all(&out).await?;
        return Ok(Some(Outcome::Admin(user.name.clone(), access)));
    }
    let pool = app.routes.pool(&routed, &user).map_err(refused)?;
    // Not needed past here: dropped now, they take no room in this future across the
    // awaits below.
    drop(user);
    drop(routed);
    let per_pool = pool.settings.max_client_conn;
    let n = pool.stats.clients.fetch_add(1, Ordering::Relaxed) + 1;
    let pool_client = PoolClient(pool.clone());
    if per_pool > 0 && n > per_pool {
        return Err(SessionError::fatal(
            sqlstate::TOO_MANY_CONNECTIONS,
            format!(
                "too many client connections for pool \"{}\": max_client_conn ({per_pool}) reached",
                pool.name
            ),
        ));
    }
    let session_mode = pool.settings.mode == PoolMode::Session;
    let mut lease = None;
    let reported = match pool.login_params(&req.params) {
        Some(known) if !session_mode => known,
        _ => {
            let mut l = Box::pin(pool.checkout()).await.map_err(|e| {
                let c = ClientError::checkout(&e);
                tracing::warn!(pool = %pool.name, kind = c.kind.label(), detail = %Escaped(&c.detail), "no server for a login");
                SessionError::fatal(c.code, c.message)
            })?;
            // Boxed, as the checkout: only a login with parameters not seen before gets here.
            Box::pin(l.prepare_for(0, &req.params, None, &pool.settings))
                .await
                .map_err(|e| match e {
                    // PostgreSQL's own verdict on the client's startup parameters.
                    ServerError::Db(f) => SessionError::fatal(known_code(&f.code), f.message),
                    e => {
                        let c = ClientError::server(&pool.name, &e, "preparing it for a client");
                        SessionError::fatal(c.code, c.message)
                    }
                })?;
            let p = pool.remember_login_params(&req.params, &l.params);
            if session_mode {
                lease = Some(l);
            } else {
                l.checkin();
            }
            p
        }
    };
    let cancel = app.cancels.register(
        lease.as_ref().map(|l: &Lease| l.process_id),
        crate::cancel::ClientInfo {
            pool: Arc::downgrade(&pool),
            addr: peer.map(Into::into),
            since_ms: crate::clock::now_ms(),
        },
    );
    for (k, v) in reported.iter() {
        backend::parameter_status(&mut out, k, v);
    }
    backend::backend_key_data(&mut out, cancel.process_id(), cancel.secret_key());
    backend::ready_for_query(&mut out, b'I');
    stream.write_all(&out).await?;
    drop(pool);
    Ok(Some(Outcome::Pool(Box::new(LoggedIn {
        pool: pool_client,
        params: req.params,
        cancel,
        lease,
        peer,
    }))))
}

/// Counts a logged-in client against its pool for as long as it lives.
pub(super) struct PoolClient(pub(super) Arc<Pool>);

impl std::ops::Deref for PoolClient {
    type Target = Arc<Pool>;
    fn deref(&self) -> &Arc<Pool> {
        &self.0
    }
}

impl Drop for PoolClient {
    fn drop(&mut self) {
        if self.0.stats.clients.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.0
                .unused_since
                .store(crate::clock::now_ms(), Ordering::Relaxed);
        }
    }
}
