//! Postgres Changes' value rendering against real PostgreSQL: for each type, what
//! `shoal_realtime::render` makes of the value's text form must be the JSON `to_jsonb`
//! gives (as Supabase Realtime renders values), arrays and edge values included.
#![allow(clippy::disallowed_methods)]

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_render_as_postgresql_s_to_jsonb() {
    let db = unique_db("render");
    pg().create_database(&db);
    let c = direct(&db).await;
    // As the change stream's connection runs.
    c.batch_execute(
        "SET TimeZone = 'UTC'; SET DateStyle = 'ISO'; \
         CREATE TYPE mood AS ENUM ('happy', 'sad');",
    )
    .await
    .unwrap();
    let exprs = [
        "1::int2",
        "2147483647",
        "-9007199254740993::int8",
        "12.50::numeric",
        "'NaN'::numeric",
        "123456789012345678901234567890.123::numeric",
        "1.5::float4",
        "'Infinity'::float8",
        "'NaN'::float8",
        "1e20::float8",
        "1e-7::float8",
        "true",
        r#"'{"a": [1, null], "b": "x"}'::jsonb"#,
        r#"'{"a":  1}'::json"#,
        "'2024-01-02 03:04:05.123+00'::timestamptz",
        "'2024-01-02 03:04:05.5+05:30'::timestamptz",
        "'infinity'::timestamptz",
        "'2024-01-02 03:04:05'::timestamp",
        "'2024-01-02'::date",
        "'03:04:05'::time",
        r"'\x00ff'::bytea",
        r#"E'a "q" \\ b\n'::text"#,
        "'ab'::char(3)",
        "'x'::varchar",
        "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'::uuid",
        "'happy'::mood",
        "interval '1 day 2 hours'",
        "'10.0.0.1'::inet",
        "ARRAY[1, 2, NULL]::int4[]",
        "ARRAY[[1, 2], [3, 4]]",
        r#"ARRAY['a b', 'c"d', NULL, 'NULL', '']"#,
        "'[0:1]={5,6}'::int4[]",
        "'{}'::text[]",
        "ARRAY[true, false]",
        "ARRAY[1.5, 2]::numeric[]",
        r#"ARRAY['{"a": 1}'::jsonb]"#,
        "ARRAY['2024-01-02 03:04:05+00'::timestamptz]",
        "ARRAY['happy', 'sad']::mood[]",
        r"ARRAY['\x01'::bytea]",
    ];
    for e in exprs {
        let q = format!(
            "SELECT format('%s', v), to_jsonb(v)::text, t.typname::text \
             FROM (SELECT {e} AS v) s JOIN pg_type t ON t.oid = pg_typeof(s.v)"
        );
        let row = c
            .query_one(&q, &[])
            .await
            .unwrap_or_else(|err| panic!("{e}: {err}"));
        let (text, want, typname): (String, String, String) = (row.get(0), row.get(1), row.get(2));
        let got = shoal_realtime::render::render(&typname, &text);
        let parse = |s: &str| -> serde_json::Value {
            serde_json::from_str(s).unwrap_or_else(|err| panic!("{e}: {s}: {err}"))
        };
        assert_eq!(
            parse(&got),
            parse(&want),
            "{e} ({typname}, text {text:?}): rendered {got}, to_jsonb gives {want}"
        );
    }
}
