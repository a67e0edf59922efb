//! One analysis of a statement text, from one parse: what every feature that decides on a
//! statement reads (session hygiene has its own lexical layer in [`crate::sql`]).
//!
//! - [`Analysis::reads`]: the proof that it only reads, with what that proof rests on (the
//!   functions, operators, casts and relations to check against a catalogue);
//! - [`Analysis::facts`]: what it does in the terms of query rules (kinds, calls,
//!   settings, `EXECUTE`s, fingerprints, relations).
//!
//! Both come from the same PostgreSQL parse tree (libpg_query), parsed once; a text too
//! deep to parse safely, or deeper than the tree's reader goes, is unknown to both.

use crate::facts::{Facts, FactsError};
use crate::readonly::Reads;

/// What one text (one or several statements) is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Analysis {
    /// `Some` when every statement only reads (given its calls are checked).
    pub reads: Option<Reads>,
    pub facts: Result<Facts, FactsError>,
}

/// The analysis of `sql`, which must be the text as the server reads it (UTF-8: see
/// [`crate::encoding::ClientEncoding::as_utf8`]).
pub fn analyse(sql: &str) -> Analysis {
    crate::readonly::on_parse_stack(sql, || match pg_query::parse(sql) {
        Ok(parsed) => Analysis {
            reads: crate::readonly::reads_of(&parsed),
            facts: crate::facts::facts_of(sql, &parsed),
        },
        Err(e) => Analysis {
            reads: None,
            facts: Err(crate::facts::parse_error(e)),
        },
    })
    .unwrap_or(Analysis {
        reads: None,
        facts: Err(FactsError::TooDeep),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_parse_gives_what_each_parse_gave() {
        for sql in [
            "SELECT count(*) FROM t WHERE a = 1",
            "INSERT INTO t VALUES (1); SELECT 1",
            "BEGIN READ ONLY",
            "SELEC 1",
            "DROP TABLE t",
        ] {
            let a = analyse(sql);
            assert_eq!(a.reads, crate::readonly::classify(sql), "{sql}");
            assert_eq!(a.facts, crate::facts::facts(sql), "{sql}");
        }
    }
}
