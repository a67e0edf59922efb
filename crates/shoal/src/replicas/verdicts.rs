//! Whether the client's next unit of work only reads: the proof in the pool's statement
//! analysis ([`crate::analysis`], parsed once per text and shape), checked against the
//! primary's catalogue: every function, operator and
//! cast it runs non-volatile, every relation it reads one a standby reads alike (a table,
//! or a view whose own definition is proven the same way). What the catalogue does not
//! know (a table made since it was read, a temporary table) goes to the primary.

use std::sync::Arc;

use shoal_wire::frame::HEADER_LEN;
use shoal_wire::frontend::tag as fe;
use shoal_wire::sql::ClientEncoding;

use crate::analysis::catalogue::Source;

/// Parse messages one unit may hold and still go to a replica.
const PARSES_PER_UNIT: usize = 16;

pub struct Verdicts {
    /// The pool's statement analysis (shared with its rules and cache).
    analyses: Arc<crate::analysis::Analyses>,
    /// The primary's catalogue (its database's, shared with the rules and the cache);
    /// until first read, any statement that calls, casts or reads a relation goes to the
    /// primary.
    catalogue: Arc<Source>,
}

/// What a unit of client work (a Query, or extended messages up to their Sync) comes to.
pub use crate::seam::ReadUnit as Unit;

impl Verdicts {
    /// Whether the statement `text`, in the client's encoding `enc`, only reads. A text
    /// that cannot be read in it (an encoding not known yet, bytes that are no characters)
    /// does not.
    pub fn reads(&self, text: &[u8], enc: ClientEncoding) -> bool {
        let Ok(analysis) = self.analyses.of(text, enc) else {
            return false;
        };
        let Some(reads) = &analysis.reads else {
            return false;
        };
        if reads.functions.is_empty()
            && reads.operators.is_empty()
            && reads.casts.is_empty()
            && reads.relations.is_empty()
        {
            return true;
        }
        let c = self.catalogue.current();
        c.loaded && c.standby_reads(reads)
    }

    /// The catalogue the verdicts are judged against.
    pub fn catalogue(&self) -> &Arc<Source> {
        &self.catalogue
    }

    /// Verdicts over the pool's analysis and catalogue.
    pub fn new(analyses: Arc<crate::analysis::Analyses>, catalogue: Arc<Source>) -> Verdicts {
        Verdicts {
            analyses,
            catalogue,
        }
    }

    /// Whether the one client message `msg` (whole, with its header) only reads: a Query
    /// or a Parse by its text, a Bind by its statement's; the others carry no SQL. For a
    /// transaction that cannot move (a block on a replica), each message is judged as it
    /// comes: a client may wait for a Parse's answer before it sends the rest.
    pub fn message_reads<'s>(
        &self,
        msg: &[u8],
        enc: ClientEncoding,
        statement_text: impl Fn(&[u8]) -> Option<&'s [u8]>,
    ) -> bool {
        let Some(&tag) = msg.first() else { return true };
        let body = msg.get(HEADER_LEN..).unwrap_or_default();
        match tag {
            fe::QUERY => self.reads(cstr(body).0, enc),
            fe::PARSE => self.reads(cstr(cstr(body).1).0, enc),
            fe::BIND => {
                let name = cstr(cstr(body).1).0;
                statement_text(name).is_some_and(|t| self.reads(t, enc))
            }
            fe::FUNCTION_CALL => false,
            _ => true,
        }
    }

    /// The unit of work at the head of `buf` (whole messages): a simple Query alone, or
    /// extended-protocol messages up to and including their Sync. `statement_text` gives
    /// the text of a statement prepared before (by client name; `""` is the unnamed one).
    pub fn unit<'s>(
        &self,
        buf: &[u8],
        enc: ClientEncoding,
        statement_text: impl Fn(&[u8]) -> Option<&'s [u8]>,
    ) -> Unit {
        // Statements parsed inside this unit, by name: a Bind may use one before the
        // client's statement list has it. Kept on the stack (this runs for every unit); a
        // unit parsing more statements than this is sent to the primary.
        let mut parsed: [(&[u8], bool); PARSES_PER_UNIT] = [(&[], false); PARSES_PER_UNIT];
        let mut n_parsed = 0;
        let mut at = 0;
        let mut messages = 0u32;
        let mut reads = true;
        while at + HEADER_LEN <= buf.len() {
            let tag = buf[at];
            let len =
                u32::from_be_bytes([buf[at + 1], buf[at + 2], buf[at + 3], buf[at + 4]]) as usize;
            let end = at + 1 + len;
            if len < 4 || end > buf.len() {
                break;
            }
            let body = &buf[at + HEADER_LEN..end];
            messages += 1;
            at = end;
            match tag {
                fe::QUERY => {
                    let ok = messages == 1 && self.reads(cstr(body).0, enc);
                    return if ok {
                        Unit::Reads { messages }
                    } else {
                        Unit::Writes
                    };
                }
                fe::PARSE => {
                    let (name, rest) = cstr(body);
                    let ok = self.reads(cstr(rest).0, enc);
                    if n_parsed == PARSES_PER_UNIT {
                        return Unit::Writes;
                    }
                    parsed[n_parsed] = (name, ok);
                    n_parsed += 1;
                    reads &= ok;
                }
                fe::BIND => {
                    let (_portal, rest) = cstr(body);
                    let name = cstr(rest).0;
                    // The latest Parse of that name in this unit, else the client's.
                    let ok = match parsed[..n_parsed].iter().rev().find(|(n, _)| *n == name) {
                        Some((_, ok)) => *ok,
                        None => statement_text(name).is_some_and(|t| self.reads(t, enc)),
                    };
                    reads &= ok;
                }
                fe::SYNC => {
                    return if reads {
                        Unit::Reads { messages }
                    } else {
                        Unit::Writes
                    };
                }
                fe::DESCRIBE | fe::EXECUTE | fe::CLOSE | fe::FLUSH => {}
                // FunctionCall, COPY data, Terminate: not a read to route.
                _ => return Unit::Writes,
            }
            if !reads {
                return Unit::Writes;
            }
        }
        Unit::Incomplete
    }
}

/// A NUL-terminated string at the head of `b`, and what follows it.
fn cstr(b: &[u8]) -> (&[u8], &[u8]) {
    match b.iter().position(|&c| c == 0) {
        Some(i) => (&b[..i], &b[i + 1..]),
        None => (b, &[]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::catalogue::{Catalogue, RelationRow, Row, ViewRow};
    use shoal_wire::frontend;

    const U: ClientEncoding = ClientEncoding::Utf8;

    /// A catalogue where `functions`, `operators` and `types` are non-volatile and
    /// `relations` (name, relkind) exist, `views` (name, definition) among them.
    fn catalogue(
        functions: &[&str],
        operators: &[&str],
        types: &[&str],
        relations: &[(&str, &str)],
        views: &[(&str, &str)],
        volatile_implicit_casts: bool,
    ) -> Catalogue {
        let non_volatile = |names: &[&str]| -> Vec<(String, bool, bool)> {
            names.iter().map(|n| (n.to_string(), false, true)).collect()
        };
        Catalogue::from_row(Row {
            version: "1".into(),
            functions: non_volatile(functions),
            operators: non_volatile(operators),
            types: non_volatile(types),
            volatile_implicit_casts,
            relations: relations
                .iter()
                .map(|(name, kind)| RelationRow {
                    qualified: format!("public.{name}"),
                    name: name.to_string(),
                    kind: kind.to_string(),
                    system: false,
                    plain: *kind == "r",
                    plain_writes: *kind == "r",
                    row_security: false,
                })
                .collect(),
            views: views
                .iter()
                .map(|(name, def)| ViewRow {
                    name: name.to_string(),
                    definition: def.to_string(),
                    kind: "v".into(),
                    user: true,
                    temporary: false,
                })
                .collect(),
            ..Row::default()
        })
    }

    fn verdicts(c: Catalogue) -> Verdicts {
        Verdicts::new(Arc::default(), Source::fixed(c))
    }

    /// Verdicts before the catalogue was read.
    fn unread() -> Verdicts {
        let c = Source::new(
            "test".into(),
            crate::server::Upstream::nowhere(),
            std::time::Duration::from_secs(1),
        );
        Verdicts::new(Arc::default(), c)
    }

    /// A catalogue with table `t`, `now` and `count`, the `=` operator and `int4`.
    fn known() -> Verdicts {
        verdicts(catalogue(
            &["now", "count"],
            &["="],
            &["int4"],
            &[("t", "r")],
            &[],
            false,
        ))
    }

    fn query(sql: &str) -> Vec<u8> {
        let mut b = bytes::BytesMut::new();
        frontend::query(&mut b, sql);
        b.to_vec()
    }

    fn extended(sql: &str, name: &str) -> Vec<u8> {
        let mut b = Vec::new();
        let mut msg = |tag: u8, body: &[u8]| {
            b.push(tag);
            b.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
            b.extend_from_slice(body);
        };
        msg(
            fe::PARSE,
            &[name.as_bytes(), b"\0", sql.as_bytes(), b"\0\0\0"].concat(),
        );
        msg(
            fe::BIND,
            &[b"\0", name.as_bytes(), b"\0\0\0\0\0\0\0"].concat(),
        );
        msg(fe::EXECUTE, b"\0\0\0\0\0");
        msg(fe::SYNC, b"");
        b
    }

    #[test]
    fn units_are_proven_whole() {
        let v = known();
        let none = |_: &[u8]| None;
        assert_eq!(
            v.unit(&query("SELECT 1"), U, none),
            Unit::Reads { messages: 1 }
        );
        assert_eq!(
            v.unit(&query("INSERT INTO t VALUES (1)"), U, none),
            Unit::Writes
        );
        assert_eq!(
            v.unit(&extended("SELECT $1", "s1"), U, none),
            Unit::Reads { messages: 4 }
        );
        assert_eq!(
            v.unit(&extended("UPDATE t SET a = 1", ""), U, none),
            Unit::Writes
        );
        // A read followed, in the same batch, by a write: the batch is a write.
        let mut mixed = extended("SELECT 1", "");
        mixed.truncate(mixed.len() - 5);
        mixed.extend(extended("DELETE FROM t", ""));
        assert_eq!(v.unit(&mixed, U, none), Unit::Writes);
        // Not all here yet: no decision.
        let partial = extended("SELECT 1", "");
        assert_eq!(
            v.unit(&partial[..partial.len() - 5], U, none),
            Unit::Incomplete
        );
        // The first unit only: what follows its end is the next one's.
        let two = [query("SELECT 1"), query("DELETE FROM t")].concat();
        assert_eq!(v.unit(&two, U, none), Unit::Reads { messages: 1 });
    }

    #[test]
    fn a_bind_is_judged_by_its_statement() {
        let v = known();
        let mut bind = Vec::new();
        bind.push(fe::BIND);
        bind.extend_from_slice(&(4 + 9u32).to_be_bytes());
        bind.extend_from_slice(b"\0w\0\0\0\0\0\0\0");
        bind.extend_from_slice(&[fe::SYNC, 0, 0, 0, 4]);
        let write = |n: &[u8]| (n == b"w").then_some(&b"DELETE FROM t"[..]);
        let read = |n: &[u8]| (n == b"w").then_some(&b"SELECT 1"[..]);
        assert_eq!(v.unit(&bind, U, write), Unit::Writes);
        assert_eq!(v.unit(&bind, U, read), Unit::Reads { messages: 2 });
        assert_eq!(v.unit(&bind, U, |_: &[u8]| None), Unit::Writes, "unknown");
    }

    #[test]
    fn a_statement_with_other_values_is_known_by_its_shape() {
        let v = known();
        assert!(v.reads(b"SELECT * FROM t WHERE id = 1", U));
        assert!(!v.reads(b"UPDATE t SET a = 1 WHERE id = 1", U));
        let parsed = v.analyses.remembered();
        assert!(v.reads(b"select *  from t where id = 2 -- again", U));
        assert!(!v.reads(b"UPDATE t SET a = 7 WHERE id = 99", U));
        assert_eq!(
            v.analyses.remembered(),
            parsed,
            "found by shape: nothing parsed or added"
        );
    }

    /// In SJIS, 0x83 0x5C is one character: the string ends at the next quote and a DELETE
    /// follows. Read as bytes it would be one string in one SELECT.
    #[test]
    fn a_text_is_proven_as_the_server_reads_it() {
        let v = known();
        let sql = b"SELECT E'\x83\x5c'; DELETE FROM t; --'";
        let sjis = ClientEncoding::Split(shoal_wire::encoding::Split::Sjis);
        assert!(!v.reads(sql, sjis));
        assert!(!v.reads(b"SELECT '\xe9'", ClientEncoding::Unknown));
        assert!(
            v.reads(b"SELECT 1", ClientEncoding::Unknown),
            "ASCII reads the same"
        );
        // The same bytes, proven once as UTF-8 bytes (invalid there), are not taken for
        // the SJIS text: the memo is keyed by what the server reads.
        let _ = v.reads(sql, U);
        assert!(!v.reads(sql, sjis));
    }

    #[test]
    fn functions_must_be_known_non_volatile() {
        let v = unread();
        assert!(!v.reads(b"SELECT now()", U), "catalogue not read yet");
        let v = known();
        assert!(v.reads(b"SELECT now(), count(*) FROM t", U));
        assert!(v.reads(b"SELECT pg_catalog.now()", U));
        assert!(!v.reads(b"SELECT nextval('s')", U));
        assert!(v.reads(b"SELECT 1", U));
    }

    /// What a statement runs without writing it out: a view's definition, an operator's
    /// function, a cast's function, a quoted name that is another function.
    #[test]
    fn what_runs_behind_names_is_proven_too() {
        let v = verdicts(catalogue(
            &["g", "count"],
            &["=", "+"],
            &["int4", "text"],
            &[
                ("t", "r"),
                ("plain_view", "v"),
                ("writing_view", "v"),
                ("view_on_view", "v"),
                ("view_on_writer", "v"),
            ],
            &[
                ("plain_view", "SELECT count(*) FROM t"),
                ("writing_view", "SELECT bump() AS n"),
                ("view_on_view", "SELECT * FROM plain_view"),
                ("view_on_writer", "SELECT * FROM writing_view"),
            ],
            false,
        ));
        assert!(v.reads(b"SELECT * FROM plain_view", U));
        assert!(v.reads(b"SELECT * FROM view_on_view", U));
        assert!(
            !v.reads(b"SELECT * FROM writing_view", U),
            "its function writes"
        );
        assert!(!v.reads(b"SELECT * FROM view_on_writer", U));
        assert!(
            !v.reads(b"SELECT * FROM made_since", U),
            "not in the catalogue"
        );
        assert!(v.reads(b"SELECT g()", U));
        assert!(!v.reads(b"SELECT \"G\"()", U), "\"G\" is not g");
        assert!(v.reads(b"SELECT 1 + 1", U));
        assert!(!v.reads(b"SELECT 1 ### 1", U), "an operator not known");
        assert!(v.reads(b"SELECT '1'::int4", U));
        assert!(!v.reads(b"SELECT 'x'::mood", U), "a cast not known");
        // A volatile implicit cast may run anywhere: nothing that calls or casts is proven.
        let v = verdicts(catalogue(
            &["g"],
            &["="],
            &["int4"],
            &[("t", "r")],
            &[],
            true,
        ));
        assert!(!v.reads(b"SELECT g()", U));
    }
}
