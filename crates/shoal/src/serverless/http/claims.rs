//! Bearer tokens on HTTP queries (the driver's `authToken`), as PostgREST and Supabase use
//! them: the token is checked with the tenant's own keys (its `jwt_secret` or `jwt_jwks`,
//! the ones Realtime checks its clients' tokens with), and the query runs in a transaction
//! that first sets `role` to the token's `role` and `request.jwt.claims` to its claims, both
//! transaction-local. Row-level security policies then decide what the query sees, and the
//! server's session is as clean afterwards as before (the session may be kept for others).
//!
//! The connection string's user still logs in with its password: a token can only narrow
//! what that user may do (to a role it is a member of), never widen it.

use std::net::IpAddr;

use shoal_realtime::jwt::{JwtError, Verifier};

use super::request::{Login, Statement};
use crate::app::App;
use crate::route::{RouteError, RouteRequest};

/// What sets a token's role and claims for the rest of the transaction.
const SET_CLAIMS: &str =
    "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)";

#[derive(Debug, thiserror::Error)]
pub enum ClaimsError {
    /// The login goes nowhere (the login would be refused the same way).
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error("a bearer token (the driver's authToken) is checked with its tenant's jwt_secret or jwt_jwks, and {0}: leave authToken out, or give the tenant a jwt_secret or jwt_jwks")]
    NoKeys(String),
    #[error("the bearer token is refused: {0}")]
    Token(#[from] JwtError),
}

impl ClaimsError {
    /// The SQLSTATE the answer carries.
    pub fn code(&self) -> &'static str {
        match self {
            ClaimsError::Route(e) => e.code(),
            ClaimsError::NoKeys(_) => shoal_wire::sqlstate::INVALID_AUTHORIZATION,
            ClaimsError::Token(_) => shoal_wire::sqlstate::INVALID_AUTHORIZATION,
        }
    }
}

/// The statement that puts `token`'s claims in force, once its tenant's keys vouch for it.
pub fn check(
    app: &App,
    login: &Login,
    addr: IpAddr,
    token: &str,
) -> Result<Statement, ClaimsError> {
    let routed = app.routes.resolve(&RouteRequest {
        user: &login.user,
        database: &login.database,
        server_name: None,
        reference: None,
        addr: Some(addr),
    })?;
    let Some(route) = routed.tenant() else {
        return Err(ClaimsError::NoKeys(
            "this login reaches a database of the configuration file, not a tenant".into(),
        ));
    };
    let t = &route.tenant;
    let verifier = Verifier::new(t.jwt_secret.as_deref(), t.jwt_jwks.as_ref());
    if verifier.is_empty() {
        return Err(ClaimsError::NoKeys(format!(
            "tenant \"{}\" has neither",
            route.id()
        )));
    }
    let claims = verifier.verify(token, shoal_realtime::jwt::now())?;
    Ok(Statement {
        text: SET_CLAIMS.into(),
        params: vec![Some(claims.role), Some(claims.all.to_string())],
    })
}
