//! A socket resumed on a new connection (see [`crate::resume`]): the client joins its
//! channels again, as the official clients do after any reconnect, and each re-join that
//! asks for what the channel already has is answered as a join would be — the reply with
//! the bindings' ids, the `system` messages, the presence state — while the subscription
//! goes on underneath, so nothing sent to the channel meanwhile is lost or sent twice. A
//! re-join that asks for something else replaces the channel as usual.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::checks::sub_topic;
use super::Socket;
use crate::changes::Binding;
use crate::feed::Identity;
use crate::hub::{Hub, Subscriber};
use crate::jwt::{Claims, Verifier};
use crate::protocol::{Message, Payload};

/// What a kept channel's subscriber asks for (the same as before: its config is).
pub(super) struct Wants {
    pub receive_own: bool,
    pub presence: bool,
    pub replication_ready: bool,
}

/// A digest of a join's `config` (its token aside, which may have been refreshed).
pub(super) fn digest(payload: &Payload) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    if let Payload::Json(p) = payload {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(p) {
            v.get("config").map(|c| c.to_string()).hash(&mut h);
        }
    }
    h.finish()
}

impl Socket {
    /// The socket goes on over a new connection, whose token (for the same role and
    /// subject) it runs on from now: its channels are kept for the client's re-joins.
    pub fn resumed(&mut self, verifier: Arc<Verifier>, claims: &Claims) {
        self.verifier = verifier;
        self.socket_exp = claims.exp;
        self.identity = Identity::of(claims);
        self.carried = self.joined.keys().cloned().collect();
    }

    /// Whether a join of `topic` with config `digest` continues a channel carried over a
    /// resume (once per channel: a second join replaces it as usual). A channel whose
    /// first join was still waiting to be answered is joined afresh.
    pub(super) fn keeps_on_rejoin(&mut self, hub: &Hub, topic: &str, digest: u64) -> bool {
        self.carried.remove(topic)
            && self.is_joined(topic)
            && self.joined[topic].config == digest
            && hub.has_subscriber(&self.joined[topic].key(topic), self.id)
    }

    /// Answers the re-join `m` of a kept channel as its first join was answered, under the
    /// new join ref, and goes on delivering to it.
    pub(super) fn rejoin_kept(
        &mut self,
        hub: &Arc<Hub>,
        m: &Message,
        exp: i64,
        identity: Identity,
        bindings: &[Binding],
        wants: Wants,
    ) {
        self.runs_on(hub, &m.topic, exp, identity);
        let Some(joined) = self.joined.get_mut(&m.topic) else {
            return;
        };
        joined.join_ref = m.join_ref.clone();
        if let Some(changes) = &joined.changes {
            changes.rejoined(m.join_ref.clone());
        }
        let key = joined.key(&m.topic).into_owned();
        let echo: Vec<serde_json::Value> = bindings.iter().map(Binding::reply).collect();
        self.reply(
            m,
            "ok",
            &serde_json::json!({ "postgres_changes": echo }).to_string(),
        );
        // Replaces the subscriber in place (same socket, same queue): the presence state
        // follows the reply, as on any join.
        hub.join(
            &key,
            Subscriber {
                socket: self.id,
                join_ref: m.join_ref.clone(),
                vsn: self.vsn,
                receive_own: wants.receive_own,
                presence: wants.presence,
                out: self.out.clone(),
            },
        );
        if !bindings.is_empty() {
            self.system(m, "postgres_changes", "Subscribed to PostgreSQL");
        }
        if wants.replication_ready {
            self.system(m, "system", "Replication connection established");
        }
    }

    fn system(&self, m: &Message, extension: &str, message: &str) {
        let payload = serde_json::json!({
            "extension": extension,
            "status": "ok",
            "message": message,
            "channel": sub_topic(&m.topic),
        });
        self.send(&Message {
            join_ref: m.join_ref.clone(),
            msg_ref: None,
            topic: m.topic.clone(),
            event: "system".into(),
            payload: Payload::Json(payload.to_string().into()),
        });
    }
}
