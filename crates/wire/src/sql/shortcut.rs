//! Deciding the common query without lexing it: its first word, and a scan for the few
//! bytes and word fragments that could make it leave anything in the session.

use super::*;

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
pub(super) fn needs_lexing(body: &[u8]) -> bool {
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
