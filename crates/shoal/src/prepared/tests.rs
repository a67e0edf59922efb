//! Unit tests of the translation: client messages in, server replies in, exact bytes out.

use std::collections::VecDeque;

use bytes::{BufMut, BytesMut};
use shoal_wire::backend::put_message;
use shoal_wire::Frame;

use super::*;

fn frames(buf: &BytesMut) -> Vec<(char, Vec<u8>)> {
    let mut b = buf.clone();
    let mut v = Vec::new();
    while let Some(f) = Frame::split(&mut b, 1 << 20).unwrap() {
        v.push((f.tag() as char, f.body().to_vec()));
    }
    v
}

fn msg(tag: u8, body: &[u8]) -> BytesMut {
    let mut b = BytesMut::new();
    put_message(&mut b, tag, |m| m.put_slice(body));
    b
}

struct Fixture {
    registry: StatementRegistry,
    client: Option<Box<ClientStatements>>,
    server: ServerStatements,
    queue: VecDeque<Expect>,
    dirty: bool,
    pending: u32,
}

impl Fixture {
    fn new() -> Self {
        Fixture {
            registry: StatementRegistry::default(),
            client: None,
            server: ServerStatements::default(),
            queue: VecDeque::new(),
            dirty: false,
            pending: 0,
        }
    }
    fn send(&mut self, m: &BytesMut) -> BytesMut {
        let mut out = BytesMut::new();
        Translator {
            registry: &self.registry,
            params: &[],
            client_id: 1,
            client: &mut self.client,
            server: &mut self.server,
            queue: &mut self.queue,
            max_per_server: 2,
            dirty: &mut self.dirty,
            encoding: shoal_wire::sql::ClientEncoding::Utf8,
            recoding: &mut false,
            untracked: &mut false,
            keeps: &mut false,
            aborted: false,
        }
        .client_message(m, &mut out)
        .unwrap();
        out
    }
    fn reply(&mut self, tag: u8) -> (bool, BytesMut) {
        self.reply_msg(&msg(tag, b""))
    }
    fn reply_msg(&mut self, m: &BytesMut) -> (bool, BytesMut) {
        let mut out = BytesMut::new();
        let fwd = server_reply(
            &mut self.queue,
            &mut self.server,
            &mut self.client,
            m,
            &mut out,
            &mut self.pending,
            b'I',
        );
        emit_due(
            &mut self.queue,
            &mut self.client,
            &mut out,
            &mut self.pending,
            b'I',
        );
        (fwd, out)
    }
}

#[test]
fn parse_is_renamed_and_second_parse_is_answered_by_shoal() {
    let mut f = Fixture::new();
    let out = f.send(&msg(b'P', b"s1\0SELECT 1\0\0\0"));
    let fr = frames(&out);
    assert_eq!(fr[0].0, 'P');
    assert!(fr[0].1.starts_with(b"shoal_1\0SELECT 1\0"));
    assert!(f.reply(b'1').0);
    // Same statement under another client name: the server has it already.
    let out = f.send(&msg(b'P', b"other\0SELECT 1\0\0\0"));
    assert!(out.is_empty());
    let out = f.send(&msg(b'S', b""));
    assert_eq!(frames(&out)[0].0, 'S');
    let (fwd, out) = f.reply(b'Z');
    assert!(fwd);
    assert_eq!(frames(&out), vec![('1', vec![]), ('Z', vec![])]);
}

#[test]
fn bind_on_a_server_without_the_statement_injects_a_hidden_parse() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"s1\0SELECT $1\0\0\0"));
    f.reply(b'1');
    // A new server knows nothing.
    f.server.clear();
    f.queue.clear();
    let out = f.send(&msg(b'B', b"\0s1\0\0\0\0\0\0\0"));
    let fr = frames(&out);
    assert_eq!(fr.iter().map(|x| x.0).collect::<String>(), "PB");
    assert!(fr[1].1.starts_with(b"\0shoal_1\0"));
    assert!(!f.reply(b'1').0, "injected ParseComplete is hidden");
    assert!(f.reply(b'2').0);
}

#[test]
fn close_is_answered_by_shoal_after_earlier_replies() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"s1\0SELECT 1\0\0\0"));
    let out = f.send(&msg(b'C', b"Ss1\0"));
    assert!(out.is_empty(), "the server keeps its copy");
    let (fwd, out) = f.reply(b'1');
    assert!(fwd);
    assert_eq!(
        frames(&out),
        vec![('1', vec![]), ('3', vec![])],
        "CloseComplete follows the ParseComplete"
    );
    assert!(
        f.client.as_ref().unwrap().is_empty(),
        "forgotten once answered"
    );
}

#[test]
fn error_skips_to_sync_and_forgets_failed_parses() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"bad\0SELEC nonsense\0\0\0"));
    f.send(&msg(b'P', b"good\0SELECT 2\0\0\0"));
    f.send(&msg(b'C', b"Sgood\0"));
    f.send(&msg(b'S', b""));
    assert_eq!(f.server.len(), 2);
    let (fwd, out) = f.reply(b'E');
    assert!(fwd);
    assert_eq!(
        frames(&out).iter().map(|x| x.0).collect::<String>(),
        "E",
        "no CloseComplete after an error"
    );
    assert!(
        f.server.is_empty(),
        "neither statement exists on the server"
    );
    let c = f.client.as_ref().unwrap();
    assert!(!c.contains(b"bad"), "the failed Parse's name is free again");
    assert!(!c.contains(b"good"), "so is the skipped Parse's");
    assert!(f.reply(b'Z').0);
    assert!(f.queue.is_empty());
    // A statement parsed before: a skipped Close leaves it.
    f.send(&msg(b'P', b"good\0SELECT 2\0\0\0"));
    f.send(&msg(b'S', b""));
    assert!(f.reply(b'1').0);
    assert!(f.reply(b'Z').0);
    f.send(&msg(b'P', b"bad\0SELEC nonsense\0\0\0"));
    f.send(&msg(b'C', b"Sgood\0"));
    f.send(&msg(b'S', b""));
    assert!(f.reply(b'E').0);
    assert!(f.reply(b'Z').0);
    let c = f.client.as_ref().unwrap();
    assert!(
        c.contains(b"good"),
        "the skipped Close leaves the client's statement"
    );
    assert!(!c.contains(b"bad"));
}

#[test]
fn eviction_closes_the_least_recently_used_statement() {
    let mut f = Fixture::new();
    for (i, q) in ["SELECT 1", "SELECT 2", "SELECT 3"].iter().enumerate() {
        let body = format!("s{i}\0{q}\0\0\0");
        let out = f.send(&msg(b'P', body.as_bytes()));
        if i == 2 {
            let tags: String = frames(&out).iter().map(|x| x.0).collect();
            assert_eq!(tags, "CP", "max 2 per server: the oldest is closed first");
        }
    }
    assert!(f.reply(b'1').0);
    assert!(f.reply(b'1').0);
    assert!(!f.reply(b'3').0, "eviction CloseComplete hidden");
    assert!(f.reply(b'1').0);
    assert_eq!(f.server.len(), 2);
}

#[test]
fn synthetic_replies_after_a_sync_follow_its_ready_for_query() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"s0\0SELECT 1\0\0\0"));
    f.send(&msg(b'S', b""));
    f.reply(b'1');
    f.reply(b'Z');
    // Close of the old name, then a re-Parse of the same text, in one flight.
    f.send(&msg(b'C', b"Ss0\0"));
    f.send(&msg(b'S', b""));
    f.send(&msg(b'P', b"s1\0SELECT 1\0\0\0"));
    f.send(&msg(b'S', b""));
    let mut out = BytesMut::new();
    emit_due(&mut f.queue, &mut f.client, &mut out, &mut f.pending, b'I');
    assert_eq!(frames(&out), vec![('3', vec![])]);
    let (_, out) = f.reply(b'Z');
    assert_eq!(frames(&out), vec![('Z', vec![]), ('1', vec![])]);
    let (_, out) = f.reply(b'Z');
    assert_eq!(frames(&out), vec![('Z', vec![])]);
}

#[test]
fn syncs_sent_before_copy_data_are_not_owed() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"\0COPY t FROM STDIN\0\0\0"));
    assert!(f.reply(b'1').0);
    f.send(&msg(b'B', b"\0\0\0\0\0\0\0\0"));
    f.send(&msg(b'E', b"\0\0\0\0\0"));
    f.send(&msg(b'S', b""));
    assert!(f.reply(b'2').0);
    assert!(f.reply(b'G').0);
    f.send(&msg(b'd', b"1\n"));
    f.send(&msg(b'c', b""));
    f.send(&msg(b'S', b""));
    assert!(f.reply(b'C').0);
    assert!(f.reply(b'Z').0);
    assert!(f.queue.is_empty(), "{:?}", f.queue);
}

#[test]
fn describe_statement_and_execute_rows() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"s\0SELECT 1\0\0\0"));
    f.send(&msg(b'D', b"Ss\0"));
    f.send(&msg(b'B', b"\0s\0\0\0\0\0\0\0"));
    f.send(&msg(b'E', b"\0\0\0\0\0"));
    f.send(&msg(b'S', b""));
    for t in [b'1', b't', b'T', b'2', b'D', b'D', b'C', b'Z'] {
        assert!(f.reply(t).0, "{}", t as char);
    }
    assert!(f.queue.is_empty());
}

fn tags(buf: &BytesMut) -> String {
    frames(buf).iter().map(|x| x.0).collect()
}

fn error(code: &str, message: &str) -> BytesMut {
    let mut b = BytesMut::new();
    shoal_wire::backend::error_response(
        &mut b,
        shoal_wire::backend::Severity::Error,
        code,
        message,
        None,
    );
    b
}

#[test]
fn unnamed_statement_is_parsed_again_on_a_server_holding_another_clients() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"\0SELECT $1::text\0\0\0"));
    f.send(&msg(b'S', b""));
    f.reply(b'1');
    f.reply(b'Z');
    // The same server, in between, ran another client's unnamed statement.
    f.server.unnamed_owner = Some((2, 1));
    let out = f.send(&msg(b'B', b"\0\0\0\0\0\x01\0\0\0\x01x\0\0"));
    assert_eq!(tags(&out), "PB", "the client's own Parse goes first");
    assert!(frames(&out)[0].1.starts_with(b"\0SELECT $1::text\0"));
    assert!(!f.reply(b'1').0, "its ParseComplete is hidden");
    assert!(f.reply(b'2').0);
    // On the server that now holds it, nothing more is needed.
    let out = f.send(&msg(b'B', b"\0\0\0\0\0\x01\0\0\0\x01y\0\0"));
    assert_eq!(tags(&out), "B");
}

#[test]
fn bind_of_the_unnamed_statement_without_one_fails_on_the_server() {
    let mut f = Fixture::new();
    f.server.unnamed_owner = Some((2, 1));
    let out = f.send(&msg(b'B', b"\0\0\0\0\0\0\0\0"));
    assert_eq!(tags(&out), "P", "a failing Parse, never the Bind");
    assert!(frames(&out)[0].1.starts_with(b"shoal_error\0)"));
    f.send(&msg(b'E', b"\0\0\0\0\0"));
    f.send(&msg(b'S', b""));
    let (_, out) = f.reply_msg(&error("42601", "syntax error at or near \")\""));
    let fr = frames(&out);
    assert_eq!(fr.len(), 1);
    let e = shoal_wire::backend::parse_error(&fr[0].1).unwrap();
    assert_eq!(e.code, "26000");
    assert_eq!(e.message, "unnamed prepared statement does not exist");
    assert!(f.reply(b'Z').0);
    assert!(f.queue.is_empty(), "{:?}", f.queue);
}

#[test]
fn unknown_and_duplicate_names_get_postgres_errors() {
    let mut f = Fixture::new();
    // Another client's statement exists on this server under its pooler-wide name.
    f.server.insert(1, 10);
    let out = f.send(&msg(b'B', b"\0shoal_1\0\0\0\0\0\0\0"));
    assert_eq!(tags(&out), "P");
    f.send(&msg(b'S', b""));
    let (_, out) = f.reply_msg(&error("42601", "x"));
    let e = shoal_wire::backend::parse_error(&frames(&out)[0].1).unwrap();
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("26000", "prepared statement \"shoal_1\" does not exist")
    );
    f.reply(b'Z');
    f.send(&msg(b'P', b"s1\0SELECT 1\0\0\0"));
    f.send(&msg(b'S', b""));
    f.reply(b'1');
    f.reply(b'Z');
    let out = f.send(&msg(b'P', b"s1\0SELECT 2\0\0\0"));
    assert_eq!(tags(&out), "P");
    assert!(frames(&out)[0].1.starts_with(b"shoal_error\0"));
    f.send(&msg(b'S', b""));
    let (_, out) = f.reply_msg(&error("42601", "x"));
    let e = shoal_wire::backend::parse_error(&frames(&out)[0].1).unwrap();
    assert_eq!(e.code, "42P05");
}

#[test]
fn sql_deallocate_of_a_protocol_statement_is_answered_by_shoal() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"_pg3_0\0SELECT 1\0\0\0"));
    f.send(&msg(b'S', b""));
    f.reply(b'1');
    f.reply(b'Z');
    f.pending = 1;
    let mut q = BytesMut::new();
    shoal_wire::frontend::query(&mut q, "DEALLOCATE _pg3_0");
    let out = f.send(&q);
    assert!(out.is_empty(), "nothing reaches the server");
    let mut out = BytesMut::new();
    emit_due(&mut f.queue, &mut f.client, &mut out, &mut f.pending, b'I');
    assert_eq!(tags(&out), "CZ");
    assert_eq!(f.pending, 0);
    assert!(!f.client.as_ref().unwrap().contains(b"_pg3_0"));
}

#[test]
fn sql_execute_of_a_protocol_statement_runs_the_servers_copy() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"s1\0SELECT $1::int\0\0\0"));
    f.send(&msg(b'S', b""));
    f.reply(b'1');
    f.reply(b'Z');
    f.server.clear();
    let mut q = BytesMut::new();
    shoal_wire::frontend::query(&mut q, "EXECUTE s1(5)");
    let out = f.send(&q);
    let fr = frames(&out);
    assert_eq!(tags(&out), "PSQ");
    assert_eq!(fr[2].1, b"EXECUTE shoal_1(5)\0");
    assert!(!f.reply(b'1').0);
    assert!(
        !f.reply(b'Z').0,
        "the injected Sync's ReadyForQuery is hidden"
    );
    assert!(f.reply(b'T').0);
    assert!(f.reply(b'Z').0);
}

#[test]
fn session_effects_mark_the_server_dirty() {
    let mut f = Fixture::new();
    let mut q = BytesMut::new();
    shoal_wire::frontend::query(&mut q, "SELECT 1");
    f.send(&q);
    assert!(!f.dirty);
    f.send(&msg(
        b'P',
        b"s\0SELECT set_config('role', 'x', false)\0\0\0",
    ));
    assert!(!f.dirty, "parsing changes nothing");
    f.send(&msg(b'B', b"\0s\0\0\0\0\0\0\0"));
    assert!(f.dirty, "binding it will");
}

#[test]
fn an_unnamed_statement_parsed_again_keeps_its_effects_and_a_new_text_is_read_anew() {
    let mut f = Fixture::new();
    let dirty = b"\0SELECT set_config('role', 'x', false)\0\0\0";
    let bind = msg(b'B', b"\0\0\0\0\0\0\0\0");
    for _ in 0..2 {
        f.dirty = false;
        f.send(&msg(b'P', dirty));
        f.send(&bind);
        assert!(
            f.dirty,
            "binding the same text again changes the session again"
        );
    }
    f.dirty = false;
    f.send(&msg(b'P', b"\0SELECT 1\0\0\0"));
    f.send(&bind);
    assert!(!f.dirty, "a plain text after it is plain");
    f.send(&msg(b'P', dirty));
    f.send(&bind);
    assert!(f.dirty);
}

#[test]
fn statements_parsed_after_ddl_are_fresh() {
    let f = Fixture::new();
    let a = f.registry.intern(
        0,
        b"SELECT * FROM t\0\0\0",
        shoal_wire::sql::ClientEncoding::Utf8,
    );
    assert_eq!(
        a.id,
        f.registry
            .intern(
                0,
                b"SELECT * FROM t\0\0\0",
                shoal_wire::sql::ClientEncoding::Utf8
            )
            .id
    );
    f.registry.schema_changed();
    let b = f.registry.intern(
        0,
        b"SELECT * FROM t\0\0\0",
        shoal_wire::sql::ClientEncoding::Utf8,
    );
    assert_ne!(a.id, b.id);
}

#[test]
fn stale_plan_errors_retire_the_statement_for_everyone() {
    let mut f = Fixture::new();
    f.send(&msg(b'P', b"s\0SELECT * FROM t\0\0\0"));
    f.send(&msg(b'B', b"\0s\0\0\0\0\0\0\0"));
    f.send(&msg(b'S', b""));
    f.reply(b'1');
    let def = f
        .client
        .as_ref()
        .unwrap()
        .named
        .get(&b"s"[..])
        .cloned()
        .unwrap();
    f.reply_msg(&error("XX000", "cache lookup failed for type 16390"));
    assert!(def.is_stale());
    // A stale plan in another language, recognised by SQLSTATE and routine.
    let mut g = Fixture::new();
    g.send(&msg(b'P', b"t\0SELECT * FROM u\0\0\0"));
    g.send(&msg(b'B', b"\0t\0\0\0\0\0\0\0"));
    g.send(&msg(b'S', b""));
    g.reply(b'1');
    let def = g
        .client
        .as_ref()
        .unwrap()
        .named
        .get(&b"t"[..])
        .cloned()
        .unwrap();
    let mut e = BytesMut::new();
    put_message(&mut e, b'E', |b| {
        b.put_slice(b"SERROR\0C0A000\0Mle plan en cache ne doit pas modifier le type\0RRevalidateCachedQuery\0\0")
    });
    g.reply_msg(&e);
    assert!(def.is_stale());
    assert_ne!(
        f.registry
            .intern(0, &def.body, shoal_wire::sql::ClientEncoding::Utf8)
            .id,
        def.id
    );
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn client_msg() -> impl Strategy<Value = BytesMut> {
        let name = prop_oneof![Just(""), Just("a"), Just("b"), Just("shoal_1")];
        prop_oneof![
            (
                name.clone(),
                prop_oneof![
                    Just("SELECT 1"),
                    Just("SET x.y = 1"),
                    Just("SELECT set_config('a','b',false)")
                ]
            )
                .prop_map(|(n, q)| msg(b'P', format!("{n}\0{q}\0\0\0").as_bytes())),
            name.clone()
                .prop_map(|n| msg(b'B', format!("\0{n}\0\0\0\0\0\0\0").as_bytes())),
            name.clone()
                .prop_map(|n| msg(b'D', format!("S{n}\0").as_bytes())),
            name.clone()
                .prop_map(|n| msg(b'C', format!("S{n}\0").as_bytes())),
            Just(msg(b'E', b"\0\0\0\0\0")),
            Just(msg(b'S', b"")),
            prop_oneof![
                Just("SELECT 1"),
                Just("DEALLOCATE a"),
                Just("EXECUTE b"),
                Just("DISCARD ALL"),
                Just("EXECUTE shoal_1")
            ]
            .prop_map(|q| {
                let mut b = BytesMut::new();
                shoal_wire::frontend::query(&mut b, q);
                b
            }),
        ]
    }

    proptest! {
        /// Any sequence of client messages and server replies: the translation never panics,
        /// only ever sends well-formed messages, and never names another client's statement
        /// it was not given.
        #[test]
        fn translation_survives_any_sequence(
            steps in proptest::collection::vec(
                prop_oneof![
                    client_msg().prop_map(Ok),
                    proptest::sample::select(&b"123CDEZTnts"[..]).prop_map(Err),
                ],
                0..60,
            )
        ) {
            let mut f = Fixture::new();
            for step in steps {
                match step {
                    Ok(m) => {
                        let out = f.send(&m);
                        for (tag, body) in frames(&out) {
                            prop_assert!(shoal_wire::frontend::validate(tag as u8, &body).is_ok());
                            if tag == 'B' {
                                // The statement bound is the client's own (renamed) or unnamed.
                                let stmt = body.split(|&b| b == 0).nth(1).unwrap_or_default();
                                prop_assert!(stmt.is_empty() || stmt.starts_with(b"shoal_"));
                            }
                        }
                    }
                    Err(tag) => {
                        let (_, _) = f.reply(tag);
                    }
                }
            }
        }
    }
}
