//! The classifier: what a query's statements leave in the session, read from their tokens.

use super::*;

/// Functions that change the session for longer than the transaction (`set_config` is read
/// apart: see [`ConfigCall`]).
const SESSION_FUNCTIONS: &[&[u8]] = &[
    b"pg_advisory_lock",
    b"pg_advisory_lock_shared",
    b"pg_try_advisory_lock",
    b"pg_try_advisory_lock_shared",
    b"setseed",
    b"dblink_connect",
    b"dblink_connect_u",
];

/// Classifies a query text: what it leaves behind in the session.
pub fn classify(sql: &[u8], enc: ClientEncoding) -> Effects {
    classify_with(FirstWord::of(sql), sql, enc)
}

/// [`classify`] for a caller that already has the text's [`FirstWord`] (it looks at the
/// statement kind for other reasons too, once per query).
pub fn classify_with(first: FirstWord, sql: &[u8], enc: ClientEncoding) -> Effects {
    // The shortcut holds in every encoding: a character's trailing byte can only add a
    // special byte or a fragment, never hide one.
    if is_plain(first, sql) {
        return Effects::default();
    }
    classify_lexed(sql, enc)
}

/// [`classify`] the long way: every token.
pub(super) fn classify_lexed(sql: &[u8], enc: ClientEncoding) -> Effects {
    let mut fx = Effects::default();
    if enc == ClientEncoding::Unknown && !sql.is_ascii() {
        // Which bytes are characters cannot be told: anything may be hidden.
        fx.dirty = true;
        fx.keeps = true;
        fx.ambiguous = true;
        fx.multi = true;
        return fx;
    }
    let mut lex = Lexer::new(sql, enc);
    // Only the first words decide a statement's kind (no allocation: this runs per query).
    let mut stmt = [Token::Other; 8];
    let mut len = 0usize;
    let mut prev: Option<Token<'_>> = None;
    let mut statements = 0usize;
    let mut seen = Seen::default();
    let mut config = ConfigCall::default();
    loop {
        let tok = lex.next();
        let byte = sql.get(lex.offset().wrapping_sub(1)).copied().unwrap_or(0);
        if config.note(tok.as_ref(), byte) {
            fx.dirty = true;
            fx.keeps = true;
        }
        match tok {
            Some(Token::Semicolon) | None => {
                if len > 0 {
                    statements += 1;
                    classify_statement(&stmt[..len], seen, &mut fx);
                    len = 0;
                }
                prev = None;
                seen = Seen::default();
                if tok.is_none() {
                    break;
                }
            }
            Some(t) => {
                // The rest is scanned for the few tokens that matter anywhere.
                scan_anywhere(&t, prev.as_ref(), &mut fx);
                seen.note(&t, prev.as_ref());
                prev = Some(t);
                if len < stmt.len() {
                    stmt[len] = t;
                    len += 1;
                }
            }
        }
    }
    fx.multi = statements > 1;
    if lex.saw_backslash_string {
        fx.ambiguous = true;
        fx.dirty = true;
    }
    fx
}

fn scan_anywhere(t: &Token<'_>, prev: Option<&Token<'_>>, fx: &mut Effects) {
    let keeps = t.name_starts_with(b"pg_temp")
        || SESSION_FUNCTIONS.iter().any(|f| t.name_eq(f))
        || ((t.is("temp") || t.is("temporary"))
            && prev.is_some_and(|p| {
                p.is("create") || p.is("global") || p.is("local") || p.is("into") || p.is("replace")
            }));
    if keeps {
        fx.dirty = true;
        fx.keeps = true;
    }
}

/// A `set_config(...)` call being read. One whose third argument is the bare word `true` is
/// transaction-local: it ends with the transaction and leaves nothing in the session. That is
/// how PostgREST and Supabase's clients set a request's role and JWT claims on every request,
/// so reading it as session state would make a pooled server look held for nothing. Anything
/// else for the third argument (`false`, a parameter, an expression, a string) may last, and
/// so does the bare name outside a call.
#[derive(Debug, Clone, Copy, Default)]
enum ConfigCall {
    #[default]
    None,
    /// The name was the last token.
    Named,
    /// Inside the call's parentheses: the nesting depth, commas seen at depth one, and the
    /// third argument's tokens so far and whether they are just `true`.
    Args {
        depth: u32,
        commas: u32,
        third: u32,
        local: bool,
    },
}

impl ConfigCall {
    /// Follows one token (`byte`: the last byte it covers); whether a `set_config` that may
    /// outlast the transaction was just seen.
    fn note(&mut self, t: Option<&Token<'_>>, byte: u8) -> bool {
        match (*self, t) {
            (ConfigCall::Named, Some(Token::OpenParen)) => {
                *self = ConfigCall::Args {
                    depth: 1,
                    commas: 0,
                    third: 0,
                    local: false,
                };
                false
            }
            (ConfigCall::Named, _) => {
                *self = ConfigCall::None;
                self.note(t, byte);
                true
            }
            (ConfigCall::None, Some(t)) => {
                if t.name_eq(b"set_config") {
                    *self = ConfigCall::Named;
                }
                false
            }
            (ConfigCall::None, None) => false,
            (ConfigCall::Args { .. }, None | Some(Token::Semicolon)) => {
                *self = ConfigCall::None;
                true
            }
            (
                ConfigCall::Args {
                    depth,
                    commas,
                    third,
                    local,
                },
                Some(t),
            ) => {
                let depth = match t {
                    Token::OpenParen => depth + 1,
                    Token::CloseParen => depth - 1,
                    _ => depth,
                };
                if depth == 0 {
                    *self = ConfigCall::None;
                    return !(commas == 2 && third == 1 && local);
                }
                let (commas, third, local) = if depth == 1 && *t == Token::Other && byte == b',' {
                    (commas + 1, third, local)
                } else if commas == 2 {
                    (commas, third + 1, t.is("true"))
                } else {
                    (commas, third, local)
                };
                *self = ConfigCall::Args {
                    depth,
                    commas,
                    third,
                    local,
                };
                false
            }
        }
    }
}

/// What a statement holds anywhere in it (past the first words that decide its kind).
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    /// `WITH HOLD` (a `DECLARE`'s cursor outlives its transaction).
    with_hold: bool,
    /// The word `UPDATE`, and a mention of `pg_settings`: an `UPDATE pg_settings` (also
    /// inside a `WITH`) calls `set_config`.
    update: bool,
    pg_settings: bool,
}

impl Seen {
    fn note(&mut self, t: &Token<'_>, prev: Option<&Token<'_>>) {
        self.with_hold |= t.is("hold") && prev.is_some_and(|p| p.is("with"));
        self.update |= t.is("update");
        self.pg_settings |= t.name_eq(b"pg_settings");
    }
}

fn classify_statement(words: &[Token<'_>], seen: Seen, fx: &mut Effects) {
    if seen.update && seen.pg_settings {
        fx.dirty = true;
        fx.keeps = true;
    }
    let w = |i: usize| words.get(i);
    let is = |i: usize, k: &str| w(i).is_some_and(|t| t.is(k));
    let Some(first) = w(0) else { return };
    // Statements that leave nothing behind need no further look.
    let mut lower = [0u8; 16];
    let first_word = match first {
        Token::Word(x) if x.len() <= lower.len() => {
            lower[..x.len()].copy_from_slice(x);
            lower[..x.len()].make_ascii_lowercase();
            &lower[..x.len()]
        }
        Token::OpenParen => return, // (SELECT ...)
        _ => {
            fx.dirty = true;
            return;
        }
    };
    match first_word {
        b"select" | b"insert" | b"update" | b"delete" | b"with" | b"values" | b"table"
        | b"merge" | b"copy" | b"begin" | b"start" | b"commit" | b"end" | b"rollback"
        | b"abort" | b"savepoint" | b"release" | b"fetch" | b"move" | b"close" | b"show"
        | b"explain" | b"analyze" | b"analyse" | b"vacuum" | b"lock" | b"notify" | b"unlisten"
        // A transaction-mode server is unlistened before it goes back to the pool.
        | b"listen"
        | b"checkpoint" | b"grant" | b"revoke" | b"truncate" | b"reindex" | b"cluster"
        | b"refresh" | b"import" | b"security" => {}
        b"set" => {
            // SET LOCAL / SET TRANSACTION / SET CONSTRAINTS end with the transaction.
            if !(is(1, "local") || is(1, "transaction") || is(1, "constraints")) {
                fx.dirty = true;
                fx.keeps = true;
            }
        }
        b"create" | b"alter" | b"drop" | b"comment" => {
            fx.ddl = true;
        }
        b"discard" => {
            fx.dirty = true;
            if is(1, "all") {
                fx.drops_statements = true;
            }
        }
        b"deallocate" => {
            fx.dirty = true;
            if is(1, "all") || (is(1, "prepare") && is(2, "all")) {
                fx.drops_statements = true;
            }
        }
        b"declare" => {
            if seen.with_hold {
                fx.dirty = true;
                fx.keeps = true;
            }
        }
        b"prepare" | b"load" => {
            fx.dirty = true;
            fx.keeps = true;
        }
        // PREPARE, EXECUTE of SQL-prepared statements, LOAD, RESET, anonymous code
        // blocks and procedures (which may do anything), and whatever this list does not know.
        _ => fx.dirty = true,
    }
}
