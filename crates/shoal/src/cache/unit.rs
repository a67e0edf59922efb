//! The client's next unit of work as the cache sees it: one simple Query, or one run of
//! extended messages (an unnamed Parse or none, one Bind of an unnamed portal, Describes,
//! one Execute of every row, and the Sync). Anything else (named Parses, Close, Flush,
//! several Executes, a row limit) is not answered from the cache, so a reply from it is
//! always exactly what the server would have sent.
//!
//! The key is written from the unit with every name taken out: what makes two units the
//! same request is their statement (text and parameter types), parameter values and
//! formats, and result formats, never what the client called its statement.

use shoal_wire::frame::HEADER_LEN;
use shoal_wire::frontend::tag as fe;

use crate::prepared::ClientStatements;

/// Messages a unit may have.
const MOST_MESSAGES: usize = 8;

/// A unit the cache may answer.
#[derive(Debug)]
pub struct Unit<'a> {
    /// Bytes of the unit at the head of the buffer.
    pub len: usize,
    /// The statement's text.
    pub text: &'a [u8],
    /// A text parameter value holds a date/time word (see `analysis::has_time_word`).
    pub time_word: bool,
    /// Where the body (after the name) of the unit's unnamed Parse lies in the buffer: a
    /// reply from the cache leaves it as the client's unnamed statement.
    pub unnamed_parse: Option<std::ops::Range<usize>>,
}

/// Reads the unit at the head of `buf` (whole messages, already validated), writing its
/// key after what `key` holds; `None` when it is not a unit the cache answers (or is not
/// all buffered yet).
pub fn read<'a>(
    buf: &'a [u8],
    statements: Option<&'a ClientStatements>,
    key: &mut Vec<u8>,
) -> Option<Unit<'a>> {
    let (tag, body, n) = message(buf, 0)?;
    if tag == fe::QUERY {
        let text = cstr(body)?.0;
        key.push(b'Q');
        key.extend_from_slice(text);
        return Some(Unit {
            len: n,
            text,
            time_word: false,
            unnamed_parse: None,
        });
    }
    let mut at = 0;
    let mut parse: Option<&[u8]> = None;
    let mut parse_at = None;
    let mut text = None;
    let mut time_word = false;
    let mut bound = false;
    let mut executed = false;
    for _ in 0..MOST_MESSAGES {
        let (tag, body, n) = message(buf, at)?;
        at += n;
        match tag {
            fe::PARSE if parse.is_none() && !bound => {
                let (name, rest) = cstr(body)?;
                if !name.is_empty() {
                    return None;
                }
                parse = Some(rest);
                // The body's place: after the header and the name's NUL.
                let start = at - n + shoal_wire::frame::HEADER_LEN + 1;
                parse_at = Some(start..start + rest.len());
                key.push(b'P');
                key.extend_from_slice(rest);
            }
            fe::BIND if !bound => {
                let (portal, rest) = cstr(body)?;
                let (statement, rest) = cstr(rest)?;
                if !portal.is_empty() {
                    return None;
                }
                let definition = match (statement.is_empty(), parse) {
                    (true, Some(p)) => p,
                    (true, None) => return None,
                    (false, _) => statements?.body_of(statement)?,
                };
                text = Some(cstr(definition)?.0);
                time_word = values_have_time_word(rest)?;
                key.push(b'B');
                key.extend_from_slice(&(definition.len() as u32).to_be_bytes());
                key.extend_from_slice(definition);
                key.extend_from_slice(rest);
                bound = true;
            }
            fe::DESCRIBE => {
                let kind = *body.first()?;
                let name = cstr(&body[1..])?.0;
                if !name.is_empty() || (kind == b'P' && !bound) {
                    return None;
                }
                key.extend_from_slice(&[b'D', kind]);
            }
            fe::EXECUTE if bound && !executed => {
                let (portal, rest) = cstr(body)?;
                if !portal.is_empty() || rest != [0, 0, 0, 0] {
                    return None;
                }
                key.push(b'E');
                executed = true;
            }
            fe::SYNC if executed => {
                key.push(b'S');
                return Some(Unit {
                    len: at,
                    text: text?,
                    time_word,
                    unnamed_parse: parse_at,
                });
            }
            _ => return None,
        }
    }
    None
}

/// The message at `at`: its tag, body and whole length, if it is all there.
fn message(buf: &[u8], at: usize) -> Option<(u8, &[u8], usize)> {
    let head = buf.get(at..at + HEADER_LEN)?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    let n = 1 + len;
    let body = buf.get(at + HEADER_LEN..at + n)?;
    Some((head[0], body, n))
}

/// A NUL-terminated string at the head of `b`, and what follows it.
fn cstr(b: &[u8]) -> Option<(&[u8], &[u8])> {
    let end = b.iter().position(|&c| c == 0)?;
    Some((&b[..end], &b[end + 1..]))
}

/// Whether a Bind's parameter values (its body after the names) hold a date/time word;
/// `None` when the body is malformed.
fn values_have_time_word(b: &[u8]) -> Option<bool> {
    let mut r = shoal_wire::frame::Reader::new(b);
    let formats = r.u16().ok()? as usize;
    r.bytes(formats * 2).ok()?;
    let values = r.u16().ok()?;
    let mut found = false;
    for _ in 0..values {
        let len = r.i32().ok()?;
        if len > 0 {
            found |= super::analysis::has_time_word(r.bytes(len as usize).ok()?);
        }
    }
    Some(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    fn bind(statement: &str, value: &str) -> Vec<u8> {
        let mut b = b"\0".to_vec();
        b.extend_from_slice(statement.as_bytes());
        b.push(0);
        b.extend_from_slice(&0u16.to_be_bytes());
        b.extend_from_slice(&1u16.to_be_bytes());
        b.extend_from_slice(&(value.len() as i32).to_be_bytes());
        b.extend_from_slice(value.as_bytes());
        b.extend_from_slice(&0u16.to_be_bytes());
        msg(b'B', &b)
    }

    fn extended(name: &str, sql: &str, value: &str) -> Vec<u8> {
        let mut parse = name.as_bytes().to_vec();
        parse.push(0);
        parse.extend_from_slice(sql.as_bytes());
        parse.extend_from_slice(b"\0\0\0");
        let mut out = msg(b'P', &parse);
        out.extend(bind(name, value));
        out.extend(msg(b'D', b"P\0"));
        out.extend(msg(b'E', b"\0\0\0\0\0"));
        out.extend(msg(b'S', b""));
        out
    }

    fn key_of(buf: &[u8], statements: Option<&ClientStatements>) -> Option<(Vec<u8>, usize)> {
        let mut key = Vec::new();
        read(buf, statements, &mut key).map(|u| (key, u.len))
    }

    #[test]
    fn a_simple_query_is_its_own_unit() {
        let mut buf = msg(b'Q', b"SELECT 1\0");
        let n = buf.len();
        buf.extend(msg(b'Q', b"SELECT 2\0"));
        let (key, len) = key_of(&buf, None).unwrap();
        assert_eq!(len, n);
        assert_eq!(key, b"QSELECT 1");
    }

    #[test]
    fn extended_units_are_keyed_by_statement_and_values() {
        let a = extended("", "SELECT $1", "1");
        let (k1, len) = key_of(&a, None).unwrap();
        assert_eq!(len, a.len());
        let (k2, _) = key_of(&extended("", "SELECT $1", "2"), None).unwrap();
        assert_ne!(k1, k2, "values are in the key");
        assert!(
            key_of(&a[..a.len() - 1], None).is_none(),
            "not all buffered"
        );
        // Named Parses change the client's state: never answered from the cache.
        assert!(key_of(&extended("s1", "SELECT $1", "1"), None).is_none());
        let mut limited = a.clone();
        let e = limited.len() - 5 - 10;
        limited[e + 6..e + 10].copy_from_slice(&5u32.to_be_bytes());
        assert!(key_of(&limited, None).is_none(), "a row limit");
    }

    #[test]
    fn a_named_statement_is_keyed_by_its_definition_not_its_name() {
        let registry = crate::prepared::StatementRegistry::sharing(Default::default());
        let def = b"SELECT $1\0\0\0".to_vec();
        let one = ClientStatements::import(
            &registry,
            0,
            vec![(b"a".to_vec(), def.clone())],
            None,
            shoal_wire::sql::ClientEncoding::Utf8,
        );
        let two = ClientStatements::import(
            &registry,
            0,
            vec![(b"b".to_vec(), def)],
            None,
            shoal_wire::sql::ClientEncoding::Utf8,
        );
        let unit = |name: &str| {
            let mut b = bind(name, "7");
            b.extend(msg(b'E', b"\0\0\0\0\0"));
            b.extend(msg(b'S', b""));
            b
        };
        let (ka, _) = key_of(&unit("a"), Some(&one)).unwrap();
        let (kb, _) = key_of(&unit("b"), Some(&two)).unwrap();
        assert_eq!(ka, kb);
        assert!(
            key_of(&unit("zz"), Some(&one)).is_none(),
            "unknown statement"
        );
    }

    #[test]
    fn an_unnamed_parse_is_placed_in_the_buffer() {
        let buf = extended("", "SELECT $1", "1");
        let mut key = Vec::new();
        let u = read(&buf, None, &mut key).unwrap();
        let body = &buf[u.unnamed_parse.unwrap()];
        assert_eq!(body, b"SELECT $1\0\0\0");
    }

    #[test]
    fn time_words_in_values_are_seen() {
        let mut key = Vec::new();
        let buf = extended("", "SELECT $1::timestamptz", "now");
        assert!(read(&buf, None, &mut key).unwrap().time_word);
    }
}
