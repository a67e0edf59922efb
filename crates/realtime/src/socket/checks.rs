//! What a socket checks before it lets a join or a message through: the tenant's limits and
//! the channel's token, and how a channel that fails them is shut down.

use bytes::Bytes;

use super::{JoinPayload, Socket, TokenUpdate};
use crate::feed::Identity;
use crate::hub::Hub;
use crate::jwt::JwtError;
use crate::protocol::{Message, Payload};

/// A `{"reason": ...}` reply body.
pub(super) fn reason_json(reason: &str) -> String {
    serde_json::json!({ "reason": reason }).to_string()
}

/// A token refusal as Realtime words it on a join.
fn join_refusal(e: &JwtError) -> String {
    let code = match e {
        JwtError::Expired(_) | JwtError::MissingClaims => "InvalidJWTToken",
        JwtError::Malformed => "MalformedJWT",
        JwtError::Signature => "JwtSignatureError",
        JwtError::NoKey(_) | JwtError::NoSigner => "JwtSignerError",
    };
    format!("{code}: {e}")
}

/// Why a private channel may not be joined (Realtime's words).
pub(crate) fn unauthorized_read(topic: &str) -> String {
    format!(
        "Unauthorized: You do not have permissions to read from this Channel topic: {}",
        sub_topic(topic)
    )
}

/// Why a private channel may not be sent to (Realtime's words).
pub(crate) fn unauthorized_write(topic: &str) -> String {
    format!(
        "Unauthorized: You do not have permissions to write to this Channel topic: {}",
        sub_topic(topic)
    )
}

/// A channel's name without its `realtime:` prefix, as `system` messages name it.
pub(super) fn sub_topic(topic: &str) -> &str {
    topic.strip_prefix("realtime:").unwrap_or(topic)
}

impl Socket {
    /// Whether `join` may join `topic`, in Realtime's order of checks; the expiry and
    /// identity of the token the channel will run on, or the reason it may not.
    pub(super) fn admit(
        &self,
        hub: &Hub,
        topic: &str,
        join: &JoinPayload,
    ) -> Result<(i64, Identity), String> {
        let limits = hub.meter().limits();
        if limits.private_only && !join.config.private {
            return Err("PrivateOnly: This project only allows private channels".into());
        }
        hub.meter().join().map_err(|over| over.to_string())?;
        if !self.joined.contains_key(topic) && self.joined.len() >= limits.max_channels {
            return Err("ChannelRateLimitReached: Too many channels".into());
        }
        match &join.access_token {
            Some(t) => self
                .verifier
                .verify(t, crate::jwt::now())
                .map(|c| (c.exp, Identity::of(&c)))
                .map_err(|e| join_refusal(&e)),
            None => Ok((self.socket_exp, self.identity.clone())),
        }
    }

    /// Counts a message from the client against the tenant's rates; when it is over, the
    /// channel is shut down and false returned.
    pub(super) fn metered(&mut self, hub: &Hub, topic: &str, bytes: usize) -> bool {
        match hub.meter().event(bytes) {
            Ok(()) => true,
            Err(over) => {
                self.shut_down(hub, topic, &over.to_string());
                false
            }
        }
    }

    /// `access_token`: the channel runs on the new token from now, or is shut down.
    pub(super) fn token_update(&mut self, hub: &Hub, m: Message) {
        let token = match &m.payload {
            Payload::Json(p) => serde_json::from_slice::<TokenUpdate>(p).ok(),
            Payload::Binary(_) => None,
        };
        let verified = match token {
            Some(t) => self
                .verifier
                .verify(&t.access_token, crate::jwt::now())
                .map_err(|e| e.to_string()),
            None => Err(JwtError::Malformed.to_string()),
        };
        match verified {
            Ok(claims) => self.runs_on(hub, &m.topic, claims.exp, Identity::of(&claims)),
            Err(why) => self.shut_down(hub, &m.topic, &why),
        }
    }

    /// The channel on `topic` runs on a token with `identity`, expiring at `exp`, from
    /// now: its changes are authorised as that token's role, and a private channel's
    /// access is checked again (when the token changed).
    pub(super) fn runs_on(&mut self, hub: &Hub, topic: &str, exp: i64, identity: Identity) {
        let Some(j) = self.joined.get_mut(topic) else {
            return;
        };
        j.exp = exp;
        if let Some(changes) = &j.changes {
            let mut current = changes.identity.lock().unwrap_or_else(|e| e.into_inner());
            if *current == identity {
                return;
            }
            *current = identity;
            drop(current);
            if j.private {
                if let Some((tenant, feed)) = hub.feed() {
                    feed.recheck(tenant, self.id, topic);
                }
            }
        }
    }

    /// Ends the socket's channel on `topic`, telling the client why (a `system` message,
    /// then `phx_close`), as Realtime does when it stops a channel.
    pub(crate) fn shut_down(&mut self, hub: &Hub, topic: &str, message: &str) {
        let Some(joined) = self.joined.remove(topic) else {
            return;
        };
        self.ended(hub, topic, &joined);
        let system = serde_json::json!({
            "extension": "system",
            "status": "error",
            "message": message,
            "channel": sub_topic(topic),
        });
        for (event, payload) in [("system", system.to_string()), ("phx_close", "{}".into())] {
            self.send(&Message {
                join_ref: joined.join_ref.clone(),
                msg_ref: None,
                topic: topic.to_owned(),
                event: event.into(),
                payload: Payload::Json(Bytes::from(payload)),
            });
        }
    }
}
