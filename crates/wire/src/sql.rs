//! Just enough SQL to tell what a client's query does to its session: a lexer that knows
//! comments, quoting and dollar quotes, and a classifier over its words.
//!
//! A pooler in transaction mode hands one server's session to many clients, so it must know
//! when a client left state behind (a `SET ROLE`, a temporary table, a `set_config()` call, a
//! `WITH HOLD` cursor) that the next client would inherit. The command tag cannot say it
//! (`SELECT set_config(...)` completes as `SELECT 1`), so Shoal reads the statement itself.
//! The classifier errs on the side of "dirty": a false alarm costs one `DISCARD ALL`, a miss
//! would leak one client's state into another's session. What no lexer can see (state changed
//! inside a function the query calls) is documented in `docs/transaction-mode.md`.
//!
//! Works on bytes, not `str`: a client may send text in any `client_encoding`. Each function
//! is told the encoding ([`ClientEncoding`]), and steps over a character's bytes as
//! PostgreSQL counts them: in SJIS, BIG5, GBK, UHC, GB18030 and JOHAB a character's second
//! byte may be a `\\` or a letter, which a scanner of bytes would take for an escape or a
//! word. A text an encoding cannot say for sure how to read (not known yet) is dirty.

pub use crate::encoding::ClientEncoding;

/// What a query (one or several statements) does beyond its own transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Effects {
    /// Leaves session state behind that Shoal does not replay: the server must be cleaned
    /// before another client gets it.
    pub dirty: bool,
    /// Of `dirty`, what surely lasts past its transaction (a temporary table, a setting, a
    /// `WITH HOLD` cursor, a session advisory lock, an SQL `PREPARE`, a `LOAD`), rather than
    /// what only might (a `DO` block, a `CALL`, a statement not known here): a client that
    /// would lose it is told.
    pub keeps: bool,
    /// Changes the schema (CREATE/ALTER/DROP...): prepared statements planned before may
    /// describe the old one.
    pub ddl: bool,
    /// Drops every prepared statement of the session (`DISCARD ALL`, `DEALLOCATE ALL`).
    pub drops_statements: bool,
    /// More than one statement.
    pub multi: bool,
    /// A string with a backslash was seen while `standard_conforming_strings` is unknown:
    /// the lexer may have split the text wrongly, so the query counts as dirty.
    pub ambiguous: bool,
}

/// Names a query may reach a whole database by (`DROP DATABASE x`, `ALTER DATABASE x RENAME`):
/// a pooler's idle connections to that database would block it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseCommand {
    pub database: Vec<u8>,
}

/// One token of SQL: a word (keyword or identifier, lower-cased when unquoted), or a piece of
/// punctuation that matters for classification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token<'a> {
    /// An unquoted word; compare with [`Token::is`] (ASCII case-insensitive).
    Word(&'a [u8]),
    /// A double-quoted identifier's raw content (with `""` left doubled).
    Quoted(&'a [u8]),
    /// A `U&"..."` identifier's raw content and its escape character (`\\` unless a
    /// `UESCAPE` clause names another): compared by its decoded name.
    UnicodeQuoted(&'a [u8], u8),
    /// A string constant (any quoting); its content is not inspected.
    Str,
    Semicolon,
    Dot,
    OpenParen,
    CloseParen,
    Other,
}

impl Token<'_> {
    pub fn is(&self, word: &str) -> bool {
        match self {
            Token::Word(w) => w.eq_ignore_ascii_case(word.as_bytes()),
            _ => false,
        }
    }

    /// The identifier's name as PostgreSQL folds it (quoted: exact; unquoted: lower case).
    fn name_eq(&self, name: &[u8]) -> bool {
        match self {
            Token::Word(w) => w.eq_ignore_ascii_case(name),
            Token::Quoted(q) => *q == name,
            Token::UnicodeQuoted(raw, esc) => decode_unicode(raw, *esc).is_some_and(|d| d == name),
            _ => false,
        }
    }

    fn name_starts_with(&self, prefix: &[u8]) -> bool {
        match self {
            Token::Word(w) => {
                w.len() >= prefix.len() && w[..prefix.len()].eq_ignore_ascii_case(prefix)
            }
            Token::Quoted(q) => q.starts_with(prefix),
            Token::UnicodeQuoted(raw, esc) => {
                decode_unicode(raw, *esc).is_some_and(|d| d.starts_with(prefix))
            }
            _ => false,
        }
    }

    /// The name an identifier token stands for (quoted ones with `""` left doubled).
    fn name(&self) -> Option<Vec<u8>> {
        match self {
            Token::Word(w) => Some(w.to_ascii_lowercase()),
            Token::Quoted(q) => Some(q.to_vec()),
            Token::UnicodeQuoted(raw, esc) => decode_unicode(raw, *esc),
            _ => None,
        }
    }
}

/// Decodes a `U&"..."` identifier as PostgreSQL does: `<esc>XXXX` and `<esc>+XXXXXX` are code
/// points (UTF-16 surrogate pairs combined), `<esc><esc>` is the escape character, `""` a
/// quote. `None` where PostgreSQL would raise a syntax error (the statement then fails whole).
pub fn decode_unicode(raw: &[u8], esc: u8) -> Option<Vec<u8>> {
    fn hex(digits: &[u8]) -> Option<u32> {
        let text = std::str::from_utf8(digits).ok()?;
        if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u32::from_str_radix(text, 16).ok()
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    let mut high: Option<u32> = None;
    while i < raw.len() {
        let b = raw[i];
        if b == b'"' && raw.get(i + 1) == Some(&b'"') {
            out.push(b'"');
            i += 2;
            continue;
        }
        if b != esc {
            if high.is_some() {
                return None;
            }
            out.push(b);
            i += 1;
            continue;
        }
        if raw.get(i + 1) == Some(&esc) {
            if high.is_some() {
                return None;
            }
            out.push(esc);
            i += 2;
            continue;
        }
        let (cp, len) = if raw.get(i + 1) == Some(&b'+') {
            (hex(raw.get(i + 2..i + 8)?)?, 8)
        } else {
            (hex(raw.get(i + 1..i + 5)?)?, 5)
        };
        i += len;
        let cp = match (high.take(), cp) {
            (None, 0xD800..=0xDBFF) => {
                high = Some(cp);
                continue;
            }
            (Some(h), 0xDC00..=0xDFFF) => 0x10000 + ((h - 0xD800) << 10) + (cp - 0xDC00),
            (Some(_), _) | (None, 0xDC00..=0xDFFF) => return None,
            (None, cp) => cp,
        };
        let c = char::from_u32(cp).filter(|&c| c != '\0')?;
        let mut utf8 = [0u8; 4];
        out.extend_from_slice(c.encode_utf8(&mut utf8).as_bytes());
    }
    if high.is_some() {
        return None;
    }
    Some(out)
}

/// Whitespace as PostgreSQL's scanner knows it (vertical tab included since PostgreSQL 16).
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

/// A lexer over SQL text. Never fails: unterminated quotes or comments end the text.
pub struct Lexer<'a> {
    s: &'a [u8],
    i: usize,
    enc: ClientEncoding,
    /// A string constant contained a backslash (meaning depends on settings).
    pub saw_backslash_string: bool,
}

fn is_word_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

fn is_word_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80
}

impl<'a> Lexer<'a> {
    /// A lexer over `s`, read in `enc` (see [`ClientEncoding::char_len`]).
    pub fn new(s: &'a [u8], enc: ClientEncoding) -> Self {
        // A query text ends at its NUL (the wire form carries one).
        let end = memchr::memchr(0, s).unwrap_or(s.len());
        Lexer {
            s: &s[..end],
            i: 0,
            enc,
            saw_backslash_string: false,
        }
    }

    fn peek(&self, k: usize) -> Option<u8> {
        self.s.get(self.i + k).copied()
    }

    /// Where the lexer is: just past the last token (for [`Token::Other`], its byte is the
    /// one before).
    pub fn offset(&self) -> usize {
        self.i
    }

    /// The length of the character at `at` (never past the text's end).
    #[inline]
    fn char_len_at(&self, at: usize) -> usize {
        let Some(&b) = self.s.get(at) else { return 1 };
        if b < 0x80 {
            return 1;
        }
        let n = self.enc.char_len(b, self.s.get(at + 1).copied());
        n.min(self.s.len() - at)
    }

    /// Skips a quoted run closed by `q`, where a doubled `q` stands for itself; with
    /// `backslash`, a backslash escapes the next byte.
    fn skip_quoted(&mut self, q: u8, backslash: bool) -> usize {
        let start = self.i;
        while self.i < self.s.len() {
            let b = self.s[self.i];
            if backslash && b == b'\\' {
                // The backslash escapes the next character, however many bytes it has.
                self.i += 1 + self.char_len_at(self.i + 1);
                continue;
            }
            // Only a plain string's backslashes depend on `standard_conforming_strings`.
            if b == b'\\' && q == b'\'' {
                self.saw_backslash_string = true;
            }
            if b == q {
                if self.peek(1) == Some(q) {
                    self.i += 2;
                    continue;
                }
                let end = self.i;
                self.i += 1;
                return end;
            }
            self.i += self.char_len_at(self.i);
        }
        self.i = self.s.len();
        let _ = start;
        self.s.len()
    }

    /// A `--` comment runs to the end of the line: PostgreSQL ends it at `\r` as well as `\n`.
    fn skip_line_comment(&mut self) {
        while self.i < self.s.len() && !matches!(self.s[self.i], b'\n' | b'\r') {
            self.i += 1;
        }
    }

    /// Skips whitespace and comments.
    fn skip_blanks(&mut self) {
        loop {
            match self.s.get(self.i) {
                Some(&b) if is_space(b) => self.i += 1,
                Some(b'-') if self.peek(1) == Some(b'-') => self.skip_line_comment(),
                Some(b'/') if self.peek(1) == Some(b'*') => self.skip_block_comment(),
                _ => return,
            }
        }
    }

    /// After a `U&` string or identifier: consumes a `UESCAPE 'c'` clause and returns its
    /// character, or the default backslash (a malformed clause is left for PostgreSQL to
    /// reject).
    fn uescape(&mut self) -> u8 {
        let at = self.i;
        self.skip_blanks();
        let word = b"uescape";
        let end = self.i + word.len();
        if self
            .s
            .get(self.i..end)
            .is_some_and(|w| w.eq_ignore_ascii_case(word))
            && !self.s.get(end).is_some_and(|&b| is_word_char(b))
        {
            self.i = end;
            self.skip_blanks();
            if let Some(&[b'\'', c, b'\'']) = self.s.get(self.i..self.i + 3) {
                if c != b'\'' {
                    self.i += 3;
                    return c;
                }
            }
        }
        self.i = at;
        b'\\'
    }

    fn skip_block_comment(&mut self) {
        // PostgreSQL's block comments nest.
        let mut depth = 0usize;
        while self.i < self.s.len() {
            if self.s[self.i] == b'/' && self.peek(1) == Some(b'*') {
                depth += 1;
                self.i += 2;
            } else if self.s[self.i] == b'*' && self.peek(1) == Some(b'/') {
                depth -= 1;
                self.i += 2;
                if depth == 0 {
                    return;
                }
            } else {
                self.i += 1;
            }
        }
    }

    /// At `$`: a dollar quote `$tag$ ... $tag$` (skipped, true) or not (false).
    fn try_dollar_quote(&mut self) -> bool {
        let rest = &self.s[self.i + 1..];
        let mut tag_len = 0;
        while let Some(&b) = rest.get(tag_len) {
            if !is_word_char(b) || b == b'$' {
                break;
            }
            tag_len += self.char_len_at(self.i + 1 + tag_len);
        }
        if rest.get(tag_len) != Some(&b'$') {
            return false;
        }
        if tag_len > 0 && rest[0].is_ascii_digit() {
            return false; // $1 is a parameter
        }
        let delim = &self.s[self.i..self.i + tag_len + 2];
        let body_start = self.i + delim.len();
        match find(&self.s[body_start..], delim) {
            Some(at) => self.i = body_start + at + delim.len(),
            None => self.i = self.s.len(),
        }
        true
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

impl<'a> Iterator for Lexer<'a> {
    type Item = Token<'a>;

    fn next(&mut self) -> Option<Token<'a>> {
        loop {
            let b = *self.s.get(self.i)?;
            match b {
                b if is_space(b) => self.i += 1,
                b'-' if self.peek(1) == Some(b'-') => self.skip_line_comment(),
                b'/' if self.peek(1) == Some(b'*') => self.skip_block_comment(),
                b'\'' => {
                    self.i += 1;
                    self.skip_quoted(b'\'', false);
                    return Some(Token::Str);
                }
                b'"' => {
                    self.i += 1;
                    let start = self.i;
                    let end = self.skip_quoted(b'"', false);
                    return Some(Token::Quoted(&self.s[start..end]));
                }
                b'$' if self.try_dollar_quote() => return Some(Token::Str),
                b';' => {
                    self.i += 1;
                    return Some(Token::Semicolon);
                }
                b'.' => {
                    self.i += 1;
                    return Some(Token::Dot);
                }
                b'(' => {
                    self.i += 1;
                    return Some(Token::OpenParen);
                }
                b')' => {
                    self.i += 1;
                    return Some(Token::CloseParen);
                }
                b if is_word_start(b) => {
                    // E'..' (backslash escapes), B'..', X'..', N'..', U&'..' / U&"..".
                    let next = self.peek(1);
                    if next == Some(b'\'') && matches!(b, b'e' | b'E') {
                        self.i += 2;
                        self.skip_quoted(b'\'', true);
                        return Some(Token::Str);
                    }
                    if next == Some(b'\'') && matches!(b, b'b' | b'B' | b'x' | b'X' | b'n' | b'N') {
                        self.i += 2;
                        self.skip_quoted(b'\'', false);
                        return Some(Token::Str);
                    }
                    if matches!(b, b'u' | b'U') && next == Some(b'&') {
                        match self.peek(2) {
                            Some(b'\'') => {
                                // Its backslashes are escapes whatever the settings.
                                let saw = self.saw_backslash_string;
                                self.i += 3;
                                self.skip_quoted(b'\'', false);
                                self.saw_backslash_string = saw;
                                self.uescape();
                                return Some(Token::Str);
                            }
                            Some(b'"') => {
                                self.i += 3;
                                let start = self.i;
                                let end = self.skip_quoted(b'"', false);
                                let raw = &self.s[start..end];
                                return Some(Token::UnicodeQuoted(raw, self.uescape()));
                            }
                            _ => {}
                        }
                    }
                    let start = self.i;
                    while self.i < self.s.len() && is_word_char(self.s[self.i]) {
                        self.i += self.char_len_at(self.i);
                    }
                    return Some(Token::Word(&self.s[start..self.i]));
                }
                _ => {
                    self.i += 1;
                    return Some(Token::Other);
                }
            }
        }
    }
}

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

/// The first word of a query after whitespace and comments, lower-cased; empty when it is
/// not a plain word or is longer than any keyword Shoal looks for. Lets the per-query checks
/// (session `SET`s, `EXECUTE`, `DROP DATABASE`) skip the statements they are not about
/// without lexing the text.
#[derive(Debug, Clone, Copy)]
pub struct FirstWord {
    buf: [u8; 16],
    len: u8,
}

impl FirstWord {
    pub fn of(sql: &[u8]) -> FirstWord {
        let mut w = FirstWord {
            buf: [0; 16],
            len: 0,
        };
        let rest = &sql[leading_comments_len(sql)..];
        let mut n = 0;
        while let Some(&b) = rest.get(n) {
            if !b.is_ascii_alphabetic() {
                break;
            }
            if n == w.buf.len() {
                // Longer than any keyword looked for.
                return FirstWord {
                    buf: [0; 16],
                    len: 0,
                };
            }
            w.buf[n] = b.to_ascii_lowercase();
            n += 1;
        }
        if n == 0 || rest.get(n).is_some_and(|&b| is_word_char(b)) {
            return FirstWord {
                buf: [0; 16],
                len: 0,
            };
        }
        w.len = n as u8;
        w
    }

    /// The word, lower-case ASCII (empty if none).
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len as usize]
    }

    pub fn is(&self, word: &[u8]) -> bool {
        self.as_bytes() == word
    }

    pub fn is_any(&self, words: &[&[u8]]) -> bool {
        words.contains(&self.as_bytes())
    }
}

/// Statement kinds that leave nothing in the session by themselves (what else they contain
/// is for [`plain`] to rule out): queries, DML and the transaction brackets around them.
const PLAIN_FIRST_WORDS: &[&[u8]] = &[
    b"select",
    b"insert",
    b"update",
    b"delete",
    b"values",
    b"table",
    b"with",
    b"begin",
    b"start",
    b"commit",
    b"end",
    b"rollback",
    b"abort",
];

/// Four-byte fragments of every word [`scan_anywhere`] and [`Seen`] react to: `temp` (also in
/// `temporary`, `pg_temp`), `seed` (`setseed`), `_con` (`set_config`, `dblink_connect`), `y_lo`
/// (the `*advisory_lock*` functions), `_set` (`pg_settings`). A text without any of them cannot contain such a word,
/// quoted or not. Written folded: see [`fold`].
const WATCHED_FRAGMENTS: [[u8; 4]; 5] = [
    [b't', b'e', b'm', b'p'],
    [b's', b'e', b'e', b'd'],
    [fold(b'_'), b'c', b'o', b'n'],
    [b'y', fold(b'_'), b'l', b'o'],
    [fold(b'_'), b's', b'e', b't'],
];

/// Case folding for the fragment search, one OR per byte: upper-case ASCII letters become
/// lower case, `_` becomes 0x7F. The only other byte folded onto a fragment's bytes is DEL
/// (onto `_`'s 0x7F): a false match, which only costs the full lexer. No occurrence is missed.
const fn fold(b: u8) -> u8 {
    b | 0x20
}

/// Starting positions examined per step of [`needs_lexing`]: a block of fixed size, free of
/// branches, which the compiler turns into vector compares.
const BLOCK: usize = 16;
/// Bytes looked at per block: each starting position and the three that follow it.
const WINDOW: usize = BLOCK + 3;

/// A byte that sends any text holding it to the lexer: a backslash, a NUL, a `;`, or a `&`
/// (a `U&"..."` identifier may spell any name in escapes).
const fn is_special(b: u8) -> bool {
    (b == b'\\') | (b == 0) | (b == b';') | (b == b'&')
}

/// Whether `body` holds a special byte ([`is_special`]) or any watched fragment.
///
/// Windows are read straight from the text (no copy); the last one ends at the text's end,
/// overlapping the one before it (looking at a position twice changes nothing). Only a text
/// shorter than one window is copied, padded with spaces (no fragment, nothing special).
fn needs_lexing(body: &[u8]) -> bool {
    let Some(last_start) = body.len().checked_sub(WINDOW) else {
        let mut w = [b' '; WINDOW];
        w[..body.len()].copy_from_slice(body);
        // Bytes past the window's starting positions can only be special (too few follow).
        let after = body.get(BLOCK..).unwrap_or_default();
        return block_needs_lexing(&w) || after.iter().any(|&b| is_special(b));
    };
    let window = |at: usize| -> &[u8; WINDOW] {
        // `at <= last_start`, so the window is always whole.
        body[at..at + WINDOW].try_into().unwrap_or(&[b' '; WINDOW])
    };
    let mut at = 0;
    while at < last_start {
        if block_needs_lexing(window(at)) {
            return true;
        }
        at += BLOCK;
    }
    // Starting positions up to the last three are covered by the window ending at the end;
    // the last three bytes can only be special bytes (a fragment needs four).
    block_needs_lexing(window(last_start))
        || body[last_start + BLOCK..].iter().any(|&b| is_special(b))
}

fn block_needs_lexing(w: &[u8; WINDOW]) -> bool {
    let mut hit = false;
    for j in 0..BLOCK {
        let b = w[j];
        let f = [fold(b), fold(w[j + 1]), fold(w[j + 2]), fold(w[j + 3])];
        let special = is_special(b);
        let mut fragment = false;
        for frag in &WATCHED_FRAGMENTS {
            fragment |=
                (f[0] == frag[0]) & (f[1] == frag[1]) & (f[2] == frag[2]) & (f[3] == frag[3]);
        }
        hit |= special | fragment;
    }
    hit
}

/// The common case, decided in one pass without lexing: one plain DML/query statement with no
/// backslash, no NUL and none of the watched words anywhere. Exactly the texts for which
/// [`classify`] would find nothing (a false "no" only costs the full lexer; the property test
/// `shortcut_agrees_with_the_lexer` holds the two together). Such a text also cannot name a
/// prepared statement (no `EXECUTE`, `PREPARE` or `DEALLOCATE` statement starts with these
/// words, and a second statement would need a `;`).
pub fn is_plain(first: FirstWord, sql: &[u8]) -> bool {
    if !first.is_any(PLAIN_FIRST_WORDS) {
        return false;
    }
    // A `;` only as the last thing in the text (one statement).
    let mut end = sql.len();
    while end > 0 && sql[end - 1].is_ascii_whitespace() {
        end -= 1;
    }
    if end > 0 && sql[end - 1] == b';' {
        end -= 1;
    }
    !needs_lexing(&sql[..end])
}

/// Whether a statement that is not [`is_plain`] may change how the server reads the next
/// ones: `SET client_encoding`, `SET NAMES`, `RESET`, `DISCARD`, a `set_config()` call, or an
/// `EXECUTE` of a statement that makes one. The server reports the new encoding before its
/// ReadyForQuery; statements sent before that cannot be read for sure. (A function the
/// client wrote may call `set_config` too: see docs/transaction-mode.md.)
pub fn may_change_encoding(sql: &[u8]) -> bool {
    const WORDS: [&[u8]; 6] = [
        b"encoding",
        b"names",
        b"_config",
        b"reset",
        b"discard",
        b"execute",
    ];
    let mut lower = [0u8; 8];
    sql.windows(5).enumerate().any(|(i, w)| {
        let head = w[0] | 0x20;
        if !matches!(head, b'e' | b'n' | b'_' | b'r' | b'd') {
            return false;
        }
        let end = (i + 8).min(sql.len());
        let n = end - i;
        for (d, &b) in lower.iter_mut().zip(&sql[i..end]) {
            *d = b.to_ascii_lowercase();
        }
        WORDS.iter().any(|word| lower[..n].starts_with(word))
    })
}

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
fn classify_lexed(sql: &[u8], enc: ClientEncoding) -> Effects {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoding::Split;

    // Most tests read UTF-8; the encodings have their own tests below.
    const U: ClientEncoding = ClientEncoding::Utf8;
    fn classify(sql: &[u8]) -> Effects {
        super::classify(sql, U)
    }
    fn database_command(sql: &[u8]) -> Option<DatabaseCommand> {
        super::database_command(sql, U)
    }
    fn named_statement_command(sql: &[u8]) -> Option<NamedStatementCommand> {
        super::named_statement_command(sql, U)
    }
    fn listen_command(sql: &[u8]) -> Option<ListenCommand> {
        super::listen_command(sql, U)
    }
    fn prepared_name_with_prefix(sql: &[u8], prefix: &[u8]) -> Option<Vec<u8>> {
        super::prepared_name_with_prefix(sql, prefix, U)
    }

    const SJIS: ClientEncoding = ClientEncoding::Split(Split::Sjis);

    #[test]
    fn prepared_names_are_read_as_postgresql_folds_them() {
        let n = |s: &str| prepare_name(s.as_bytes(), U);
        assert_eq!(n("PREPARE Foo(int) AS SELECT $1"), Some(b"foo".to_vec()));
        assert_eq!(
            n("/* x */ prepare \"Bar\" AS SELECT 1"),
            Some(b"Bar".to_vec())
        );
        assert_eq!(n("PREPARE TRANSACTION 'x'"), None);
        assert_eq!(n("SELECT 1"), None);
    }

    #[test]
    fn changes_of_encoding_are_seen() {
        for sql in [
            "SET client_encoding = 'SJIS'",
            "set NAMES 'BIG5'",
            "RESET ALL",
            "discard all",
            "SELECT pg_catalog.SET_CONFIG('client_encoding', 'GBK', false)",
            "EXECUTE p('x')",
        ] {
            assert!(may_change_encoding(sql.as_bytes()), "{sql}");
        }
        for sql in ["SET application_name = 'x'", "SELECT 1", "BEGIN"] {
            assert!(!may_change_encoding(sql.as_bytes()), "{sql}");
        }
    }

    #[test]
    fn a_characters_trailing_backslash_escapes_nothing() {
        // 0x83 0x5C is one SJIS character: the string ends at the next quote, and what
        // follows is two more statements, one of them changing the session.
        let sql = b"SELECT E'\x83\x5c'; SELECT set_config('role', 'x', false); --'";
        let fx = super::classify(sql, SJIS);
        assert!(fx.multi && fx.dirty, "{fx:?}");
        // Read as bytes (UTF-8 says they are not characters anyway) the same text is one
        // string: the difference the encoding makes.
        assert!(!super::classify(sql, U).multi);
        // The same for every encoding whose trailing bytes can be a backslash.
        for split in [
            Split::Big5,
            Split::Gbk,
            Split::Uhc,
            Split::Gb18030,
            Split::Johab,
        ] {
            let fx = super::classify(sql, ClientEncoding::Split(split));
            assert!(fx.multi && fx.dirty, "{split:?}: {fx:?}");
        }
        // A hidden EXECUTE of the pooler's own statements is found, and a hidden DROP
        // DATABASE named.
        let exec = b"SELECT E'\x83\x5c'; EXECUTE shoal_1; --'";
        assert!(super::prepared_name_with_prefix(exec, b"shoal_", SJIS).is_some());
        assert!(super::prepared_name_with_prefix(exec, b"shoal_", U).is_none());
    }

    #[test]
    fn trailing_bytes_never_split_a_word_or_a_tag() {
        // JOHAB's trailing bytes include `;`: inside a name it ends no statement.
        let johab = ClientEncoding::Split(Split::Johab);
        let sql = b"SELECT a\x88\x3bb FROM t";
        assert!(!super::classify(sql, johab).multi);
        // A dollar quote's tag may hold any character.
        let sql = b"SELECT $\x83\x5c$ '; SET ROLE x; $\x83\x5c$";
        assert!(!super::classify(sql, SJIS).dirty);
        // GB18030's four-byte characters carry digits.
        let gb = ClientEncoding::Split(Split::Gb18030);
        assert!(!super::classify(b"SELECT E'\x81\x30\x81\x30\\'' ", gb).multi);
    }

    #[test]
    fn an_unknown_encoding_reads_only_ascii() {
        let unknown = ClientEncoding::Unknown;
        assert!(!super::classify(b"SELECT 1; SELECT 2", unknown).dirty);
        let fx = super::classify(b"SELECT '\xe9'; SELECT 2", unknown);
        assert!(fx.dirty && fx.ambiguous, "{fx:?}");
        assert!(
            super::prepared_name_with_prefix(b"EXECUTE \xe9shoal_1", b"shoal_", unknown).is_some()
        );
        assert_eq!(super::listen_command(b"LISTEN \xe9", unknown), None);
    }

    #[test]
    fn listen_commands_name_their_channel_as_postgresql_does() {
        let l = |s: &str| listen_command(s.as_bytes());
        assert_eq!(
            l("LISTEN foo"),
            Some(ListenCommand::Listen(b"foo".to_vec()))
        );
        assert_eq!(
            l("listen FooBar;"),
            Some(ListenCommand::Listen(b"foobar".to_vec()))
        );
        assert_eq!(
            l("/* c */ LISTEN \"Mixed \"\"q\"\"\" ; "),
            Some(ListenCommand::Listen(b"Mixed \"q\"".to_vec()))
        );
        assert_eq!(
            l("LISTEN U&\"d\\0061t\\+000061\""),
            Some(ListenCommand::Listen(b"data".to_vec()))
        );
        assert_eq!(
            l("UNLISTEN foo"),
            Some(ListenCommand::Unlisten(b"foo".to_vec()))
        );
        assert_eq!(l("unlisten *"), Some(ListenCommand::UnlistenAll));
        assert_eq!(l("UNLISTEN * ;"), Some(ListenCommand::UnlistenAll));
        let long = "x".repeat(70);
        assert_eq!(
            l(&format!("LISTEN {long}")),
            Some(ListenCommand::Listen(vec![b'x'; 63]))
        );
        // 62 ASCII bytes then a two-byte character: cut before it.
        let name = format!("{}é", "y".repeat(62));
        assert_eq!(
            l(&format!("LISTEN \"{name}\"")),
            Some(ListenCommand::Listen(vec![b'y'; 62]))
        );
        for no in [
            "LISTEN",
            "LISTEN *",
            "LISTEN a; LISTEN b",
            "LISTEN a b",
            "LISTEN \"\"",
            "SELECT 1",
            "NOTIFY a",
            "LISTEN 'a'",
        ] {
            assert_eq!(l(no), None, "{no}");
        }
    }

    fn dirty(sql: &str) -> bool {
        classify(sql.as_bytes()).dirty
    }

    #[test]
    fn plain_queries_are_clean() {
        for sql in [
            "SELECT 1",
            "select abalance from pgbench_accounts where aid = $1",
            "INSERT INTO t VALUES ('SET ROLE x; set_config')",
            "UPDATE t SET a = 1",
            "BEGIN; SELECT 1; COMMIT",
            "SET LOCAL statement_timeout = 5",
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            "-- SET ROLE x\nSELECT 1",
            "/* SET ROLE /* nested */ x */ SELECT 1",
            "SELECT $$ set_config $$, $x$ pg_temp $x$",
            "SELECT temp FROM readings",
            "DECLARE c CURSOR FOR SELECT 1",
            "SELECT \"set_configs\" FROM t",
            "(SELECT 1)",
            // Transaction-local settings, as PostgREST makes them on every request.
            "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)",
            "BEGIN; select pg_catalog.set_config('search_path', format('%s', 'x'), TRUE); COMMIT",
            "SELECT \"set_config\"('a.b', 'c', true)",
        ] {
            assert!(!dirty(sql), "{sql}");
        }
    }

    #[test]
    fn session_changes_are_dirty() {
        for sql in [
            "SET ROLE other",
            "set session authorization other",
            "SELECT set_config('search_path', 'x', false)",
            "select pg_catalog.set_config('role', 'x', false)",
            "SELECT \"set_config\"('a.b', 'c', false)",
            "CREATE TEMP TABLE t (a int)",
            "create global temporary table t (a int)",
            "CREATE TABLE pg_temp.t (a int)",
            "SELECT 1 INTO TEMP t",
            "CREATE OR REPLACE TEMP VIEW v AS SELECT 1",
            "PREPARE p AS SELECT 1",
            "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
            "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
            "SELECT pg_advisory_lock(1)",
            "DO $$BEGIN PERFORM 1; END$$",
            "CALL p()",
            "SELECT 1; SET search_path = x",
            "/* c */ SET search_path = x",
            "DISCARD ALL",
            "RESET ALL",
            "LOAD 'auto_explain'",
            "SELECT 'a\\'; set_config('x', 'y', false); --'",
            "SELECT set_config('role', $1, $2)",
            "SELECT set_config('role', 'x', 'true')",
            "SELECT set_config('role', 'x', true OR false)",
            "SELECT set_config('role', 'x', (true))",
            "SELECT set_config('a', 'x', true), set_config('b', 'y', false)",
            "SELECT set_config('a', 'x', true, 1)",
            "SELECT set_config",
            "SELECT set_config('a', 'x', tru",
        ] {
            assert!(dirty(sql), "{sql}");
        }
        // Carried by the pool's listener; the server is unlistened before reuse.
        assert!(!dirty("LISTEN chan"));
    }

    /// What PostgreSQL's scanner sees that a simpler lexer would not: a `--` comment ended by
    /// a carriage return, `U&` identifiers spelled in escapes (with `UESCAPE`), vertical tabs,
    /// state-changing words after the eighth token, writes to `pg_settings`.
    #[test]
    fn hidden_session_changes_are_dirty() {
        for sql in [
            "select 1 --x\r; select set_config('search_path','cr',false)",
            "--x\rcreate temp table orders (a int)",
            "select 1 --x\r; deallocate shoal_17; prepare shoal_17(int) as select 666 + $1 * 0",
            "select U&\"!0073et_config\" UESCAPE '!'('role', 'x', false)",
            "select U&\"\\0073\\0065\\0074\\005f\\0063\\006f\\006e\\0066\\0069\\0067\"('a.b', 'c', false)",
            "select u&\"set\\+00005Fconfig\" /* c */ uescape /* d */ '\\' ('a.b', 'c', false)",
            "create table U&\"pg_\\0074emp\".t (a int)",
            "select 1;\x0bset role other",
            "UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path'",
            "update pg_catalog.\"pg_settings\" set setting = 'x' where name = 'work_mem'",
            "WITH u AS (UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path' RETURNING 1) SELECT 1",
            "declare c9 binary insensitive no scroll cursor with hold for select 1",
        ] {
            assert!(dirty(sql), "{sql:?}");
        }
        for sql in [
            "SELECT name, setting FROM pg_settings",
            "select 1 -- set role x\n",
            "SELECT U&\"d\\0061t\\+000061\" FROM t",
            "declare c9 binary insensitive no scroll cursor without hold for select 1",
        ] {
            assert!(!dirty(sql), "{sql:?}");
        }
    }

    #[test]
    fn unicode_identifiers_decode() {
        assert_eq!(
            decode_unicode(b"d\\0061t\\+000061", b'\\').unwrap(),
            b"data"
        );
        assert_eq!(decode_unicode(b"!0073et!!", b'!').unwrap(), b"set!");
        assert_eq!(decode_unicode(b"a\"\"b", b'\\').unwrap(), b"a\"b");
        assert_eq!(
            decode_unicode(b"\\D83D\\DE00", b'\\').unwrap(),
            "\u{1F600}".as_bytes()
        );
        for bad in [
            &b"\\00"[..],
            b"\\zzzz",
            b"\\D83D",
            b"\\DE00",
            b"\\0000",
            b"\\+11FFFF",
        ] {
            assert_eq!(decode_unicode(bad, b'\\'), None, "{bad:?}");
        }
    }

    #[test]
    fn ddl_and_statement_drops() {
        assert!(classify(b"ALTER TABLE t ADD COLUMN b int").ddl);
        assert!(classify(b"drop type x").ddl);
        assert!(!classify(b"SELECT 1").ddl);
        assert!(classify(b"DISCARD ALL").drops_statements);
        assert!(classify(b"deallocate prepare all").drops_statements);
        assert!(!classify(b"DEALLOCATE x").drops_statements);
        assert!(classify(b"SELECT 1; SELECT 2").multi);
        assert!(!classify(b"SELECT ';'").multi);
    }

    #[test]
    fn database_commands() {
        assert_eq!(
            database_command(b"DROP DATABASE IF EXISTS \"My\""),
            Some(DatabaseCommand {
                database: b"My".to_vec()
            })
        );
        assert_eq!(
            database_command(b"alter database Foo rename to bar"),
            Some(DatabaseCommand {
                database: b"foo".to_vec()
            })
        );
        assert_eq!(database_command(b"alter database foo set x = 1"), None);
        assert_eq!(database_command(b"drop table x"), None);
    }

    #[test]
    fn named_statement_commands() {
        let c = named_statement_command(b"DEALLOCATE _pg3_1").unwrap();
        assert!(!c.execute);
        assert_eq!(c.name, b"_pg3_1");
        let sql = b"EXECUTE \"S1\"(1, 'a')";
        let c = named_statement_command(sql).unwrap();
        assert!(c.execute);
        assert_eq!(&sql[c.name_at.clone()], b"\"S1\"");
        assert_eq!(c.name, b"S1");
        assert_eq!(
            named_statement_command(b"deallocate prepare Foo;")
                .unwrap()
                .name,
            b"foo"
        );
        assert_eq!(named_statement_command(b"DEALLOCATE ALL"), None);
        assert_eq!(named_statement_command(b"DEALLOCATE a; SELECT 1"), None);
        assert_eq!(named_statement_command(b"EXECUTE a; SELECT 1"), None);
        assert_eq!(named_statement_command(b"EXECUTE a(1); SET ROLE x"), None);
        for sql in [
            &b"EXPLAIN EXECUTE s1(1)"[..],
            b"explain analyze verbose execute s1 (1)",
            b"EXPLAIN (ANALYZE, FORMAT JSON, SETTINGS (true)) EXECUTE s1(1);",
        ] {
            let c = named_statement_command(sql).unwrap();
            assert!(c.execute);
            assert_eq!(c.name, b"s1");
            assert_eq!(&sql[c.name_at.clone()], b"s1");
        }
        assert_eq!(named_statement_command(b"EXPLAIN SELECT 1"), None);
        assert_eq!(named_statement_command(b"EXPLAIN DEALLOCATE s1"), None);
    }

    #[test]
    fn pooler_names_in_sql() {
        let p = b"shoal_";
        assert_eq!(
            prepared_name_with_prefix(b"EXECUTE shoal_1", p),
            Some(b"shoal_1".to_vec())
        );
        assert_eq!(
            prepared_name_with_prefix(b"explain execute \"shoal_2\"(1)", p),
            Some(b"shoal_2".to_vec())
        );
        assert!(prepared_name_with_prefix(b"DEALLOCATE SHOAL_3", p).is_some());
        assert!(prepared_name_with_prefix(b"SELECT * FROM shoal_stats", p).is_none());
        assert!(prepared_name_with_prefix(b"EXECUTE mine; SELECT shoal_x FROM t", p).is_none());
        assert!(prepared_name_with_prefix(b"EXECUTE 'shoal_1'", p).is_none());
        assert_eq!(
            prepared_name_with_prefix(b"execute U&\"!0073hoal_20\" UESCAPE '!'(1)", p),
            Some(b"shoal_20".to_vec())
        );
        assert!(prepared_name_with_prefix(b"select 1 --x\r; deallocate shoal_4", p).is_some());
    }

    #[test]
    fn lexer_never_panics_on_odd_input() {
        for sql in [
            &b"'unterminated"[..],
            b"\"unterminated",
            b"/* open",
            b"$a$ open",
            b"$",
            b"$1",
            b"E'\\",
            b"U&",
            b"\xff\xfe SET",
            b"--",
        ] {
            let _ = classify(sql);
            let _ = database_command(sql);
            let _ = named_statement_command(sql);
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::encoding::{Split, Table};
    use proptest::prelude::*;

    /// Every way of reading bytes: the lexer must finish and agree with its shortcut in each.
    fn encodings() -> impl Strategy<Value = ClientEncoding> {
        prop_oneof![
            Just(ClientEncoding::Utf8),
            Just(ClientEncoding::Latin1),
            Just(ClientEncoding::AsciiSafe(Table::EucJp)),
            Just(ClientEncoding::Split(Split::Sjis)),
            Just(ClientEncoding::Split(Split::Big5)),
            Just(ClientEncoding::Split(Split::Gb18030)),
            Just(ClientEncoding::Split(Split::Johab)),
            Just(ClientEncoding::Unknown),
        ]
    }

    proptest! {
        /// Any bytes: the lexer and every classifier finish without panicking, and the
        /// statement-name range they report lies inside the text.
        #[test]
        fn classifiers_accept_any_bytes(
            sql in proptest::collection::vec(any::<u8>(), 0..200),
            enc in encodings(),
        ) {
            let _ = classify(&sql, enc);
            let _ = database_command(&sql, enc);
            let _ = prepared_name_with_prefix(&sql, b"shoal_", enc);
            let _ = listen_command(&sql, enc);
            let _ = may_change_encoding(&sql);
            let n = leading_comments_len(&sql);
            prop_assert!(n <= sql.len());
            if let Some(c) = named_statement_command(&sql, enc) {
                prop_assert!(c.name_at.end <= sql.len());
            }
        }

        /// SQL-shaped input built from the tokens that matter.
        #[test]
        fn classifiers_accept_sql_shaped_text(parts in proptest::collection::vec(
            prop_oneof![
                Just("SET "), Just("ROLE "), Just("'"), Just("\""), Just("$$"), Just("$a$"),
                Just("--"), Just("/*"), Just("*/"), Just(";"), Just("\n"), Just("E'\\'"),
                Just("temp "), Just("create "), Just("execute "), Just("shoal_1 "), Just("("),
                Just("U&\""), Just("é"), Just("\r"), Just("UESCAPE '!'"), Just("!0073"),
                Just("\\+00005F"), Just("\x0b"), Just("hold "), Just("with "),
            ], 0..30), enc in encodings()) {
            let sql: String = parts.concat();
            let _ = classify(sql.as_bytes(), enc);
            let _ = named_statement_command(sql.as_bytes(), enc);
            let _ = prepared_name_with_prefix(sql.as_bytes(), b"shoal_", enc);
            let n = leading_comments_len(sql.as_bytes());
            prop_assert!(sql.is_char_boundary(n));
        }

        /// The shortcut for plain statements never disagrees with the lexer: whatever the
        /// text, `classify` gives what lexing every token gives.
        #[test]
        fn shortcut_agrees_with_the_lexer(parts in proptest::collection::vec(
            prop_oneof![
                Just("SELECT "), Just("select "), Just("insert "), Just("UPDATE t "),
                Just("with "), Just("values "), Just("set_config(a) "), Just("SetSeed "),
                Just("pg_try_advisory_lock(1) "), Just("dblink_connect "), Just("TEMP "),
                Just("temporary "), Just("pg_temp.x "), Just("create "), Just("into "),
                Just("'"), Just("\""), Just("$$"), Just(";"), Just("; "), Just("\n"),
                Just("E'\\'"), Just("'\\'"), Just("--"), Just("/*"), Just("*/"), Just("("),
                Just("x "), Just("1 "), Just("\0"), Just("selectx "), Just("select$1 "),
                Just("BEGIN "), Just("end "), Just("commit "), Just("Rollback "), Just("start "),
                Just("set "), Just("discard "), Just("deallocate "), Just("all "),
                Just("\r"), Just("&"), Just("U&\"a\" "), Just("pg_settings "), Just("_set"),
                Just("\u{30bd}"), Just("\u{8868}"),
            ], 0..16), enc in encodings()) {
            let sql: String = parts.concat();
            // Shift JIS's "ソ" (0x83 0x5C) and "表" (0x95 0x5C), as a client in SJIS sends them.
            let sql = sql.replace('\u{30bd}', "\u{83}\\").replace('\u{8868}', "\u{95}\\");
            let bytes: Vec<u8> = sql.chars().map(|c| if (c as u32) < 0x100 { c as u8 } else { b'?' }).collect();
            // Unknown: the shortcut still reads a plain text right (no character's trailing
            // byte can hide a special byte or a word), where the lexer gives up.
            if enc != ClientEncoding::Unknown || bytes.is_ascii() {
                prop_assert_eq!(classify(&bytes, enc), classify_lexed(&bytes, enc), "{:?} {:?}", sql, enc);
            }
        }
    }

    /// The block-wise search finds what a byte-by-byte, case-insensitive one finds, at every
    /// offset (block boundaries included).
    fn naive_needs_lexing(body: &[u8]) -> bool {
        let lower = body.to_ascii_lowercase();
        let words: [&[u8]; 5] = [b"temp", b"seed", b"_con", b"y_lo", b"_set"];
        body.iter()
            .any(|&b| b == b'\\' || b == 0 || b == b';' || b == b'&')
            || lower.windows(4).any(|w| words.contains(&w))
    }

    /// Every length around the window sizes, every position: the overlapping last window and
    /// the short-text path leave no byte unexamined.
    #[test]
    fn block_search_finds_a_mark_at_every_position() {
        for len in 0..64 {
            for mark in [&b"\\"[..], b"\0", b";", b"&", b"TeMp", b"y_lo", b"_SeT"] {
                for at in 0..=len {
                    if at + mark.len() > len {
                        continue;
                    }
                    let mut text = vec![b'a'; len];
                    text[at..at + mark.len()].copy_from_slice(mark);
                    assert!(needs_lexing(&text), "{len} {at} {mark:?}");
                }
            }
            assert!(!needs_lexing(&vec![b'a'; len]), "{len}");
        }
    }

    proptest! {
        #[test]
        fn block_search_agrees_with_a_byte_search(
            pad in 0usize..40,
            word in prop_oneof![Just("TEMP"), Just("sEeD"), Just("_CON"), Just("Y_lO"), Just("\\"), Just("_Set"), Just("&"),
                                Just("\0"), Just(";"), Just("te_p"), Just("y lo"), Just("x")],
            tail in 0usize..40,
        ) {
            let text = format!("{}{}{}", "a".repeat(pad), word, "b".repeat(tail));
            prop_assert_eq!(needs_lexing(text.as_bytes()), naive_needs_lexing(text.as_bytes()), "{:?}", text);
        }

        #[test]
        fn block_search_misses_nothing(body in proptest::collection::vec(any::<u8>(), 0..100)) {
            if naive_needs_lexing(&body) {
                prop_assert!(needs_lexing(&body));
            }
        }
    }

    #[test]
    fn first_word() {
        assert_eq!(
            FirstWord::of(b"  /* x */ -- y\n SeLeCt 1").as_bytes(),
            b"select"
        );
        assert_eq!(FirstWord::of(b"select$1").as_bytes(), b"");
        assert_eq!(FirstWord::of(b"(select 1)").as_bytes(), b"");
        assert_eq!(FirstWord::of(b"SET").as_bytes(), b"set");
        assert_eq!(FirstWord::of(b"checkpointcheckpoint").as_bytes(), b"");
        let plain = |sql: &[u8]| is_plain(FirstWord::of(sql), sql);
        assert!(plain(
            b"SELECT abalance FROM pgbench_accounts WHERE aid = 1;"
        ));
        assert!(plain(b"BEGIN;"));
        assert!(plain(b"end"));
        assert!(!plain(b"SELECT set_config('a', 'b', false)"));
        assert!(!plain(b"SELECT 1; SET ROLE x"));
        assert!(!plain(b"SET ROLE x"));
        assert!(!plain(b"BEGIN; CREATE TEMP TABLE t ()"));
    }
}
