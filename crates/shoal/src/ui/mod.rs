//! The web dashboard's server side, on the API listener under `/ui` (issue 37, first
//! slice): logging in with the API's token or JWT opens a session kept in a cookie
//! ([`session`]), and `/ui/feed` serves what the pooler does, second by second, for the
//! last fifteen minutes ([`feed`]). Nothing is served without a session.
// The HTTP endpoints run on the main runtime, as the API's.
#![allow(clippy::disallowed_methods)]

use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::api::auth::ApiAuth;
use crate::app::App;

pub mod feed;
pub mod session;

/// How long a session lasts.
const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

struct Ui {
    app: Arc<App>,
    auth: Arc<ApiAuth>,
    sessions: session::Sessions,
    history: feed::History,
}

/// The dashboard's routes; its sampler runs (on the control runtime) while they exist.
pub fn router(app: Arc<App>, auth: Arc<ApiAuth>) -> Router {
    let ui = Arc::new(Ui {
        app,
        auth,
        sessions: session::Sessions::new(SESSION_TTL),
        history: feed::History::default(),
    });
    crate::control::spawn(sample(Arc::downgrade(&ui)));
    Router::new()
        .route("/ui/login", post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/feed", get(feed))
        .with_state(ui)
}

/// Takes the pooler's measure every second.
async fn sample(ui: Weak<Ui>) {
    let mut tick = crate::timer::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Some(ui) = ui.upgrade() else { return };
        let (totals, gauges) = measure(&ui.app);
        ui.history.record(totals, gauges);
    }
}

/// The pooler's running totals and gauges now, summed over its pools (replicas' too).
fn measure(app: &App) -> (feed::Totals, feed::Gauges) {
    use std::sync::atomic::Ordering::Relaxed;
    let pools = crate::replicas::status::with_replica_pools(app.routes.pools());
    let mut t = feed::Totals {
        at: crate::clock::now_ms(),
        ..feed::Totals::default()
    };
    let mut g = feed::Gauges {
        pools: pools.len(),
        ..feed::Gauges::default()
    };
    let add = |into: &mut Vec<(f64, u64)>, from: Vec<(f64, u64)>| {
        if into.is_empty() {
            *into = from;
        } else {
            for (a, b) in into.iter_mut().zip(from) {
                a.1 += b.1;
            }
        }
    };
    for p in &pools {
        let clients = p.stats.clients.load(Relaxed);
        let waiting = p.stats.waiting.load(Relaxed);
        let active = p.in_use();
        g.clients_active += active;
        g.clients_waiting += waiting;
        g.clients_idle += clients.saturating_sub(active + waiting);
        g.servers_active += active;
        g.servers_idle += p.idle_count();
        t.transactions += p.metrics.transaction.snapshot().1;
        t.queries += p.metrics.queries.load(Relaxed);
        t.errors += p
            .metrics
            .errors
            .iter()
            .map(|e| e.load(Relaxed))
            .sum::<u64>();
        add(&mut t.wait, p.metrics.wait.snapshot().2);
        add(&mut t.query, p.metrics.query.snapshot().2);
    }
    (t, g)
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

/// `POST /ui/login` with `{"token": "..."}`: the API's token or a JWT it accepts opens a
/// session (`204` and its cookie); anything else is `401`.
async fn login(State(ui): State<Arc<Ui>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Login {
        token: String,
    }
    let Ok(l) = serde_json::from_slice::<Login>(&body) else {
        return refuse(StatusCode::BAD_REQUEST, "send {\"token\": \"...\"}");
    };
    if !ui.auth.allows(Some(&format!("Bearer {}", l.token.trim()))) {
        return refuse(
            StatusCode::UNAUTHORIZED,
            "that is neither the API's token nor a JWT it accepts",
        );
    }
    let id = ui.sessions.open();
    (
        StatusCode::NO_CONTENT,
        [(header::SET_COOKIE, ui.sessions.cookie(&id))],
    )
        .into_response()
}

/// `POST /ui/logout`: the session ends and its cookie is expired.
async fn logout(State(ui): State<Arc<Ui>>, headers: HeaderMap) -> Response {
    if let Some(id) = session::from_headers(&headers) {
        ui.sessions.close(id);
    }
    (
        StatusCode::NO_CONTENT,
        [(header::SET_COOKIE, ui.sessions.cookie(""))],
    )
        .into_response()
}

#[derive(serde::Deserialize)]
struct Since {
    #[serde(default)]
    since: u64,
}

/// `GET /ui/feed[?since=MS]`: the samples after `since` (all fifteen minutes without it).
async fn feed(State(ui): State<Arc<Ui>>, headers: HeaderMap, Query(q): Query<Since>) -> Response {
    if !session::from_headers(&headers).is_some_and(|id| ui.sessions.valid(id)) {
        return refuse(StatusCode::UNAUTHORIZED, "log in first (POST /ui/login)");
    }
    Json(json!({ "samples": ui.history.since(q.since) })).into_response()
}
