//! HTTP queries (`POST /sql`), as Neon's driver sends them from `neon()` and
//! `sql.transaction()`: the connection string in `Neon-Connection-String`, the statement (or
//! a batch) in a JSON body, the answer in Neon's JSON. Each request logs in as a client of
//! its own (see `exchange`), so tenants, passwords, limits, rules and the cache are a TCP
//! client's, and a one-shot query holds a server only for its transaction. Passwords
//! checked lately are remembered (see `PasswordMemo`), so a query does not pay PBKDF2.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use shoal_wire::sqlstate;

use super::listener::Peer;
use super::Door;
use crate::net::Stream;

mod claims;
mod exchange;
mod request;
mod results;
mod values;
mod warm;

pub use warm::Warm;

use exchange::{Exchange, Failure};
use request::{RequestError, Shape, Work};

pub use crate::metrics::HTTP_STATUSES as STATUSES;

pub async fn query(
    State(door): State<Arc<Door>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let response = answer(&door, peer, &headers, body).await;
    door.app.metrics.serverless.http(response.status().as_u16());
    response
}

async fn answer(door: &Arc<Door>, peer: Peer, headers: &HeaderMap, body: Body) -> Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    // The body is read first, even for a request refused for its headers: the connection
    // then stays usable for the client's next request (keep-alive).
    let limit = door.max_request;
    let declared = header(header::CONTENT_LENGTH.as_str()).and_then(|l| l.parse::<usize>().ok());
    if declared.is_some_and(|l| l > limit) {
        return too_large(limit);
    }
    let body = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(_) => return too_large(limit),
    };
    let read = || -> Result<_, RequestError> {
        let token = request::bearer(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()))?;
        let login = request::login(
            header("neon-connection-string").ok_or(RequestError::NoConnectionString)?,
        )?;
        let shape = Shape {
            array_mode: request::flag("Neon-Array-Mode", header("neon-array-mode"))?,
            raw_text: request::flag("Neon-Raw-Text-Output", header("neon-raw-text-output"))?,
        };
        let begin = request::begin(
            header("neon-batch-isolation-level"),
            header("neon-batch-read-only"),
            header("neon-batch-deferrable"),
        )?;
        let work = request::work(&body, begin)?;
        Ok((login, shape, work, token))
    };
    let (login, shape, work, token) = match read() {
        Ok(x) => x,
        Err(e) => return error(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let claims = match token.map(|t| claims::check(&door.app, &login, peer.addr.ip(), t)) {
        None => None,
        Some(Ok(statement)) => Some(statement),
        Some(Err(e)) => {
            let code = e.code();
            let body = serde_json::json!({"message": e.to_string(), "code": code});
            return (status_for(code, true), json_headers(), body.to_string()).into_response();
        }
    };
    drop(body);
    run(door, peer, &login, (&work, claims.as_ref()), shape).await
}

/// Runs the request (its statements, after its token's claims if it has one) on a kept
/// session for its connection string, or logs in on a fresh one; answers; past the request
/// timeout, cancels.
async fn run(
    door: &Arc<Door>,
    peer: Peer,
    login: &request::Login,
    (work, claims): (&Work, Option<&request::Statement>),
    shape: Shape,
) -> Response {
    let key = door.warm.key(login);
    let timeout = Duration::from_secs_f64(door.request_timeout);
    let max_message = door.max_response.saturating_add(1024);
    let fresh = || {
        let pipe = door.start_session(|theirs| Stream::Http(Box::new(theirs), peer.tls), peer.addr);
        Exchange::new(pipe, max_message)
    };
    let (mut ex, mut logged_in) = match door.warm.take(&key) {
        Some(ex) => (ex, true),
        None => (fresh(), false),
    };
    let outcome = crate::timer::timeout(timeout, async {
        loop {
            if !logged_in {
                ex.login(login).await?;
            }
            match ex.run(work, claims, shape, door.max_response).await {
                // A kept session ended meanwhile, before reading anything: nothing ran.
                Err(Failure::Closed) if logged_in => {
                    ex = fresh();
                    logged_in = false;
                }
                r => return r,
            }
        }
    })
    .await;
    let cancel = |ex: &Exchange| {
        let key = ex.key;
        let app = door.app.clone();
        async move {
            if let Some((pid, secret)) = key {
                app.cancels.cancel(pid, secret).await;
            }
        }
    };
    // Done with the session: kept for the next query if it is as a fresh login's.
    let done = |ex: Exchange| async {
        if work.leaves_session_clean() {
            door.warm.put(key, ex).await;
        } else {
            ex.terminate().await;
        }
    };
    match outcome {
        Ok(Ok(json)) => {
            done(ex).await;
            (StatusCode::OK, json_headers(), json).into_response()
        }
        Ok(Err(Failure::Login { code, error })) => {
            // The session ends itself after a refused login.
            (status_for(&code, true), json_headers(), error).into_response()
        }
        Ok(Err(Failure::Statement { code, error })) => {
            done(ex).await;
            (status_for(&code, false), json_headers(), error).into_response()
        }
        Ok(Err(Failure::TooLarge(limit))) => {
            // The statement may still be sending rows: stop it, then leave.
            cancel(&ex).await;
            error(
                StatusCode::INSUFFICIENT_STORAGE,
                &format!(
                    "the answer would exceed [serverless] max_response_size ({limit} bytes): ask for fewer rows"
                ),
            )
        }
        Ok(Err(Failure::Session(why))) => {
            tracing::warn!(peer = %peer.addr, why, "serverless HTTP query: the session failed");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("the query could not be run: {why}"),
            )
        }
        Ok(Err(Failure::Closed)) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the query could not be run: its session ended before reading it",
        ),
        Err(_) => {
            cancel(&ex).await;
            let (status, message) = (
                StatusCode::GATEWAY_TIMEOUT,
                format!(
                    "the query ran past [serverless] request_timeout ({}s) and was cancelled",
                    door.request_timeout
                ),
            );
            let body = serde_json::json!({"message": message, "code": sqlstate::QUERY_CANCELED});
            (status, json_headers(), body.to_string()).into_response()
        }
    }
}

/// The HTTP status of an error PostgreSQL (or Shoal's login) answered with `code`. A
/// statement's own errors are 400, as Neon answers them (the driver reads their fields
/// only then); refusals by the front door say what they are.
fn status_for(code: &str, login: bool) -> StatusCode {
    match code {
        sqlstate::TOO_MANY_CONNECTIONS | sqlstate::CONFIGURATION_LIMIT_EXCEEDED => {
            StatusCode::TOO_MANY_REQUESTS
        }
        sqlstate::INVALID_PASSWORD | sqlstate::INVALID_AUTHORIZATION if login => {
            StatusCode::UNAUTHORIZED
        }
        sqlstate::INVALID_CATALOG_NAME if login => StatusCode::NOT_FOUND,
        sqlstate::CONNECTION_REJECTED if login => StatusCode::FORBIDDEN,
        sqlstate::CANNOT_CONNECT_NOW
        | sqlstate::ADMIN_SHUTDOWN
        | sqlstate::CONNECTION_FAILURE
        | sqlstate::CONNECTION_EXCEPTION => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::BAD_REQUEST,
    }
}

fn json_headers() -> [(header::HeaderName, &'static str); 1] {
    [(header::CONTENT_TYPE, "application/json")]
}

fn error(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({ "message": message });
    (status, json_headers(), body.to_string()).into_response()
}

fn too_large(limit: usize) -> Response {
    error(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("the request body exceeds [serverless] max_request_size ({limit} bytes)"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(status_for("28P01", true), StatusCode::UNAUTHORIZED);
        assert_eq!(status_for("3D000", true), StatusCode::NOT_FOUND);
        // A statement naming a database that does not exist is the statement's error.
        assert_eq!(status_for("3D000", false), StatusCode::BAD_REQUEST);
        assert_eq!(status_for("53300", true), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(status_for("42601", false), StatusCode::BAD_REQUEST);
        assert_eq!(status_for("57P01", false), StatusCode::SERVICE_UNAVAILABLE);
        for s in [
            status_for("28P01", true),
            status_for("08004", true),
            status_for("08006", false),
            StatusCode::INSUFFICIENT_STORAGE,
            StatusCode::GATEWAY_TIMEOUT,
            StatusCode::PAYLOAD_TOO_LARGE,
        ] {
            assert!(STATUSES.contains(&s.as_u16()), "{s} is counted");
        }
    }
}
