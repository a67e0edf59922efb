//! Channels across Shoal nodes. A broadcast from a client of one node reaches the
//! subscribers of every node: the node where it arrived delivers it to its own sockets and
//! hands it to its [`Relay`], which carries it to the other nodes (Shoal's node links);
//! each of them delivers it to its own sockets and relays it no further. Presence goes the
//! same way: each node relays its own sockets' tracks and untracks and, first on every new
//! stream to a peer, a reset and all of them, so the peer's view of this node's presences
//! is whole again after any loss.
//!
//! Each message is one frame, pure and bounded:
//!
//! ```text
//! u32 length of the rest | u8 version (1) | u8 kind | fields
//! kind 1, 2 (a broadcast, JSON or binary payload): tenant, topic, event (u16-prefixed), payload
//! kind 3 (track): tenant, topic, key (u16-prefixed), u64 socket, meta (a JSON object)
//! kind 4 (untrack): tenant, topic (u16-prefixed), u64 socket
//! kind 5 (reset): nothing
//! ```

use bytes::Bytes;

use crate::protocol::{Payload, UserBroadcast};

/// Carries a tenant's broadcasts and presence changes to the other nodes.
pub trait Relay: Send + Sync + 'static {
    fn publish(&self, tenant: &str, b: &UserBroadcast);
    fn presence(&self, tenant: &str, change: &PresenceChange);
}

/// A presence change of one of this node's sockets.
#[derive(Debug, Clone, PartialEq)]
pub enum PresenceChange {
    Track {
        topic: String,
        socket: u64,
        key: String,
        meta: serde_json::Map<String, serde_json::Value>,
    },
    Untrack {
        topic: String,
        socket: u64,
    },
}

/// What a frame carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Relayed {
    Broadcast(String, UserBroadcast),
    Presence(String, PresenceChange),
    /// Forget what the sender said of its presences before.
    Reset,
}

/// The largest relayed frame (a payload is bounded by the tenant's limit well below it).
pub const MAX_FRAME: usize = 64 << 20;

const VERSION: u8 = 1;
const JSON: u8 = 1;
const BINARY: u8 = 2;
const TRACK: u8 = 3;
const UNTRACK: u8 = 4;
const RESET: u8 = 5;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FabricError {
    #[error("relayed message: {0}")]
    Malformed(&'static str),
    #[error("relayed message: a name is longer than 65535 bytes")]
    TooLong,
}

/// `b` of `tenant` as a frame, length prefix included.
pub fn encode(tenant: &str, b: &UserBroadcast) -> Result<Vec<u8>, FabricError> {
    let (kind, payload) = match &b.payload {
        Payload::Json(p) => (JSON, p),
        Payload::Binary(p) => (BINARY, p),
    };
    let names = [tenant.as_bytes(), b.topic.as_bytes(), b.event.as_bytes()];
    frame(kind, &names, None, payload)
}

/// A presence change of `tenant` as a frame, length prefix included.
pub fn encode_presence(tenant: &str, change: &PresenceChange) -> Result<Vec<u8>, FabricError> {
    match change {
        PresenceChange::Track {
            topic,
            socket,
            key,
            meta,
        } => {
            let meta = serde_json::to_vec(meta).map_err(|_| FabricError::Malformed("meta"))?;
            let names = [tenant.as_bytes(), topic.as_bytes(), key.as_bytes()];
            frame(TRACK, &names, Some(*socket), &meta)
        }
        PresenceChange::Untrack { topic, socket } => {
            let names = [tenant.as_bytes(), topic.as_bytes()];
            frame(UNTRACK, &names, Some(*socket), &[])
        }
    }
}

/// The reset frame, length prefix included.
pub fn encode_reset() -> Vec<u8> {
    vec![0, 0, 0, 2, VERSION, RESET]
}

fn frame(
    kind: u8,
    names: &[&[u8]],
    socket: Option<u64>,
    rest: &[u8],
) -> Result<Vec<u8>, FabricError> {
    let len =
        2 + names.iter().map(|n| 2 + n.len()).sum::<usize>() + socket.map_or(0, |_| 8) + rest.len();
    let prefix = u32::try_from(len).map_err(|_| FabricError::TooLong)?;
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(&prefix.to_be_bytes());
    out.push(VERSION);
    out.push(kind);
    for n in names {
        let l = u16::try_from(n.len()).map_err(|_| FabricError::TooLong)?;
        out.extend_from_slice(&l.to_be_bytes());
        out.extend_from_slice(n);
    }
    if let Some(s) = socket {
        out.extend_from_slice(&s.to_be_bytes());
    }
    out.extend_from_slice(rest);
    Ok(out)
}

/// The length of the frame whose 4-byte prefix is `prefix`.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FabricError> {
    let n = u32::from_be_bytes(prefix) as usize;
    if n > MAX_FRAME {
        return Err(FabricError::Malformed("frame too long"));
    }
    Ok(n)
}

/// Reads a frame's fields in order.
struct Reader {
    frame: Bytes,
    at: usize,
}

impl Reader {
    fn take(&mut self, n: usize) -> Result<Bytes, FabricError> {
        if self.frame.len() < self.at + n {
            return Err(FabricError::Malformed("short frame"));
        }
        self.at += n;
        Ok(self.frame.slice(self.at - n..self.at))
    }

    fn name(&mut self) -> Result<String, FabricError> {
        let l = self.take(2)?;
        let l = usize::from(u16::from_be_bytes([l[0], l[1]]));
        String::from_utf8(self.take(l)?.to_vec())
            .map_err(|_| FabricError::Malformed("a name is not UTF-8"))
    }

    fn socket(&mut self) -> Result<u64, FabricError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_be_bytes(a))
    }

    fn rest(self) -> Bytes {
        self.frame.slice(self.at..)
    }
}

/// A frame (without its length prefix), read.
pub fn decode(frame: Bytes) -> Result<Relayed, FabricError> {
    let mut r = Reader { frame, at: 0 };
    let head = r.take(2)?;
    if head[0] != VERSION {
        return Err(FabricError::Malformed("unknown version"));
    }
    let kind = head[1];
    if kind == RESET {
        return Ok(Relayed::Reset);
    }
    let (tenant, topic) = (r.name()?, r.name()?);
    match kind {
        JSON | BINARY => {
            let event = r.name()?;
            let payload = r.rest();
            let payload = if kind == JSON {
                Payload::json(payload).map_err(|_| FabricError::Malformed("payload is not JSON"))?
            } else {
                Payload::Binary(payload)
            };
            let b = UserBroadcast {
                join_ref: None,
                msg_ref: None,
                topic,
                event,
                meta: None,
                payload,
            };
            Ok(Relayed::Broadcast(tenant, b))
        }
        TRACK => {
            let key = r.name()?;
            let socket = r.socket()?;
            let meta = serde_json::from_slice(&r.rest())
                .map_err(|_| FabricError::Malformed("meta is not a JSON object"))?;
            let change = PresenceChange::Track {
                topic,
                socket,
                key,
                meta,
            };
            Ok(Relayed::Presence(tenant, change))
        }
        UNTRACK => {
            let socket = r.socket()?;
            Ok(Relayed::Presence(
                tenant,
                PresenceChange::Untrack { topic, socket },
            ))
        }
        _ => Err(FabricError::Malformed("unknown kind")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ping(payload: Payload) -> UserBroadcast {
        UserBroadcast {
            join_ref: Some("1".into()),
            msg_ref: Some("2".into()),
            topic: "realtime:room".into(),
            event: "ping".into(),
            meta: None,
            payload,
        }
    }

    #[test]
    fn broadcasts_round_trip_and_lose_their_refs() {
        for payload in [
            Payload::json(Bytes::from_static(br#"{"a":[1,2]}"#)).unwrap(),
            Payload::Binary(Bytes::from_static(b"\x00\x01\xff")),
        ] {
            let f = encode("acme", &ping(payload.clone())).unwrap();
            let n = frame_len(f[..4].try_into().unwrap()).unwrap();
            assert_eq!(n, f.len() - 4);
            let Relayed::Broadcast(tenant, b) = decode(Bytes::copy_from_slice(&f[4..])).unwrap()
            else {
                panic!("a broadcast")
            };
            assert_eq!(tenant, "acme");
            assert_eq!(
                (b.topic.as_str(), b.event.as_str()),
                ("realtime:room", "ping")
            );
            assert_eq!(b.payload, payload);
            assert_eq!((b.join_ref, b.msg_ref), (None, None));
        }
    }

    #[test]
    fn presence_changes_and_resets_round_trip() {
        let meta = serde_json::json!({"name": "Ann", "phx_ref": "F1"});
        for change in [
            PresenceChange::Track {
                topic: "realtime:lobby".into(),
                socket: 7,
                key: "ann".into(),
                meta: meta.as_object().unwrap().clone(),
            },
            PresenceChange::Untrack {
                topic: "realtime:lobby".into(),
                socket: u64::MAX,
            },
        ] {
            let f = encode_presence("acme", &change).unwrap();
            assert_eq!(frame_len(f[..4].try_into().unwrap()).unwrap(), f.len() - 4);
            let got = decode(Bytes::copy_from_slice(&f[4..])).unwrap();
            assert_eq!(got, Relayed::Presence("acme".into(), change));
        }
        let r = encode_reset();
        assert_eq!(
            decode(Bytes::copy_from_slice(&r[4..])).unwrap(),
            Relayed::Reset
        );
    }

    #[test]
    fn broken_frames_are_errors() {
        let f = encode(
            "acme",
            &ping(Payload::json(Bytes::from_static(b"{}")).unwrap()),
        )
        .unwrap();
        let body = &f[4..];
        for cut in 0..body.len() - 2 {
            assert!(
                decode(Bytes::copy_from_slice(&body[..cut])).is_err(),
                "cut at {cut}"
            );
        }
        let mut bad = body.to_vec();
        bad[0] = 9;
        assert!(decode(Bytes::from(bad)).is_err());
        let mut bad = body.to_vec();
        bad[1] = 7;
        assert!(decode(Bytes::from(bad)).is_err());
        assert!(frame_len([0xff, 0xff, 0xff, 0xff]).is_err());
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_fail_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(Bytes::from(bytes));
        }
    }
}
