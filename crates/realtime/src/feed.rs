//! The seam between channels and the database's change capture (Postgres Changes).
//!
//! A join with `postgres_changes` bindings is not answered at once: its [`Subscription`]
//! goes to the tenant's [`ChangeFeed`], which answers it through [`Ready`] once capture
//! covers every binding, so that `SUBSCRIBED` (what the clients report on the join's
//! reply) is never said before a change committed from then on is certain to be sent.
//! Until then the channel gets nothing, not even broadcasts. Changes are then queued to
//! the socket through the subscription's [`Target`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;

use crate::changes::Binding;
use crate::hub::{Frame, Hub, Outbox, SocketId, Subscriber};
use crate::protocol::{self, Message, Payload, Vsn};

/// Where a tenant's `postgres_changes` subscriptions go: Shoal's capture of its database.
pub trait ChangeFeed: Send + Sync + 'static {
    /// Captures `sub`'s bindings for `tenant` and answers its join through `sub.ready`.
    fn subscribe(&self, tenant: &str, sub: Subscription);
    /// `socket`'s subscription on `topic` ended (a leave, a re-join, the socket closing).
    fn unsubscribe(&self, tenant: &str, socket: SocketId, topic: &str);
    /// A private channel's token changed: its access is checked again, and the channel
    /// shut down (through its [`Target`]) if it may no longer read.
    fn recheck(&self, tenant: &str, socket: SocketId, topic: &str);
    /// Whether `identity` may send to the private channel `topic` (without `realtime:`),
    /// for a message over HTTP: answered on `reply` (dropped: no).
    fn may_write(
        &self,
        tenant: &str,
        identity: Identity,
        topic: String,
        reply: tokio::sync::oneshot::Sender<bool>,
    );
}

/// The service's change feed, once it has one.
pub type FeedSlot = Arc<OnceLock<Arc<dyn ChangeFeed>>>;

/// Who a subscriber is to the database: the role its token names and the token's claims
/// (as JSON text, for `request.jwt.claims`). Subscribers with the same identity share one
/// authorization check per table per batch of changes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: String,
    pub claims: Arc<str>,
}

impl Identity {
    /// A verified token's identity.
    pub fn of(claims: &crate::jwt::Claims) -> Identity {
        Identity {
            role: claims.role.clone(),
            claims: claims.all.to_string().into(),
        }
    }
}

/// A channel's identity, which a token update replaces.
pub type SharedIdentity = Arc<std::sync::Mutex<Identity>>;

/// A channel that needs the database: its `postgres_changes` bindings (waiting for capture
/// to cover them, then receiving changes), or its being private (waiting for the tenant's
/// policies to let it in), or both.
pub struct Subscription {
    pub socket: SocketId,
    pub topic: String,
    /// A private channel: joining needs the policies' leave to read the topic, sending
    /// their leave to write it (see [`Subscription::writes`]).
    pub private: bool,
    pub bindings: Vec<Binding>,
    /// Set by the feed when the policies let the channel send (private channels).
    pub writes: Arc<AtomicBool>,
    /// Changes when the channel's token is updated.
    pub identity: SharedIdentity,
    pub target: Target,
    pub ready: Ready,
    /// Broadcasts from the database to send it on joining (a private channel's replay).
    pub replay: Option<Replay>,
}

/// Supabase's broadcast replay: the private channel's broadcasts from the database since
/// `since_ms` (milliseconds since the epoch), the last `limit` of them, oldest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replay {
    pub since_ms: i64,
    pub limit: u32,
}

impl Replay {
    /// The most a join may ask for, as Supabase allows.
    pub const MAX: u32 = 25;
}

/// Where a subscription's changes are queued.
#[derive(Clone)]
pub struct Target {
    out: Outbox,
    pub vsn: Vsn,
    /// Set when the subscription ended; nothing more is queued then.
    ended: Arc<AtomicBool>,
    /// What [`Target::shut_down`] needs: the channel in its hub, and how it was joined.
    hub: Arc<Hub>,
    key: String,
    topic: String,
    /// The channel's join ref, which a resumed socket's re-join replaces (see
    /// [`Handle::rejoined`]).
    join_ref: JoinRef,
    socket: SocketId,
}

/// A channel's join ref, shared by the socket and the feed's deliveries.
type JoinRef = Arc<std::sync::Mutex<Option<String>>>;

impl Target {
    /// Whether the subscription ended (its socket left or closed).
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Ends the channel as Realtime stops one it may no longer serve: a `system` message
    /// saying why, then `phx_close`; the socket stays.
    pub fn shut_down(&self, message: &str) {
        if self.ended.swap(true, Ordering::AcqRel) {
            return;
        }
        self.hub.leave(&self.key, self.socket);
        let system = serde_json::json!({
            "extension": "system", "status": "error", "message": message, "channel": self.channel(),
        });
        self.send("system", None, system.to_string());
        self.send("phx_close", None, "{}".into());
    }

    /// The channel's name without `realtime:`, as `system` messages give it.
    fn channel(&self) -> &str {
        self.topic.strip_prefix("realtime:").unwrap_or(&self.topic)
    }

    /// Queues a message of the channel (with its join ref), whatever became of it.
    fn send(&self, event: &str, msg_ref: Option<String>, payload: String) {
        let m = Message {
            join_ref: self
                .join_ref
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            msg_ref,
            topic: self.topic.clone(),
            event: event.into(),
            payload: Payload::Json(Bytes::from(payload)),
        };
        if let Some(t) = protocol::encode_text(self.vsn, &m) {
            self.out.push(Frame::Text(t.into()));
        }
    }

    /// Queues a frame made by [`change_frame`]; false when the socket's queue is full
    /// (the socket is then closed as too slow) or the subscription ended.
    pub fn push(&self, frame: Frame) -> bool {
        !self.ended() && self.out.push(frame)
    }
}

/// The `postgres_changes` message with `payload` (see [`crate::changes::payload`]) on
/// `topic`, as a socket speaking `vsn` reads it.
pub fn change_frame(vsn: Vsn, topic: &str, payload: String) -> Option<Frame> {
    let m = Message {
        join_ref: None,
        msg_ref: None,
        topic: topic.to_owned(),
        event: "postgres_changes".into(),
        payload: Payload::Json(payload.into()),
    };
    protocol::encode_text(vsn, &m).map(|t| Frame::Text(t.into()))
}

/// The pending answer to a join with bindings.
pub struct Ready {
    /// The channel the answer is for (its hub, key, topic and end).
    target: Target,
    subscriber: Subscriber,
    /// Whether it has `postgres_changes` bindings (then a `system` message follows).
    changes: bool,
    /// Whether the join asked to be told when capture is live (`replication_ready`).
    replication_ready: bool,
    /// A public channel without bindings: when capture fails it is joined all the same
    /// (broadcasts and presence need no database).
    optional: bool,
    msg_ref: Option<String>,
    /// The bindings as the join reply echoes them.
    echo: serde_json::Value,
}

impl Ready {
    /// Capture covers the bindings: the join is answered `ok` (with the bindings and
    /// their ids), the channel subscribed to its topic, and the `system` message Realtime
    /// sends once it listens to the database follows.
    pub fn subscribed(self) {
        self.subscribed_with(&[]);
    }

    /// [`Ready::subscribed`], with `replayed` broadcasts (the channel's topic as its client
    /// calls it) sent to this subscriber alone before anything else of the channel.
    pub fn subscribed_with(self, replayed: &[crate::protocol::UserBroadcast]) {
        if self.abandoned() {
            return;
        }
        self.answer("ok", serde_json::json!({ "postgres_changes": self.echo }));
        let t = &self.target;
        if !t.hub.join_unless(&t.key, self.subscriber.clone(), &t.ended) {
            return;
        }
        for b in replayed {
            if let Some(f) = crate::hub::broadcast_frame(self.subscriber.vsn, b) {
                t.push(f);
            }
        }
        if self.changes {
            self.system("postgres_changes", "ok", "Subscribed to PostgreSQL");
        }
        if self.replication_ready {
            self.system("system", "ok", "Replication connection established");
        }
    }

    /// The bindings cannot be served: the join is refused with `reason` — but for a
    /// public channel without bindings, which is joined without broadcasts from the
    /// database (told so if it asked for `replication_ready`).
    pub fn failed(self, reason: &str) {
        if self.optional {
            if self.abandoned() {
                return;
            }
            self.answer("ok", serde_json::json!({ "postgres_changes": [] }));
            let t = &self.target;
            if t.hub.join_unless(&t.key, self.subscriber.clone(), &t.ended)
                && self.replication_ready
            {
                self.system("system", "error", reason);
            }
            return;
        }
        self.target.ended.store(true, Ordering::Release);
        self.answer("error", serde_json::json!({ "reason": reason }));
    }

    fn system(&self, extension: &str, status: &str, message: &str) {
        let system = serde_json::json!({
            "extension": extension,
            "status": status,
            "message": message,
            "channel": self.target.channel(),
        });
        self.target.send("system", None, system.to_string());
    }

    /// Whether the join was given up (the socket left, re-joined or closed) while waiting.
    pub fn abandoned(&self) -> bool {
        self.target.ended()
    }

    fn answer(&self, status: &str, response: serde_json::Value) {
        let payload = serde_json::json!({ "status": status, "response": response });
        self.target
            .send("phx_reply", self.msg_ref.clone(), payload.to_string());
    }
}

/// What a socket keeps of a subscription it handed to the feed: ending it stops the
/// feed's deliveries and an answer still to come.
#[derive(Debug, Clone)]
pub struct Handle {
    ended: Arc<AtomicBool>,
    pub identity: SharedIdentity,
    writes: Arc<AtomicBool>,
    join_ref: JoinRef,
}

impl Handle {
    pub fn end(&self) {
        self.ended.store(true, Ordering::Release);
    }

    /// Whether the join was refused (or the subscription ended).
    pub fn is_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Whether the tenant's policies let the (private) channel send.
    pub fn may_write(&self) -> bool {
        self.writes.load(Ordering::Acquire)
    }

    /// The channel was joined again on a resumed socket: the feed's messages carry the new
    /// join ref (a client drops lifecycle messages of another join).
    pub fn rejoined(&self, join_ref: Option<String>) {
        *self.join_ref.lock().unwrap_or_else(|e| e.into_inner()) = join_ref;
    }
}

/// What a join asked for, as the feed needs it.
pub struct Join<'a> {
    pub topic: &'a str,
    pub private: bool,
    pub msg_ref: Option<String>,
    pub replication_ready: bool,
    pub replay: Option<Replay>,
}

/// The parts of a join: what the feed gets, and what the socket keeps.
pub fn subscription(
    hub: Arc<Hub>,
    subscriber: Subscriber,
    join: Join<'_>,
    bindings: Vec<Binding>,
    identity: SharedIdentity,
) -> (Subscription, Handle) {
    let Join {
        topic,
        private,
        msg_ref,
        replication_ready,
        replay,
    } = join;
    let ended = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicBool::new(false));
    let join_ref: JoinRef = Arc::new(std::sync::Mutex::new(subscriber.join_ref.clone()));
    let changes = !bindings.is_empty();
    let echo = bindings
        .iter()
        .map(Binding::reply)
        .collect::<Vec<_>>()
        .into();
    let target = Target {
        out: subscriber.out.clone(),
        vsn: subscriber.vsn,
        ended: ended.clone(),
        hub: hub.clone(),
        key: crate::hub::channel_key(topic, private).into_owned(),
        topic: topic.to_owned(),
        join_ref: join_ref.clone(),
        socket: subscriber.socket,
    };
    let sub = Subscription {
        socket: subscriber.socket,
        topic: topic.to_owned(),
        private,
        bindings,
        writes: writes.clone(),
        identity: identity.clone(),
        target: target.clone(),
        replay,
        ready: Ready {
            target,
            subscriber,
            changes,
            replication_ready,
            optional: !changes && !private,
            msg_ref,
            echo,
        },
    };
    (
        sub,
        Handle {
            ended,
            identity,
            writes,
            join_ref,
        },
    )
}
