use super::*;

#[test]
fn trees_too_deep_to_prove_are_not_parsed() {
    // Each would overflow a 2 MiB stack inside libpg_query: refused before parsing, on a
    // small stack to prove it, with no thread of its own.
    let deep = [
        format!("SELECT {}1", "1+".repeat(100_000)),
        format!("SELECT {}1{}", "abs(".repeat(100_000), ")".repeat(100_000)),
        format!("SELECT {}true", "NOT ".repeat(100_000)),
        format!("SELECT 1{}", " IS NULL".repeat(50_000)),
        format!("SELECT 1{}", " UNION SELECT 1".repeat(5_000)),
        format!("SELECT {}1{}", "ARRAY[".repeat(5_000), "]".repeat(5_000)),
    ];
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            for sql in &deep {
                assert_eq!(classify(sql), None);
                assert_eq!(
                    crate::facts::facts(sql),
                    Err(crate::facts::FactsError::TooDeep)
                );
            }
        })
        .unwrap()
        .join()
        .unwrap();
    // The deepest texts within the bound parse on a thread's usual 2 MiB, unoptimised
    // (and fail to prove: deeper than the decoder goes, which is unknown, not a
    // statement PostgreSQL would refuse).
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            let depth = MAX_NESTING - 2;
            for sql in [
                format!("SELECT {}1", "1+".repeat(depth)),
                format!("SELECT {}true", "NOT ".repeat(depth)),
                format!(
                    "SELECT {}1{}",
                    "abs(".repeat(depth / 3 - 4),
                    ")".repeat(depth / 3 - 4)
                ),
            ] {
                assert!(nesting_estimate(&sql) <= MAX_NESTING + 2, "{}", &sql[..20]);
                assert_eq!(classify(&sql), None);
                assert_eq!(
                    crate::facts::facts(&sql),
                    Err(crate::facts::FactsError::TooDeep)
                );
            }
        })
        .unwrap()
        .join()
        .unwrap();
    // Long but flat texts are still proven: a long IN list, a wide ORM select, a WHERE
    // of many conditions.
    let ids: Vec<String> = (0..5000).map(|i| i.to_string()).collect();
    assert!(classify(&format!("SELECT * FROM t WHERE id IN ({})", ids.join(", "))).is_some());
    let cols: Vec<String> = (0..400)
        .map(|i| format!("\"t0\".\"c{i}\" AS \"x{i}\""))
        .collect();
    assert!(classify(&format!("SELECT {} FROM t AS t0", cols.join(", "))).is_some());
    let conds: Vec<String> = (0..2000).map(|i| format!("c{i} = {i}")).collect();
    assert!(classify(&format!("SELECT * FROM t WHERE {}", conds.join(" AND "))).is_some());
}

#[test]
fn values_comments_and_case_are_taken_out() {
    let n = |s: &str| String::from_utf8(normalized(s.as_bytes()).expect(s)).unwrap();
    assert_eq!(
        n("SELECT * FROM t WHERE id = 42 AND name = 'bob''s'"),
        n("select *  from t where id = 7 and name = 'x' -- note")
    );
    assert_eq!(n("SELECT 1.5e-3, .5, 0x1F, 1_000"), "select 0, 0, 0, 0");
    assert_eq!(
        n("SELECT E'a\\'b', B'101', X'1f', N'z'"),
        "select e'?', b'?', x'?', n'?'"
    );
    assert_eq!(
        n("SELECT \"Mixed Case\", $1, $12 /* a /* nested */ c */"),
        "select \"Mixed Case\", $1, $12"
    );
    assert_eq!(n("SELECT a1, x_2"), "select a1, x_2");
    assert_ne!(n("SELECT a - 1"), n("SELECT a + 1"));
    assert_ne!(n("SELECT \"A\""), n("SELECT \"a\""));
    for unsure in [
        "SELECT 'a\\'b'",
        "SELECT $$x$$",
        "SELECT $tag$x$tag$",
        "SELECT 'open",
        "SELECT \"open",
        "SELECT 1 /* open",
        "SELECT x$$",
    ] {
        assert_eq!(normalized(unsure.as_bytes()), None, "{unsure}");
    }
}

proptest::proptest! {
    /// Texts of one shape get one verdict: whatever values are written into a
    /// statement, it is read-only exactly when its first form is.
    #[test]
    fn one_shape_one_verdict(
        shape in proptest::sample::select(vec![
            "SELECT v FROM t WHERE id = {n} AND s = '{s}'",
            "UPDATE t SET v = {n} WHERE s = '{s}'",
            "SELECT nextval('{s}') + {n}",
            "SELECT * FROM t WHERE a IN ({n}, {n}) FOR UPDATE",
            "WITH d AS (DELETE FROM t WHERE id = {n} RETURNING '{s}') SELECT * FROM d",
            "SET search_path = '{s}'",
            "BEGIN READ ONLY; SELECT {n}, E'{s}'; COMMIT",
        ]),
        n in 0u32..1_000_000,
        s in "[a-z ;()'-]{0,12}",
    ) {
        let quoted = s.replace('\'', "''");
        let text = shape.replace("{n}", &n.to_string()).replace("{s}", &quoted);
        let first = shape.replace("{n}", "1").replace("{s}", "x");
        proptest::prop_assert_eq!(normalized(text.as_bytes()), normalized(first.as_bytes()));
        proptest::prop_assert_eq!(classify(&text).is_some(), classify(&first).is_some());
    }
}

fn reads(sql: &str) -> Vec<String> {
    classify(sql)
        .unwrap_or_else(|| panic!("{sql:?} should be proven read-only"))
        .functions
}

fn writes(sql: &str) {
    assert_eq!(classify(sql), None, "{sql:?} must go to the primary");
}

#[test]
fn plain_reads_are_proven() {
    for sql in [
        "SELECT 1",
        "select * from t where a = $1 order by b limit 10 offset 5",
        "SELECT a, b FROM t JOIN u USING (id) LEFT JOIN v ON v.x = t.x",
        "SELECT * FROM (SELECT 1) s, LATERAL (SELECT 2) l",
        "WITH c AS (SELECT 1 AS x) SELECT x FROM c",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 5) SELECT n FROM r",
        "VALUES (1, 'one'), (2, 'two')",
        "TABLE t",
        "SELECT 1 UNION SELECT 2 EXCEPT SELECT 3",
        "SELECT CASE WHEN a IS NULL THEN 0 ELSE a END, COALESCE(b, 1), NULLIF(c, 2) FROM t",
        "SELECT a[1], (r).f, ARRAY[1,2], ROW(1,2), x::int, CURRENT_TIMESTAMP FROM t",
        "SELECT EXISTS (SELECT 1 FROM t WHERE t.a = u.a) FROM u WHERE a IN (1,2,3)",
        "SHOW search_path",
        "SET search_path TO app, public",
        "EXPLAIN SELECT 1",
        "EXPLAIN ANALYZE SELECT * FROM t",
        "BEGIN READ ONLY",
        "START TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY",
        "COMMIT",
        "ROLLBACK",
        "BEGIN READ ONLY; SELECT 1; COMMIT",
        "SELECT 1; SELECT 2",
        "/* shoal */ SELECT $$a;b$$, 'c;d' -- end",
        "",
    ] {
        classify(sql).unwrap_or_else(|| panic!("{sql:?} should be proven read-only"));
    }
}

#[test]
fn relations_read_are_named_for_a_cache() {
    let rel = |schema: Option<&str>, name: &str| Relation {
        schema: schema.map(str::to_owned),
        name: name.to_owned(),
    };
    let r = classify(
        "WITH c AS (SELECT * FROM Base) SELECT * FROM c JOIN app.\"Odd\" o ON true \
         WHERE EXISTS (SELECT 1 FROM sub) AND x IN (SELECT y FROM app.c)",
    )
    .unwrap();
    assert_eq!(
        r.relations,
        vec![
            rel(None, "base"),
            rel(None, "sub"),
            rel(Some("app"), "Odd"),
            rel(Some("app"), "c"),
        ]
    );
    assert!(r.only_queries && r.statements == 1 && !r.clock);
    assert!(classify("SELECT CURRENT_DATE").unwrap().clock);
    assert!(classify("SELECT LOCALTIMESTAMP(2)").unwrap().clock);
    assert!(
        !classify("SELECT CURRENT_USER, current_schema")
            .unwrap()
            .clock
    );
    assert!(!classify("SHOW search_path").unwrap().only_queries);
    assert!(!classify("BEGIN READ ONLY; SELECT 1").unwrap().only_queries);
    assert!(!classify("").unwrap().only_queries);
    assert_eq!(classify("SELECT 1; SELECT 2").unwrap().statements, 2);
}

#[test]
fn functions_are_named_for_the_catalogue() {
    assert_eq!(
        reads("SELECT count(*), pg_catalog.now(), Lower(name) FROM t GROUP BY name"),
        ["count", "lower", "pg_catalog.now"]
    );
    assert_eq!(
        reads("SELECT * FROM generate_series(1, 3)"),
        ["generate_series"]
    );
    assert_eq!(
        reads("SELECT x FROM t WHERE y = (SELECT max(z) FROM u)"),
        ["max"]
    );
    assert_eq!(
        reads("SELECT sum(a) OVER (PARTITION BY b ORDER BY c) FROM t"),
        ["sum"]
    );
    // Functions that write are named too: the catalogue knows them as volatile.
    assert_eq!(reads("SELECT nextval('s')"), ["nextval"]);
    assert_eq!(reads("SELECT pg_advisory_lock(1)"), ["pg_advisory_lock"]);
    assert_eq!(
        reads("SELECT set_config('a.b', 'c', false)"),
        ["set_config"]
    );
}

#[test]
fn writes_and_possible_writes_are_not() {
    for sql in [
        "INSERT INTO t VALUES (1)",
        "UPDATE t SET a = 1",
        "DELETE FROM t",
        "MERGE INTO t USING u ON t.a = u.a WHEN MATCHED THEN DELETE",
        "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
        "WITH i AS (INSERT INTO t VALUES (1) RETURNING a) SELECT a FROM i",
        "SELECT * FROM t FOR UPDATE",
        "SELECT * FROM t FOR SHARE",
        "SELECT * FROM t FOR NO KEY UPDATE SKIP LOCKED",
        "SELECT * INTO new_t FROM t",
        "CREATE TABLE x (a int)",
        "CREATE TEMP TABLE x (a int)",
        "DROP TABLE t",
        "TRUNCATE t",
        "COPY t FROM STDIN",
        "COPY t TO STDOUT",
        "LISTEN ch",
        "NOTIFY ch",
        "LOCK TABLE t",
        "BEGIN",
        "START TRANSACTION",
        "BEGIN READ WRITE",
        "BEGIN; SELECT 1; COMMIT",
        "SELECT 1; INSERT INTO t VALUES (1)",
        "EXPLAIN ANALYZE INSERT INTO t VALUES (1)",
        "CALL p()",
        "DO $$ BEGIN END $$",
        "PREPARE p AS SELECT 1",
        "EXECUTE p",
        "DECLARE c CURSOR FOR SELECT 1",
        "SET TRANSACTION READ WRITE",
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
        "PREPARE TRANSACTION 'x'",
        "VACUUM t",
        "REFRESH MATERIALIZED VIEW v",
        "DISCARD ALL",
        "SELEC 1",
        "SELECT (",
    ] {
        writes(sql);
    }
}
