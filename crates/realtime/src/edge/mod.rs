//! The WebSocket edge: `/socket/websocket` and `/realtime/v1/websocket`, with the tenant
//! taken from the first label of the `Host` header (as Supabase does), from a configured
//! header, or from a path prefix (`/t/TENANT/socket/websocket`), `vsn=1.0.0|2.0.0`, and the tenant's JWT as `apikey` (query) or `x-api-key`
//! (header). A refused request gets its HTTP status and a JSON body before any upgrade.
//!
//! Refusals carry Realtime's statuses and texts: 401 for a missing, malformed, expired or
//! wrongly signed token, 404 for an unknown tenant, 403 for a banned one, 429 when the
//! tenant has its most sockets connected.
//!
//! Each socket is one task: frames from the client go through its [`Socket`], frames for
//! it come from its bounded queue (see [`crate::hub`]). A socket that does not keep up is
//! closed with a reason rather than let its queue grow; one that sends nothing (not even
//! a heartbeat) for the heartbeat timeout is closed, and its presences leave with it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message as WsMessage, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::{SinkExt, StreamExt};

use crate::hub::{Ending, Frame, Hub, Outbox};
use crate::jwt::{Claims, JwtError, Verifier};
use crate::limits::Limits;
use crate::protocol::Vsn;
use crate::resume::{Kept, Owner, Sessions};
use crate::socket::Socket;
use socket_loop::{run, Outcome};

mod socket_loop;

/// What the edge needs of a tenant.
#[derive(Clone)]
pub struct TenantKeys {
    /// Verifies the tenant's JWTs (its secret and its JWKS).
    pub verifier: Arc<Verifier>,
    pub limits: Limits,
}

/// A tenant as the edge finds it.
pub enum Lookup {
    Found(TenantKeys),
    /// Banned, or realtime not set up (no secret or JWKS).
    Disabled,
    NotFound,
}

/// Where the edge finds tenants (the pooler's tenant store, in Shoal).
pub trait Directory: Send + Sync + 'static {
    fn tenant(&self, id: &str) -> Lookup;
}

/// How the edge behaves, apart from its tenants.
#[derive(Debug, Clone)]
pub struct Options {
    /// The header naming the tenant (`None`: the first label of `Host`).
    pub tenant_header: Option<String>,
    /// A socket that sends nothing for this long is closed (Phoenix's default: 60 s;
    /// realtime-js sends a heartbeat every 25 s).
    pub heartbeat_timeout: Duration,
    /// How long a socket that connected with `resume=<id>` is kept after losing its
    /// connection (see [`crate::resume`]); zero keeps none.
    pub resume_window: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            tenant_header: None,
            heartbeat_timeout: Duration::from_secs(60),
            resume_window: Duration::from_secs(30),
        }
    }
}

/// One tenant's realtime numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantStats {
    pub tenant: String,
    pub sockets: u64,
    /// Topics with at least one subscriber.
    pub channels: u64,
    /// Messages from clients (over sockets and HTTP).
    pub messages: u64,
    pub joins: u64,
    /// Sockets, joins and messages refused for a tenant limit.
    pub limited: u64,
    /// Frames queued to subscribers by broadcasts.
    pub delivered: u64,
    /// Subscribers found too slow (then closed).
    pub slow: u64,
}

/// A request turned away: its status and Realtime's text.
#[derive(Debug)]
pub struct Refusal {
    pub status: StatusCode,
    pub message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Refusal {
        Refusal {
            status,
            message: message.into(),
        }
    }

    /// As the WebSocket endpoint answers: `{"error": ...}`.
    pub fn upgrade_response(&self) -> Response {
        let body = serde_json::json!({ "error": self.message });
        (self.status, Json(body)).into_response()
    }

    /// As the HTTP API answers: `{"message": ...}`.
    pub fn api_response(&self) -> Response {
        refuse(self.status, &self.message)
    }
}

/// A request the tenant's token lets through.
pub(crate) struct Admitted {
    pub tenant: String,
    pub hub: Arc<Hub>,
    pub keys: TenantKeys,
    pub claims: Claims,
}

/// Frames a socket may have queued before it counts as too slow.
pub const SOCKET_QUEUE: usize = 1024;

/// Bytes read from a socket at a time.
const READ_BUFFER: usize = 1024;

const TOO_SLOW: &str = "too slow: the socket's send queue is full";

pub struct Service {
    directory: Arc<dyn Directory>,
    options: Options,
    hubs: Mutex<HashMap<String, Arc<Hub>>>,
    next_socket: AtomicU64,
    stopping: std::sync::atomic::AtomicBool,
    /// Where broadcasts go to reach other nodes, in a cluster.
    relay: crate::hub::RelaySlot,
    /// Where `postgres_changes` subscriptions go.
    feed: crate::feed::FeedSlot,
    /// Each other node's current stream generation (see [`Service::origin_starts`]).
    origins: Mutex<HashMap<String, u64>>,
    /// Sockets a client may come back to.
    sessions: Arc<Sessions>,
}

impl Service {
    pub fn new(directory: Arc<dyn Directory>, mut options: Options) -> Arc<Service> {
        options.tenant_header = options.tenant_header.map(|h| h.to_ascii_lowercase());
        Arc::new(Service {
            directory,
            options,
            hubs: Mutex::default(),
            next_socket: AtomicU64::new(1),
            stopping: std::sync::atomic::AtomicBool::new(false),
            relay: Arc::default(),
            feed: Arc::default(),
            origins: Mutex::default(),
            sessions: Arc::default(),
        })
    }

    /// Tenant `id`'s channels.
    pub fn hub(&self, id: &str) -> Arc<Hub> {
        self.lock_hubs()
            .entry(id.to_owned())
            .or_insert_with(|| Arc::new(Hub::relayed(id, self.relay.clone(), self.feed.clone())))
            .clone()
    }

    /// In a cluster: broadcasts from this node's clients go to the other nodes through
    /// `relay` from now on.
    pub fn set_relay(&self, relay: Arc<dyn crate::fabric::Relay>) {
        let _ = self.relay.set(relay);
    }

    /// `postgres_changes` subscriptions go to `feed` from now on.
    pub fn set_feed(&self, feed: Arc<dyn crate::feed::ChangeFeed>) {
        let _ = self.feed.set(feed);
    }

    /// A presence change node `origin` relayed for `tenant`.
    pub fn presence_relayed(
        &self,
        origin: &str,
        tenant: &str,
        change: crate::fabric::PresenceChange,
    ) {
        self.hub(tenant).presence_relayed(origin, change);
    }

    /// Node `origin` starts telling its presences again from nothing (a new stream): what
    /// it said before leaves. The generation returned ends them with
    /// [`Service::origin_ends`].
    pub fn origin_starts(&self, origin: &str) -> u64 {
        let generation = {
            let mut o = self.origins.lock().unwrap_or_else(|e| e.into_inner());
            let g = o.entry(origin.to_owned()).or_default();
            *g += 1;
            *g
        };
        self.drop_origin(origin);
        generation
    }

    /// Node `origin`'s stream of generation `generation` ended: its presences leave,
    /// unless a newer stream from it has started since.
    pub fn origin_ends(&self, origin: &str, generation: u64) {
        let current = self
            .origins
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(origin)
            .copied();
        if current == Some(generation) {
            self.drop_origin(origin);
        }
    }

    fn drop_origin(&self, origin: &str) {
        let hubs: Vec<Arc<Hub>> = self.lock_hubs().values().cloned().collect();
        for hub in hubs {
            hub.drop_origin(origin);
        }
    }

    /// This node's own presences, by tenant (to tell a peer on a new stream).
    pub fn local_presences(&self) -> Vec<(String, crate::fabric::PresenceChange)> {
        let hubs: Vec<(String, Arc<Hub>)> = self
            .lock_hubs()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        hubs.into_iter()
            .flat_map(|(t, h)| h.local_presences().into_iter().map(move |c| (t.clone(), c)))
            .collect()
    }

    /// A broadcast another node relayed: delivered to this node's subscribers, if any.
    pub fn deliver_relayed(&self, tenant: &str, b: &crate::protocol::UserBroadcast) {
        if let Some(hub) = self.existing_hub(tenant) {
            hub.deliver(b, None);
        }
    }

    /// The tenant's channels and keys, and the token's claims, when `token` is one of its
    /// JWTs; else the refusal. The tenant's limits are brought up to date on the way.
    pub(crate) fn authorize(
        &self,
        tenant: Option<String>,
        token: Option<&str>,
    ) -> Result<Admitted, Refusal> {
        let Some(tenant) = tenant else {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                "no tenant: the host name's first label (or the tenant header) names it",
            ));
        };
        let keys = match self.directory.tenant(&tenant) {
            Lookup::Found(keys) => keys,
            Lookup::Disabled => {
                return Err(Refusal::new(
                    StatusCode::FORBIDDEN,
                    "Realtime was disabled for this tenant",
                ))
            }
            Lookup::NotFound => {
                return Err(Refusal::new(StatusCode::NOT_FOUND, "Tenant not found"))
            }
        };
        let Some(token) = token.filter(|t| !t.trim().is_empty()) else {
            return Err(Refusal::new(StatusCode::UNAUTHORIZED, "API key is missing"));
        };
        let claims = keys
            .verifier
            .verify(token, crate::jwt::now())
            .map_err(|e| {
                let message = match e {
                    // Realtime says how long ago on a channel, not here.
                    JwtError::Expired(_) => "Token has expired".to_owned(),
                    e => e.to_string(),
                };
                Refusal::new(StatusCode::UNAUTHORIZED, message)
            })?;
        let hub = self.hub(&tenant);
        hub.meter().set_limits(keys.limits);
        Ok(Admitted {
            tenant,
            hub,
            keys,
            claims,
        })
    }

    /// Tenant `id` changed: its limits apply to its sockets from now on, and if it is gone
    /// or disabled, its sockets end.
    pub fn tenant_changed(&self, id: &str) {
        let Some(hub) = self.existing_hub(id) else {
            return;
        };
        match self.directory.tenant(id) {
            Lookup::Found(keys) => hub.meter().set_limits(keys.limits),
            Lookup::Disabled | Lookup::NotFound => hub.end_sockets(Ending::TENANT),
        }
    }

    /// Tenant `id`'s clients were ended (a ban, an operator's terminate): so are its
    /// sockets.
    pub fn tenant_ended(&self, id: &str) {
        if let Some(hub) = self.existing_hub(id) {
            hub.end_sockets(Ending::TENANT);
        }
    }

    /// The service stops: every socket is closed with 1012 (service restart), and sockets
    /// still being accepted are refused the same way.
    pub fn shut_down(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let hubs: Vec<Arc<Hub>> = self.lock_hubs().values().cloned().collect();
        for hub in hubs {
            hub.end_sockets(Ending::RESTART);
        }
    }

    /// Each tenant's numbers, for metrics.
    pub fn stats(&self) -> Vec<TenantStats> {
        let hubs: Vec<(String, Arc<Hub>)> = self
            .lock_hubs()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut rows: Vec<TenantStats> = hubs
            .into_iter()
            .map(|(tenant, h)| TenantStats {
                sockets: h.meter().users() as u64,
                channels: h.topics() as u64,
                messages: load(&h.meter().messages),
                joins: load(&h.meter().joins),
                limited: load(&h.meter().limited),
                delivered: load(&h.delivered),
                slow: load(&h.slow),
                tenant,
            })
            .collect();
        rows.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        rows
    }

    /// Sockets connected, all tenants together.
    pub fn sockets(&self) -> usize {
        self.lock_hubs().values().map(|h| h.meter().users()).sum()
    }

    fn lock_hubs(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Hub>>> {
        self.hubs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn existing_hub(&self, id: &str) -> Option<Arc<Hub>> {
        self.lock_hubs().get(id).cloned()
    }

    pub(crate) fn tenant_of(&self, headers: &HeaderMap) -> Option<String> {
        let value = match &self.options.tenant_header {
            Some(h) => headers.get(h.as_str())?.to_str().ok()?.to_owned(),
            None => {
                let host = headers.get("host")?.to_str().ok()?;
                host.split(['.', ':']).next()?.to_owned()
            }
        };
        (!value.is_empty()).then_some(value)
    }
}

pub fn router(service: Arc<Service>) -> axum::Router {
    axum::Router::new()
        .route("/socket/websocket", axum::routing::get(upgrade))
        .route("/realtime/v1/websocket", axum::routing::get(upgrade))
        .route(
            "/t/{tenant}/socket/websocket",
            axum::routing::get(upgrade_named),
        )
        .route(
            "/t/{tenant}/realtime/v1/websocket",
            axum::routing::get(upgrade_named),
        )
        .route("/socket/websocket/websocket", axum::routing::get(doubled))
        .route(
            "/realtime/v1/websocket/websocket",
            axum::routing::get(doubled),
        )
        .route(
            "/t/{tenant}/socket/websocket/websocket",
            axum::routing::get(doubled),
        )
        .route(
            "/t/{tenant}/realtime/v1/websocket/websocket",
            axum::routing::get(doubled),
        )
        .merge(crate::rest::routes())
        .with_state(service)
}

/// Supabase's clients append `/websocket` to the endpoint they are given, so a user who
/// copies a full socket URL into `new RealtimeClient(…)` asks for `/websocket/websocket`.
/// realtime-js reports only "transport failure" for a bare 404: the body says what to use.
async fn doubled(uri: axum::http::Uri) -> Response {
    let endpoint = uri.path().trim_end_matches("/websocket/websocket");
    Refusal::new(
        StatusCode::NOT_FOUND,
        format!(
            "{} asks for /websocket twice: Supabase's clients add /websocket to the endpoint \
             themselves. Give the client the endpoint {endpoint} instead.",
            uri.path()
        ),
    )
    .upgrade_response()
}

pub(crate) fn refuse(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "message": message }))).into_response()
}

async fn upgrade(
    State(svc): State<Arc<Service>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    ws: WebSocketUpgrade,
) -> Response {
    let tenant = svc.tenant_of(&headers);
    accept(svc, tenant, headers, query, ws)
}

async fn upgrade_named(
    State(svc): State<Arc<Service>>,
    axum::extract::Path(tenant): axum::extract::Path<String>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    ws: WebSocketUpgrade,
) -> Response {
    accept(svc, Some(tenant), headers, query, ws)
}

fn accept(
    svc: Arc<Service>,
    tenant: Option<String>,
    headers: HeaderMap,
    query: HashMap<String, String>,
    ws: WebSocketUpgrade,
) -> Response {
    let token = query
        .get("apikey")
        .cloned()
        .or_else(|| headers.get("x-api-key")?.to_str().ok().map(str::to_owned));
    let Some(vsn) = Vsn::parse(query.get("vsn").map(String::as_str)) else {
        return Refusal::new(StatusCode::BAD_REQUEST, "vsn must be 1.0.0 or 2.0.0")
            .upgrade_response();
    };
    if svc.stopping.load(Ordering::SeqCst) {
        return Refusal::new(StatusCode::SERVICE_UNAVAILABLE, Ending::RESTART.reason)
            .upgrade_response();
    }
    let admitted = match svc.authorize(tenant, token.as_deref()) {
        Ok(a) => a,
        Err(r) => return r.upgrade_response(),
    };
    let resume = resumption(&svc, &admitted, vsn, query.get("resume"));
    // A session taken over comes with its seat; any other socket takes one now.
    let seat = match &resume {
        Some(Resumption {
            holder: Some(_), ..
        }) => None,
        _ => match Seat::take(&admitted.hub) {
            Ok(seat) => Some(seat),
            Err(refusal) => return refusal.upgrade_response(),
        },
    };
    let id = svc.next_socket.fetch_add(1, Ordering::Relaxed);
    let (out, queue) = Outbox::new(SOCKET_QUEUE);
    let socket = Socket::new(
        id,
        vsn,
        out.clone(),
        admitted.keys.verifier.clone(),
        &admitted.claims,
    );
    // A frame may carry the largest payload the tenant allows, and its envelope; a bigger
    // one closes the socket (1009) before it is read whole.
    let largest = admitted.keys.limits.max_payload.saturating_add(64 * 1024);
    let fresh = Fresh {
        socket,
        queue,
        out,
        seat,
    };
    ws.max_message_size(largest)
        .max_frame_size(largest)
        // tungstenite allocates its read buffer up front (128 KiB by default): an idle
        // socket should cost little, and a bigger frame grows it as it comes.
        .read_buffer_size(READ_BUFFER)
        // Frames are written as they come; the queue in front already batches nothing.
        .write_buffer_size(0)
        .on_upgrade(move |ws| start(ws, svc, admitted, fresh, resume))
}

/// A socket's session as a new connection finds it: `holder` has it when the client
/// comes back to one (see [`crate::resume`]).
struct Resumption {
    id: String,
    owner: Owner,
    holder: Option<crate::resume::Sender>,
}

/// What the connection's `resume` id lets it do: come back to a session, start one that
/// can be come back to, or neither (no id, resuming off, or another owner's session).
fn resumption(
    svc: &Service,
    admitted: &Admitted,
    vsn: Vsn,
    id: Option<&String>,
) -> Option<Resumption> {
    let id = id.filter(|id| crate::resume::valid_id(id))?;
    if svc.options.resume_window.is_zero() {
        return None;
    }
    let owner = Owner::of(&admitted.claims, vsn);
    let holder = match svc.sessions.holder(&admitted.tenant, id, &owner) {
        Ok(holder) => holder,
        // Someone else's: this connection neither takes nor displaces it.
        Err(()) => return None,
    };
    Some(Resumption {
        id: id.clone(),
        owner,
        holder,
    })
}

/// A new socket's parts, used unless it takes over a session.
struct Fresh {
    socket: Socket,
    queue: tokio::sync::mpsc::Receiver<Frame>,
    out: Outbox,
    seat: Option<Seat>,
}

/// Runs the upgraded connection: on the session it comes back to, if it gets it, else on
/// its own.
async fn start(
    ws: WebSocket,
    svc: Arc<Service>,
    admitted: Admitted,
    fresh: Fresh,
    resume: Option<Resumption>,
) {
    let mut kept = None;
    if let Some(holder) = resume.as_ref().and_then(|r| r.holder.clone()) {
        kept = Sessions::take(holder).await;
    }
    let kept = match kept {
        Some(mut kept) => {
            kept.socket
                .resumed(admitted.keys.verifier.clone(), &admitted.claims);
            kept
        }
        None => {
            let seat = match fresh.seat {
                Some(seat) => seat,
                None => match Seat::take(&admitted.hub) {
                    Ok(seat) => seat,
                    Err(refusal) => {
                        let (mut sink, _) = ws.split();
                        let frame = WsMessage::Close(Some(CloseFrame {
                            code: 1013,
                            reason: refusal.message.into(),
                        }));
                        let _ =
                            tokio::time::timeout(Duration::from_secs(1), sink.send(frame)).await;
                        return;
                    }
                },
            };
            Kept {
                socket: fresh.socket,
                unread: Default::default(),
                queue: fresh.queue,
                out: fresh.out,
                seat,
            }
        }
    };
    let held = resume.map(|r| svc.sessions.hold(&admitted.tenant, &r.id, r.owner));
    let heartbeat = svc.options.heartbeat_timeout;
    let goodbye = run(ws, kept, held, heartbeat, &svc.sessions).await;
    match goodbye {
        Outcome::Lost(kept, held) => svc.sessions.park(kept, held, svc.options.resume_window),
        Outcome::Over(kept, held) => {
            if let Some(held) = &held {
                svc.sessions.release(held);
            }
            kept.end();
        }
        Outcome::HandedOver => {}
    }
}

/// A socket counted against its tenant's `max_concurrent_users`.
pub(crate) struct Seat(Arc<Hub>);

impl Seat {
    /// A seat among the tenant's connected users, unless all are taken.
    fn take(hub: &Arc<Hub>) -> Result<Seat, Refusal> {
        match hub.meter().admit_user() {
            Ok(()) => Ok(Seat(hub.clone())),
            Err(over) => Err(Refusal::new(
                StatusCode::TOO_MANY_REQUESTS,
                over.to_string(),
            )),
        }
    }

    pub fn hub(&self) -> &Arc<Hub> {
        &self.0
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.0.meter().user_left();
    }
}
