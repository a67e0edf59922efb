//! What SQL does, in the terms query rules are written in: the kinds of statement it runs
//! (nested ones included: a `DELETE` inside a `WITH`, an `INSERT` under `EXPLAIN ANALYZE`,
//! a `DROP` inside `PREPARE`), the functions it calls, the settings it sets, the SQL-level
//! prepared statements it executes, and each statement's fingerprint.
//!
//! Rules guard what a tenant may run, so the walk must miss nothing: the parse tree
//! (PostgreSQL's own grammar, through libpg_query) is turned into a generic tree and every
//! node of every type is visited. Case, comments, quoting and dollar quotes are gone by then;
//! they cannot hide a statement or a call.

use serde_json::Value;

/// What one text (one or several statements) does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// Statement kinds, upper case: `SELECT`, `INSERT`, `DROP`, `ALTER SYSTEM`, `COPY`,
    /// `COPY PROGRAM`, `SET`, `TRUNCATE`, ..., and `DDL` for any statement that changes the
    /// schema or roles.
    pub kinds: Vec<String>,
    /// Functions called, lower case, as written (`pg_catalog.now` or `now`).
    pub functions: Vec<String>,
    /// Parameters set (`SET name`, `RESET name`, `SET LOCAL name`), lower case.
    pub settings: Vec<String>,
    /// SQL-level prepared statements run (`EXECUTE name`), and made (`PREPARE name`).
    pub executes: Vec<String>,
    pub prepares: Vec<String>,
    /// Each statement's fingerprint (pg_query's: literals and formatting do not count), hex;
    /// and, for a statement naming a relation with its schema, the fingerprint of the same
    /// statement with the schemas left out (`public.docs` is matched as `docs` is).
    pub fingerprints: Vec<String>,
    /// Relations named anywhere (read or written), by name without schema.
    pub relations: Vec<String>,
    /// Operators applied (each runs its function), and types cast to (each runs an input
    /// or cast function), as the parser names them.
    pub operators: Vec<String>,
    pub casts: Vec<String>,
}

/// Why a text has no facts.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum FactsError {
    #[error("the statement does not parse: {0}")]
    Parse(String),
    #[error("the statement nests too deep to be checked")]
    TooDeep,
}

/// The facts of `sql`.
pub fn facts(sql: &str) -> Result<Facts, FactsError> {
    crate::readonly::on_parse_stack(sql, || facts_here(sql)).unwrap_or(Err(FactsError::TooDeep))
}

fn facts_here(sql: &str) -> Result<Facts, FactsError> {
    facts_of(sql, &pg_query::parse(sql).map_err(parse_error)?)
}

/// Why pg_query could not give a tree: the grammar's own limits, and a tree deeper than
/// the decoder reads, are not "unparseable" (PostgreSQL may well run such a text) but
/// unknown.
pub(crate) fn parse_error(e: pg_query::Error) -> FactsError {
    match e {
        pg_query::Error::Parse(m)
            if m.contains("stack depth limit exceeded") || m.contains("memory exhausted") =>
        {
            FactsError::TooDeep
        }
        pg_query::Error::Parse(m) => FactsError::Parse(m),
        _ => FactsError::TooDeep,
    }
}

/// [`facts`] of `sql`, parsed already.
pub(crate) fn facts_of(sql: &str, parsed: &pg_query::ParseResult) -> Result<Facts, FactsError> {
    let tree =
        serde_json::to_value(&parsed.protobuf).map_err(|e| FactsError::Parse(e.to_string()))?;
    let mut f = Facts::default();
    let mut qualified_at = Vec::new();
    walk(&tree, &mut f, &mut qualified_at);
    qualified_at.sort_unstable();
    for raw in &parsed.protobuf.stmts {
        let start = raw.stmt_location.max(0) as usize;
        let end = match raw.stmt_len {
            0 => sql.len(),
            n => start + n as usize,
        };
        let Some(text) = sql.get(start..end) else {
            continue;
        };
        if let Ok(fp) = pg_query::fingerprint(text) {
            f.fingerprints.push(fp.hex);
        }
        let here: Vec<usize> = qualified_at
            .iter()
            .filter(|&&at| at >= start && at < end)
            .map(|&at| at - start)
            .collect();
        if let Some(bare) = without_schemas(text, &here) {
            if let Ok(fp) = pg_query::fingerprint(&bare) {
                f.fingerprints.push(fp.hex);
            }
        }
    }
    for v in [
        &mut f.kinds,
        &mut f.functions,
        &mut f.settings,
        &mut f.executes,
        &mut f.relations,
        &mut f.operators,
        &mut f.casts,
    ] {
        v.sort();
        v.dedup();
    }
    Ok(f)
}

/// `text` with the qualifiers of the relation names starting at `at` (sorted byte offsets)
/// cut off (`public.docs` → `docs`); `None` when there are none or one is not where the
/// parser said.
fn without_schemas(text: &str, at: &[usize]) -> Option<String> {
    if at.is_empty() {
        return None;
    }
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    for &start in at {
        if start < copied {
            return None;
        }
        // Every `name .` before the last name.
        let mut i = start;
        let mut cut = start;
        loop {
            i = identifier_end(b, i)?;
            let mut j = i;
            while b.get(j).is_some_and(u8::is_ascii_whitespace) {
                j += 1;
            }
            if b.get(j) != Some(&b'.') {
                break;
            }
            j += 1;
            while b.get(j).is_some_and(u8::is_ascii_whitespace) {
                j += 1;
            }
            cut = j;
            i = j;
        }
        out.push_str(text.get(copied..start)?);
        copied = cut;
    }
    out.push_str(text.get(copied..)?);
    Some(out)
}

/// Past the identifier at `i` (quoted, or a run of name characters).
fn identifier_end(b: &[u8], mut i: usize) -> Option<usize> {
    if b.get(i) == Some(&b'"') {
        i += 1;
        loop {
            match b.get(i)? {
                b'"' if b.get(i + 1) == Some(&b'"') => i += 2,
                b'"' => return Some(i + 1),
                _ => i += 1,
            }
        }
    }
    let start = i;
    while b
        .get(i)
        .is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80)
    {
        i += 1;
    }
    (i > start).then_some(i)
}

/// Every node of the generic tree: a node is an object with one key naming its type.
/// `qualified_at`: where each relation named with its schema starts.
fn walk(v: &Value, f: &mut Facts, qualified_at: &mut Vec<usize>) {
    match v {
        Value::Object(map) => {
            // A RangeVar: named as a node in lists, but held bare in fields such as an
            // INSERT's `relation`; known by its fields either way.
            if map.contains_key("relpersistence") {
                if let Some(name) = map.get("relname").and_then(Value::as_str) {
                    f.relations.push(name.to_owned());
                }
                let qualified = map
                    .get("schemaname")
                    .and_then(Value::as_str)
                    .is_some_and(|s| !s.is_empty());
                let at = map.get("location").and_then(Value::as_i64).unwrap_or(-1);
                if qualified && at >= 0 {
                    qualified_at.push(at as usize);
                }
            }
            for (key, inner) in map {
                if let Some(kind) = key.strip_suffix("Stmt") {
                    note_statement(kind, inner, f);
                } else if key == "FuncCall" {
                    if let Some(name) = func_name(inner) {
                        f.functions.push(name);
                    }
                } else if key == "AExpr" {
                    match last_name(inner.get("name")) {
                        // BETWEEN and its kin compare with `>=` and `<=`.
                        Some(op) if op.bytes().any(|b| b.is_ascii_alphabetic()) => {
                            f.operators.extend([">=".to_owned(), "<=".to_owned()])
                        }
                        Some(op) => f.operators.push(op.to_owned()),
                        None => {}
                    }
                } else if key == "TypeCast" {
                    if let Some(t) = last_name(inner.get("type_name").and_then(|t| t.get("names")))
                    {
                        f.casts.push(t.to_owned());
                    }
                }
                walk(inner, f, qualified_at);
            }
        }
        Value::Array(items) => items.iter().for_each(|i| walk(i, f, qualified_at)),
        _ => {}
    }
}

/// The last part of a list of `String` nodes (an operator's or a type's name).
fn last_name(list: Option<&Value>) -> Option<&str> {
    list?
        .as_array()?
        .last()?
        .get("node")?
        .get("String")?
        .get("sval")?
        .as_str()
}

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key)?.as_str()
}

/// `funcname` parts joined by `.`, lower case (the parser folded unquoted names already).
fn func_name(call: &Value) -> Option<String> {
    let parts: Vec<&str> = call
        .get("funcname")?
        .as_array()?
        .iter()
        .filter_map(|p| p.get("node")?.get("String")?.get("sval")?.as_str())
        .collect();
    (!parts.is_empty()).then(|| parts.join(".").to_lowercase())
}

/// Records one statement node (`kind` is its type without `Stmt`).
fn note_statement(kind: &str, node: &Value, f: &mut Facts) {
    let mut add = |k: &str| f.kinds.push(k.to_owned());
    match kind {
        "Select" | "SetOperation" => add("SELECT"),
        "Insert" => add("INSERT"),
        "Update" => add("UPDATE"),
        "Delete" => add("DELETE"),
        "Merge" => add("MERGE"),
        "Truncate" => add("TRUNCATE"),
        "Copy" => {
            add("COPY");
            if node.get("is_program").and_then(Value::as_bool) == Some(true) {
                add("COPY PROGRAM");
            }
        }
        "VariableSet" => {
            add("SET");
            if let Some(name) = str_field(node, "name") {
                f.settings.push(name.to_lowercase());
            }
        }
        "VariableShow" => add("SHOW"),
        "AlterSystem" => {
            add("ALTER SYSTEM");
            add("DDL");
        }
        "Execute" => {
            add("EXECUTE");
            if let Some(name) = str_field(node, "name") {
                f.executes.push(name.to_owned());
            }
        }
        "Transaction" => add("TRANSACTION"),
        "Explain" => add("EXPLAIN"),
        "Prepare" => {
            add("PREPARE");
            if let Some(name) = str_field(node, "name") {
                f.prepares.push(name.to_owned());
            }
        }
        "Deallocate" => add("DEALLOCATE"),
        "Listen" => add("LISTEN"),
        "Unlisten" => add("UNLISTEN"),
        "Notify" => add("NOTIFY"),
        "Lock" => add("LOCK"),
        "Do" => add("DO"),
        "Call" => add("CALL"),
        "Vacuum" => add("VACUUM"),
        "Cluster" => add("CLUSTER"),
        "Reindex" => add("REINDEX"),
        "CheckPoint" => add("CHECKPOINT"),
        "Load" => add("LOAD"),
        "Discard" => add("DISCARD"),
        "DeclareCursor" => add("DECLARE"),
        "Fetch" => add("FETCH"),
        "ClosePortal" => add("CLOSE"),
        "Grant" | "GrantRole" => {
            add("GRANT");
            add("DDL");
        }
        "Drop" | "Dropdb" | "DropRole" | "DropOwned" | "DropTableSpace" | "DropSubscription"
        | "DropUserMapping" => {
            add("DROP");
            add("DDL");
        }
        "CreateTableAs" => {
            add("CREATE");
            add("DDL");
        }
        other if other.starts_with("Create") || other.starts_with("Define") => {
            add("CREATE");
            add("DDL");
        }
        other if other.starts_with("Alter") || other == "Rename" => {
            add("ALTER");
            add("DDL");
        }
        "Comment"
        | "SecLabel"
        | "Index"
        | "View"
        | "Rule"
        | "CompositeType"
        | "ReassignOwned"
        | "ImportForeignSchema"
        | "RefreshMatView" => add("DDL"),
        // A node named "...Stmt" this list does not know yet: still a statement, under its
        // own name, so a rule can name it.
        other => add(&other.to_uppercase()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree deeper than the decoder reads is not a text PostgreSQL refuses: PostgreSQL
    /// runs the DROP. It must come out unknown, never as "does not parse".
    /// A fingerprint rule written for `docs` holds for `public.docs` (and any schema's).
    #[test]
    fn a_statement_naming_schemas_also_has_the_fingerprint_without_them() {
        let bare = &facts("SELECT * FROM docs WHERE id = 1")
            .unwrap()
            .fingerprints[0];
        for sql in [
            "SELECT * FROM public.docs WHERE id = 2",
            "SELECT * FROM \"public\" . docs WHERE id = 3",
            "select * from app.public.docs where id = 4",
        ] {
            assert!(facts(sql).unwrap().fingerprints.contains(bare), "{sql}");
        }
        assert_eq!(facts("SELECT * FROM docs").unwrap().fingerprints.len(), 1);
    }

    #[test]
    fn operators_and_casts_are_named() {
        let f = facts("INSERT INTO t SELECT 1 ### 2, 'x'::date, CAST(1 AS mood)").unwrap();
        assert_eq!(f.operators, ["###"]);
        assert_eq!(f.casts, ["date", "mood"]);
    }

    #[test]
    fn a_tree_too_deep_to_read_is_unknown_not_unparseable() {
        let sql = format!(
            "DROP TABLE victim; SELECT {}1{}",
            "abs(".repeat(60),
            ")".repeat(60)
        );
        assert_eq!(facts(&sql), Err(FactsError::TooDeep));
        assert!(matches!(facts("SELEC 1"), Err(FactsError::Parse(_))));
    }

    fn kinds(sql: &str) -> Vec<String> {
        facts(sql).unwrap().kinds
    }

    #[test]
    fn statements_are_found_wherever_they_are() {
        assert_eq!(kinds("SELECT 1"), ["SELECT"]);
        assert_eq!(kinds("drop TABLE t"), ["DDL", "DROP"]);
        assert!(
            kinds("WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d")
                .contains(&"DELETE".into())
        );
        assert!(kinds("EXPLAIN ANALYZE INSERT INTO t VALUES (1)").contains(&"INSERT".into()));
        assert!(kinds("PREPARE p AS DELETE FROM t").contains(&"DELETE".into()));
        assert!(kinds("SELECT 1; /* x */ TRUNCATE t").contains(&"TRUNCATE".into()));
        assert!(kinds("ALTER SYSTEM SET work_mem = '1GB'").contains(&"ALTER SYSTEM".into()));
        assert!(kinds("COPY t FROM PROGRAM 'curl x'").contains(&"COPY PROGRAM".into()));
        assert!(!kinds("COPY t FROM STDIN").contains(&"COPY PROGRAM".into()));
        assert!(kinds("CREATE TABLE x (a int)").contains(&"DDL".into()));
        assert!(kinds("ALTER TABLE t ADD COLUMN b int").contains(&"ALTER".into()));
        assert!(kinds("GRANT SELECT ON t TO bob").contains(&"GRANT".into()));
    }

    #[test]
    fn calls_settings_and_executes_are_named() {
        let f =
            facts("SELECT PG_TERMINATE_BACKEND(pid) FROM pg_stat_activity WHERE f(x) > 0").unwrap();
        assert_eq!(f.functions, ["f", "pg_terminate_backend"]);
        let f = facts("SELECT * FROM dblink('host=x', 'select 1') AS t(a int)").unwrap();
        assert_eq!(f.functions, ["dblink"]);
        let f = facts("SELECT \"pg_catalog\".\"pg_terminate_backend\"(1)").unwrap();
        assert_eq!(f.functions, ["pg_catalog.pg_terminate_backend"]);
        let f = facts("DO $$ BEGIN PERFORM 1; END $$").unwrap();
        assert_eq!(f.kinds, ["DO"]);
        let f = facts("SET LOCAL statement_timeout = 0; RESET Work_Mem").unwrap();
        assert_eq!(f.settings, ["statement_timeout", "work_mem"]);
        let f = facts("EXECUTE q(1)").unwrap();
        assert_eq!(f.executes, ["q"]);
        // Calls inside anything: a DML's RETURNING, a default, a subquery in DDL.
        let f = facts("UPDATE t SET a = g(1) RETURNING h(a)").unwrap();
        assert_eq!(f.functions, ["g", "h"]);
        let f =
            facts("WITH d AS (DELETE FROM a.t RETURNING *) INSERT INTO u SELECT * FROM d").unwrap();
        assert_eq!(f.relations, ["d", "t", "u"]);
    }

    #[test]
    fn fingerprints_ignore_values_and_formatting() {
        let a = facts("SELECT * FROM t WHERE id = 1").unwrap().fingerprints;
        let b = facts("select *  from t /* c */ where id = 42")
            .unwrap()
            .fingerprints;
        assert_eq!(a, b);
        assert_eq!(a.len(), 1);
        let two = facts("SELECT 1; SELECT * FROM t WHERE id = 7")
            .unwrap()
            .fingerprints;
        assert_eq!(two.len(), 2);
        assert_eq!(two[1], a[0]);
    }

    #[test]
    fn unparseable_and_too_deep_are_errors() {
        assert!(matches!(facts("SELEC 1"), Err(FactsError::Parse(_))));
        let deep = format!("SELECT {}1", "1+".repeat(50_000));
        assert_eq!(facts(&deep), Err(FactsError::TooDeep));
    }
}
