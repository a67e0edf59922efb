//! The management API (HTTP, JSON): Supavisor's tenant routes and bodies, so provisioning
//! scripts written for Supavisor work unchanged, plus a tenant list, live pool state, a
//! health check and the OpenAPI document. Every route but `/api/health` and
//! `/api/openapi.json` needs a bearer token ([`auth`]).

pub use shoal_control::api_auth as auth;
pub mod ops;

use crate::features::PoolFeatures;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::tenant::model::{valid_external_id, Tenant};
use crate::tenant::service::{ServiceError, TenantService};

/// The OpenAPI 3 document describing this API (a test checks it against the router).
pub const OPENAPI: &str = include_str!("openapi.json");

/// Every route, for the OpenAPI test: (method, path).
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/api/health"),
    ("get", "/api/openapi.json"),
    ("get", "/api/openapi"),
    ("get", "/api/tenants"),
    ("get", "/api/tenants/{id}"),
    ("put", "/api/tenants/{id}"),
    ("patch", "/api/tenants/{id}"),
    ("delete", "/api/tenants/{id}"),
    ("get", "/api/tenants/{id}/terminate"),
    ("post", "/api/tenants/{id}/terminate"),
    ("get", "/api/tenants/{id}/pools"),
    ("delete", "/api/tenants/{id}/cache"),
];

/// What a request does: a gate whose credential a browser sends by itself (a cookie) must
/// know, since a page of another site can make a browser send reads it cannot see but
/// writes that act.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

/// Who may use the tenant routes: a bearer token on `/api`, the dashboard's session on
/// `/ui/api` (the same handlers, so both say the same things).
pub trait Gate: Send + Sync {
    /// `Err` holds what the `401` says.
    fn admits(&self, headers: &HeaderMap, access: Access) -> Result<(), &'static str>;
}

impl Gate for auth::ApiAuth {
    /// A bearer token travels only when a client puts it in the request itself: reads and
    /// writes are admitted alike.
    fn admits(&self, headers: &HeaderMap, _: Access) -> Result<(), &'static str> {
        let header = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if self.allows(header) {
            Ok(())
        } else {
            Err("missing or invalid bearer token")
        }
    }
}

struct Api {
    service: Arc<TenantService>,
    gate: Arc<dyn Gate>,
}

type Shared = State<Arc<Api>>;

pub fn router(service: Arc<TenantService>, auth: Arc<auth::ApiAuth>) -> Router {
    Router::new()
        .route("/api/health", get(health))
        .route("/api/openapi.json", get(openapi))
        // Where Supavisor serves its document, for tools pointed at a Supavisor.
        .route("/api/openapi", get(openapi))
        .merge(tenant_routes("/api", service, auth))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route") })
}

/// The tenant routes under `prefix`, guarded by `gate`.
pub fn tenant_routes(prefix: &str, service: Arc<TenantService>, gate: Arc<dyn Gate>) -> Router {
    // Supavisor's clients terminate with a GET. Kept for bearer tokens only: a browser never
    // sends one on its own, as it does the dashboard's cookie (`/ui/api` takes POST alone).
    let get_terminate = prefix == "/api";
    let api = Arc::new(Api { service, gate });
    let terminate_route = if get_terminate {
        get(terminate).post(terminate)
    } else {
        axum::routing::post(terminate)
    };
    Router::new()
        .route(&format!("{prefix}/tenants"), get(list))
        .route(
            &format!("{prefix}/tenants/{{id}}"),
            get(get_tenant)
                .put(put_tenant)
                .patch(patch_tenant)
                .delete(delete_tenant),
        )
        .route(
            &format!("{prefix}/tenants/{{id}}/terminate"),
            terminate_route,
        )
        .route(&format!("{prefix}/tenants/{{id}}/pools"), get(pools))
        .route(
            &format!("{prefix}/tenants/{{id}}/cache"),
            axum::routing::delete(purge_cache),
        )
        .with_state(api)
}

/// Serves the API on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener, router: Router) {
    if let Err(e) = axum::serve(listener, router).await {
        tracing::error!(error = %e, "management API stopped");
    }
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "error": message }))).into_response()
}

fn field_errors(errors: crate::tenant::model::FieldErrors) -> Response {
    (
        StatusCode::UNPROCESSABLE_ENTITY,
        Json(json!({ "errors": errors })),
    )
        .into_response()
}

fn one_field(field: &str, message: &str) -> Response {
    let mut e = crate::tenant::model::FieldErrors::new();
    e.insert(field.into(), vec![message.into()]);
    field_errors(e)
}

fn service_error(e: ServiceError) -> Response {
    match e {
        ServiceError::Invalid(errors) => field_errors(errors),
        ServiceError::NotFound => error(StatusCode::NOT_FOUND, "tenant not found"),
        ServiceError::Store(e) => {
            tracing::error!(error = %e, "tenant store failed");
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the tenant store failed; see Shoal's log",
            )
        }
    }
}

/// Refuses a request without a valid bearer token.
/// A response that ends a request early (boxed: responses are large).
type Refusal = Box<Response>;

fn authorized(api: &Api, headers: &HeaderMap) -> Result<(), Refusal> {
    admitted(api, headers, Access::Read)
}

/// [`authorized`] for a request that changes something.
fn authorized_to_change(api: &Api, headers: &HeaderMap) -> Result<(), Refusal> {
    admitted(api, headers, Access::Write)
}

fn admitted(api: &Api, headers: &HeaderMap, access: Access) -> Result<(), Refusal> {
    api.gate
        .admits(headers, access)
        .map_err(|why| Box::new(error(StatusCode::UNAUTHORIZED, why)))
}

fn checked_id(id: &str) -> Result<(), Refusal> {
    if valid_external_id(id) {
        Ok(())
    } else {
        Err(Box::new(one_field(
            "external_id",
            "must be 1-63 lowercase letters, digits or hyphens, not starting or ending with a hyphen",
        )))
    }
}

/// A JSON body `{"tenant": {...}}`; type errors name the field.
fn tenant_body(body: &[u8]) -> Result<Value, Refusal> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            &format!("the body is not valid JSON: {e}"),
        ))
    })?;
    match v.get("tenant") {
        Some(t @ Value::Object(_)) => Ok(t.clone()),
        _ => Err(Box::new(one_field(
            "tenant",
            "the body must be {\"tenant\": {...}}",
        ))),
    }
}

fn tenant_json(t: &Tenant) -> Value {
    json!({ "data": t })
}

async fn health() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
        .into_response()
}

#[derive(serde::Deserialize)]
struct Page {
    page: Option<usize>,
    per_page: Option<usize>,
    /// Only tenants whose id contains this (case-insensitively).
    search: Option<String>,
}

/// A query string that does not parse is the client's mistake, said in JSON like every
/// other error (axum's own rejection is plain text).
fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, Refusal> {
    q.map(|Query(v)| v).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            &format!("invalid query string: {}", e.body_text()),
        ))
    })
}

async fn list(
    State(api): Shared,
    headers: HeaderMap,
    p: Result<Query<Page>, QueryRejection>,
) -> Response {
    if let Err(r) = authorized(&api, &headers) {
        return *r;
    }
    let p = match query(p) {
        Ok(p) => p,
        Err(r) => return *r,
    };
    let per_page = p.per_page.unwrap_or(100);
    let page = p.page.unwrap_or(1);
    if !(1..=1000).contains(&per_page) || page == 0 {
        return error(
            StatusCode::BAD_REQUEST,
            "page must be at least 1 and per_page between 1 and 1000",
        );
    }
    let search = p.search.as_deref().unwrap_or("").trim();
    let offset = (page - 1).saturating_mul(per_page);
    match api.service.page(search, offset, per_page).await {
        Ok((data, total)) => {
            Json(json!({ "data": data, "page": page, "per_page": per_page, "total": total }))
                .into_response()
        }
        Err(e) => service_error(e),
    }
}

async fn get_tenant(State(api): Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = authorized(&api, &headers) {
        return *r;
    }
    match api.service.get(&id).await {
        Ok(t) => Json(tenant_json(&t)).into_response(),
        Err(e) => service_error(e),
    }
}

#[derive(serde::Deserialize)]
struct PutQuery {
    check: Option<bool>,
}

async fn put_tenant(
    State(api): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<PutQuery>, QueryRejection>,
    body: Bytes,
) -> Response {
    if let Err(r) = authorized_to_change(&api, &headers) {
        return *r;
    }
    let q = match query(q) {
        Ok(q) => q,
        Err(r) => return *r,
    };
    if let Err(r) = checked_id(&id) {
        return *r;
    }
    let body = match tenant_body(&body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let t = match Tenant::from_json(&body, &id) {
        Ok(t) => t,
        Err(errors) => return field_errors(errors),
    };
    match api.service.put(t, &id, q.check.unwrap_or(true)).await {
        Ok(created) => {
            let status = if created {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            match api.service.get(&id).await {
                Ok(t) => (status, Json(tenant_json(&t))).into_response(),
                Err(e) => service_error(e),
            }
        }
        Err(e) => service_error(e),
    }
}

async fn patch_tenant(
    State(api): Shared,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    if let Err(r) = authorized_to_change(&api, &headers) {
        return *r;
    }
    let body = match tenant_body(&body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    match api.service.patch(&id, body).await {
        Ok(t) => Json(tenant_json(&t)).into_response(),
        Err(e) => service_error(e),
    }
}

async fn delete_tenant(State(api): Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = authorized_to_change(&api, &headers) {
        return *r;
    }
    match api.service.delete(&id).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => service_error(e),
    }
}

async fn terminate(State(api): Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = authorized_to_change(&api, &headers) {
        return *r;
    }
    match api.service.terminate(&id).await {
        Ok(n) => Json(json!({ "result": "success", "clients": n })).into_response(),
        Err(e) => service_error(e),
    }
}

/// Drops every reply the tenant's pools keep (after a migration, say: schema changes made
/// outside Shoal are not seen by the cache until its entries expire).
async fn purge_cache(State(api): Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = authorized_to_change(&api, &headers) {
        return *r;
    }
    if api.service.routes.tenants.get(&id).is_none() {
        return error(StatusCode::NOT_FOUND, "tenant not found");
    }
    let mut entries = 0;
    for p in api.service.routes.tenant_pools(&id) {
        if let Some(c) = p.cache() {
            entries += c.entries();
            c.purge();
        }
    }
    Json(json!({ "result": "success", "entries": entries })).into_response()
}

async fn pools(State(api): Shared, headers: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = authorized(&api, &headers) {
        return *r;
    }
    if api.service.routes.tenants.get(&id).is_none() {
        return error(StatusCode::NOT_FOUND, "tenant not found");
    }
    let pools: Vec<Value> = api
        .service
        .routes
        .tenant_pools(&id)
        .iter()
        .map(|p| {
            let s = &p.stats;
            json!({
                "db_user": p.upstream.user,
                "mode_type": p.settings.mode.name(),
                "pool_size": p.size(),
                "clients": s.clients.load(Ordering::Relaxed),
                "waiting": s.waiting.load(Ordering::Relaxed),
                "servers": s.servers.load(Ordering::Relaxed),
                "servers_idle": p.idle_count(),
                "transactions": s.checkouts.load(Ordering::Relaxed),
            })
        })
        .collect();
    Json(json!({ "data": pools })).into_response()
}
