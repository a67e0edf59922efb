//! Where a logged-in client goes (a pool this node serves, a relay to the node that owns
//! the pool, or the admin console) and how it enters its pool: its limits, its settings
//! checked against the pool's, and the values reported to it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use shoal_wire::backend;
use shoal_wire::sqlstate;

use super::login::{refused, LoggedIn, Outcome, Relayed, Request};
use super::SessionError;
use crate::app::App;
use crate::config::{PoolMode, User};
use crate::error::ErrorKind;
use crate::error::{known_code, ClientError};
use crate::logsafe::Escaped;
use crate::net::Stream;
use crate::pool::{Lease, Pool, ServerWait};
use crate::route::Routed;
use crate::seam::Features as _;
use crate::server::ServerError;
use crate::Plugged;

/// Where an authenticated client goes.
pub(super) enum Destination {
    Admin(String, crate::admin::Access),
    Pool(Arc<Pool>),
    /// The pool's owner is another node (boxed: rare, and large).
    Relay(Box<(Arc<Pool>, String, crate::cluster::open::RelayOpen)>),
}

/// In a cluster: the pool here, if this node owns it, or a relay to the node that does.
pub(super) async fn placed(
    node: &Arc<crate::cluster::Node>,
    req: &Request,
    pool: Arc<Pool>,
    user: &User,
) -> Result<Destination, SessionError> {
    let place = node.place(&pool, false).await.map_err(|e| {
        SessionError::fatal(
            ErrorKind::NodeLost,
            sqlstate::CONNECTION_FAILURE,
            e.to_string(),
        )
    })?;
    let to = match place {
        crate::cluster::Place::Here => return Ok(Destination::Pool(pool)),
        crate::cluster::Place::There(to) => to,
    };
    let client_key = match user.passthrough.as_deref() {
        Some(crate::config::Passthrough::Scram { client_key, .. }) => Some(*client_key),
        _ => None,
    };
    let open = crate::cluster::open::RelayOpen {
        pool: pool.name.clone(),
        user: req.startup.user.clone(),
        database: req.startup.database.clone(),
        params: req.startup.params.clone(),
        reference: req.startup.reference.clone(),
        target: req.startup.target,
        server_name: req.server_name.clone(),
        peer: req.peer,
        client_key,
        resume: None,
    };
    Ok(Destination::Relay(Box::new((pool, to, open))))
}

/// PgBouncer's peer login to its console: over the Unix socket, a client running as the
/// same OS user as Shoal (who could read its configuration and signal it anyway) reaches
/// the admin console under any user name that is not configured, without a password.
pub(super) fn console_peer(stream: &Stream, req: &Request, routed: &Routed) -> bool {
    let Stream::Unix(s) = stream else {
        return false;
    };
    routed.tenant().is_none()
        && crate::admin::is_console(&req.startup.database)
        && routed.database().is_none()
        && routed.configured_user().is_none()
        && s.peer_cred()
            .is_ok_and(|c| c.uid() == nix::unistd::geteuid().as_raw())
}

pub(super) fn destination(
    app: &App,
    req: &Request,
    routed: &Routed,
    user: &User,
    peer_admin: bool,
) -> Result<Destination, SessionError> {
    if routed.tenant().is_none()
        && crate::admin::is_console(&req.startup.database)
        && routed.database().is_none()
    {
        let access = crate::admin::access(app, &user.name)
            .or(peer_admin.then_some(crate::admin::Access::Admin));
        return match access {
            Some(access) => Ok(Destination::Admin(user.name.clone(), access)),
            None => Err(SessionError::fatal(
                ErrorKind::Routing,
                sqlstate::INVALID_AUTHORIZATION,
                format!(
                    "user \"{}\" may not use the admin console (not in [admin] users or stats_users)",
                    user.name
                ),
            )),
        };
    }
    let pool = app.routes.pool(routed, user).map_err(refused)?;
    Ok(Destination::Pool(pool))
}

/// Ends the login at its destination, with the reply that tells the client it is in.
pub(super) async fn enter(
    app: &Arc<App>,
    stream: &mut Stream,
    req: &mut Request,
    to: Destination,
) -> Result<Outcome, SessionError> {
    match to {
        Destination::Admin(user, access) => {
            let out = &mut req.out;
            for (k, v) in crate::admin::PARAMS {
                backend::parameter_status(out, k, v);
            }
            backend::backend_key_data(out, rand::random::<i32>() & i32::MAX, rand::random());
            backend::ready_for_query(out, b'I');
            stream.write_all(out).await?;
            Ok(Outcome::Admin(user, access))
        }
        Destination::Pool(pool) => enter_pool(app, stream, req, pool).await.map(Outcome::Pool),
        Destination::Relay(relay) => {
            let (pool, to, open) = *relay;
            pool.stats.clients.fetch_add(1, Ordering::Relaxed);
            Ok(Outcome::Relay(Box::new(Relayed {
                pool: PoolClient(pool),
                open: Box::new(crate::cluster::open::HeldOpen::new(&open)),
                opening: Some(Box::new(crate::cluster::pipe::Opening {
                    to,
                    greeting: std::mem::take(&mut req.out),
                })),
            })))
        }
    }
}

/// Joins the pool: its client limit, the ParameterStatus values to report (known for these
/// startup parameters, or learned from a server prepared for them), the cancel key, and the
/// reply that ends the login.
pub(super) async fn enter_pool(
    app: &Arc<App>,
    stream: &mut Stream,
    req: &mut Request,
    pool: Arc<Pool>,
) -> Result<Box<LoggedIn>, SessionError> {
    let per_pool = pool.settings.max_client_conn;
    let n = pool.stats.clients.fetch_add(1, Ordering::Relaxed) + 1;
    let pool_client = PoolClient(pool.clone());
    rules_allow_mode(&pool)?;
    cap_statement_timeout(&pool, &mut req.startup.params);
    let pool_client = if per_pool > 0 && n > per_pool {
        Box::pin(over_pool_max(app, pool_client)).await?
    } else {
        pool_client
    };
    // A session-mode client keeps one server: a replica's for a client whose reads all go
    // to replicas, the promoted replica's after a failover.
    let server_pool = match Plugged::replicas(&pool) {
        Some(_) if pool.settings.mode == PoolMode::Session => {
            Box::pin(super::reads::session_backend(&pool, req.startup.target)).await?
        }
        _ => pool.clone(),
    };
    let (reported, lease) = reported_params(&pool, &server_pool, &req.startup.params).await?;
    let cancel = app.cancels.register(
        lease.as_ref().map(|l: &Lease| l.process_id),
        crate::cancel::ClientInfo {
            pool: Arc::downgrade(&pool),
            addr: req.peer.map(Into::into),
            since_ms: crate::clock::now_ms(),
        },
    );
    let out = &mut req.out;
    for (k, v) in reported.iter() {
        backend::parameter_status(out, k, v);
    }
    backend::backend_key_data(out, cancel.process_id(), cancel.secret_key());
    backend::ready_for_query(out, b'I');
    stream.write_all(out).await?;
    drop(pool);
    let reported_value = |name: &str| {
        reported
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let encoding = shoal_wire::sql::ClientEncoding::of_session(
        reported_value("client_encoding"),
        reported_value("server_encoding"),
    );
    Ok(Box::new(LoggedIn {
        encoding,
        pool: pool_client,
        params: std::mem::take(&mut req.startup.params),
        cancel,
        lease,
        peer: req.peer,
        target: req.startup.target,
    }))
}

/// How a client's text is read as its startup parameters say (UTF8 when they say nothing).
pub(super) fn startup_encoding(params: &[(String, String)]) -> shoal_wire::sql::ClientEncoding {
    let startup = params.iter().find(|(k, _)| k == "client_encoding");
    shoal_wire::sql::ClientEncoding::of_session(startup.map(|(_, v)| v.as_str()), None)
}

/// Holds a client's startup `statement_timeout` to its pool's `max_statement_timeout`: a
/// value above it (or 0, none at all) becomes the cap. (Not inlined: it would grow every
/// login's future.)
#[inline(never)]
fn cap_statement_timeout(pool: &Pool, params: &mut [(String, String)]) {
    let Some(cap) = pool.settings.statement_timeout else {
        return;
    };
    let cap_ms = cap.as_millis().max(1) as f64;
    for (k, v) in params.iter_mut() {
        if k == "statement_timeout" {
            let asked = crate::params::pg_duration_ms(v).unwrap_or(0.0);
            if asked <= 0.0 || asked > cap_ms {
                *v = format!("{}", cap_ms as u64);
            }
        }
    }
}

/// Refuses a session-mode pool with query rules: rules are enforced where Shoal follows each
/// statement's replies, in transaction mode. (Not inlined: it would grow every login's
/// future.)
#[inline(never)]
fn rules_allow_mode(pool: &Pool) -> Result<(), SessionError> {
    if pool.settings.mode != PoolMode::Session || Plugged::rules(pool).is_none() {
        return Ok(());
    }
    Err(SessionError::fatal(
        ErrorKind::Routing,
        sqlstate::FEATURE_NOT_SUPPORTED,
        format!(
            "pool \"{}\" has query rules, which are enforced in transaction mode only: set pool_mode = \"transaction\" for it",
            pool.name
        ),
    ))
}

/// The ParameterStatus values a login with these startup parameters reports, and in session
/// mode the client's server (prepared for them).
async fn reported_params(
    pool: &Arc<Pool>,
    server_pool: &Arc<Pool>,
    params: &[(String, String)],
) -> Result<(crate::params::SharedParams, Option<Lease>), SessionError> {
    let session_mode = pool.settings.mode == PoolMode::Session;
    // One login at a time learns what a server reports for parameters not seen before; the
    // others wait for its answer instead of each taking a server (in a connect storm the
    // first thousand logins would otherwise hold the whole pool).
    let _learning = if session_mode {
        None
    } else {
        if let Some(known) = pool.login_params(params) {
            return Ok((known, None));
        }
        let learning = pool.learning_login_params.lock().await;
        // Learned while this login waited.
        if let Some(known) = pool.login_params(params) {
            return Ok((known, None));
        }
        Some(learning)
    };
    // Boxed: only a login with parameters not seen before gets here.
    let l = Box::pin(server_pool.prepared_server(0, params, None, &crate::pool::NoCancel))
        .await
        .map_err(|e| match e {
            // PostgreSQL's own verdict on the client's startup parameters.
            ServerWait::Prepare(ServerError::Db(f)) => {
                SessionError::fatal(ErrorKind::ServerRefused, known_code(&f.code), f.message)
            }
            e => {
                let c = ClientError::wait(&pool.name, &e);
                tracing::warn!(pool = %pool.name, kind = c.kind.label(), detail = %Escaped(&c.detail), "no server for a login");
                SessionError::fatal(c.kind, c.code, c.message)
            }
        })?;
    let p = pool.remember_login_params(params, &l.params);
    if session_mode {
        return Ok((p, Some(l)));
    }
    l.checkin();
    Ok((p, None))
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

/// [`enter_pool`] past the pool's `max_client_conn`: room made by ending the sessions
/// Shoal keeps on its own account, or the refusal. (Boxed apart: a rare path that would
/// grow every login's future.)
pub(super) async fn over_pool_max(
    app: &App,
    client: PoolClient,
) -> Result<PoolClient, SessionError> {
    let max = client.settings.max_client_conn;
    if app
        .admission
        .make_room(|| client.stats.clients.load(Ordering::Relaxed) > max)
        .await
    {
        return Ok(client);
    }
    Err(SessionError::fatal(
        ErrorKind::ClientLimit,
        sqlstate::TOO_MANY_CONNECTIONS,
        format!(
            "too many client connections for pool \"{}\": max_client_conn ({max}) reached",
            client.name
        ),
    ))
}
