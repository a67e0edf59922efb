//! The lexer: tokens of SQL as PostgreSQL's scanner splits them, in any client encoding.

use super::ClientEncoding;

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
    pub(super) fn name_eq(&self, name: &[u8]) -> bool {
        match self {
            Token::Word(w) => w.eq_ignore_ascii_case(name),
            Token::Quoted(q) => *q == name,
            Token::UnicodeQuoted(raw, esc) => decode_unicode(raw, *esc).is_some_and(|d| d == name),
            _ => false,
        }
    }

    pub(super) fn name_starts_with(&self, prefix: &[u8]) -> bool {
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
    pub(super) fn name(&self) -> Option<Vec<u8>> {
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
    pub(super) i: usize,
    enc: ClientEncoding,
    /// A string constant contained a backslash (meaning depends on settings).
    pub saw_backslash_string: bool,
}

fn is_word_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_' || b >= 0x80
}

pub(super) fn is_word_char(b: u8) -> bool {
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
    pub(super) fn skip_blanks(&mut self) {
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
