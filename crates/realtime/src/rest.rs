//! Broadcast over HTTP, as realtime-js's `httpSend()` and its REST fallback call it:
//!
//! - `POST …/api/broadcast` with `{"messages": [{"topic", "event", "payload", "private"}]}`;
//! - `POST …/api/broadcast/{topic}/events/{event}` with the payload as the body (JSON, or
//!   raw bytes as `application/octet-stream`).
//!
//! `…` is nothing, `/realtime/v1`, or `/t/TENANT[/realtime/v1]`, as for the socket. The
//! tenant's JWT comes as `Authorization: Bearer`, else as the `apikey` header. Topics are
//! the channel's name without its `realtime:` prefix. Accepted messages are delivered to
//! the topic's subscribers at once and answered `202`. They count against the tenant's
//! `max_events_per_second` and `max_bytes_per_second` (429 when over). A private message
//! (`"private": true`, or `?private=true`) goes to the private channel of its topic, if the
//! tenant's policies on `realtime.messages` let the token write the topic (403 if not).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::edge::{refuse, Service};
use crate::protocol::{Payload, UserBroadcast};

pub(crate) fn routes() -> axum::Router<Arc<Service>> {
    use axum::routing::post;
    let mut r = axum::Router::new();
    for prefix in ["", "/realtime/v1"] {
        r = r
            .route(&format!("{prefix}/api/broadcast"), post(batch))
            .route(
                &format!("{prefix}/api/broadcast/{{topic}}/events/{{event}}"),
                post(one),
            )
            .route(
                &format!("/t/{{tenant}}{prefix}/api/broadcast"),
                post(batch_named),
            )
            .route(
                &format!("/t/{{tenant}}{prefix}/api/broadcast/{{topic}}/events/{{event}}"),
                post(one_named),
            );
    }
    r
}

fn token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| headers.get("apikey")?.to_str().ok())
}

#[derive(Deserialize)]
struct Batch<'a> {
    #[serde(borrow)]
    messages: Vec<BatchMessage<'a>>,
}

#[derive(Deserialize)]
struct BatchMessage<'a> {
    topic: String,
    event: String,
    #[serde(borrow, default)]
    payload: Option<&'a RawValue>,
    #[serde(default)]
    private: bool,
}

fn too_large() -> Response {
    refuse(
        StatusCode::PAYLOAD_TOO_LARGE,
        "Payload too large: max_payload_size_in_kb exceeded",
    )
}

fn over_rate(over: crate::limits::Over) -> Response {
    let why = format!("You have exceeded your rate limit: {over}");
    refuse(StatusCode::TOO_MANY_REQUESTS, &why)
}

/// How long an HTTP message waits for the tenant's database to say it may be sent.
const WRITE_CHECK: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether the token of `admitted` may send to the private channel `topic`, as the
/// tenant's policies say; the refusal if not.
async fn may_write(admitted: &crate::edge::Admitted, topic: &str) -> Result<(), Response> {
    let refused = || {
        refuse(
            StatusCode::FORBIDDEN,
            &format!(
                "Unauthorized: You do not have permissions to write to this Channel topic: {topic}"
            ),
        )
    };
    let Some((tenant, feed)) = admitted.hub.feed() else {
        return Err(refused());
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    feed.may_write(
        tenant,
        crate::feed::Identity::of(&admitted.claims),
        topic.to_owned(),
        tx,
    );
    match tokio::time::timeout(WRITE_CHECK, rx).await {
        Ok(Ok(true)) => Ok(()),
        _ => Err(refused()),
    }
}

async fn batch(State(svc): State<Arc<Service>>, headers: HeaderMap, body: Bytes) -> Response {
    let tenant = svc.tenant_of(&headers);
    deliver_batch(&svc, tenant, &headers, &body).await
}

async fn batch_named(
    State(svc): State<Arc<Service>>,
    Path(tenant): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    deliver_batch(&svc, Some(tenant), &headers, &body).await
}

/// `?private=true`: the message is for the private channel of that name.
#[derive(Deserialize)]
struct OneQuery {
    #[serde(default)]
    private: bool,
}

async fn one(
    State(svc): State<Arc<Service>>,
    Path((topic, event)): Path<(String, String)>,
    Query(q): Query<OneQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let tenant = svc.tenant_of(&headers);
    deliver_one(&svc, tenant, &headers, (topic, q.private), event, body).await
}

async fn one_named(
    State(svc): State<Arc<Service>>,
    Path((tenant, topic, event)): Path<(String, String, String)>,
    Query(q): Query<OneQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    deliver_one(
        &svc,
        Some(tenant),
        &headers,
        (topic, q.private),
        event,
        body,
    )
    .await
}

async fn deliver_batch(
    svc: &Service,
    tenant: Option<String>,
    headers: &HeaderMap,
    body: &[u8],
) -> Response {
    let admitted = match svc.authorize(tenant, token(headers)) {
        Ok(a) => a,
        Err(r) => return r.api_response(),
    };
    let batch: Batch<'_> = match serde_json::from_slice(body) {
        Ok(b) => b,
        Err(e) => {
            let why = format!("the body is not a batch of messages (topic, event, payload): {e}");
            return refuse(StatusCode::UNPROCESSABLE_ENTITY, &why);
        }
    };
    let hub = admitted.hub.clone();
    let mut bytes = 0;
    for m in &batch.messages {
        let payload = m.payload.map_or("{}", |p| p.get());
        if payload.len() > admitted.keys.limits.max_payload {
            return too_large();
        }
        if !crate::hub::valid_topic(&m.topic) {
            return refuse(
                StatusCode::UNPROCESSABLE_ENTITY,
                "a topic may not contain NUL",
            );
        }
        bytes += payload.len();
    }
    if let Err(over) = hub.meter().events(batch.messages.len(), bytes) {
        return over_rate(over);
    }
    // Every private topic is checked before any message goes.
    let mut checked: Vec<&str> = Vec::new();
    for m in batch.messages.iter().filter(|m| m.private) {
        if !checked.contains(&m.topic.as_str()) {
            if let Err(r) = may_write(&admitted, &m.topic).await {
                return r;
            }
            checked.push(&m.topic);
        }
    }
    for m in batch.messages {
        let payload = m.payload.map_or("{}", |p| p.get());
        hub.broadcast(
            &UserBroadcast {
                join_ref: None,
                msg_ref: None,
                topic: crate::hub::channel_key(&format!("realtime:{}", m.topic), m.private)
                    .into_owned(),
                event: m.event,
                meta: None,
                payload: Payload::Json(bytes::Bytes::copy_from_slice(payload.as_bytes())),
            },
            None,
        );
    }
    StatusCode::ACCEPTED.into_response()
}

async fn deliver_one(
    svc: &Service,
    tenant: Option<String>,
    headers: &HeaderMap,
    (topic, private): (String, bool),
    event: String,
    body: Bytes,
) -> Response {
    let admitted = match svc.authorize(tenant, token(headers)) {
        Ok(a) => a,
        Err(r) => return r.api_response(),
    };
    if body.len() > admitted.keys.limits.max_payload {
        return too_large();
    }
    if !crate::hub::valid_topic(&topic) {
        return refuse(
            StatusCode::UNPROCESSABLE_ENTITY,
            "a topic may not contain NUL",
        );
    }
    if let Err(over) = admitted.hub.meter().event(body.len()) {
        return over_rate(over);
    }
    if private {
        if let Err(r) = may_write(&admitted, &topic).await {
            return r;
        }
    }
    let binary = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/octet-stream"));
    let payload = if binary {
        Payload::Binary(body)
    } else {
        match Payload::json(body) {
            Ok(p) => p,
            Err(e) => return refuse(StatusCode::UNPROCESSABLE_ENTITY, &e.to_string()),
        }
    };
    admitted.hub.broadcast(
        &UserBroadcast {
            join_ref: None,
            msg_ref: None,
            topic: crate::hub::channel_key(&format!("realtime:{topic}"), private).into_owned(),
            event,
            meta: None,
            payload,
        },
        None,
    );
    StatusCode::ACCEPTED.into_response()
}
