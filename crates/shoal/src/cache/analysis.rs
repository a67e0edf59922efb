//! What the cache decides on a statement's analysis (the pool's, see [`crate::analysis`]):
//! whether its result may be kept and what it depends on, and, for a statement that may
//! write, which tables it touches. The verdicts that depend on the catalogue (which
//! functions are immutable, which relations are plain tables) are taken afresh each time
//! from the catalogue of the moment.

use shoal_wire::statement::Analysis;

use crate::analysis::catalogue::Catalogue;

/// What a statement that may write does to cached results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Touches {
    Nothing,
    /// These tables (by name) and no others.
    Tables(Vec<String>),
    /// Anything: triggers, rules, functions, DDL, or what could not be parsed.
    Everything,
}

/// Why a read's result is not kept (for SHOW CACHE's counts and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotKept {
    /// Not proven to only read, or not one plain query.
    NotARead,
    /// Calls a function that is not IMMUTABLE, or reads the clock.
    Volatile,
    /// Reads a relation that is not a plain table the stream can follow (a view, a
    /// catalogue, a partitioned or unlogged table, one with row security that reads other
    /// tables), or one the catalogue does not know yet.
    Relation,
    /// A date/time literal (`'now'`, `'today'`, ...) is read when the statement runs.
    TimeWord,
}

/// What the cache reads of a statement's analysis (see [`crate::analysis`]).
pub trait ForCache {
    /// The tables a kept result of this text depends on, or why it is not kept.
    fn keepable<'a>(&'a self, c: &Catalogue) -> Result<Vec<&'a str>, NotKept>;
    /// What running this text (when it may write) does to cached results.
    fn touches(&self, c: &Catalogue) -> Touches;
}

impl ForCache for Analysis {
    fn keepable<'a>(&'a self, c: &Catalogue) -> Result<Vec<&'a str>, NotKept> {
        let r = self.reads.as_ref().ok_or(NotKept::NotARead)?;
        if !r.only_queries || r.statements != 1 {
            return Err(NotKept::NotARead);
        }
        if r.clock {
            return Err(NotKept::Volatile);
        }
        if !c.calls_only(r, true) {
            return Err(NotKept::Volatile);
        }
        let mut tables = Vec::with_capacity(r.relations.len());
        for rel in &r.relations {
            if matches!(
                rel.schema.as_deref(),
                Some("pg_catalog" | "information_schema")
            ) {
                return Err(NotKept::Relation);
            }
            match c.relations.get(&rel.name) {
                Some(info) if info.cacheable => tables.push(rel.name.as_str()),
                _ => return Err(NotKept::Relation),
            }
        }
        tables.dedup();
        Ok(tables)
    }

    fn touches(&self, c: &Catalogue) -> Touches {
        if let Some(r) = &self.reads {
            // A read writes only through a volatile function, operator or cast, and then
            // anything.
            return if c.calls_only(r, false) {
                Touches::Nothing
            } else {
                Touches::Everything
            };
        }
        let Ok(f) = &self.facts else {
            return Touches::Everything;
        };
        const PLAIN: &[&str] = &[
            "SELECT",
            "INSERT",
            "UPDATE",
            "DELETE",
            "MERGE",
            "TRUNCATE",
            "COPY",
            "TRANSACTION",
            "SET",
            "SHOW",
        ];
        if !f.kinds.iter().all(|k| PLAIN.contains(&k.as_str())) {
            return Touches::Everything;
        }
        if !f
            .functions
            .iter()
            .all(|n| c.non_volatile.contains(unqualified(n)))
            || !f
                .operators
                .iter()
                .all(|o| c.non_volatile_operators.contains(o))
            || !f.casts.iter().all(|t| c.non_volatile_types.contains(t))
        {
            return Touches::Everything;
        }
        let mut tables = Vec::with_capacity(f.relations.len());
        for name in &f.relations {
            match c.relations.get(name) {
                Some(info) if info.plain_writes => tables.push(name.clone()),
                // A view, a table with triggers or rules, or a name the catalogue lacks
                // (a CTE's name is harmless but cannot be told from a new table).
                _ => return Touches::Everything,
            }
        }
        if tables.is_empty() {
            Touches::Nothing
        } else {
            Touches::Tables(tables)
        }
    }
}

fn unqualified(f: &str) -> &str {
    f.rsplit('.').next().unwrap_or(f)
}

/// Date/time input words PostgreSQL resolves when a statement runs (`'now'::timestamptz`,
/// a parameter `'today'`): a result holding them goes stale with the clock.
pub fn has_time_word(text: &[u8]) -> bool {
    const WORDS: [&[u8]; 4] = [b"now", b"today", b"tomorrow", b"yesterday"];
    // Only where a word could start (`b | 0x20` folds exactly `N`, `T`, `Y` onto `n`, `t`,
    // `y`): every statement a cache looks at is scanned, so most bytes cost one compare.
    text.iter().enumerate().any(|(i, &b)| {
        matches!(b | 0x20, b'n' | b't' | b'y')
            && WORDS.iter().any(|word| {
                text.get(i..i + word.len())
                    .is_some_and(|t| t.eq_ignore_ascii_case(word))
            })
    })
}

/// The hint `/* shoal:cache */` or `/* shoal:cache ttl=30s */` in a text: `Some(None)` for
/// the plain hint, `Some(Some(ttl))` with one, `None` without a hint (or with a bad TTL).
pub fn hint(text: &[u8]) -> Option<Option<std::time::Duration>> {
    const MARK: &[u8] = b"shoal:cache";
    let at = text.windows(MARK.len()).position(|w| w == MARK)?;
    // Inside a block comment: an opening `/*` before it with no `*/` between.
    let before = &text[..at];
    let open = before.windows(2).rposition(|w| w == b"/*")?;
    if before[open..].windows(2).any(|w| w == b"*/") {
        return None;
    }
    let after = &text[at + MARK.len()..];
    let end = after.windows(2).position(|w| w == b"*/")?;
    let args = std::str::from_utf8(&after[..end]).ok()?;
    let mut ttl = None;
    for arg in args.split_whitespace() {
        match arg.split_once('=') {
            Some(("ttl", v)) => {
                ttl = Some(shoal_control::config::cache::parse_ttl(v).ok()?);
            }
            _ => return None,
        }
    }
    Some(ttl)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::catalogue::Relation;

    fn catalogue() -> Catalogue {
        let mut c = Catalogue {
            loaded: true,
            ..Default::default()
        };
        for f in ["lower", "abs", "count", "sum"] {
            c.immutable.insert(f.into());
            c.non_volatile.insert(f.into());
        }
        c.non_volatile.insert("now".into());
        for o in ["=", "+"] {
            c.immutable_operators.insert(o.into());
            c.non_volatile_operators.insert(o.into());
        }
        c.non_volatile_operators.insert("@@".into());
        c.immutable_types.insert("int4".into());
        c.non_volatile_types
            .extend(["int4".into(), "timestamptz".into(), "regclass".into()]);
        let table = Relation {
            cacheable: true,
            plain_writes: true,
            qualified: vec![],
        };
        c.relations.insert("items".into(), table.clone());
        c.relations.insert("users".into(), table);
        c.relations.insert(
            "audited".into(),
            Relation {
                cacheable: true,
                plain_writes: false,
                qualified: vec![],
            },
        );
        c.relations.insert("v".into(), Relation::default());
        c
    }

    fn parsed(sql: &str) -> std::sync::Arc<Analysis> {
        crate::analysis::Analyses::default().of_utf8(sql.as_bytes())
    }

    #[test]
    fn only_plain_queries_over_plain_tables_are_kept() {
        let c = catalogue();
        assert_eq!(
            parsed("SELECT count(*), lower(u.name) FROM items i JOIN users u ON u.id = i.uid")
                .keepable(&c),
            Ok(vec!["items", "users"])
        );
        assert_eq!(parsed("SELECT 1").keepable(&c), Ok(vec![]));
        for (sql, why) in [
            ("SELECT now()", NotKept::Volatile),
            ("SELECT CURRENT_TIMESTAMP", NotKept::Volatile),
            ("SELECT random()", NotKept::Volatile),
            // The clock through a cast, a catalogue lookup, a stable operator, an
            // operator or cast not known to be immutable.
            ("SELECT ('n'||'ow')::timestamptz", NotKept::Volatile),
            ("SELECT ('it' || 'ems')::regclass", NotKept::Volatile),
            ("SELECT 'a' @@ 'b'", NotKept::Volatile),
            ("SELECT 1 ### 2 FROM items", NotKept::Volatile),
            ("SELECT 1::mood", NotKept::Volatile),
            ("SELECT * FROM v", NotKept::Relation),
            ("SELECT * FROM unknown", NotKept::Relation),
            ("SELECT * FROM pg_catalog.pg_class", NotKept::Relation),
            ("SELECT * FROM items FOR UPDATE", NotKept::NotARead),
            ("SELECT 1; SELECT 2", NotKept::NotARead),
            ("SHOW search_path", NotKept::NotARead),
            ("UPDATE items SET a = 1", NotKept::NotARead),
        ] {
            assert_eq!(parsed(sql).keepable(&c), Err(why), "{sql}");
        }
    }

    #[test]
    fn writes_touch_their_tables_or_everything() {
        let c = catalogue();
        let t = |sql: &str| parsed(sql).touches(&c);
        assert_eq!(t("SELECT * FROM items"), Touches::Nothing);
        assert_eq!(t("BEGIN"), Touches::Nothing);
        assert_eq!(
            t("UPDATE items SET n = n + 1 WHERE id = 1"),
            Touches::Tables(vec!["items".into()])
        );
        assert_eq!(
            t("INSERT INTO items SELECT * FROM users"),
            Touches::Tables(vec!["items".into(), "users".into()])
        );
        assert_eq!(t("INSERT INTO audited VALUES (1)"), Touches::Everything);
        assert_eq!(t("UPDATE v SET a = 1"), Touches::Everything);
        assert_eq!(t("SELECT nextval('s')"), Touches::Everything);
        // An operator or a cast may run a function that writes.
        assert_eq!(t("SELECT 1 ### 2"), Touches::Everything);
        assert_eq!(t("INSERT INTO items SELECT 1 ### 2"), Touches::Everything);
        assert_eq!(t("INSERT INTO items VALUES (1::mood)"), Touches::Everything);
        assert_eq!(
            t("UPDATE items SET n = n + 1::int4"),
            Touches::Tables(vec!["items".into()])
        );
        assert_eq!(t("ALTER TABLE items ADD c int"), Touches::Everything);
        assert_eq!(t("CALL p()"), Touches::Everything);
        assert_eq!(t("this is not sql"), Touches::Everything);
    }

    #[test]
    fn hints_and_time_words_are_found() {
        assert_eq!(hint(b"/* shoal:cache */ SELECT 1"), Some(None));
        assert_eq!(
            hint(b"SELECT 1 /* shoal:cache ttl=5s */"),
            Some(Some(std::time::Duration::from_secs(5)))
        );
        assert_eq!(hint(b"SELECT 'shoal:cache'"), None);
        assert_eq!(hint(b"/* x */ SELECT 'shoal:cache */'"), None);
        assert_eq!(hint(b"/* shoal:cache ttl=never */ SELECT 1"), None);
        assert_eq!(hint(b"SELECT 1"), None);
        assert!(has_time_word(b"SELECT 'NOW'::timestamptz"));
        assert!(has_time_word(b"yesterday"));
        assert!(!has_time_word(b"SELECT 'no'"));
    }
}
