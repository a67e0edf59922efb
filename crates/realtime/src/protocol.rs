//! Phoenix channel frames, as Supabase Realtime's clients send and read them.
//!
//! - Protocol 1.0 (`vsn=1.0.0`, the Python client): text frames holding a JSON object,
//!   `{"topic", "event", "payload", "ref", "join_ref"}`.
//! - Protocol 2.0 (`vsn=2.0.0`, realtime-js): text frames holding a JSON array,
//!   `[join_ref, ref, topic, event, payload]`, and binary frames for user broadcasts:
//!   - the client pushes kind 3 (a user broadcast push): a header of byte lengths
//!     (join_ref, ref, topic, event, metadata) and the payload's encoding, the strings, then
//!     the payload (JSON text or raw bytes);
//!   - the server sends kind 4 (a user broadcast): lengths of topic, event and metadata,
//!     the encoding, the strings, then the payload.
//!
//!   Phoenix's own binary push (kind 0) is read too.
//!
//! Payloads are kept as the bytes they came in. JSON is checked once, when it arrives (a
//! payload spliced into other clients' frames must be JSON), and never parsed into a tree
//! to be passed on, so a broadcast to many subscribers costs one encoding per protocol, not
//! one per subscriber.

use bytes::Bytes;
use serde_json::value::RawValue;

/// The protocol version a socket asked for (`vsn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vsn {
    V1,
    V2,
}

impl Vsn {
    /// `vsn` as a client sends it; Phoenix takes a missing one as 1.0.0.
    pub fn parse(vsn: Option<&str>) -> Option<Vsn> {
        match vsn {
            None | Some("1.0.0") => Some(Vsn::V1),
            Some("2.0.0") => Some(Vsn::V2),
            Some(_) => None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("the frame is not a Phoenix message: {0}")]
    Malformed(String),
    #[error("binary frame cut short")]
    Short,
    #[error("unknown binary frame kind {0}")]
    UnknownKind(u8),
    #[error("unknown payload encoding {0}")]
    UnknownEncoding(u8),
    #[error("a name in the frame is not UTF-8")]
    NotUtf8,
    #[error("the payload is not JSON: {0}")]
    NotJson(String),
}

/// A payload: JSON text (checked), or raw bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    Json(Bytes),
    Binary(Bytes),
}

impl Payload {
    /// JSON text, checked to be one JSON value.
    pub fn json(text: impl Into<Bytes>) -> Result<Payload, ProtocolError> {
        let text = text.into();
        serde_json::from_slice::<&RawValue>(&text)
            .map_err(|e| ProtocolError::NotJson(e.to_string()))?;
        Ok(Payload::Json(text))
    }
}

/// One message, either way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub join_ref: Option<String>,
    pub msg_ref: Option<String>,
    pub topic: String,
    pub event: String,
    pub payload: Payload,
}

/// A user broadcast as protocol 2.0's binary frames carry it: the user's event, optional
/// metadata (a JSON object, as text), and the user's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserBroadcast {
    pub join_ref: Option<String>,
    pub msg_ref: Option<String>,
    pub topic: String,
    pub event: String,
    pub meta: Option<Bytes>,
    pub payload: Payload,
}

/// What a client sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inbound {
    Message(Message),
    UserBroadcast(UserBroadcast),
}

/// Reads a text frame.
pub fn decode_text(vsn: Vsn, text: &str) -> Result<Message, ProtocolError> {
    let bad = |e: serde_json::Error| ProtocolError::Malformed(e.to_string());
    match vsn {
        Vsn::V1 => {
            #[derive(serde::Deserialize)]
            struct V1<'a> {
                topic: String,
                event: String,
                #[serde(borrow)]
                payload: Option<&'a RawValue>,
                #[serde(rename = "ref", default)]
                msg_ref: Option<RefValue>,
                #[serde(default)]
                join_ref: Option<RefValue>,
            }
            let m: V1<'_> = serde_json::from_str(text).map_err(bad)?;
            Ok(Message {
                join_ref: m.join_ref.and_then(RefValue::into_string),
                msg_ref: m.msg_ref.and_then(RefValue::into_string),
                topic: m.topic,
                event: m.event,
                payload: raw_payload(m.payload),
            })
        }
        Vsn::V2 => {
            type V2<'a> = (
                Option<RefValue>,
                Option<RefValue>,
                String,
                String,
                Option<&'a RawValue>,
            );
            let (join_ref, msg_ref, topic, event, payload): V2<'_> =
                serde_json::from_str(text).map_err(bad)?;
            Ok(Message {
                join_ref: join_ref.and_then(RefValue::into_string),
                msg_ref: msg_ref.and_then(RefValue::into_string),
                topic,
                event,
                payload: raw_payload(payload),
            })
        }
    }
}

/// A ref as clients send it: a string, though some send numbers.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum RefValue {
    Text(String),
    Number(serde_json::Number),
}

impl RefValue {
    fn into_string(self) -> Option<String> {
        Some(match self {
            RefValue::Text(s) => s,
            RefValue::Number(n) => n.to_string(),
        })
    }
}

fn raw_payload(p: Option<&RawValue>) -> Payload {
    Payload::Json(Bytes::copy_from_slice(
        p.map_or("{}", |r| r.get()).as_bytes(),
    ))
}

/// Binary frame kinds.
const PUSH: u8 = 0;
const USER_BROADCAST_PUSH: u8 = 3;
const USER_BROADCAST: u8 = 4;
/// A user payload's encodings.
const BINARY: u8 = 0;
const JSON: u8 = 1;

/// Reads a binary frame (protocol 2.0).
pub fn decode_binary(frame: &[u8]) -> Result<Inbound, ProtocolError> {
    let kind = *frame.first().ok_or(ProtocolError::Short)?;
    match kind {
        PUSH => {
            let lens = frame.get(1..5).ok_or(ProtocolError::Short)?;
            let mut r = Strings(&frame[5..]);
            let join_ref = r.take(lens[0])?;
            let msg_ref = r.take(lens[1])?;
            let topic = r.take(lens[2])?;
            let event = r.take(lens[3])?;
            Ok(Inbound::Message(Message {
                join_ref: non_empty(join_ref),
                msg_ref: non_empty(msg_ref),
                topic: topic.to_owned(),
                event: event.to_owned(),
                payload: Payload::Binary(Bytes::copy_from_slice(r.0)),
            }))
        }
        USER_BROADCAST_PUSH => {
            let head = frame.get(1..7).ok_or(ProtocolError::Short)?;
            let mut r = Strings(&frame[7..]);
            let join_ref = r.take(head[0])?;
            let msg_ref = r.take(head[1])?;
            let topic = r.take(head[2])?;
            let event = r.take(head[3])?;
            let meta = r.take(head[4])?;
            let payload = match head[5] {
                JSON => Payload::json(Bytes::copy_from_slice(r.0))?,
                BINARY => Payload::Binary(Bytes::copy_from_slice(r.0)),
                e => return Err(ProtocolError::UnknownEncoding(e)),
            };
            let meta = if meta.is_empty() {
                None
            } else {
                match Payload::json(Bytes::copy_from_slice(meta.as_bytes()))? {
                    Payload::Json(m) => Some(m),
                    Payload::Binary(_) => None,
                }
            };
            Ok(Inbound::UserBroadcast(UserBroadcast {
                join_ref: non_empty(join_ref),
                msg_ref: non_empty(msg_ref),
                topic: topic.to_owned(),
                event: event.to_owned(),
                meta,
                payload,
            }))
        }
        k => Err(ProtocolError::UnknownKind(k)),
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// Length-prefixed strings read in order from the rest of a binary frame.
struct Strings<'a>(&'a [u8]);

impl<'a> Strings<'a> {
    fn take(&mut self, len: u8) -> Result<&'a str, ProtocolError> {
        let len = usize::from(len);
        if self.0.len() < len {
            return Err(ProtocolError::Short);
        }
        let (s, rest) = self.0.split_at(len);
        self.0 = rest;
        std::str::from_utf8(s).map_err(|_| ProtocolError::NotUtf8)
    }
}

/// Writes `m` as a text frame. A binary payload cannot go in one: `None`.
pub fn encode_text(vsn: Vsn, m: &Message) -> Option<String> {
    let Payload::Json(payload) = &m.payload else {
        return None;
    };
    // Checked JSON when it was made: spliced as it is.
    let payload = std::str::from_utf8(payload).ok()?;
    let s = |v: &str| serde_json::to_string(v).unwrap_or_else(|_| "\"\"".into());
    let r = |v: &Option<String>| v.as_deref().map_or_else(|| "null".to_owned(), s);
    Some(match vsn {
        Vsn::V1 => format!(
            "{{\"topic\":{},\"event\":{},\"payload\":{},\"ref\":{},\"join_ref\":{}}}",
            s(&m.topic),
            s(&m.event),
            payload,
            r(&m.msg_ref),
            r(&m.join_ref)
        ),
        Vsn::V2 => format!(
            "[{},{},{},{},{}]",
            r(&m.join_ref),
            r(&m.msg_ref),
            s(&m.topic),
            s(&m.event),
            payload
        ),
    })
}

/// A user broadcast as the `broadcast` message text frames carry it:
/// `{"type":"broadcast","event":E,"payload":P}` (and `"meta"` when it has some). `None` for
/// a binary payload, which only protocol 2.0's binary frames can carry.
pub fn broadcast_message(b: &UserBroadcast) -> Option<Message> {
    let Payload::Json(p) = &b.payload else {
        return None;
    };
    let mut payload = Vec::with_capacity(p.len() + b.event.len() + 48);
    payload.extend_from_slice(b"{\"type\":\"broadcast\",\"event\":");
    payload.extend_from_slice(serde_json::to_string(&b.event).ok()?.as_bytes());
    if let Some(meta) = &b.meta {
        payload.extend_from_slice(b",\"meta\":");
        payload.extend_from_slice(meta);
    }
    payload.extend_from_slice(b",\"payload\":");
    payload.extend_from_slice(p);
    payload.push(b'}');
    Some(Message {
        join_ref: None,
        msg_ref: None,
        topic: b.topic.clone(),
        event: "broadcast".into(),
        payload: Payload::Json(payload.into()),
    })
}

/// Writes a user broadcast as protocol 2.0's binary frame (kind 4); `None` when a name is
/// longer than the frame's one-byte lengths allow.
pub fn encode_user_broadcast(b: &UserBroadcast) -> Option<Vec<u8>> {
    let meta: &[u8] = b.meta.as_deref().unwrap_or_default();
    let (encoding, payload) = match &b.payload {
        Payload::Json(p) => (JSON, p),
        Payload::Binary(p) => (BINARY, p),
    };
    let len = |s: &[u8]| u8::try_from(s.len()).ok();
    let header = [
        USER_BROADCAST,
        len(b.topic.as_bytes())?,
        len(b.event.as_bytes())?,
        len(meta)?,
        encoding,
    ];
    let mut out = Vec::with_capacity(
        header.len() + b.topic.len() + b.event.len() + meta.len() + payload.len(),
    );
    out.extend_from_slice(&header);
    out.extend_from_slice(b.topic.as_bytes());
    out.extend_from_slice(b.event.as_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(payload);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(s: &str) -> Payload {
        Payload::json(Bytes::copy_from_slice(s.as_bytes())).unwrap()
    }

    #[test]
    fn text_frames_of_both_versions_read_and_write() {
        let v1 = r#"{"topic":"realtime:room","event":"phx_join","payload":{"config":{"broadcast":{"self":true}}},"ref":"1","join_ref":"1"}"#;
        let m = decode_text(Vsn::V1, v1).unwrap();
        assert_eq!(m.topic, "realtime:room");
        assert_eq!(m.event, "phx_join");
        assert_eq!(
            (m.msg_ref.as_deref(), m.join_ref.as_deref()),
            (Some("1"), Some("1"))
        );
        assert_eq!(m.payload, json(r#"{"config":{"broadcast":{"self":true}}}"#));
        assert_eq!(encode_text(Vsn::V1, &m).unwrap(), v1);

        let v2 = r#"["3","4","realtime:room","broadcast",{"type":"broadcast","event":"e","payload":{"a":1}}]"#;
        let m = decode_text(Vsn::V2, v2).unwrap();
        assert_eq!(encode_text(Vsn::V2, &m).unwrap(), v2);
        let heartbeat = decode_text(Vsn::V2, r#"[null,"9","phoenix","heartbeat",{}]"#).unwrap();
        assert_eq!(heartbeat.join_ref, None);
        assert_eq!(heartbeat.msg_ref.as_deref(), Some("9"));
        // A number for a ref, as some clients send.
        let m = decode_text(
            Vsn::V1,
            r#"{"topic":"phoenix","event":"heartbeat","payload":{},"ref":7}"#,
        )
        .unwrap();
        assert_eq!(m.msg_ref.as_deref(), Some("7"));
        for bad in [
            "",
            "[]",
            "{}",
            "[1,2,3]",
            r#"{"topic":1,"event":"x"}"#,
            "not json",
        ] {
            assert!(
                decode_text(Vsn::V2, bad).is_err() && decode_text(Vsn::V1, bad).is_err(),
                "{bad}"
            );
        }
        assert!(decode_text(Vsn::V2, r#"["1","2","t","e",{"a":1},"extra"]"#).is_err());
    }

    /// What realtime-js 2.119.1's serializer writes for
    /// `channel.send({type: 'broadcast', event: 'ping', payload: {n: 1}})` on topic
    /// `realtime:room` with join_ref "1" and ref "2".
    fn js_user_broadcast_push() -> Vec<u8> {
        let mut f = vec![3, 1, 1, 13, 4, 0, 1];
        f.extend_from_slice(b"12realtime:roomping");
        f.extend_from_slice(br#"{"n":1}"#);
        f
    }

    #[test]
    fn a_user_broadcast_push_reads_as_realtime_js_wrote_it() {
        let Inbound::UserBroadcast(b) = decode_binary(&js_user_broadcast_push()).unwrap() else {
            panic!("a user broadcast")
        };
        assert_eq!(b.join_ref.as_deref(), Some("1"));
        assert_eq!(b.msg_ref.as_deref(), Some("2"));
        assert_eq!(
            (b.topic.as_str(), b.event.as_str()),
            ("realtime:room", "ping")
        );
        assert_eq!(b.meta, None);
        assert_eq!(b.payload, json(r#"{"n":1}"#));
        // Binary payload, with metadata.
        let mut f = vec![3, 0, 0, 1, 1, 18, 0];
        f.extend_from_slice(b"te");
        f.extend_from_slice(br#"{"persist":true}  "#);
        f.extend_from_slice(&[0, 159, 255]);
        let Inbound::UserBroadcast(b) = decode_binary(&f).unwrap() else {
            panic!("a user broadcast")
        };
        assert_eq!(
            b.payload,
            Payload::Binary(Bytes::from_static(&[0, 159, 255]))
        );
        assert!(b.meta.is_some());
        assert_eq!(b.join_ref, None);
    }

    #[test]
    fn a_user_broadcast_is_written_as_realtime_js_reads_it() {
        let b = UserBroadcast {
            join_ref: None,
            msg_ref: None,
            topic: "realtime:room".into(),
            event: "ping".into(),
            meta: None,
            payload: json(r#"{"n":1}"#),
        };
        let mut want = vec![4, 13, 4, 0, 1];
        want.extend_from_slice(b"realtime:roomping");
        want.extend_from_slice(br#"{"n":1}"#);
        assert_eq!(encode_user_broadcast(&b).unwrap(), want);
        let text = encode_text(Vsn::V1, &broadcast_message(&b).unwrap()).unwrap();
        assert_eq!(
            text,
            r#"{"topic":"realtime:room","event":"broadcast","payload":{"type":"broadcast","event":"ping","payload":{"n":1}},"ref":null,"join_ref":null}"#
        );
        let binary = UserBroadcast {
            payload: Payload::Binary(Bytes::from_static(b"\x00\x01")),
            ..b
        };
        assert_eq!(broadcast_message(&binary), None);
        assert_eq!(encode_user_broadcast(&binary).unwrap()[4], BINARY);
        let long = UserBroadcast {
            topic: "t".repeat(256),
            ..binary
        };
        assert_eq!(encode_user_broadcast(&long), None);
    }

    #[test]
    fn broken_binary_frames_are_errors() {
        let good = js_user_broadcast_push();
        for n in 0..good.len() {
            assert!(decode_binary(&good[..n]).is_err(), "cut at {n}");
        }
        let mut bad_json = good.clone();
        bad_json.truncate(good.len() - 1);
        assert!(matches!(
            decode_binary(&bad_json),
            Err(ProtocolError::NotJson(_))
        ));
        let mut encoding = good.clone();
        encoding[6] = 9;
        assert_eq!(
            decode_binary(&encoding),
            Err(ProtocolError::UnknownEncoding(9))
        );
        assert_eq!(decode_binary(&[7]), Err(ProtocolError::UnknownKind(7)));
        let mut not_utf8 = good;
        not_utf8[7] = 0xff;
        assert_eq!(decode_binary(&not_utf8), Err(ProtocolError::NotUtf8));
    }

    proptest::proptest! {
        /// Whatever a socket sends, reading it returns (an error at worst).
        #[test]
        fn any_frame_reads_or_fails_cleanly(b in proptest::collection::vec(proptest::num::u8::ANY, 0..120)) {
            let _ = decode_binary(&b);
            for kind in [PUSH, USER_BROADCAST_PUSH] {
                let mut f = vec![kind];
                f.extend_from_slice(&b);
                let _ = decode_binary(&f);
            }
            if let Ok(s) = std::str::from_utf8(&b) {
                let _ = decode_text(Vsn::V1, s);
                let _ = decode_text(Vsn::V2, s);
            }
        }

        /// A message written as text reads back the same, in both versions.
        #[test]
        fn text_round_trips(topic in ".{0,20}", event in "[a-z_]{1,10}", r in proptest::option::of("[0-9]{1,4}"), n in proptest::num::i64::ANY) {
            let m = Message {
                join_ref: r.clone(),
                msg_ref: r,
                topic,
                event,
                payload: json(&format!("{{\"n\":{n}}}")),
            };
            for vsn in [Vsn::V1, Vsn::V2] {
                let text = encode_text(vsn, &m).unwrap();
                proptest::prop_assert_eq!(&decode_text(vsn, &text).unwrap(), &m);
            }
        }
    }
}
