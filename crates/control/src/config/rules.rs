//! Query rules: what a database's (or a user's) clients may run. Each rule has one matcher
//! and an action; see `docs/rules.md`.

use serde::{Deserialize, Serialize};
use shoal_wire::facts::Facts;

/// A rule as written (`[[databases.NAME.rules]]`, `[[users.NAME.rules]]`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleSection {
    /// Shown in errors and logs (default: what it matches).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statement: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
    pub action: Action,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Refused with SQLSTATE 42501.
    Deny,
    /// Logged, and run (a dry run of a deny).
    Log,
}

/// What a rule matches.
#[derive(Debug, Clone)]
pub enum Matcher {
    /// A statement kind (`DROP`, `TRUNCATE`, `ALTER SYSTEM`, `COPY PROGRAM`, `DDL`, ...).
    Statement(String),
    /// `SET name`: setting that parameter (`SET`, `SET LOCAL`, `RESET`).
    Setting(String),
    /// A function called, by name (a schema-qualified rule name matches only that schema's;
    /// an unqualified one matches any schema's).
    Function(String),
    /// pg_query's fingerprint of a statement, hex.
    Fingerprint(String),
    /// A regular expression on the statement text as sent.
    Regex(regex::Regex),
}

/// A validated rule.
#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    pub matcher: Matcher,
    pub action: Action,
    /// As written, for telling a changed rule set from an unchanged one.
    source: RuleSection,
}

impl PartialEq for Rule {
    fn eq(&self, other: &Rule) -> bool {
        self.source == other.source
    }
}

/// The statement kinds a rule may name (what [`Facts::kinds`] holds).
pub const STATEMENT_KINDS: &[&str] = &[
    "SELECT",
    "INSERT",
    "UPDATE",
    "DELETE",
    "MERGE",
    "TRUNCATE",
    "COPY",
    "COPY PROGRAM",
    "SET",
    "SHOW",
    "ALTER SYSTEM",
    "EXECUTE",
    "TRANSACTION",
    "EXPLAIN",
    "PREPARE",
    "DEALLOCATE",
    "LISTEN",
    "UNLISTEN",
    "NOTIFY",
    "LOCK",
    "DO",
    "CALL",
    "VACUUM",
    "CLUSTER",
    "REINDEX",
    "CHECKPOINT",
    "LOAD",
    "DISCARD",
    "DECLARE",
    "FETCH",
    "CLOSE",
    "GRANT",
    "DROP",
    "CREATE",
    "ALTER",
    "DDL",
];

impl Rule {
    /// What the rule matches, as the console shows it (`statement DROP`, `function f`, ...).
    pub fn matcher_text(&self) -> String {
        match &self.matcher {
            Matcher::Statement(k) => format!("statement {k}"),
            Matcher::Setting(p) => format!("statement SET {p}"),
            Matcher::Function(f) => format!("function {f}"),
            Matcher::Fingerprint(f) => format!("fingerprint {f}"),
            Matcher::Regex(r) => format!("regex {}", r.as_str()),
        }
    }

    /// Validates one rule; `at` names it in messages (`databases.app.rules[2]`).
    pub fn from_section(at: &str, s: &RuleSection) -> Result<Rule, String> {
        let given = [
            s.statement.is_some(),
            s.function.is_some(),
            s.fingerprint.is_some(),
            s.regex.is_some(),
        ];
        if given.iter().filter(|g| **g).count() != 1 {
            return Err(format!(
                "{at}: a rule has exactly one of statement, function, fingerprint or regex"
            ));
        }
        let (matcher, what) = if let Some(st) = &s.statement {
            let upper = st.trim().to_uppercase();
            let upper = upper.split_whitespace().collect::<Vec<_>>().join(" ");
            match upper.strip_prefix("SET ") {
                Some(param) => (
                    Matcher::Setting(param.to_lowercase()),
                    format!("SET {}", param.to_lowercase()),
                ),
                None if STATEMENT_KINDS.contains(&upper.as_str()) => {
                    (Matcher::Statement(upper.clone()), upper)
                }
                None => {
                    return Err(format!(
                        "{at}: statement = \"{st}\" is not a statement kind Shoal knows ({}, or SET <parameter>)",
                        STATEMENT_KINDS.join(", ")
                    ))
                }
            }
        } else if let Some(f) = &s.function {
            let f = f.trim().to_lowercase();
            if f.is_empty() {
                return Err(format!("{at}: function is empty"));
            }
            (Matcher::Function(f.clone()), format!("function {f}"))
        } else if let Some(fp) = &s.fingerprint {
            let fp = fp.trim().to_lowercase();
            if fp.len() != 16 || !fp.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "{at}: fingerprint \"{fp}\" is not pg_query's (16 hex digits)"
                ));
            }
            (
                Matcher::Fingerprint(fp.clone()),
                format!("fingerprint {fp}"),
            )
        } else {
            let re = s.regex.as_deref().unwrap_or_default();
            let compiled = regex::RegexBuilder::new(re)
                .size_limit(1 << 20)
                .build()
                .map_err(|e| format!("{at}: regex: {e}"))?;
            (Matcher::Regex(compiled), format!("regex {re}"))
        };
        Ok(Rule {
            name: s.name.clone().unwrap_or(what),
            matcher,
            action: s.action,
            source: s.clone(),
        })
    }

    /// Whether the rule matches a text with these facts.
    pub fn matches(&self, facts: &Facts, text: &str) -> bool {
        match &self.matcher {
            Matcher::Statement(k) => facts.kinds.iter().any(|x| x == k),
            Matcher::Setting(p) => facts.settings.iter().any(|x| x == p),
            Matcher::Function(f) => facts.functions.iter().any(|x| function_may_be(x, f)),
            Matcher::Fingerprint(fp) => facts.fingerprints.iter().any(|x| x == fp),
            Matcher::Regex(re) => re.is_match(text),
        }
    }
}

/// Whether a call written `call` may run the function a rule names `rule`, as PostgreSQL
/// resolves names: the same name, and either the same schema or a schema left to the
/// search path (which may lead to the rule's; `pg_catalog` is always on it). Overloads
/// are not told apart: a rule names them all.
fn function_may_be(call: &str, rule: &str) -> bool {
    let (call_schema, call_name) = match call.rsplit_once('.') {
        Some((schema, name)) => (Some(schema), name),
        None => (None, call),
    };
    let (rule_schema, rule_name) = match rule.rsplit_once('.') {
        Some((schema, name)) => (Some(schema), name),
        None => (None, rule),
    };
    call_name == rule_name
        && match (call_schema, rule_schema) {
            (Some(c), Some(r)) => c == r,
            _ => true,
        }
}

/// A list of rules as written (`at`: where, e.g. `databases.app.rules`), validated.
pub fn validate(at: &str, sections: &[RuleSection]) -> Result<Vec<Rule>, String> {
    sections
        .iter()
        .enumerate()
        .map(|(i, s)| Rule::from_section(&format!("{at}[{i}]"), s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(toml: &str) -> Result<Rule, String> {
        let s: RuleSection = toml::from_str(toml).map_err(|e| e.to_string())?;
        Rule::from_section("databases.app.rules[0]", &s)
    }

    fn facts(sql: &str) -> Facts {
        shoal_wire::facts::facts(sql).unwrap()
    }

    #[test]
    fn rules_are_checked_as_written() {
        assert!(rule("statement = \"drop\"\naction = \"deny\"").is_ok());
        assert!(rule("statement = \"set  Work_Mem\"\naction = \"log\"").is_ok());
        let e = rule("statement = \"DORP\"\naction = \"deny\"").unwrap_err();
        assert!(e.contains("not a statement kind"), "{e}");
        let e = rule("statement = \"DROP\"\nfunction = \"f\"\naction = \"deny\"").unwrap_err();
        assert!(e.contains("exactly one"), "{e}");
        let e = rule("regex = \"(\"\naction = \"deny\"").unwrap_err();
        assert!(e.contains("regex"), "{e}");
        let e = rule("fingerprint = \"xyz\"\naction = \"deny\"").unwrap_err();
        assert!(e.contains("16 hex"), "{e}");
        assert!(rule("statement = \"DROP\"\naction = \"allow\"").is_err());
    }

    #[test]
    fn each_matcher_sees_through_the_text() {
        let drop = rule("statement = \"DROP\"\naction = \"deny\"").unwrap();
        assert_eq!(drop.name, "DROP");
        let sql = "/* hi */ dRoP\tTABLE \"t\"";
        assert!(drop.matches(&facts(sql), sql));
        let kill = rule("function = \"pg_terminate_backend\"\naction = \"deny\"").unwrap();
        for sql in [
            "SELECT pg_terminate_backend(1)",
            "select PG_TERMINATE_BACKEND(1)",
            "SELECT \"pg_catalog\".\"pg_terminate_backend\"(1)",
            "SELECT 1; SELECT x FROM (SELECT pg_terminate_backend(2) AS x) s",
            "WITH k AS (SELECT pg_terminate_backend(3)) SELECT * FROM k",
        ] {
            assert!(kill.matches(&facts(sql), sql), "{sql}");
        }
        let sql = "SELECT 'pg_terminate_backend(1)'";
        assert!(!kill.matches(&facts(sql), sql), "a string is not a call");
        // A rule naming the schema still matches a call left to the search path.
        let sleep = rule("function = \"pg_catalog.pg_sleep\"\naction = \"deny\"").unwrap();
        for sql in ["SELECT pg_sleep(1)", "SELECT pg_catalog.pg_sleep(1)"] {
            assert!(sleep.matches(&facts(sql), sql), "{sql}");
        }
        let sql = "SELECT other.pg_sleep(1)";
        assert!(
            !sleep.matches(&facts(sql), sql),
            "another schema's function"
        );
        let set = rule("statement = \"SET statement_timeout\"\naction = \"deny\"").unwrap();
        let sql = "SET LOCAL Statement_Timeout = 0";
        assert!(set.matches(&facts(sql), sql));
        let sql = "SET work_mem = '1MB'";
        assert!(!set.matches(&facts(sql), sql));
        let fp = facts("SELECT * FROM t WHERE id = 1").fingerprints[0].clone();
        let by_fp = rule(&format!("fingerprint = \"{fp}\"\naction = \"deny\"")).unwrap();
        let sql = "select * from t where id = 99";
        assert!(by_fp.matches(&facts(sql), sql));
        let re = rule("regex = \"(?i)pg_sleep\"\naction = \"log\"").unwrap();
        let sql = "SELECT PG_SLEEP(1)";
        assert!(re.matches(&facts(sql), sql));
    }
}
