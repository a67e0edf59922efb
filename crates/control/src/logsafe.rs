//! Client-controlled text in logs: user and database names, parameter values and messages
//! that quote them can carry newlines (forging a log line), NUL bytes or terminal escapes.
//! [`Escaped`] writes such text with every control character escaped.

use std::fmt;

/// Displays the inner value with control characters escaped (`\n`, `\0`, `\u{1b}`, ...);
/// everything else, including non-ASCII letters, is written as is.
pub struct Escaped<T>(pub T);

impl<T: fmt::Display> fmt::Display for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write;
        let text = self.0.to_string();
        for c in text.chars() {
            if c.is_control() {
                for e in c.escape_default() {
                    f.write_char(e)?;
                }
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        let s = Escaped("user \"a\nINFO forged\0\u{1b}[31m\" é").to_string();
        assert_eq!(s, "user \"a\\nINFO forged\\u{0}\\u{1b}[31m\" é");
        assert!(!s.contains('\n'));
    }
}
