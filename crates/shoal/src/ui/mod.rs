//! The web dashboard, served on the API listener under `/ui` and embedded in the binary
//! ([`assets`]): a login with the API's token or JWT opens a session kept in a cookie
//! ([`session`]); with it, `/ui/feed` serves what the pooler does second by second for the
//! last fifteen minutes ([`feed`]), `/ui/api/pools` a page of pools ([`pools`]),
//! `/ui/api/sections` the optional features ([`sections`]), and `/ui/api/tenants…` the
//! management API's tenant routes (the same handlers). No data is served without a session.
// The HTTP endpoints run on the main runtime, as the API's.
#![allow(clippy::disallowed_methods)]

use std::sync::{Arc, Weak};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::api::auth::ApiAuth;
use crate::api::Gate;
use crate::app::App;
use crate::tenant::service::TenantService;

mod assets;
pub mod feed;
pub mod pools;
pub mod sections;
pub mod session;

/// How long a session lasts.
const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

struct Ui {
    app: Arc<App>,
    auth: Arc<ApiAuth>,
    sessions: Arc<session::Sessions>,
    history: feed::History,
    sparks: pools::Sparks,
    realtime: sections::RealtimeRates,
}

/// The dashboard's routes; its sampler runs (on the control runtime) while they exist.
pub fn router(app: Arc<App>, service: Arc<TenantService>, auth: Arc<ApiAuth>) -> Router {
    let sessions = Arc::new(session::Sessions::new(SESSION_TTL));
    let ui = Arc::new(Ui {
        app,
        auth,
        sessions: sessions.clone(),
        history: feed::History::default(),
        sparks: pools::Sparks::default(),
        realtime: sections::RealtimeRates::default(),
    });
    crate::control::spawn(sample(Arc::downgrade(&ui)));
    Router::new()
        .route("/ui", get(assets::page))
        .route("/ui/", get(assets::page))
        .route("/ui/assets/{file}", get(assets::file))
        .route("/ui/login", post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/feed", get(feed))
        .route("/ui/api/sections", get(sections))
        .route("/ui/api/pools", get(pools))
        .route("/ui/api/pool", get(pool))
        .with_state(ui)
        .merge(crate::api::tenant_routes("/ui/api", service, sessions))
}

/// Takes the pooler's measure every second.
async fn sample(ui: Weak<Ui>) {
    let mut tick = crate::timer::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Some(ui) = ui.upgrade() else { return };
        let (totals, gauges) = measure(&ui.app);
        let at = totals.at;
        ui.history.record(totals, gauges);
        let pools = pools::all(&ui.app);
        ui.sparks.record(
            at,
            pools
                .iter()
                .map(|p| (p.name.clone(), p.metrics.transaction.snapshot().1)),
        );
        ui.realtime
            .record(at, sections::realtime_totals(&ui.app).into_iter());
    }
}

/// The pooler's running totals and gauges now, summed over its pools (replicas' too).
fn measure(app: &App) -> (feed::Totals, feed::Gauges) {
    use std::sync::atomic::Ordering::Relaxed;
    let pools = crate::features::with_replica_pools(app.routes.pools());
    let mut t = feed::Totals {
        at: crate::clock::epoch_ms(),
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
        if t.error_classes.is_empty() {
            t.error_classes = vec![0; p.metrics.errors.len()];
        }
        for (sum, e) in t.error_classes.iter_mut().zip(&p.metrics.errors) {
            let n = e.load(Relaxed);
            *sum += n;
            t.errors += n;
        }
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
async fn login(State(ui): State<Arc<Ui>>, headers: HeaderMap, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Login {
        token: String,
    }
    if !session::same_origin(&headers) {
        return refuse(
            StatusCode::FORBIDDEN,
            "log in from the dashboard's own page",
        );
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
        [(
            header::SET_COOKIE,
            ui.sessions.cookie(&id, session::over_https(&headers)),
        )],
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
        [(
            header::SET_COOKIE,
            ui.sessions.cookie("", session::over_https(&headers)),
        )],
    )
        .into_response()
}

/// A request without a session (or from another site's page) gets `401` (`403`).
fn guard(ui: &Ui, headers: &HeaderMap) -> Result<(), Box<Response>> {
    ui.sessions
        .admits(headers, crate::api::Access::Read)
        .map_err(|why| {
            let status = if session::same_origin(headers) {
                StatusCode::UNAUTHORIZED
            } else {
                StatusCode::FORBIDDEN
            };
            Box::new(refuse(status, why))
        })
}

/// A guarded request's query string, or the answer refusing it.
fn asked<T>(
    ui: &Ui,
    headers: &HeaderMap,
    q: Result<Query<T>, QueryRejection>,
) -> Result<T, Box<Response>> {
    guard(ui, headers)?;
    q.map(|Query(v)| v)
        .map_err(|e| Box::new(refuse(StatusCode::BAD_REQUEST, &e.body_text())))
}

/// What the dashboard serves is live: never kept by a browser or proxy.
fn fresh(body: impl serde::Serialize) -> Response {
    ([(header::CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

#[derive(serde::Deserialize)]
struct Since {
    #[serde(default)]
    since: u64,
}

/// `GET /ui/feed[?since=MS]`: the samples after `since` (all fifteen minutes without it).
async fn feed(
    State(ui): State<Arc<Ui>>,
    headers: HeaderMap,
    q: Result<Query<Since>, QueryRejection>,
) -> Response {
    match asked(&ui, &headers, q) {
        Ok(q) => fresh(json!({ "samples": ui.history.since(q.since) })),
        Err(r) => *r,
    }
}

/// `GET /ui/api/sections`: the cluster, realtime, replicas and cache, those in use.
async fn sections(State(ui): State<Arc<Ui>>, headers: HeaderMap) -> Response {
    if let Err(r) = guard(&ui, &headers) {
        return *r;
    }
    fresh(sections::sections(&ui.app, &ui.realtime))
}

/// `GET /ui/api/pools?page&per_page&sort&desc&filter`: a page of pools.
async fn pools(
    State(ui): State<Arc<Ui>>,
    headers: HeaderMap,
    q: Result<Query<pools::Ask>, QueryRejection>,
) -> Response {
    let ask = match asked(&ui, &headers, q) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    match pools::page(&ui.app, &ui.sparks, &ask) {
        Ok(page) => fresh(page),
        Err(why) => refuse(StatusCode::BAD_REQUEST, why),
    }
}

#[derive(serde::Deserialize)]
struct Named {
    name: String,
}

/// `GET /ui/api/pool?name=`: one pool, with its servers, waiting clients and slow queries.
async fn pool(
    State(ui): State<Arc<Ui>>,
    headers: HeaderMap,
    q: Result<Query<Named>, QueryRejection>,
) -> Response {
    let name = match asked(&ui, &headers, q) {
        Ok(n) => n.name,
        Err(r) => return *r,
    };
    match pools::detail(&ui.app, &ui.sparks, &name) {
        Some(d) => fresh(d),
        None => refuse(StatusCode::NOT_FOUND, "no such pool (it may have closed)"),
    }
}
