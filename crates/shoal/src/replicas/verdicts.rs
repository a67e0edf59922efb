//! Whether the client's next unit of work only reads: the proof of
//! [`shoal_wire::readonly`], remembered per statement text so that a repeated statement is
//! parsed once, and checked against the functions the database knows as non-volatile.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};

use shoal_wire::frame::HEADER_LEN;
use shoal_wire::frontend::tag as fe;
use shoal_wire::readonly::{self, Reads};
use shoal_wire::sql::ClientEncoding;

/// Statement texts remembered; past it the memory starts over (a workload with more
/// distinct texts than this is parsed more often, never wrongly).
const REMEMBERED: usize = 8192;
/// Parse messages one unit may hold and still go to a replica.
const PARSES_PER_UNIT: usize = 16;
/// Texts longer than this are parsed each time rather than kept.
const LONGEST_KEPT: usize = 16 * 1024;

/// Statement text → its proof (`None`: it may write). Hashed with foldhash: every read on a
/// replica looks its text up, and SipHash's resistance to chosen keys buys nothing here
/// (the map is bounded and cleared when full).
type Proofs = HashMap<Box<[u8]>, Option<Arc<Reads>>, foldhash::fast::RandomState>;

#[derive(Default)]
pub struct Verdicts {
    known: Mutex<Proofs>,
    /// Function names (unqualified) whose every overload, in every schema, is `STABLE` or
    /// `IMMUTABLE`, as the primary's catalogue last said; empty until first read, when any
    /// function call goes to the primary.
    read_only_functions: RwLock<Arc<HashSet<String>>>,
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
        let Ok(text) = enc.as_utf8(text) else {
            return false;
        };
        let proof = self.proof(&text);
        let Some(reads) = proof else { return false };
        if reads.functions.is_empty() {
            return true;
        }
        let known = self
            .read_only_functions
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        reads
            .functions
            .iter()
            .all(|f| known.contains(f.rsplit('.').next().unwrap_or(f)))
    }

    /// The proof for `text`: remembered by the text itself (a prepared statement, a repeated
    /// query), else by its shape with the values taken out (a query with its values written
    /// in), else parsed and remembered both ways.
    fn proof(&self, text: &[u8]) -> Option<Arc<Reads>> {
        if let Some(v) = self.lock().get(text) {
            return v.clone();
        }
        let shape = readonly::normalized(text).filter(|s| s.as_slice() != text);
        if let Some(v) = shape.as_deref().and_then(|s| self.lock().get(s).cloned()) {
            return v;
        }
        let proof = std::str::from_utf8(text)
            .ok()
            .and_then(readonly::classify)
            .map(Arc::new);
        if text.len() <= LONGEST_KEPT {
            let mut known = self.lock();
            if known.len() + 2 > REMEMBERED {
                known.clear();
            }
            if let Some(shape) = shape {
                known.insert(shape.into(), proof.clone());
            }
            known.insert(text.into(), proof.clone());
        }
        proof
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Proofs> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The catalogue's non-volatile function names (see [`health`](super::health)).
    pub fn set_functions(&self, names: HashSet<String>) {
        *self
            .read_only_functions
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(names);
    }

    pub fn functions_known(&self) -> usize {
        self.read_only_functions
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
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
        let v = Verdicts::default();
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
        let v = Verdicts::default();
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
        let v = Verdicts::default();
        assert!(v.reads(b"SELECT * FROM t WHERE id = 1", U));
        assert!(!v.reads(b"UPDATE t SET a = 1 WHERE id = 1", U));
        let parsed = v.lock().len();
        assert!(v.reads(b"select *  from t where id = 2 -- again", U));
        assert!(!v.reads(b"UPDATE t SET a = 7 WHERE id = 99", U));
        assert_eq!(
            v.lock().len(),
            parsed,
            "found by shape: nothing parsed or added"
        );
    }

    /// In SJIS, 0x83 0x5C is one character: the string ends at the next quote and a DELETE
    /// follows. Read as bytes it would be one string in one SELECT.
    #[test]
    fn a_text_is_proven_as_the_server_reads_it() {
        let v = Verdicts::default();
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
        v.set_functions(["now".to_string(), "count".to_string()].into());
        assert!(v.reads(b"SELECT now(), count(*) FROM t", U));
        assert!(v.reads(b"SELECT pg_catalog.now()", U));
        assert!(!v.reads(b"SELECT nextval('s')", U));
        assert!(v.reads(b"SELECT 1", U));
    }
}
