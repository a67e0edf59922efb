//! Who is present on a tenant's topics, from this node's sockets and (in a cluster) from
//! the other nodes' sockets as they relay them. A presence is known by its origin (`None`
//! for this node, else the node it came from) and that node's socket id; sockets that want
//! presence hear every change as a `presence_diff`, whatever node it happened on.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Frame, Hub, SocketId, Topic};
use crate::fabric::PresenceChange;
use crate::protocol::{self, Vsn};

/// One socket's presence on a topic: its key and what it tracked (a JSON object with its
/// `phx_ref` in it).
#[derive(Debug, Clone)]
pub(super) struct Presence {
    /// The node the socket is on (`None`: this one).
    origin: Option<Arc<str>>,
    socket: SocketId,
    key: String,
    meta: serde_json::Map<String, serde_json::Value>,
}

impl Presence {
    fn is(&self, origin: Option<&str>, socket: SocketId) -> bool {
        self.socket == socket && self.origin.as_deref() == origin
    }
}

impl Hub {
    /// `socket` (of this node) is present on `topic` under `key` with `meta` (a JSON
    /// object), in place of what it tracked before; every socket that wants presence, here
    /// and on the other nodes, hears of the change.
    pub fn track(
        &self,
        topic: &str,
        socket: SocketId,
        key: &str,
        mut meta: serde_json::Map<String, serde_json::Value>,
    ) {
        let n = self.next_ref.fetch_add(1, Ordering::Relaxed);
        meta.insert("phx_ref".into(), format!("F{n:x}").into());
        {
            let mut topics = self.lock();
            let Some(t) = topics.get_mut(topic) else {
                return;
            };
            // Tracking turns presence on for the socket, as in Realtime.
            if let Some(s) = t.subs.iter_mut().find(|s| s.socket == socket) {
                s.presence = true;
            }
            track_in(t, topic, None, socket, key, meta.clone());
        }
        self.relay_presence(&PresenceChange::Track {
            topic: topic.to_owned(),
            socket,
            key: key.to_owned(),
            meta,
        });
    }

    /// `socket` (of this node) is no longer present on `topic`.
    pub fn untrack(&self, topic: &str, socket: SocketId) {
        let untracked = self
            .lock()
            .get_mut(topic)
            .is_some_and(|t| untrack_in(t, topic, None, socket));
        if untracked {
            self.relay_untrack(topic, socket);
        }
    }

    pub(super) fn relay_untrack(&self, topic: &str, socket: SocketId) {
        self.relay_presence(&PresenceChange::Untrack {
            topic: topic.to_owned(),
            socket,
        });
    }

    fn relay_presence(&self, change: &PresenceChange) {
        if let Some((tenant, slot)) = &self.relay {
            if let Some(relay) = slot.get() {
                relay.presence(tenant, change);
            }
        }
    }

    /// A presence change node `origin` relayed.
    pub fn presence_relayed(&self, origin: &str, change: PresenceChange) {
        let mut topics = self.lock();
        match change {
            PresenceChange::Track {
                topic,
                socket,
                key,
                meta,
            } => {
                let t = topics.entry(topic.clone()).or_default();
                track_in(t, &topic, Some(origin), socket, &key, meta);
            }
            PresenceChange::Untrack { topic, socket } => {
                if let Some(t) = topics.get_mut(&topic) {
                    untrack_in(t, &topic, Some(origin), socket);
                    if t.is_empty() {
                        topics.remove(&topic);
                    }
                }
            }
        }
    }

    /// Node `origin` is gone (or starts over): its presences leave.
    pub fn drop_origin(&self, origin: &str) {
        let mut topics = self.lock();
        for (topic, t) in topics.iter_mut() {
            let (gone, kept) = std::mem::take(&mut t.presences)
                .into_iter()
                .partition::<Vec<_>, _>(|p| p.origin.as_deref() == Some(origin));
            t.presences = kept;
            if !gone.is_empty() {
                send_diff(t, topic, std::iter::empty(), gone.iter());
            }
        }
        topics.retain(|_, t| !t.is_empty());
    }

    /// This node's own presences, as the changes that would tell another node of them.
    pub fn local_presences(&self) -> Vec<PresenceChange> {
        self.lock()
            .iter()
            .flat_map(|(topic, t)| {
                t.presences
                    .iter()
                    .filter(|p| p.origin.is_none())
                    .map(|p| PresenceChange::Track {
                        topic: topic.clone(),
                        socket: p.socket,
                        key: p.key.clone(),
                        meta: p.meta.clone(),
                    })
            })
            .collect()
    }
}

fn track_in(
    t: &mut Topic,
    topic: &str,
    origin: Option<&str>,
    socket: SocketId,
    key: &str,
    meta: serde_json::Map<String, serde_json::Value>,
) {
    let old: Vec<Presence> = t
        .presences
        .iter()
        .filter(|p| p.is(origin, socket))
        .cloned()
        .collect();
    t.presences.retain(|p| !p.is(origin, socket));
    let new = Presence {
        origin: origin.map(Arc::from),
        socket,
        key: key.to_owned(),
        meta,
    };
    t.presences.push(new.clone());
    send_diff(t, topic, std::iter::once(&new), old.iter());
}

/// Removes the presence of `socket` of `origin` from `t`, telling its sockets; whether it
/// had one.
pub(super) fn untrack_in(
    t: &mut Topic,
    topic: &str,
    origin: Option<&str>,
    socket: SocketId,
) -> bool {
    let gone: Vec<Presence> = t
        .presences
        .iter()
        .filter(|p| p.is(origin, socket))
        .cloned()
        .collect();
    if gone.is_empty() {
        return false;
    }
    t.presences.retain(|p| !p.is(origin, socket));
    send_diff(t, topic, std::iter::empty(), gone.iter());
    true
}

/// Presences by key, as Phoenix sends them: `{key: {"metas": [meta, ...]}}`.
pub(super) fn map<'a>(presences: impl Iterator<Item = &'a Presence>) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    for p in presences {
        let entry = map
            .entry(p.key.clone())
            .or_insert_with(|| serde_json::json!({ "metas": [] }));
        if let Some(metas) = entry.get_mut("metas").and_then(|m| m.as_array_mut()) {
            metas.push(serde_json::Value::Object(p.meta.clone()));
        }
    }
    serde_json::Value::Object(map)
}

/// Sends `presence_diff` with `joins` and `leaves` to every socket of `t` that wants
/// presence, encoded once per version.
fn send_diff<'a>(
    t: &Topic,
    topic: &str,
    joins: impl Iterator<Item = &'a Presence>,
    leaves: impl Iterator<Item = &'a Presence>,
) {
    if !t.subs.iter().any(|s| s.presence) {
        return;
    }
    let diff = serde_json::json!({ "joins": map(joins), "leaves": map(leaves) });
    let mut frames: [Option<Option<Frame>>; 2] = [None, None];
    for s in t.subs.iter().filter(|s| s.presence) {
        let i = usize::from(s.vsn == Vsn::V2);
        let f = frames[i].get_or_insert_with(|| frame(s.vsn, topic, "presence_diff", diff.clone()));
        if let Some(f) = f {
            s.out.push(f.clone());
        }
    }
}

pub(super) fn frame(
    vsn: Vsn,
    topic: &str,
    event: &str,
    payload: serde_json::Value,
) -> Option<Frame> {
    let m = protocol::Message {
        join_ref: None,
        msg_ref: None,
        topic: super::client_topic(topic).to_owned(),
        event: event.to_owned(),
        payload: protocol::Payload::Json(payload.to_string().into()),
    };
    protocol::encode_text(vsn, &m).map(|t| Frame::Text(t.into()))
}
