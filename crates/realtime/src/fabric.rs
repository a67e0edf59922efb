//! Broadcasts between Shoal nodes. A broadcast from a client of one node reaches the
//! subscribers of every node: the node where it arrived delivers it to its own sockets and
//! hands it to its [`Relay`], which carries it to the other nodes (Shoal's node links);
//! each of them delivers it to its own sockets and relays it no further.
//!
//! A relayed broadcast is one frame, pure and bounded:
//!
//! ```text
//! u32 length of the rest | u8 version (1) | u8 payload kind (1 JSON, 2 binary)
//! | u16 tenant length | tenant | u16 topic length | topic | u16 event length | event | payload
//! ```

use bytes::Bytes;

use crate::protocol::{Payload, UserBroadcast};

/// Carries a tenant's broadcasts to the other nodes.
pub trait Relay: Send + Sync + 'static {
    fn publish(&self, tenant: &str, b: &UserBroadcast);
}

/// The largest relayed frame (a payload is bounded by the tenant's limit well below it).
pub const MAX_FRAME: usize = 64 << 20;

const VERSION: u8 = 1;
const JSON: u8 = 1;
const BINARY: u8 = 2;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FabricError {
    #[error("relayed broadcast: {0}")]
    Malformed(&'static str),
    #[error("relayed broadcast: a name is longer than 65535 bytes")]
    TooLong,
}

/// `b` of `tenant` as a frame, length prefix included.
pub fn encode(tenant: &str, b: &UserBroadcast) -> Result<Vec<u8>, FabricError> {
    let (kind, payload) = match &b.payload {
        Payload::Json(p) => (JSON, p),
        Payload::Binary(p) => (BINARY, p),
    };
    let names = [tenant.as_bytes(), b.topic.as_bytes(), b.event.as_bytes()];
    let len = 2 + names.iter().map(|n| 2 + n.len()).sum::<usize>() + payload.len();
    let mut out = Vec::with_capacity(4 + len);
    out.extend_from_slice(
        &u32::try_from(len)
            .map_err(|_| FabricError::TooLong)?
            .to_be_bytes(),
    );
    out.push(VERSION);
    out.push(kind);
    for n in names {
        let l = u16::try_from(n.len()).map_err(|_| FabricError::TooLong)?;
        out.extend_from_slice(&l.to_be_bytes());
        out.extend_from_slice(n);
    }
    out.extend_from_slice(payload);
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

/// A frame (without its length prefix): the tenant and the broadcast.
pub fn decode(frame: Bytes) -> Result<(String, UserBroadcast), FabricError> {
    let mut at = 2;
    let head = frame
        .get(..2)
        .ok_or(FabricError::Malformed("short frame"))?;
    if head[0] != VERSION {
        return Err(FabricError::Malformed("unknown version"));
    }
    let kind = head[1];
    let mut name = || -> Result<String, FabricError> {
        let l = frame
            .get(at..at + 2)
            .ok_or(FabricError::Malformed("short frame"))?;
        let l = usize::from(u16::from_be_bytes([l[0], l[1]]));
        let s = frame
            .get(at + 2..at + 2 + l)
            .ok_or(FabricError::Malformed("short frame"))?;
        at += 2 + l;
        String::from_utf8(s.to_vec()).map_err(|_| FabricError::Malformed("a name is not UTF-8"))
    };
    let (tenant, topic, event) = (name()?, name()?, name()?);
    let payload = frame.slice(at..);
    let payload = match kind {
        JSON => {
            Payload::json(payload).map_err(|_| FabricError::Malformed("payload is not JSON"))?
        }
        BINARY => Payload::Binary(payload),
        _ => return Err(FabricError::Malformed("unknown payload kind")),
    };
    Ok((
        tenant,
        UserBroadcast {
            join_ref: None,
            msg_ref: None,
            topic,
            event,
            meta: None,
            payload,
        },
    ))
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
            let (tenant, b) = decode(Bytes::copy_from_slice(&f[4..])).unwrap();
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
