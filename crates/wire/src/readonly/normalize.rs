//! A statement's shape: its text with the values taken out, so that a judgement made once
//! holds for every text of that shape.

/// The text with its literal values taken out: every string constant becomes `'?'`, every
/// number `0`, comments and runs of blanks one space, unquoted words lower case. Two texts
/// with the same form differ only in values, comments, blanks and case: what [`super::classify`]
/// says of one it says of the other, so a client that writes its values into the text
/// (the simple protocol's usual way) is parsed once per statement shape, not once per
/// value. `None` when the text has what this cannot take apart with certainty (a dollar
/// quote, a backslash in a plain string, an unterminated quote or comment, a NUL): such a
/// text is judged as it is.
pub fn normalized(sql: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(sql.len());
    let mut i = 0;
    let word_char = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
    let blank = |out: &mut Vec<u8>| {
        if out.last().is_some_and(|&b| b != b' ') {
            out.push(b' ');
        }
    };
    while i < sql.len() {
        let b = sql[i];
        match b {
            0 => return None,
            b' ' | b'\t' | b'\n' | b'\r' | 0x0c => {
                blank(&mut out);
                i += 1;
            }
            b'-' if sql.get(i + 1) == Some(&b'-') => {
                while i < sql.len() && !matches!(sql[i], b'\n' | b'\r') {
                    i += 1;
                }
                blank(&mut out);
            }
            b'/' if sql.get(i + 1) == Some(&b'*') => {
                let mut depth = 0usize;
                loop {
                    match (sql.get(i), sql.get(i + 1)) {
                        (Some(b'/'), Some(b'*')) => {
                            depth += 1;
                            i += 2;
                        }
                        (Some(b'*'), Some(b'/')) => {
                            depth -= 1;
                            i += 2;
                            if depth == 0 {
                                break;
                            }
                        }
                        (Some(_), _) => i += 1,
                        (None, _) => return None,
                    }
                }
                blank(&mut out);
            }
            b'\'' => {
                i = skip_string(sql, i + 1, false)?;
                out.extend_from_slice(b"'?'");
            }
            b'"' => {
                let start = i;
                i += 1;
                loop {
                    match sql.get(i) {
                        Some(b'"') if sql.get(i + 1) == Some(&b'"') => i += 2,
                        Some(b'"') => break,
                        Some(_) => i += 1,
                        None => return None,
                    }
                }
                i += 1;
                out.extend_from_slice(&sql[start..i]);
            }
            b'0'..=b'9' | b'.' if b != b'.' || sql.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                // A number (PostgreSQL's forms: 12, 1.5, .5, 1e-3, 0x1F, 1_000): one token up
                // to the next character that cannot continue it.
                i += 1;
                while let Some(&c) = sql.get(i) {
                    let exponent_sign =
                        matches!(c, b'+' | b'-') && matches!(sql[i - 1], b'e' | b'E');
                    if c.is_ascii_alphanumeric() || c == b'.' || c == b'_' || exponent_sign {
                        i += 1;
                    } else {
                        break;
                    }
                }
                out.push(b'0');
            }
            b'$' if sql.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                // A parameter: its number matters.
                let start = i;
                i += 1;
                while sql.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
                out.extend_from_slice(&sql[start..i]);
            }
            b'$' => return None,
            _ if word_char(b) => {
                let start = i;
                while sql.get(i).is_some_and(|&c| word_char(c)) {
                    i += 1;
                }
                let word = &sql[start..i];
                if word.contains(&b'$') {
                    // A dollar quote may start inside a word's tail (`x$$`): not taken apart.
                    return None;
                }
                match (word, sql.get(i)) {
                    // E'...': backslash escapes.
                    (w, Some(b'\'')) if w.eq_ignore_ascii_case(b"e") => {
                        i = skip_string(sql, i + 1, true)?;
                        out.extend_from_slice(b"e'?'");
                    }
                    // B'...', X'...', N'...': constants of their kind.
                    (w, Some(b'\''))
                        if w.len() == 1
                            && matches!(w[0].to_ascii_lowercase(), b'b' | b'x' | b'n') =>
                    {
                        i = skip_string(sql, i + 1, false)?;
                        out.push(w[0].to_ascii_lowercase());
                        out.extend_from_slice(b"'?'");
                    }
                    _ => out.extend(word.iter().map(u8::to_ascii_lowercase)),
                }
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    if out.last() == Some(&b' ') {
        out.pop();
    }
    Some(out)
}

/// Past a string constant whose opening quote is before `i`: `''` stands for a quote; with
/// `escapes`, a backslash escapes the next byte. A backslash in a plain string depends on
/// `standard_conforming_strings`, which the caller does not know: `None` then, as for an
/// unterminated string.
fn skip_string(sql: &[u8], mut i: usize, escapes: bool) -> Option<usize> {
    loop {
        match sql.get(i)? {
            b'\\' if escapes => i += 2,
            b'\\' => return None,
            b'\'' if sql.get(i + 1) == Some(&b'\'') => i += 2,
            b'\'' => return Some(i + 1),
            _ => i += 1,
        }
    }
}
