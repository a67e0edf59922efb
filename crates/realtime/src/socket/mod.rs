//! One socket's side of the Phoenix protocol, apart from its transport: heartbeats, joins
//! (a re-join of a joined topic replacing the old one), leaves, broadcasts with `self` and
//! `ack`, presence `track` and `untrack`, and the replies each gets, written to the
//! socket's own queue.
//!
//! Each channel runs on a token: the one its join carried (`access_token`), else the
//! socket's. A token update is verified again; a bad one, or the token's expiry, shuts the
//! channel down with a `system` message saying why and a `phx_close`, as Realtime does.
//! The tenant's limits are checked on every join and every message from the client.
//!
//! Errors use Realtime's `{"reason": ...}` replies where clients match on them; a frame
//! that is not a Phoenix message is an error for the transport to close the socket with.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::feed::{Handle, Identity, Replay, SharedIdentity};
use crate::hub::{Frame, Hub, Outbox, SocketId, Subscriber};
use crate::jwt::{Claims, JwtError, Verifier};
pub use crate::limits::Limits;
use crate::protocol::{self, Inbound, Message, Payload, ProtocolError, UserBroadcast, Vsn};

pub struct Socket {
    pub id: SocketId,
    pub vsn: Vsn,
    out: Outbox,
    verifier: Arc<Verifier>,
    /// Expiry of the token the socket connected with (seconds since the epoch).
    socket_exp: i64,
    /// Who the socket's token says it is (to the database, for Postgres Changes).
    identity: Identity,
    joined: HashMap<String, Joined>,
    /// Channels joined before the socket was resumed on a new connection and not joined
    /// again since: a re-join with the same config keeps them (see `resumed.rs`).
    carried: std::collections::HashSet<String>,
}

struct Joined {
    join_ref: Option<String>,
    ack: bool,
    /// The key this socket's presence is tracked under (`presence.key`, or one made up).
    presence_key: String,
    /// When the channel's token expires (seconds since the epoch).
    exp: i64,
    /// The channel's subscription handed to the change feed (bindings, or private).
    changes: Option<Handle>,
    private: bool,
    /// A digest of the join's config: a resumed socket's re-join keeps the channel only
    /// when it asks for the same.
    config: u64,
}

impl Joined {
    /// The channel's key in the hub.
    fn key<'a>(&self, topic: &'a str) -> std::borrow::Cow<'a, str> {
        crate::hub::channel_key(topic, self.private)
    }
}

/// A join config field that is null (as the Python client sends an unset `broadcast`)
/// reads as its default.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[derive(Deserialize, Default)]
struct JoinPayload {
    #[serde(default, deserialize_with = "null_as_default")]
    config: JoinConfig,
    #[serde(default, deserialize_with = "null_as_default")]
    access_token: Option<String>,
}

#[derive(Deserialize, Default)]
struct JoinConfig {
    #[serde(default, deserialize_with = "null_as_default")]
    broadcast: BroadcastConfig,
    #[serde(default, deserialize_with = "null_as_default")]
    presence: PresenceConfig,
    #[serde(default, deserialize_with = "null_as_default")]
    private: bool,
    #[serde(default, deserialize_with = "null_as_default")]
    postgres_changes: Vec<serde_json::Value>,
}

#[derive(Deserialize)]
struct TokenUpdate {
    access_token: String,
}

#[derive(Deserialize, Default)]
struct PresenceConfig {
    #[serde(default, deserialize_with = "null_as_default")]
    key: String,
    #[serde(default, deserialize_with = "null_as_default")]
    enabled: bool,
}

/// A `presence` push: `{"type": "presence", "event": "track" | "untrack", "payload": {...}}`.
#[derive(Deserialize)]
struct PresencePush {
    event: String,
    #[serde(default)]
    payload: Option<serde_json::Value>,
}

#[derive(Deserialize, Default)]
struct BroadcastConfig {
    #[serde(rename = "self", default, deserialize_with = "null_as_default")]
    receive_own: bool,
    #[serde(default, deserialize_with = "null_as_default")]
    ack: bool,
    /// Asks for a `system` message once broadcasts from the database are captured.
    #[serde(default, deserialize_with = "null_as_default")]
    replication_ready: bool,
    /// Asks for the private channel's earlier broadcasts from the database.
    #[serde(default, deserialize_with = "null_as_default")]
    replay: Option<ReplayConfig>,
}

#[derive(Deserialize)]
struct ReplayConfig {
    since: i64,
    #[serde(default)]
    limit: Option<i64>,
}

/// A broadcast as a text frame carries it.
#[derive(Deserialize)]
struct TextBroadcast<'a> {
    event: String,
    #[serde(borrow, default)]
    payload: Option<&'a RawValue>,
}

impl Socket {
    /// A socket that connected with a token `verifier` accepted, carrying `claims`.
    pub fn new(
        id: SocketId,
        vsn: Vsn,
        out: Outbox,
        verifier: Arc<Verifier>,
        claims: &Claims,
    ) -> Socket {
        Socket {
            id,
            vsn,
            out,
            verifier,
            socket_exp: claims.exp,
            identity: Identity::of(claims),
            joined: HashMap::new(),
            carried: Default::default(),
        }
    }

    /// When the first of the socket's channels' tokens expires, if it has channels.
    pub fn expiry(&self) -> Option<i64> {
        self.joined.values().map(|j| j.exp).min()
    }

    /// Shuts down every channel whose token has expired by `now`.
    pub fn expire(&mut self, hub: &Hub, now: i64) {
        let due: Vec<(String, i64)> = self
            .joined
            .iter()
            .filter(|(_, j)| j.exp <= now)
            .map(|(t, j)| (t.clone(), j.exp))
            .collect();
        for (topic, exp) in due {
            self.shut_down(hub, &topic, &JwtError::Expired(now - exp).to_string());
        }
    }

    pub fn channels(&self) -> usize {
        self.joined.len()
    }

    /// A text frame from the client.
    pub fn on_text(&mut self, hub: &Arc<Hub>, text: &str) -> Result<(), ProtocolError> {
        let m = protocol::decode_text(self.vsn, text)?;
        self.on_message(hub, m);
        Ok(())
    }

    /// A binary frame from the client.
    pub fn on_binary(&mut self, hub: &Arc<Hub>, frame: &[u8]) -> Result<(), ProtocolError> {
        match protocol::decode_binary(frame)? {
            Inbound::Message(m) => self.on_message(hub, m),
            Inbound::UserBroadcast(b) => self.on_broadcast(hub, b),
        }
        Ok(())
    }

    /// The socket closed: its subscriptions end.
    pub fn close(&mut self, hub: &Hub) {
        for (topic, joined) in std::mem::take(&mut self.joined) {
            self.ended(hub, &topic, &joined);
        }
    }

    /// What a channel leaves behind when it ends: its subscription and its changes.
    fn ended(&self, hub: &Hub, topic: &str, joined: &Joined) {
        if let Some((tenant, feed)) = hub.feed() {
            if let Some(changes) = &joined.changes {
                changes.end();
                feed.unsubscribe(tenant, self.id, topic);
            }
        }
        hub.leave(&joined.key(topic), self.id);
    }

    /// Whether `topic` is joined (a join refused after the fact does not count).
    fn is_joined(&self, topic: &str) -> bool {
        self.joined
            .get(topic)
            .is_some_and(|j| !j.changes.as_ref().is_some_and(Handle::is_ended))
    }

    fn on_message(&mut self, hub: &Arc<Hub>, m: Message) {
        match (m.topic.as_str(), m.event.as_str()) {
            ("phoenix", "heartbeat") => self.reply(&m, "ok", "{}"),
            (_, "phx_join") => self.join(hub, m),
            (_, "phx_leave") => self.leave(hub, m),
            _ if !self.is_joined(&m.topic) => {
                self.reply(&m, "error", r#"{"reason":"unmatched topic"}"#)
            }
            (_, "broadcast") => {
                let Payload::Json(p) = &m.payload else {
                    return self.reply(&m, "error", r#"{"reason":"malformed broadcast"}"#);
                };
                let Ok(b) = serde_json::from_slice::<TextBroadcast<'_>>(p) else {
                    return self.reply(&m, "error", r#"{"reason":"malformed broadcast"}"#);
                };
                let payload = Payload::Json(Bytes::copy_from_slice(
                    b.payload.map_or("{}", |r| r.get()).as_bytes(),
                ));
                let b = UserBroadcast {
                    join_ref: m.join_ref,
                    msg_ref: m.msg_ref,
                    topic: m.topic,
                    event: b.event,
                    meta: None,
                    payload,
                };
                self.on_broadcast(hub, b);
            }
            (_, "presence") => {
                if self.metered(hub, &m.topic, 0) {
                    self.presence(hub, m)
                }
            }
            (_, "access_token") => {
                if self.metered(hub, &m.topic, 0) {
                    self.token_update(hub, m)
                }
            }
            _ => self.reply(&m, "error", r#"{"reason":"unknown event"}"#),
        }
    }

    fn join(&mut self, hub: &Arc<Hub>, m: Message) {
        let join = match &m.payload {
            Payload::Json(p) => serde_json::from_slice::<JoinPayload>(p).unwrap_or_default(),
            Payload::Binary(_) => JoinPayload::default(),
        };
        let (exp, identity) = match self.admit(hub, &m.topic, &join) {
            Ok(admitted) => admitted,
            Err(reason) => return self.reply(&m, "error", &reason_json(&reason)),
        };
        if !crate::hub::valid_topic(&m.topic) {
            return self.reply(&m, "error", r#"{"reason":"a topic may not contain NUL"}"#);
        }
        let bindings = match join
            .config
            .postgres_changes
            .iter()
            .map(crate::changes::Binding::parse)
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(b) => b,
            Err(e) => return self.reply(&m, "error", &reason_json(&e.to_string())),
        };
        let private = join.config.private;
        let replay = match &join.config.broadcast.replay {
            None => None,
            Some(_) if !private => {
                return self.reply(
                    &m,
                    "error",
                    r#"{"reason":"Replay is only available on private channels"}"#,
                )
            }
            Some(r) => match r.limit.unwrap_or(i64::from(Replay::MAX)) {
                n @ 1..=25 => Some(Replay {
                    since_ms: r.since,
                    limit: n as u32,
                }),
                _ => {
                    return self.reply(
                        &m,
                        "error",
                        r#"{"reason":"Replay limit must be between 1 and 25"}"#,
                    )
                }
            },
        };
        if (!bindings.is_empty() || private) && hub.feed().is_none() {
            let why = if private {
                checks::unauthorized_read(&m.topic)
            } else {
                "Postgres Changes are not available for this tenant".into()
            };
            return self.reply(&m, "error", &reason_json(&why));
        }
        let config_digest = resumed::digest(&m.payload);
        if self.keeps_on_rejoin(hub, &m.topic, config_digest) {
            let c = &join.config;
            let wants = resumed::Wants {
                receive_own: c.broadcast.receive_own,
                presence: c.presence.enabled,
                replication_ready: c.broadcast.replication_ready,
            };
            return self.rejoin_kept(hub, &m, exp, identity, &bindings, wants);
        }
        // A re-join replaces the channel: the old one's subscriptions end first.
        if let Some(old) = self.joined.remove(&m.topic) {
            self.ended(hub, &m.topic, &old);
        }
        let config = join.config;
        let subscriber = Subscriber {
            socket: self.id,
            join_ref: m.join_ref.clone(),
            vsn: self.vsn,
            receive_own: config.broadcast.receive_own,
            presence: config.presence.enabled,
            out: self.out.clone(),
        };
        let presence_key = if config.presence.key.is_empty() {
            made_up_key(self.id)
        } else {
            config.presence.key
        };
        // With a database, every join waits for its capture: the channel may get broadcasts
        // from the database, and SUBSCRIBED means none sent after it is missed.
        let changes = hub.feed().map(|(tenant, feed)| {
            let identity: SharedIdentity = Arc::new(std::sync::Mutex::new(identity));
            let (sub, handle) = crate::feed::subscription(
                hub.clone(),
                subscriber.clone(),
                crate::feed::Join {
                    topic: &m.topic,
                    private,
                    msg_ref: m.msg_ref.clone(),
                    replication_ready: config.broadcast.replication_ready,
                    replay,
                },
                bindings,
                identity,
            );
            feed.subscribe(tenant, sub);
            handle
        });
        let answered_later = changes.is_some();
        self.joined.insert(
            m.topic.clone(),
            Joined {
                join_ref: m.join_ref.clone(),
                ack: config.broadcast.ack,
                presence_key,
                exp,
                changes,
                private,
                config: config_digest,
            },
        );
        if answered_later {
            // The feed answers once capture covers the bindings (see `crate::feed`).
            return;
        }
        // The reply first, then the subscription (which queues the presence state), as
        // Phoenix orders them; nothing runs between the two.
        self.reply(&m, "ok", r#"{"postgres_changes":[]}"#);
        hub.join(&m.topic, subscriber);
        debug_assert!(!private);
    }

    fn presence(&mut self, hub: &Hub, m: Message) {
        let push = match &m.payload {
            Payload::Json(p) => serde_json::from_slice::<PresencePush>(p).ok(),
            Payload::Binary(_) => None,
        };
        let Some(push) = push else {
            return self.reply(&m, "error", r#"{"reason":"malformed presence message"}"#);
        };
        let Some(joined) = self.joined.get(&m.topic) else {
            return;
        };
        let key = joined.presence_key.clone();
        let channel = joined.key(&m.topic).into_owned();
        match push.event.as_str() {
            "track" => {
                let meta = match push.payload {
                    None => serde_json::Map::new(),
                    Some(serde_json::Value::Object(o)) => o,
                    Some(_) => {
                        return self.reply(
                            &m,
                            "error",
                            r#"{"reason":"a presence payload is a JSON object"}"#,
                        )
                    }
                };
                hub.track(&channel, self.id, &key, meta);
                self.reply(&m, "ok", "{}");
            }
            "untrack" => {
                hub.untrack(&channel, self.id);
                self.reply(&m, "ok", "{}");
            }
            _ => self.reply(&m, "error", r#"{"reason":"unknown presence event"}"#),
        }
    }

    fn leave(&mut self, hub: &Hub, m: Message) {
        let Some(joined) = self.joined.remove(&m.topic) else {
            return self.reply(&m, "error", r#"{"reason":"unmatched topic"}"#);
        };
        self.ended(hub, &m.topic, &joined);
        self.reply(&m, "ok", "{}");
        self.send(&Message {
            join_ref: m.join_ref,
            msg_ref: m.msg_ref,
            topic: m.topic,
            event: "phx_close".into(),
            payload: Payload::Json(Bytes::from_static(b"{}")),
        });
    }

    fn on_broadcast(&mut self, hub: &Hub, mut b: UserBroadcast) {
        let Some(joined) = self
            .joined
            .get(&b.topic)
            .filter(|_| self.is_joined(&b.topic))
        else {
            return self.reply_to(
                &b.topic,
                b.join_ref,
                b.msg_ref,
                "error",
                r#"{"reason":"unmatched topic"}"#,
            );
        };
        let ack = joined.ack;
        let key = joined.key(&b.topic).into_owned();
        if joined.private && !joined.changes.as_ref().is_some_and(Handle::may_write) {
            let why = reason_json(&checks::unauthorized_write(&b.topic));
            return self.reply_to(&b.topic, b.join_ref, b.msg_ref, "error", &why);
        }
        let size = match &b.payload {
            Payload::Json(p) | Payload::Binary(p) => p.len(),
        };
        if !self.metered(hub, &b.topic, size) {
            return;
        }
        if size > hub.meter().limits().max_payload {
            return self.reply_to(
                &b.topic,
                b.join_ref,
                b.msg_ref,
                "error",
                r#"{"reason":"Payload too large: max_payload_size_in_kb exceeded"}"#,
            );
        }
        let topic = std::mem::replace(&mut b.topic, key);
        hub.broadcast(&b, Some(self.id));
        if ack {
            self.reply_to(&topic, b.join_ref, b.msg_ref, "ok", "{}");
        }
    }

    fn reply(&self, m: &Message, status: &str, response: &str) {
        self.reply_to(
            &m.topic,
            m.join_ref.clone(),
            m.msg_ref.clone(),
            status,
            response,
        )
    }

    fn reply_to(
        &self,
        topic: &str,
        join_ref: Option<String>,
        msg_ref: Option<String>,
        status: &str,
        response: &str,
    ) {
        let payload = format!("{{\"status\":\"{status}\",\"response\":{response}}}");
        self.send(&Message {
            join_ref,
            msg_ref,
            topic: topic.to_owned(),
            event: "phx_reply".into(),
            payload: Payload::Json(payload.into()),
        });
    }

    fn send(&self, m: &Message) {
        if let Some(t) = protocol::encode_text(self.vsn, m) {
            self.out.push(Frame::Text(t.into()));
        }
    }

    /// The socket's join ref for `topic`, if it is joined.
    pub fn join_ref(&self, topic: &str) -> Option<&str> {
        self.joined.get(topic)?.join_ref.as_deref()
    }
}

/// A presence key for a socket that named none: unique enough to tell sockets apart.
fn made_up_key(socket: SocketId) -> String {
    use std::hash::BuildHasher;
    let s = std::collections::hash_map::RandomState::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{:016x}{:016x}",
        s.hash_one((socket, now)),
        s.hash_one((now, socket, 1u8))
    )
}

mod checks;
mod resumed;
#[cfg(test)]
mod tests;

use checks::reason_json;
