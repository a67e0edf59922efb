//! Whether the client's next unit of work only reads: the proof in the pool's statement
//! analysis ([`crate::analysis`], parsed once per text and shape), checked against the
//! primary's catalogue: every function, operator and
//! cast it runs non-volatile, every relation it reads one a standby reads alike (a table,
//! or a view whose own definition is proven the same way). What the catalogue does not
//! know (a table made since it was read, a temporary table) goes to the primary.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use shoal_wire::frame::HEADER_LEN;
use shoal_wire::frontend::tag as fe;
use shoal_wire::readonly::{self, Reads};
use shoal_wire::sql::ClientEncoding;

/// Parse messages one unit may hold and still go to a replica.
const PARSES_PER_UNIT: usize = 16;

#[derive(Default)]
pub struct Verdicts {
    /// The pool's statement analysis (shared with its rules and cache).
    analyses: Arc<crate::analysis::Analyses>,
    /// What the primary's catalogue last said; empty until first read, when any statement
    /// that calls, casts or reads a relation goes to the primary.
    catalogue: RwLock<Arc<ReplicaCatalogue>>,
    /// DDL passed through Shoal since the catalogue was read.
    stale: std::sync::atomic::AtomicBool,
}

/// The primary's catalogue, as the proof needs it. Names are unqualified: a name stands
/// for every object of that name in any schema, and is as safe as the least safe of them.
#[derive(Debug, Default)]
pub struct ReplicaCatalogue {
    /// Functions whose every overload is `STABLE` or `IMMUTABLE` and takes no transaction
    /// id (`txid_current()` is `STABLE` but cannot run on a standby).
    pub functions: HashSet<String>,
    /// Operators whose every function (`oprcode`) is non-volatile.
    pub operators: HashSet<String>,
    /// Types whose input function and every cast to them are non-volatile.
    pub types: HashSet<String>,
    /// Relations a standby reads as the primary would: tables, materialized views, foreign
    /// and partitioned tables, and views whose definitions are proven.
    pub readable: HashSet<String>,
    /// An implicit or assignment cast runs a volatile function: any statement may call it
    /// without naming it, so nothing is proven.
    pub volatile_implicit_casts: bool,
}

impl ReplicaCatalogue {
    /// Builds the catalogue from the primary's lists; `relations` are (name, relkind),
    /// `views` (name, definition).
    pub fn new(
        functions: HashSet<String>,
        operators: HashSet<String>,
        types: HashSet<String>,
        relations: Vec<(String, String)>,
        views: Vec<(String, String)>,
        volatile_implicit_casts: bool,
    ) -> ReplicaCatalogue {
        let mut c = ReplicaCatalogue {
            functions,
            operators,
            types,
            readable: HashSet::new(),
            volatile_implicit_casts,
        };
        // A name any of whose relations is a view is readable once all its views are.
        let mut view_names: HashSet<&str> = HashSet::new();
        for (name, kind) in &relations {
            if kind == "v" {
                view_names.insert(name);
            }
        }
        for (name, kind) in &relations {
            if kind != "v" && !view_names.contains(name.as_str()) {
                c.readable.insert(name.clone());
            }
        }
        let proofs: Vec<(&str, Option<Reads>)> = views
            .iter()
            .map(|(name, def)| (name.as_str(), readonly::classify(def)))
            .collect();
        // Views on views: each round proves the views whose relations are proven; a view
        // that never gets there (a cycle, a write, a volatile call) stays out.
        loop {
            let mut proven: HashMap<&str, bool> = HashMap::new();
            for (name, proof) in &proofs {
                let ok = proof.as_ref().is_some_and(|r| {
                    r.only_queries && c.calls_only_safe(r) && c.reads_only_readable(r)
                });
                *proven.entry(name).or_insert(true) &= ok;
            }
            let before = c.readable.len();
            for (name, ok) in proven {
                if ok {
                    c.readable.insert(name.to_string());
                }
            }
            if c.readable.len() == before {
                break;
            }
        }
        c
    }

    fn calls_only_safe(&self, r: &Reads) -> bool {
        !self.volatile_implicit_casts
            && r.functions
                .iter()
                .all(|f| self.functions.contains(f.rsplit('.').next().unwrap_or(f)))
            && r.operators.iter().all(|o| self.operators.contains(o))
            && r.casts.iter().all(|t| self.types.contains(t))
    }

    fn reads_only_readable(&self, r: &Reads) -> bool {
        r.relations
            .iter()
            .all(|rel| self.readable.contains(&rel.name))
    }

    fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }
}

/// What a unit of client work (a Query, or extended messages up to their Sync) comes to.
#[derive(Debug, PartialEq, Eq)]
pub enum Unit {
    /// Every statement only reads: `messages` messages may go to a replica.
    Reads { messages: u32 },
    /// Something in it may write (or cannot be proven not to).
    Writes,
    /// The unit is not all buffered yet: a decision now could split it.
    Incomplete,
}

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
        let c = self
            .catalogue
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        c.calls_only_safe(reads) && c.reads_only_readable(reads)
    }

    /// Verdicts over the pool's analysis.
    pub fn new(analyses: Arc<crate::analysis::Analyses>) -> Verdicts {
        Verdicts {
            analyses,
            ..Verdicts::default()
        }
    }

    /// The primary's catalogue, read again (see [`health`](super::health)).
    pub fn set_catalogue(&self, c: ReplicaCatalogue) {
        *self.catalogue.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(c);
    }

    /// DDL passed through Shoal: the catalogue is read again at the next check.
    pub fn catalogue_changed(&self) {
        self.stale.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether DDL passed since the catalogue was last read (once).
    pub fn take_stale(&self) -> bool {
        self.stale.swap(false, std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the catalogue has been read.
    pub fn catalogue_known(&self) -> bool {
        !self
            .catalogue
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
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
    use shoal_wire::frontend;

    const U: ClientEncoding = ClientEncoding::Utf8;

    fn set(names: &[&str]) -> HashSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    /// A catalogue with table `t`, `now` and `count`, the `=` operator and `int4`.
    fn known() -> Verdicts {
        let v = Verdicts::default();
        v.set_catalogue(ReplicaCatalogue::new(
            set(&["now", "count"]),
            set(&["="]),
            set(&["int4"]),
            vec![("t".into(), "r".into())],
            vec![],
            false,
        ));
        v
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
        let v = Verdicts::default();
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
        let v = Verdicts::default();
        v.set_catalogue(ReplicaCatalogue::new(
            set(&["g", "count"]),
            set(&["=", "+"]),
            set(&["int4", "text"]),
            vec![
                ("t".into(), "r".into()),
                ("plain_view".into(), "v".into()),
                ("writing_view".into(), "v".into()),
                ("view_on_view".into(), "v".into()),
                ("view_on_writer".into(), "v".into()),
            ],
            vec![
                ("plain_view".into(), "SELECT count(*) FROM t".into()),
                ("writing_view".into(), "SELECT bump() AS n".into()),
                ("view_on_view".into(), "SELECT * FROM plain_view".into()),
                ("view_on_writer".into(), "SELECT * FROM writing_view".into()),
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
        v.set_catalogue(ReplicaCatalogue::new(
            set(&["g"]),
            set(&["="]),
            set(&["int4"]),
            vec![("t".into(), "r".into())],
            vec![],
            true,
        ));
        assert!(!v.reads(b"SELECT g()", U));
    }
}
