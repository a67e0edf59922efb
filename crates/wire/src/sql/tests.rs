use super::*;
use crate::encoding::Split;

// Most tests read UTF-8; the encodings have their own tests below.
const U: ClientEncoding = ClientEncoding::Utf8;
fn classify(sql: &[u8]) -> Effects {
    super::classify(sql, U)
}
fn database_command(sql: &[u8]) -> Option<DatabaseCommand> {
    super::database_command(sql, U)
}
fn named_statement_command(sql: &[u8]) -> Option<NamedStatementCommand> {
    super::named_statement_command(sql, U)
}
fn listen_command(sql: &[u8]) -> Option<ListenCommand> {
    super::listen_command(sql, U)
}
fn prepared_name_with_prefix(sql: &[u8], prefix: &[u8]) -> Option<Vec<u8>> {
    super::prepared_name_with_prefix(sql, prefix, U)
}

const SJIS: ClientEncoding = ClientEncoding::Split(Split::Sjis);

#[test]
fn prepared_names_are_read_as_postgresql_folds_them() {
    let n = |s: &str| prepare_name(s.as_bytes(), U);
    assert_eq!(n("PREPARE Foo(int) AS SELECT $1"), Some(b"foo".to_vec()));
    assert_eq!(
        n("/* x */ prepare \"Bar\" AS SELECT 1"),
        Some(b"Bar".to_vec())
    );
    assert_eq!(n("PREPARE TRANSACTION 'x'"), None);
    assert_eq!(n("SELECT 1"), None);
}

#[test]
fn changes_of_encoding_are_seen() {
    for sql in [
        "SET client_encoding = 'SJIS'",
        "set NAMES 'BIG5'",
        "RESET ALL",
        "discard all",
        "SELECT pg_catalog.SET_CONFIG('client_encoding', 'GBK', false)",
        "EXECUTE p('x')",
    ] {
        assert!(may_change_encoding(sql.as_bytes()), "{sql}");
    }
    for sql in ["SET application_name = 'x'", "SELECT 1", "BEGIN"] {
        assert!(!may_change_encoding(sql.as_bytes()), "{sql}");
    }
}

#[test]
fn a_characters_trailing_backslash_escapes_nothing() {
    // 0x83 0x5C is one SJIS character: the string ends at the next quote, and what
    // follows is two more statements, one of them changing the session.
    let sql = b"SELECT E'\x83\x5c'; SELECT set_config('role', 'x', false); --'";
    let fx = super::classify(sql, SJIS);
    assert!(fx.multi && fx.dirty, "{fx:?}");
    // Read as bytes (UTF-8 says they are not characters anyway) the same text is one
    // string: the difference the encoding makes.
    assert!(!super::classify(sql, U).multi);
    // The same for every encoding whose trailing bytes can be a backslash.
    for split in [
        Split::Big5,
        Split::Gbk,
        Split::Uhc,
        Split::Gb18030,
        Split::Johab,
    ] {
        let fx = super::classify(sql, ClientEncoding::Split(split));
        assert!(fx.multi && fx.dirty, "{split:?}: {fx:?}");
    }
    // A hidden EXECUTE of the pooler's own statements is found, and a hidden DROP
    // DATABASE named.
    let exec = b"SELECT E'\x83\x5c'; EXECUTE shoal_1; --'";
    assert!(super::prepared_name_with_prefix(exec, b"shoal_", SJIS).is_some());
    assert!(super::prepared_name_with_prefix(exec, b"shoal_", U).is_none());
}

#[test]
fn trailing_bytes_never_split_a_word_or_a_tag() {
    // JOHAB's trailing bytes include `;`: inside a name it ends no statement.
    let johab = ClientEncoding::Split(Split::Johab);
    let sql = b"SELECT a\x88\x3bb FROM t";
    assert!(!super::classify(sql, johab).multi);
    // A dollar quote's tag may hold any character.
    let sql = b"SELECT $\x83\x5c$ '; SET ROLE x; $\x83\x5c$";
    assert!(!super::classify(sql, SJIS).dirty);
    // GB18030's four-byte characters carry digits.
    let gb = ClientEncoding::Split(Split::Gb18030);
    assert!(!super::classify(b"SELECT E'\x81\x30\x81\x30\\'' ", gb).multi);
}

#[test]
fn an_unknown_encoding_reads_only_ascii() {
    let unknown = ClientEncoding::Unknown;
    assert!(!super::classify(b"SELECT 1; SELECT 2", unknown).dirty);
    let fx = super::classify(b"SELECT '\xe9'; SELECT 2", unknown);
    assert!(fx.dirty && fx.ambiguous, "{fx:?}");
    assert!(super::prepared_name_with_prefix(b"EXECUTE \xe9shoal_1", b"shoal_", unknown).is_some());
    assert_eq!(super::listen_command(b"LISTEN \xe9", unknown), None);
}

#[test]
fn listen_commands_name_their_channel_as_postgresql_does() {
    let l = |s: &str| listen_command(s.as_bytes());
    assert_eq!(
        l("LISTEN foo"),
        Some(ListenCommand::Listen(b"foo".to_vec()))
    );
    assert_eq!(
        l("listen FooBar;"),
        Some(ListenCommand::Listen(b"foobar".to_vec()))
    );
    assert_eq!(
        l("/* c */ LISTEN \"Mixed \"\"q\"\"\" ; "),
        Some(ListenCommand::Listen(b"Mixed \"q\"".to_vec()))
    );
    assert_eq!(
        l("LISTEN U&\"d\\0061t\\+000061\""),
        Some(ListenCommand::Listen(b"data".to_vec()))
    );
    assert_eq!(
        l("UNLISTEN foo"),
        Some(ListenCommand::Unlisten(b"foo".to_vec()))
    );
    assert_eq!(l("unlisten *"), Some(ListenCommand::UnlistenAll));
    assert_eq!(l("UNLISTEN * ;"), Some(ListenCommand::UnlistenAll));
    let long = "x".repeat(70);
    assert_eq!(
        l(&format!("LISTEN {long}")),
        Some(ListenCommand::Listen(vec![b'x'; 63]))
    );
    // 62 ASCII bytes then a two-byte character: cut before it.
    let name = format!("{}é", "y".repeat(62));
    assert_eq!(
        l(&format!("LISTEN \"{name}\"")),
        Some(ListenCommand::Listen(vec![b'y'; 62]))
    );
    for no in [
        "LISTEN",
        "LISTEN *",
        "LISTEN a; LISTEN b",
        "LISTEN a b",
        "LISTEN \"\"",
        "SELECT 1",
        "NOTIFY a",
        "LISTEN 'a'",
    ] {
        assert_eq!(l(no), None, "{no}");
    }
}

fn dirty(sql: &str) -> bool {
    classify(sql.as_bytes()).dirty
}

#[test]
fn plain_queries_are_clean() {
    for sql in [
        "SELECT 1",
        "select abalance from pgbench_accounts where aid = $1",
        "INSERT INTO t VALUES ('SET ROLE x; set_config')",
        "UPDATE t SET a = 1",
        "BEGIN; SELECT 1; COMMIT",
        "SET LOCAL statement_timeout = 5",
        "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        "-- SET ROLE x\nSELECT 1",
        "/* SET ROLE /* nested */ x */ SELECT 1",
        "SELECT $$ set_config $$, $x$ pg_temp $x$",
        "SELECT temp FROM readings",
        "DECLARE c CURSOR FOR SELECT 1",
        "SELECT \"set_configs\" FROM t",
        "(SELECT 1)",
        // Transaction-local settings, as PostgREST makes them on every request.
        "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)",
        "BEGIN; select pg_catalog.set_config('search_path', format('%s', 'x'), TRUE); COMMIT",
        "SELECT \"set_config\"('a.b', 'c', true)",
    ] {
        assert!(!dirty(sql), "{sql}");
    }
}

#[test]
fn session_changes_are_dirty() {
    for sql in [
        "SET ROLE other",
        "set session authorization other",
        "SELECT set_config('search_path', 'x', false)",
        "select pg_catalog.set_config('role', 'x', false)",
        "SELECT \"set_config\"('a.b', 'c', false)",
        "CREATE TEMP TABLE t (a int)",
        "create global temporary table t (a int)",
        "CREATE TABLE pg_temp.t (a int)",
        "SELECT 1 INTO TEMP t",
        "CREATE OR REPLACE TEMP VIEW v AS SELECT 1",
        "PREPARE p AS SELECT 1",
        "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
        "SELECT pg_advisory_lock(1)",
        "DO $$BEGIN PERFORM 1; END$$",
        "CALL p()",
        "SELECT 1; SET search_path = x",
        "/* c */ SET search_path = x",
        "DISCARD ALL",
        "RESET ALL",
        "LOAD 'auto_explain'",
        "SELECT 'a\\'; set_config('x', 'y', false); --'",
        "SELECT set_config('role', $1, $2)",
        "SELECT set_config('role', 'x', 'true')",
        "SELECT set_config('role', 'x', true OR false)",
        "SELECT set_config('role', 'x', (true))",
        "SELECT set_config('a', 'x', true), set_config('b', 'y', false)",
        "SELECT set_config('a', 'x', true, 1)",
        "SELECT set_config",
        "SELECT set_config('a', 'x', tru",
    ] {
        assert!(dirty(sql), "{sql}");
    }
    // Carried by the pool's listener; the server is unlistened before reuse.
    assert!(!dirty("LISTEN chan"));
}

/// What PostgreSQL's scanner sees that a simpler lexer would not: a `--` comment ended by
/// a carriage return, `U&` identifiers spelled in escapes (with `UESCAPE`), vertical tabs,
/// state-changing words after the eighth token, writes to `pg_settings`.
#[test]
fn hidden_session_changes_are_dirty() {
    for sql in [
        "select 1 --x\r; select set_config('search_path','cr',false)",
        "--x\rcreate temp table orders (a int)",
        "select 1 --x\r; deallocate shoal_17; prepare shoal_17(int) as select 666 + $1 * 0",
        "select U&\"!0073et_config\" UESCAPE '!'('role', 'x', false)",
        "select U&\"\\0073\\0065\\0074\\005f\\0063\\006f\\006e\\0066\\0069\\0067\"('a.b', 'c', false)",
        "select u&\"set\\+00005Fconfig\" /* c */ uescape /* d */ '\\' ('a.b', 'c', false)",
        "create table U&\"pg_\\0074emp\".t (a int)",
        "select 1;\x0bset role other",
        "UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path'",
        "update pg_catalog.\"pg_settings\" set setting = 'x' where name = 'work_mem'",
        "WITH u AS (UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path' RETURNING 1) SELECT 1",
        "declare c9 binary insensitive no scroll cursor with hold for select 1",
    ] {
        assert!(dirty(sql), "{sql:?}");
    }
    for sql in [
        "SELECT name, setting FROM pg_settings",
        "select 1 -- set role x\n",
        "SELECT U&\"d\\0061t\\+000061\" FROM t",
        "declare c9 binary insensitive no scroll cursor without hold for select 1",
    ] {
        assert!(!dirty(sql), "{sql:?}");
    }
}

#[test]
fn unicode_identifiers_decode() {
    assert_eq!(
        decode_unicode(b"d\\0061t\\+000061", b'\\').unwrap(),
        b"data"
    );
    assert_eq!(decode_unicode(b"!0073et!!", b'!').unwrap(), b"set!");
    assert_eq!(decode_unicode(b"a\"\"b", b'\\').unwrap(), b"a\"b");
    assert_eq!(
        decode_unicode(b"\\D83D\\DE00", b'\\').unwrap(),
        "\u{1F600}".as_bytes()
    );
    for bad in [
        &b"\\00"[..],
        b"\\zzzz",
        b"\\D83D",
        b"\\DE00",
        b"\\0000",
        b"\\+11FFFF",
    ] {
        assert_eq!(decode_unicode(bad, b'\\'), None, "{bad:?}");
    }
}

#[test]
fn ddl_and_statement_drops() {
    assert!(classify(b"ALTER TABLE t ADD COLUMN b int").ddl);
    assert!(classify(b"drop type x").ddl);
    assert!(!classify(b"SELECT 1").ddl);
    assert!(classify(b"DISCARD ALL").drops_statements);
    assert!(classify(b"deallocate prepare all").drops_statements);
    assert!(!classify(b"DEALLOCATE x").drops_statements);
    assert!(classify(b"SELECT 1; SELECT 2").multi);
    assert!(!classify(b"SELECT ';'").multi);
}

#[test]
fn database_commands() {
    assert_eq!(
        database_command(b"DROP DATABASE IF EXISTS \"My\""),
        Some(DatabaseCommand {
            database: b"My".to_vec()
        })
    );
    assert_eq!(
        database_command(b"alter database Foo rename to bar"),
        Some(DatabaseCommand {
            database: b"foo".to_vec()
        })
    );
    assert_eq!(database_command(b"alter database foo set x = 1"), None);
    assert_eq!(database_command(b"drop table x"), None);
}

#[test]
fn named_statement_commands() {
    let c = named_statement_command(b"DEALLOCATE _pg3_1").unwrap();
    assert!(!c.execute);
    assert_eq!(c.name, b"_pg3_1");
    let sql = b"EXECUTE \"S1\"(1, 'a')";
    let c = named_statement_command(sql).unwrap();
    assert!(c.execute);
    assert_eq!(&sql[c.name_at.clone()], b"\"S1\"");
    assert_eq!(c.name, b"S1");
    assert_eq!(
        named_statement_command(b"deallocate prepare Foo;")
            .unwrap()
            .name,
        b"foo"
    );
    assert_eq!(named_statement_command(b"DEALLOCATE ALL"), None);
    assert_eq!(named_statement_command(b"DEALLOCATE a; SELECT 1"), None);
    assert_eq!(named_statement_command(b"EXECUTE a; SELECT 1"), None);
    assert_eq!(named_statement_command(b"EXECUTE a(1); SET ROLE x"), None);
    for sql in [
        &b"EXPLAIN EXECUTE s1(1)"[..],
        b"explain analyze verbose execute s1 (1)",
        b"EXPLAIN (ANALYZE, FORMAT JSON, SETTINGS (true)) EXECUTE s1(1);",
    ] {
        let c = named_statement_command(sql).unwrap();
        assert!(c.execute);
        assert_eq!(c.name, b"s1");
        assert_eq!(&sql[c.name_at.clone()], b"s1");
    }
    assert_eq!(named_statement_command(b"EXPLAIN SELECT 1"), None);
    assert_eq!(named_statement_command(b"EXPLAIN DEALLOCATE s1"), None);
}

#[test]
fn pooler_names_in_sql() {
    let p = b"shoal_";
    assert_eq!(
        prepared_name_with_prefix(b"EXECUTE shoal_1", p),
        Some(b"shoal_1".to_vec())
    );
    assert_eq!(
        prepared_name_with_prefix(b"explain execute \"shoal_2\"(1)", p),
        Some(b"shoal_2".to_vec())
    );
    assert!(prepared_name_with_prefix(b"DEALLOCATE SHOAL_3", p).is_some());
    assert!(prepared_name_with_prefix(b"SELECT * FROM shoal_stats", p).is_none());
    assert!(prepared_name_with_prefix(b"EXECUTE mine; SELECT shoal_x FROM t", p).is_none());
    assert!(prepared_name_with_prefix(b"EXECUTE 'shoal_1'", p).is_none());
    assert_eq!(
        prepared_name_with_prefix(b"execute U&\"!0073hoal_20\" UESCAPE '!'(1)", p),
        Some(b"shoal_20".to_vec())
    );
    assert!(prepared_name_with_prefix(b"select 1 --x\r; deallocate shoal_4", p).is_some());
}

#[test]
fn lexer_never_panics_on_odd_input() {
    for sql in [
        &b"'unterminated"[..],
        b"\"unterminated",
        b"/* open",
        b"$a$ open",
        b"$",
        b"$1",
        b"E'\\",
        b"U&",
        b"\xff\xfe SET",
        b"--",
    ] {
        let _ = classify(sql);
        let _ = database_command(sql);
        let _ = named_statement_command(sql);
    }
}
