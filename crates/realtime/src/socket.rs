//! One socket's side of the Phoenix protocol, apart from its transport: heartbeats, joins
//! (a re-join of a joined topic replacing the old one), leaves, broadcasts with `self` and
//! `ack`, presence `track` and `untrack`, and the replies each gets, written to the
//! socket's own queue.
//!
//! Errors use Realtime's `{"reason": ...}` replies where clients match on them; a frame
//! that is not a Phoenix message is an error for the transport to close the socket with.

use std::collections::HashMap;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::hub::{Frame, Hub, Outbox, SocketId, Subscriber};
use crate::protocol::{self, Inbound, Message, Payload, ProtocolError, UserBroadcast, Vsn};

/// The limits a socket is held to.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_channels: usize,
    /// Bytes of a broadcast's payload.
    pub max_payload: usize,
}

pub struct Socket {
    pub id: SocketId,
    pub vsn: Vsn,
    out: Outbox,
    limits: Limits,
    joined: HashMap<String, Joined>,
}

struct Joined {
    join_ref: Option<String>,
    ack: bool,
    /// The key this socket's presence is tracked under (`presence.key`, or one made up).
    presence_key: String,
}

#[derive(Deserialize, Default)]
struct JoinPayload {
    #[serde(default)]
    config: JoinConfig,
}

#[derive(Deserialize, Default)]
struct JoinConfig {
    #[serde(default)]
    broadcast: BroadcastConfig,
    #[serde(default)]
    presence: PresenceConfig,
}

#[derive(Deserialize, Default)]
struct PresenceConfig {
    #[serde(default)]
    key: String,
    #[serde(default)]
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
    #[serde(rename = "self", default)]
    receive_own: bool,
    #[serde(default)]
    ack: bool,
}

/// A broadcast as a text frame carries it.
#[derive(Deserialize)]
struct TextBroadcast<'a> {
    event: String,
    #[serde(borrow, default)]
    payload: Option<&'a RawValue>,
}

impl Socket {
    pub fn new(id: SocketId, vsn: Vsn, out: Outbox, limits: Limits) -> Socket {
        Socket {
            id,
            vsn,
            out,
            limits,
            joined: HashMap::new(),
        }
    }

    pub fn channels(&self) -> usize {
        self.joined.len()
    }

    /// A text frame from the client.
    pub fn on_text(&mut self, hub: &Hub, text: &str) -> Result<(), ProtocolError> {
        let m = protocol::decode_text(self.vsn, text)?;
        self.on_message(hub, m);
        Ok(())
    }

    /// A binary frame from the client.
    pub fn on_binary(&mut self, hub: &Hub, frame: &[u8]) -> Result<(), ProtocolError> {
        match protocol::decode_binary(frame)? {
            Inbound::Message(m) => self.on_message(hub, m),
            Inbound::UserBroadcast(b) => self.on_broadcast(hub, b),
        }
        Ok(())
    }

    /// The socket closed: its subscriptions end.
    pub fn close(&mut self, hub: &Hub) {
        for topic in self.joined.keys() {
            hub.leave(topic, self.id);
        }
        self.joined.clear();
    }

    fn on_message(&mut self, hub: &Hub, m: Message) {
        match (m.topic.as_str(), m.event.as_str()) {
            ("phoenix", "heartbeat") => self.reply(&m, "ok", "{}"),
            (_, "phx_join") => self.join(hub, m),
            (_, "phx_leave") => self.leave(hub, m),
            _ if !self.joined.contains_key(&m.topic) => {
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
            (_, "presence") => self.presence(hub, m),
            // The token is checked by the transport, which knows the tenant's keys.
            (_, "access_token") => {}
            _ => self.reply(&m, "error", r#"{"reason":"unknown event"}"#),
        }
    }

    fn join(&mut self, hub: &Hub, m: Message) {
        if !self.joined.contains_key(&m.topic) && self.joined.len() >= self.limits.max_channels {
            return self.reply(
                &m,
                "error",
                r#"{"reason":"Too many channels: max_channels_per_client reached"}"#,
            );
        }
        let config = match &m.payload {
            Payload::Json(p) => serde_json::from_slice::<JoinPayload>(p).unwrap_or_default(),
            Payload::Binary(_) => JoinPayload::default(),
        }
        .config;
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
        self.joined.insert(
            m.topic.clone(),
            Joined {
                join_ref: m.join_ref.clone(),
                ack: config.broadcast.ack,
                presence_key,
            },
        );
        // The reply first, then the subscription (which queues the presence state), as
        // Phoenix orders them; nothing runs between the two.
        self.reply(&m, "ok", r#"{"postgres_changes":[]}"#);
        hub.join(&m.topic, subscriber);
    }

    fn presence(&mut self, hub: &Hub, m: Message) {
        let push = match &m.payload {
            Payload::Json(p) => serde_json::from_slice::<PresencePush>(p).ok(),
            Payload::Binary(_) => None,
        };
        let Some(push) = push else {
            return self.reply(&m, "error", r#"{"reason":"malformed presence message"}"#);
        };
        let key = self
            .joined
            .get(&m.topic)
            .map(|j| j.presence_key.clone())
            .unwrap_or_default();
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
                hub.track(&m.topic, self.id, &key, meta);
                self.reply(&m, "ok", "{}");
            }
            "untrack" => {
                hub.untrack(&m.topic, self.id);
                self.reply(&m, "ok", "{}");
            }
            _ => self.reply(&m, "error", r#"{"reason":"unknown presence event"}"#),
        }
    }

    fn leave(&mut self, hub: &Hub, m: Message) {
        if self.joined.remove(&m.topic).is_none() {
            return self.reply(&m, "error", r#"{"reason":"unmatched topic"}"#);
        }
        hub.leave(&m.topic, self.id);
        self.reply(&m, "ok", "{}");
        self.send(Message {
            join_ref: m.join_ref,
            msg_ref: m.msg_ref,
            topic: m.topic,
            event: "phx_close".into(),
            payload: Payload::Json(Bytes::from_static(b"{}")),
        });
    }

    fn on_broadcast(&mut self, hub: &Hub, b: UserBroadcast) {
        let Some(joined) = self.joined.get(&b.topic) else {
            return self.reply_to(
                &b.topic,
                b.join_ref,
                b.msg_ref,
                "error",
                r#"{"reason":"unmatched topic"}"#,
            );
        };
        let ack = joined.ack;
        let size = match &b.payload {
            Payload::Json(p) | Payload::Binary(p) => p.len(),
        };
        if size > self.limits.max_payload {
            return self.reply_to(
                &b.topic,
                b.join_ref,
                b.msg_ref,
                "error",
                r#"{"reason":"Payload too large: max_payload_size_in_kb exceeded"}"#,
            );
        }
        hub.broadcast(&b, Some(self.id));
        if ack {
            self.reply_to(&b.topic, b.join_ref, b.msg_ref, "ok", "{}");
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
        self.send(Message {
            join_ref,
            msg_ref,
            topic: topic.to_owned(),
            event: "phx_reply".into(),
            payload: Payload::Json(payload.into()),
        });
    }

    fn send(&self, m: Message) {
        if let Some(t) = protocol::encode_text(self.vsn, &m) {
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

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_channels: 2,
        max_payload: 64,
    };

    fn socket(id: SocketId, vsn: Vsn) -> (Socket, tokio::sync::mpsc::Receiver<Frame>) {
        let (out, rx) = Outbox::new(16);
        (Socket::new(id, vsn, out, LIMITS), rx)
    }

    fn texts(rx: &mut tokio::sync::mpsc::Receiver<Frame>) -> Vec<String> {
        let mut v = Vec::new();
        while let Ok(f) = rx.try_recv() {
            v.push(match f {
                Frame::Text(t) => t.to_string(),
                Frame::Binary(b) => format!("binary {:?}", &b[..]),
            });
        }
        v
    }

    #[test]
    fn heartbeats_joins_and_leaves_get_their_replies() {
        let hub = Hub::default();
        let (mut s, mut rx) = socket(1, Vsn::V2);
        s.on_text(&hub, r#"[null,"1","phoenix","heartbeat",{}]"#)
            .unwrap();
        s.on_text(
            &hub,
            r#"["2","2","realtime:room","phx_join",{"config":{"broadcast":{"self":true,"ack":true}},"access_token":"x"}]"#,
        )
        .unwrap();
        assert_eq!(hub.subscribers("realtime:room"), 1);
        s.on_text(&hub, r#"["2","3","realtime:nope","broadcast",{"type":"broadcast","event":"e","payload":{}}]"#)
            .unwrap();
        s.on_text(&hub, r#"["2","4","realtime:room","phx_leave",{}]"#)
            .unwrap();
        assert_eq!(
            texts(&mut rx),
            vec![
                r#"[null,"1","phoenix","phx_reply",{"status":"ok","response":{}}]"#,
                r#"["2","2","realtime:room","phx_reply",{"status":"ok","response":{"postgres_changes":[]}}]"#,
                r#"["2","3","realtime:nope","phx_reply",{"status":"error","response":{"reason":"unmatched topic"}}]"#,
                r#"["2","4","realtime:room","phx_reply",{"status":"ok","response":{}}]"#,
                r#"["2","4","realtime:room","phx_close",{}]"#,
            ]
        );
        assert_eq!(hub.subscribers("realtime:room"), 0);
        assert!(s.on_text(&hub, "not a frame").is_err());
    }

    #[test]
    fn broadcasts_go_to_the_others_with_self_and_ack_as_asked() {
        let hub = Hub::default();
        let (mut a, mut ra) = socket(1, Vsn::V1);
        let (mut b, mut rb) = socket(2, Vsn::V2);
        a.on_text(
            &hub,
            r#"{"topic":"realtime:room","event":"phx_join","payload":{"config":{"broadcast":{"ack":true}}},"ref":"1","join_ref":"1"}"#,
        )
        .unwrap();
        b.on_text(
            &hub,
            r#"["1","1","realtime:room","phx_join",{"config":{"broadcast":{"self":true}}}]"#,
        )
        .unwrap();
        texts(&mut ra);
        texts(&mut rb);
        a.on_text(
            &hub,
            r#"{"topic":"realtime:room","event":"broadcast","payload":{"type":"broadcast","event":"hi","payload":{"x":1}},"ref":"2","join_ref":"1"}"#,
        )
        .unwrap();
        // `a` did not ask for its own, but asked for an ack.
        assert_eq!(
            texts(&mut ra),
            vec![
                r#"{"topic":"realtime:room","event":"phx_reply","payload":{"status":"ok","response":{}},"ref":"2","join_ref":"1"}"#
            ]
        );
        let got = texts(&mut rb);
        assert_eq!(got.len(), 1);
        assert!(got[0].starts_with("binary [4, 13, 2, 0, 1"), "{got:?}");
        // A 2.0 binary push from `b` reaches `a` as 1.0 text, and `b` itself (`self`).
        let mut push = vec![3, 1, 1, 13, 2, 0, 1];
        push.extend_from_slice(b"12realtime:roomyo");
        push.extend_from_slice(br#"{"y":2}"#);
        b.on_binary(&hub, &push).unwrap();
        assert_eq!(
            texts(&mut ra),
            vec![
                r#"{"topic":"realtime:room","event":"broadcast","payload":{"type":"broadcast","event":"yo","payload":{"y":2}},"ref":null,"join_ref":null}"#
            ]
        );
        assert_eq!(texts(&mut rb).len(), 1);
    }

    #[test]
    fn limits_refuse_with_a_reason() {
        let hub = Hub::default();
        let (mut s, mut rx) = socket(1, Vsn::V2);
        for t in ["a", "b", "c"] {
            s.on_text(&hub, &format!(r#"["{t}","{t}","{t}","phx_join",{{}}]"#))
                .unwrap();
        }
        assert_eq!(s.channels(), 2);
        let big = "x".repeat(100);
        s.on_text(
            &hub,
            &format!(
                r#"["a","9","a","broadcast",{{"type":"broadcast","event":"e","payload":"{big}"}}]"#
            ),
        )
        .unwrap();
        let replies = texts(&mut rx);
        assert!(
            replies[2].contains("max_channels_per_client"),
            "{replies:?}"
        );
        assert!(replies[3].contains("max_payload_size_in_kb"), "{replies:?}");
        s.close(&hub);
        assert_eq!(hub.topics(), 0);
    }
}
