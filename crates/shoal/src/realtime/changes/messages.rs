//! Broadcasts from the database: a row inserted into `realtime.messages` (by
//! `realtime.send`, `realtime.broadcast_changes` or by hand) with extension `broadcast` is
//! delivered to the channel it names, private or public, on this node: it comes through
//! the same stream as Postgres Changes, so none is lost while the stream reconnects, and
//! every node with subscribers streams for its own. Pure.

use bytes::Bytes;
use shoal_realtime::changes::Kind;
use shoal_realtime::hub::{channel_key, Hub};
use shoal_realtime::protocol::{Payload, UserBroadcast};

use super::stream::{Row, Value};

/// Whether `row` is a change of `realtime.messages`.
pub(super) fn is_message(row: &Row) -> bool {
    row.rel.schema == "realtime" && row.rel.table == "messages"
}

/// The broadcast an inserted message stands for, if it is one.
pub(super) fn broadcast(row: &Row) -> Option<UserBroadcast> {
    if !is_message(row) || row.kind != Kind::Insert {
        return None;
    }
    let get = |name: &str| {
        let i = row.rel.columns.iter().position(|c| c.name == name)?;
        row.new.get(i).and_then(Value::text)
    };
    if get("extension")? != "broadcast" {
        return None;
    }
    let private = get("private") == Some("t");
    let topic = channel_key(&format!("realtime:{}", get("topic")?), private).into_owned();
    let meta = get("id").map(|id| Bytes::from(serde_json::json!({ "id": id }).to_string()));
    Some(UserBroadcast {
        join_ref: None,
        msg_ref: None,
        topic,
        event: get("event").unwrap_or_default().to_owned(),
        meta,
        payload: match get("binary_payload").and_then(bytea) {
            Some(bytes) => Payload::Binary(bytes),
            None => Payload::Json(Bytes::copy_from_slice(
                get("payload").unwrap_or("{}").as_bytes(),
            )),
        },
    })
}

/// A bytea column's text form (`\x` and hex digits: the stream's sessions keep
/// PostgreSQL's default `bytea_output`).
pub(super) fn bytea(text: &str) -> Option<Bytes> {
    let hex = text.strip_prefix("\\x")?.as_bytes();
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect::<Option<Vec<u8>>>()
        .map(Bytes::from)
}

/// Delivers the broadcasts among `rows` to `hub`'s channels; how many frames were queued.
pub(super) fn deliver(hub: &Hub, rows: &[Row]) -> usize {
    rows.iter()
        .filter_map(broadcast)
        .map(|b| hub.deliver(&b, None).delivered)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_realtime::changes::Column;
    use std::sync::Arc;

    #[test]
    fn inserted_broadcast_messages_become_broadcasts() {
        let col = |n: &str, t: &str| Column {
            name: n.into(),
            typname: t.into(),
        };
        let rel = Arc::new(super::super::stream::Rel {
            oid: 1,
            schema: "realtime".into(),
            table: "messages".into(),
            qualified: "\"realtime\".\"messages\"".into(),
            columns: vec![
                col("topic", "text"),
                col("extension", "text"),
                col("payload", "jsonb"),
                col("event", "text"),
                col("private", "bool"),
                col("id", "uuid"),
            ],
            key: vec![false, false, false, false, false, true],
            primary: vec![false, false, false, false, false, true],
        });
        let text = |s: &str| Value::Text(s.into());
        let row = |ext: &str, private: &str| Row {
            rel: rel.clone(),
            kind: Kind::Insert,
            commit_time: 0,
            new: vec![
                text("room"),
                text(ext),
                text(r#"{"a": 1}"#),
                text("ping"),
                text(private),
                text("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
            ],
            old: vec![],
        };
        let b = broadcast(&row("broadcast", "f")).unwrap();
        assert_eq!(b.topic, "realtime:room");
        assert_eq!(b.event, "ping");
        assert_eq!(b.payload, Payload::Json(Bytes::from_static(br#"{"a": 1}"#)));
        assert_eq!(
            b.meta.as_deref(),
            Some(&br#"{"id":"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"}"#[..])
        );
        let private = broadcast(&row("broadcast", "t")).unwrap();
        assert_eq!(private.topic, channel_key("realtime:room", true));
        assert!(broadcast(&row("presence", "f")).is_none());
    }

    #[test]
    fn binary_payloads_are_read_from_bytea_text() {
        assert_eq!(bytea("\\x00ff10").as_deref(), Some(&[0u8, 255, 16][..]));
        assert_eq!(bytea("\\x").as_deref(), Some(&[][..]));
        assert_eq!(bytea("\\x0"), None);
        assert_eq!(bytea("\\xzz"), None);
        assert_eq!(bytea("00ff"), None);
    }
}
