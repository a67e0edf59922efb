use super::*;
use crate::encoding::{Split, Table};
use proptest::prelude::*;

/// Every way of reading bytes: the lexer must finish and agree with its shortcut in each.
fn encodings() -> impl Strategy<Value = ClientEncoding> {
    prop_oneof![
        Just(ClientEncoding::Utf8),
        Just(ClientEncoding::Latin1),
        Just(ClientEncoding::AsciiSafe(Table::EucJp)),
        Just(ClientEncoding::Split(Split::Sjis)),
        Just(ClientEncoding::Split(Split::Big5)),
        Just(ClientEncoding::Split(Split::Gb18030)),
        Just(ClientEncoding::Split(Split::Johab)),
        Just(ClientEncoding::Unknown),
    ]
}

proptest! {
    /// Any bytes: the lexer and every classifier finish without panicking, and the
    /// statement-name range they report lies inside the text.
    #[test]
    fn classifiers_accept_any_bytes(
        sql in proptest::collection::vec(any::<u8>(), 0..200),
        enc in encodings(),
    ) {
        let _ = classify(&sql, enc);
        let _ = database_command(&sql, enc);
        let _ = prepared_name_with_prefix(&sql, b"shoal_", enc);
        let _ = listen_command(&sql, enc);
        let _ = may_change_encoding(&sql);
        let n = leading_comments_len(&sql);
        prop_assert!(n <= sql.len());
        if let Some(c) = named_statement_command(&sql, enc) {
            prop_assert!(c.name_at.end <= sql.len());
        }
    }

    /// SQL-shaped input built from the tokens that matter.
    #[test]
    fn classifiers_accept_sql_shaped_text(parts in proptest::collection::vec(
        prop_oneof![
            Just("SET "), Just("ROLE "), Just("'"), Just("\""), Just("$$"), Just("$a$"),
            Just("--"), Just("/*"), Just("*/"), Just(";"), Just("\n"), Just("E'\\'"),
            Just("temp "), Just("create "), Just("execute "), Just("shoal_1 "), Just("("),
            Just("U&\""), Just("é"), Just("\r"), Just("UESCAPE '!'"), Just("!0073"),
            Just("\\+00005F"), Just("\x0b"), Just("hold "), Just("with "),
        ], 0..30), enc in encodings()) {
        let sql: String = parts.concat();
        let _ = classify(sql.as_bytes(), enc);
        let _ = named_statement_command(sql.as_bytes(), enc);
        let _ = prepared_name_with_prefix(sql.as_bytes(), b"shoal_", enc);
        let n = leading_comments_len(sql.as_bytes());
        prop_assert!(sql.is_char_boundary(n));
    }

    /// The shortcut for plain statements never disagrees with the lexer: whatever the
    /// text, `classify` gives what lexing every token gives.
    #[test]
    fn shortcut_agrees_with_the_lexer(parts in proptest::collection::vec(
        prop_oneof![
            Just("SELECT "), Just("select "), Just("insert "), Just("UPDATE t "),
            Just("with "), Just("values "), Just("set_config(a) "), Just("SetSeed "),
            Just("pg_try_advisory_lock(1) "), Just("dblink_connect "), Just("TEMP "),
            Just("temporary "), Just("pg_temp.x "), Just("create "), Just("into "),
            Just("'"), Just("\""), Just("$$"), Just(";"), Just("; "), Just("\n"),
            Just("E'\\'"), Just("'\\'"), Just("--"), Just("/*"), Just("*/"), Just("("),
            Just("x "), Just("1 "), Just("\0"), Just("selectx "), Just("select$1 "),
            Just("BEGIN "), Just("end "), Just("commit "), Just("Rollback "), Just("start "),
            Just("set "), Just("discard "), Just("deallocate "), Just("all "),
            Just("\r"), Just("&"), Just("U&\"a\" "), Just("pg_settings "), Just("_set"),
            Just("\u{30bd}"), Just("\u{8868}"),
        ], 0..16), enc in encodings()) {
        let sql: String = parts.concat();
        // Shift JIS's "ソ" (0x83 0x5C) and "表" (0x95 0x5C), as a client in SJIS sends them.
        let sql = sql.replace('\u{30bd}', "\u{83}\\").replace('\u{8868}', "\u{95}\\");
        let bytes: Vec<u8> = sql.chars().map(|c| if (c as u32) < 0x100 { c as u8 } else { b'?' }).collect();
        // Unknown: the shortcut still reads a plain text right (no character's trailing
        // byte can hide a special byte or a word), where the lexer gives up.
        if enc != ClientEncoding::Unknown || bytes.is_ascii() {
            prop_assert_eq!(classify(&bytes, enc), classify_lexed(&bytes, enc), "{:?} {:?}", sql, enc);
        }
    }
}

/// The block-wise search finds what a byte-by-byte, case-insensitive one finds, at every
/// offset (block boundaries included).
fn naive_needs_lexing(body: &[u8]) -> bool {
    let lower = body.to_ascii_lowercase();
    let words: [&[u8]; 5] = [b"temp", b"seed", b"_con", b"y_lo", b"_set"];
    body.iter()
        .any(|&b| b == b'\\' || b == 0 || b == b';' || b == b'&')
        || lower.windows(4).any(|w| words.contains(&w))
}

/// Every length around the window sizes, every position: the overlapping last window and
/// the short-text path leave no byte unexamined.
#[test]
fn block_search_finds_a_mark_at_every_position() {
    for len in 0..64 {
        for mark in [&b"\\"[..], b"\0", b";", b"&", b"TeMp", b"y_lo", b"_SeT"] {
            for at in 0..=len {
                if at + mark.len() > len {
                    continue;
                }
                let mut text = vec![b'a'; len];
                text[at..at + mark.len()].copy_from_slice(mark);
                assert!(needs_lexing(&text), "{len} {at} {mark:?}");
            }
        }
        assert!(!needs_lexing(&vec![b'a'; len]), "{len}");
    }
}

proptest! {
    #[test]
    fn block_search_agrees_with_a_byte_search(
        pad in 0usize..40,
        word in prop_oneof![Just("TEMP"), Just("sEeD"), Just("_CON"), Just("Y_lO"), Just("\\"), Just("_Set"), Just("&"),
                            Just("\0"), Just(";"), Just("te_p"), Just("y lo"), Just("x")],
        tail in 0usize..40,
    ) {
        let text = format!("{}{}{}", "a".repeat(pad), word, "b".repeat(tail));
        prop_assert_eq!(needs_lexing(text.as_bytes()), naive_needs_lexing(text.as_bytes()), "{:?}", text);
    }

    #[test]
    fn block_search_misses_nothing(body in proptest::collection::vec(any::<u8>(), 0..100)) {
        if naive_needs_lexing(&body) {
            prop_assert!(needs_lexing(&body));
        }
    }
}

#[test]
fn first_word() {
    assert_eq!(
        FirstWord::of(b"  /* x */ -- y\n SeLeCt 1").as_bytes(),
        b"select"
    );
    assert_eq!(FirstWord::of(b"select$1").as_bytes(), b"");
    assert_eq!(FirstWord::of(b"(select 1)").as_bytes(), b"");
    assert_eq!(FirstWord::of(b"SET").as_bytes(), b"set");
    assert_eq!(FirstWord::of(b"checkpointcheckpoint").as_bytes(), b"");
    let plain = |sql: &[u8]| is_plain(FirstWord::of(sql), sql);
    assert!(plain(
        b"SELECT abalance FROM pgbench_accounts WHERE aid = 1;"
    ));
    assert!(plain(b"BEGIN;"));
    assert!(plain(b"end"));
    assert!(!plain(b"SELECT set_config('a', 'b', false)"));
    assert!(!plain(b"SELECT 1; SET ROLE x"));
    assert!(!plain(b"SET ROLE x"));
    assert!(!plain(b"BEGIN; CREATE TEMP TABLE t ()"));
}
