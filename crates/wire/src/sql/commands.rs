//! Statements the pooler acts on by name: `DROP DATABASE`, `DEALLOCATE`, `EXECUTE`,
//! `PREPARE`, `LISTEN` and `UNLISTEN`.

use super::*;

/// Bytes of whitespace and comments before the first token (always on a char boundary).
pub fn leading_comments_len(sql: &[u8]) -> usize {
    if sql.first().is_some_and(|b| b.is_ascii_alphabetic()) {
        return 0;
    }
    // Comments read the same in every encoding: no character's trailing byte is a `*`, a
    // `/`, a `-` or a line end.
    let mut lex = Lexer::new(sql, ClientEncoding::Utf8);
    lex.skip_blanks();
    lex.i
}

/// `DROP DATABASE x` or `ALTER DATABASE x RENAME ...`: the database it names.
pub fn database_command(sql: &[u8], enc: ClientEncoding) -> Option<DatabaseCommand> {
    let mut lex = Lexer::new(sql, enc);
    let first = lex.next()?;
    let second = lex.next()?;
    if !second.is("database") || !(first.is("drop") || first.is("alter")) {
        return None;
    }
    let mut name = lex.next()?;
    if first.is("drop") && name.is("if") {
        lex.next()?; // EXISTS
        name = lex.next()?;
    }
    let database = name.name()?;
    if first.is("alter") && !lex.next().is_some_and(|t| t.is("rename")) {
        return None;
    }
    Some(DatabaseCommand { database })
}

/// A single statement `DEALLOCATE [PREPARE] name` or `EXECUTE name [(args)]`: which one, the
/// statement name as PostgreSQL folds it, and the byte range of the name in the text (for
/// rewriting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedStatementCommand {
    pub execute: bool,
    pub name: Vec<u8>,
    pub name_at: std::ops::Range<usize>,
}

/// Recognises `DEALLOCATE [PREPARE] name` and `[EXPLAIN ...] EXECUTE name ...` as the only
/// statement.
pub fn named_statement_command(sql: &[u8], enc: ClientEncoding) -> Option<NamedStatementCommand> {
    let mut lex = Lexer::new(sql, enc);
    let mut first = lex.next()?;
    if first.is("explain") {
        // EXPLAIN [ (option, ...) ] or EXPLAIN [ANALYZE] [VERBOSE], then the statement.
        first = lex.next()?;
        if first == Token::OpenParen {
            let mut depth = 1;
            while depth > 0 {
                match lex.next()? {
                    Token::OpenParen => depth += 1,
                    Token::CloseParen => depth -= 1,
                    _ => {}
                }
            }
            first = lex.next()?;
        }
        while first.is("analyze") || first.is("analyse") || first.is("verbose") {
            first = lex.next()?;
        }
        if !first.is("execute") {
            return None;
        }
    }
    let execute = if first.is("execute") {
        true
    } else if first.is("deallocate") {
        false
    } else {
        return None;
    };
    let mut name = lex.next()?;
    if !execute && name.is("prepare") {
        name = lex.next()?;
    }
    let end = lex.i;
    let (folded, start, stop) = match name {
        Token::Word(w) => {
            if !execute && w.eq_ignore_ascii_case(b"all") {
                return None;
            }
            (w.to_ascii_lowercase(), end - w.len(), end)
        }
        Token::Quoted(q) if !q.contains(&b'"') => (q.to_vec(), end - q.len() - 2, end),
        _ => return None,
    };
    // One statement only: EXECUTE may be followed by its argument list.
    let mut depth = 0i32;
    let mut seen_end = false;
    for t in lex.by_ref() {
        if seen_end {
            return None;
        }
        match t {
            Token::OpenParen => depth += 1,
            Token::CloseParen => depth -= 1,
            Token::Other if depth > 0 => {}
            Token::Semicolon if depth <= 0 => seen_end = true,
            _ if !execute => return None,
            _ => {}
        }
    }
    if lex.saw_backslash_string {
        return None;
    }
    Some(NamedStatementCommand {
        execute,
        name: folded,
        name_at: start..stop,
    })
}

/// The name a text starting `PREPARE name` gives its statement, as PostgreSQL folds it.
pub fn prepare_name(sql: &[u8], enc: ClientEncoding) -> Option<Vec<u8>> {
    if enc == ClientEncoding::Unknown && !sql.is_ascii() {
        return None;
    }
    let mut lex = Lexer::new(sql, enc);
    if !lex.next()?.is("prepare") {
        return None;
    }
    let name = lex.next()?;
    if name.is("transaction") {
        // PREPARE TRANSACTION: two-phase commit, not a statement.
        return None;
    }
    identifier(name)
}

/// `LISTEN`, `UNLISTEN` and `UNLISTEN *` as the only statement of a text, with the channel
/// named as PostgreSQL names it (what its NotificationResponse messages carry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenCommand {
    Listen(Vec<u8>),
    Unlisten(Vec<u8>),
    UnlistenAll,
}

/// PostgreSQL's `NAMEDATALEN - 1`: longer identifiers are cut to this many bytes.
const MAX_IDENTIFIER: usize = 63;

/// Recognises a single `LISTEN channel`, `UNLISTEN channel` or `UNLISTEN *`.
pub fn listen_command(sql: &[u8], enc: ClientEncoding) -> Option<ListenCommand> {
    if !enc.bytes_are_characters(sql) {
        // Its channel's name would be in the client's encoding, not the listener's.
        return None;
    }
    let mut lex = Lexer::new(sql, enc);
    let first = lex.next()?;
    let listen = if first.is("listen") {
        true
    } else if first.is("unlisten") {
        false
    } else {
        return None;
    };
    let channel = match lex.next()? {
        Token::Other if !listen && sql[..lex.i].ends_with(b"*") => None,
        t => Some(identifier(t)?),
    };
    match lex.next() {
        None => {}
        Some(Token::Semicolon) if lex.next().is_none() => {}
        Some(_) => return None,
    }
    if lex.saw_backslash_string {
        return None;
    }
    Some(match (listen, channel) {
        (true, Some(c)) => ListenCommand::Listen(c),
        (false, Some(c)) => ListenCommand::Unlisten(c),
        (_, None) => ListenCommand::UnlistenAll,
    })
}

/// An identifier token's name as PostgreSQL's scanner makes it: unquoted words lower-cased
/// (ASCII only, as for UTF-8 databases), `""` in quoted ones undoubled, `U&` escapes decoded,
/// and anything past 63 bytes cut off (at a character boundary).
fn identifier(t: Token<'_>) -> Option<Vec<u8>> {
    let mut name = match t {
        Token::Word(w) => w.to_ascii_lowercase(),
        Token::Quoted(q) => {
            let mut out = Vec::with_capacity(q.len());
            let mut i = 0;
            while i < q.len() {
                out.push(q[i]);
                i += if q[i] == b'"' { 2 } else { 1 };
            }
            out
        }
        Token::UnicodeQuoted(raw, esc) => decode_unicode(raw, esc)?,
        _ => return None,
    };
    if name.is_empty() {
        return None;
    }
    if name.len() > MAX_IDENTIFIER {
        let mut cut = MAX_IDENTIFIER;
        // Back up over UTF-8 continuation bytes so no character is split.
        while cut > 0 && (name[cut] & 0xC0) == 0x80 {
            cut -= 1;
        }
        name.truncate(cut);
    }
    Some(name)
}

/// A name starting with `prefix` used as a prepared statement's name in SQL (`PREPARE`,
/// `EXECUTE`, `DEALLOCATE`, also inside `EXPLAIN EXECUTE` or `CREATE TABLE ... AS EXECUTE`):
/// the pooler's own statements must not be reachable from a client's SQL.
pub fn prepared_name_with_prefix(
    sql: &[u8],
    prefix: &[u8],
    enc: ClientEncoding,
) -> Option<Vec<u8>> {
    // Cheap first look (fast scans): a prefix ending in a rare byte such as `_`.
    let has_prefix = match prefix.split_last() {
        None => true,
        Some((&last, head)) => {
            memchr::memchr2_iter(last.to_ascii_lowercase(), last.to_ascii_uppercase(), sql)
                .any(|i| i >= head.len() && sql[i - head.len()..i].eq_ignore_ascii_case(head))
        }
    };
    // A `U&"..."` identifier may spell the prefix in escapes.
    if !has_prefix && memchr::memchr(b'&', sql).is_none() {
        return None;
    }
    if enc == ClientEncoding::Unknown && !sql.is_ascii() {
        // Cannot be read: taken as naming the prefix (the caller refuses it).
        return Some(prefix.to_vec());
    }
    let mut keyword = false;
    for t in Lexer::new(sql, enc) {
        match t {
            Token::Semicolon => keyword = false,
            t if t.is("execute") || t.is("deallocate") || t.is("prepare") => keyword = true,
            t if keyword && t.name_starts_with(prefix) => {
                return Some(t.name().unwrap_or_default())
            }
            _ => {}
        }
    }
    None
}
