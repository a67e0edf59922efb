//! Client encodings whose characters may end in an ASCII byte (SJIS, BIG5, GBK, ...):
//! PostgreSQL reads `E'\x83\x5c'` in SJIS as one character and the end of the string, a
//! scanner of bytes as an escaped quote. Against a real PostgreSQL and a real Shoal: what
//! such a text hides is seen by the query rules and by session hygiene, whether the encoding
//! came with the login, a `SET` before, or a `SET` in the same pipeline; ordinary SJIS text
//! goes through unchanged.
#![allow(clippy::disallowed_methods)]

mod common;

use bytes::{BufMut, BytesMut};
use common::raw::{self, Raw};
use common::*;

/// A simple Query with `sql` as raw bytes (in whatever encoding the client speaks).
fn query_bytes(b: &mut BytesMut, sql: &[u8]) {
    shoal_wire::backend::put_message(b, b'Q', |m| {
        m.put_slice(sql);
        m.put_u8(0);
    });
}

/// Sends `sql` as bytes; the messages up to ReadyForQuery.
async fn run(r: &mut Raw, sql: &[u8]) -> Vec<raw::Msg> {
    let mut b = BytesMut::new();
    query_bytes(&mut b, sql);
    r.send(&b).await;
    r.until_ready().await
}

fn error(msgs: &[raw::Msg]) -> Option<&raw::Msg> {
    msgs.iter().find(|m| m.tag == 'E')
}

async fn victim_exists(db: &str) -> bool {
    let d = direct(db).await;
    let rows = simple_rows(&d, "SELECT count(*) FROM pg_class WHERE relname = 'victim'").await;
    rows == vec!["1"]
}

/// `ソ` in SJIS is 0x83 0x5C: inside `E'...'` its second byte is no backslash, so the string
/// ends at the next quote and a DROP follows.
const HIDDEN_DROP: &[u8] = b"SELECT E'\x83\x5c'; DROP TABLE victim; --'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_see_what_a_two_byte_character_would_hide() {
    let db = unique_db("enc");
    pg().create_database(&db);
    let config = base_config(pg(), &[&db], "")
        + &format!("[[databases.{db}.rules]]\nname = \"no-drop\"\nstatement = \"DROP\"\naction = \"deny\"\n");
    let shoal = Shoal::start(&config);
    let d = direct(&db).await;
    d.batch_execute("CREATE TABLE victim (id int)")
        .await
        .unwrap();

    // The encoding given at login.
    let mut r = Raw::login(shoal.addr, "raw", &db, &[("client_encoding", "SJIS")]).await;
    let msgs = run(&mut r, HIDDEN_DROP).await;
    let e = error(&msgs).expect("refused");
    assert_eq!(e.code(), "42501", "{}", e.text());
    assert!(e.text().contains("no-drop"), "{}", e.text());
    assert!(victim_exists(&db).await);
    // Ordinary SJIS text passes and comes back as sent.
    let msgs = run(&mut r, b"SELECT E'\x83\x5c' AS so").await;
    assert!(error(&msgs).is_none(), "{msgs:?}");
    let row = msgs.iter().find(|m| m.tag == 'D').expect("a row");
    assert!(row.body.ends_with(b"\x83\x5c"), "{:?}", row.body);

    // The encoding set by a statement before.
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let msgs = run(&mut r, b"SET client_encoding = 'SJIS'").await;
    assert!(error(&msgs).is_none(), "{msgs:?}");
    let msgs = run(&mut r, HIDDEN_DROP).await;
    assert_eq!(
        error(&msgs).map(|e| e.code()),
        Some("42501".into()),
        "{msgs:?}"
    );
    assert!(victim_exists(&db).await);
    // Set through set_config(), whose change only the server's report tells.
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let msgs = run(
        &mut r,
        b"SELECT set_config('client_encoding', 'BIG5', false)",
    )
    .await;
    assert!(error(&msgs).is_none(), "{msgs:?}");
    let msgs = run(&mut r, HIDDEN_DROP).await;
    assert!(error(&msgs).is_some(), "{msgs:?}");
    assert!(victim_exists(&db).await);

    // The SET and the hidden DROP in one pipeline: the second text is sent before the
    // server has said how it reads it, and is refused rather than guessed at.
    let mut r = Raw::login(shoal.addr, "raw", &db, &[]).await;
    let mut b = BytesMut::new();
    query_bytes(&mut b, b"SET client_encoding = 'GBK'");
    query_bytes(&mut b, HIDDEN_DROP);
    r.send(&b).await;
    let first = r.until_ready().await;
    assert!(error(&first).is_none(), "{first:?}");
    let second = r.until_ready().await;
    let e = error(&second).expect("refused");
    assert!(
        ["42501", "0A000"].contains(&e.code().as_str()),
        "{}: {}",
        e.code(),
        e.text()
    );
    assert!(victim_exists(&db).await);
    // Once the server has answered, the encoding is known again.
    let msgs = run(&mut r, b"SELECT 1").await;
    assert!(error(&msgs).is_none(), "{msgs:?}");
}

/// A `set_config` hidden behind a two-byte character still marks the server: the next
/// client (a pool of one) does not inherit the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_hygiene_sees_what_a_two_byte_character_would_hide() {
    let db = unique_db("enc");
    let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
    let mut a = Raw::login(shoal.addr, "raw", &db, &[("client_encoding", "SJIS")]).await;
    let msgs = run(
        &mut a,
        b"SELECT E'\x83\x5c'; SELECT set_config('request.jwt.claims', 'a-secret', false); --'",
    )
    .await;
    assert!(error(&msgs).is_none(), "{msgs:?}");
    let b = shoal.connect(&db).await;
    let seen = simple_rows(
        &b,
        "SELECT coalesce(current_setting('request.jwt.claims', true), '')",
    )
    .await;
    assert_eq!(seen, vec![""], "B inherited A's claims");
    // A keeps its own: it gets its server back once B is done with the pool's one.
    drop(b);
    let msgs = run(
        &mut a,
        b"SELECT current_setting('request.jwt.claims', true)",
    )
    .await;
    assert!(error(&msgs).is_none(), "{msgs:?}");
}
