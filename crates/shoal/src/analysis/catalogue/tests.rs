use super::*;

/// The row as PostgreSQL writes it: relations and views as JSON arrays.
fn read(row: serde_json::Value) -> Catalogue {
    Catalogue::from_text(&row.to_string()).expect("a catalogue row")
}

fn empty() -> serde_json::Value {
    serde_json::json!({
        "version": "1", "functions": [], "operators": [], "types": [],
        "user_operators": [], "user_casts": [], "volatile_implicit_casts": false,
        "policies": [], "relations": [], "views": [],
    })
}

fn with(mut row: serde_json::Value, key: &str, value: serde_json::Value) -> serde_json::Value {
    row[key] = value;
    row
}

#[test]
fn a_name_in_several_schemas_is_as_safe_as_its_least_safe_table() {
    let row = with(
        empty(),
        "relations",
        serde_json::json!([
            ["public.t", "t", "r", false, true, true, false],
            ["app.t", "t", "r", false, true, false, false],
            ["public.v", "v", "v", false, false, false, false],
            ["public.tables", "tables", "r", false, true, true, false],
            [
                "information_schema.tables",
                "tables",
                "v",
                true,
                false,
                false,
                false
            ],
        ]),
    );
    let row = with(
        row,
        "functions",
        serde_json::json!([["abs", true, true], ["now", false, true]]),
    );
    let c = read(row);
    let t = &c.relations["t"];
    assert!(t.cacheable && !t.plain_writes);
    assert_eq!(t.qualified, vec!["public.t", "app.t"]);
    assert!(!c.relations["v"].cacheable);
    assert!(
        c.relations["tables"].cacheable,
        "information_schema.tables is not the cache's"
    );
    assert!(c.loaded && c.immutable.contains("abs") && !c.immutable.contains("now"));
    assert!(c.non_volatile.contains("now"));
}

/// A policy that reads a setting (Supabase's `current_setting('request.jwt.claims')`)
/// or another table makes its table not kept; one on the role alone does not.
#[test]
fn row_security_is_judged_by_what_its_policies_call() {
    let table = |name: &str| {
        serde_json::json!([format!("public.{name}"), name, "r", false, true, true, true])
    };
    let row = empty();
    let row = with(
        row,
        "functions",
        serde_json::json!([["lower", true, true], ["current_setting", false, true]]),
    );
    let row = with(
        row,
        "operators",
        serde_json::json!([["=", true, true], ["->>", true, true]]),
    );
    let row = with(
        row,
        "types",
        serde_json::json!([
            ["name", true, true],
            ["text", true, true],
            ["json", true, true]
        ]),
    );
    let row = with(
        row,
        "policies",
        serde_json::json!([
            ["by_role", "(owner = CURRENT_USER)", "true"],
            [
                "by_claims",
                "(owner = ((current_setting('request.jwt.claims'::text))::json ->> 'sub'::text))",
                "true"
            ],
            ["by_table", "(owner IN (SELECT u FROM allowed))", "true"],
        ]),
    );
    let row = with(
        row,
        "relations",
        serde_json::json!([
            table("by_role"),
            table("by_claims"),
            table("by_table"),
            table("no_policy")
        ]),
    );
    let c = read(row);
    assert!(c.relations["by_role"].cacheable);
    assert!(!c.relations["by_claims"].cacheable);
    assert!(!c.relations["by_table"].cacheable);
    assert!(
        c.relations["no_policy"].cacheable,
        "no policy: nothing is visible, to anyone"
    );
}

/// A standby reads tables and proven views alike; a temporary view is the session's own,
/// and a function that takes a transaction id cannot run there though it is STABLE.
#[test]
fn what_a_standby_reads_alike_is_proven_through_views() {
    let row = with(
        empty(),
        "functions",
        serde_json::json!([["count", true, true], ["txid_current", false, true]]),
    );
    let row = with(
        row,
        "relations",
        serde_json::json!([
            ["public.t", "t", "r", false, true, true, false],
            ["public.counted", "counted", "v", false, false, false, false],
            ["public.bumped", "bumped", "v", false, false, false, false],
            ["public.xid", "xid", "v", false, false, false, false],
        ]),
    );
    let row = with(
        row,
        "views",
        serde_json::json!([
            ["counted", "SELECT count(*) FROM t", "v", true, false],
            ["bumped", "SELECT bump() AS n", "v", true, false],
            ["xid", "SELECT txid_current() AS x", "v", true, false],
            ["mine", "SELECT count(*) FROM t", "v", true, true],
        ]),
    );
    let c = read(row);
    assert!(c.readable.contains("t") && c.readable.contains("counted"));
    assert!(!c.readable.contains("bumped"), "calls a function not known");
    assert!(!c.readable.contains("xid"), "takes a transaction id");
    assert!(!c.readable.contains("mine"), "a temporary view");
    assert!(c.non_volatile.contains("txid_current"));
}

/// Rules see what runs behind the objects users made: their operators', casts' and
/// views' functions, and none of PostgreSQL's own views.
#[test]
fn what_runs_behind_user_objects_is_read_for_the_rules() {
    let row = with(
        empty(),
        "user_operators",
        serde_json::json!([["##", "pg_catalog.pg_sleep"]]),
    );
    let row = with(
        row,
        "views",
        serde_json::json!([
            ["slow", "SELECT pg_sleep(1) AS s", "v", true, false],
            [
                "pg_stat_activity",
                "SELECT pg_stat_get_activity(NULL) AS a",
                "v",
                false,
                false
            ],
        ]),
    );
    let c = read(row);
    let behind = |sql: &str| c.calls.behind(&shoal_wire::facts::facts(sql).unwrap());
    assert_eq!(behind("SELECT ## 0.1"), ["pg_catalog.pg_sleep"]);
    assert_eq!(behind("SELECT * FROM slow"), ["pg_sleep"]);
    assert!(behind("SELECT * FROM pg_stat_activity").is_empty());
}

/// Readings that change move the generation; one read again unchanged does not (kept
/// results and remembered verdicts stay).
#[test]
fn the_generation_moves_only_when_the_catalogue_changed() {
    let s = Source::new(
        "test".into(),
        crate::server::Upstream::nowhere(),
        std::time::Duration::from_secs(1),
    );
    assert!(!s.current().loaded);
    let g0 = s.generation();
    s.set(read(empty()));
    let g1 = s.generation();
    assert!(g1 > g0, "the first reading");
    s.set(read(empty()));
    assert_eq!(s.generation(), g1, "the same version");
    s.set(read(with(empty(), "version", "2".into())));
    assert!(s.generation() > g1);
    assert_eq!(s.status().readings, 3);
}

#[test]
fn the_query_carries_its_version_subquery() {
    let q = row::query();
    assert!(!q.contains("(VERSION)"));
    assert!(q.contains("(SELECT * FROM (SELECT concat_ws("));
}
