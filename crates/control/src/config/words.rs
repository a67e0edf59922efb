//! What serde says about a wrong value, said the way a person fixes it: `expected u16` becomes
//! "a port between 1 and 65535", an unknown key gets the nearest known one. Used by the
//! configuration file and the tenant API alike, so both speak the same words.

/// `message` (serde's, about the value of `key`) in words. `key` is the key's last name
/// (`db_port`), which picks the words where the type alone is not enough (a port).
pub fn in_words(key: &str, message: &str) -> String {
    if let Some(rest) = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))
    {
        if let Some((got, expected)) = rest.split_once(", expected ") {
            return format!("{}, not {}", wanted(key, expected), given(got));
        }
    }
    if let Some(rest) = message.strip_prefix("unknown field `") {
        if let Some((name, known)) = rest.split_once('`') {
            let known = names(known);
            return match nearest(name, &known) {
                Some(near) => format!("`{name}` is not a key here; did you mean `{near}`?"),
                None if known.is_empty() => format!("`{name}` is not a key here"),
                None => format!(
                    "`{name}` is not a key here (the keys here: {})",
                    known.join(", ")
                ),
            };
        }
    }
    if let Some(rest) = message.strip_prefix("unknown variant `") {
        if let Some((name, known)) = rest.split_once('`') {
            let known: Vec<String> = names(known).iter().map(|n| format!("\"{n}\"")).collect();
            return format!("one of {}, not \"{name}\"", known.join(", "));
        }
    }
    if let Some(rest) = message.strip_prefix("missing field `") {
        if let Some((name, _)) = rest.split_once('`') {
            return format!("`{name}` is required");
        }
    }
    if message.starts_with("invalid socket address syntax") {
        return wanted(key, "socket address");
    }
    message.to_owned()
}

/// What a value of serde's `expected` type is, in words.
fn wanted(key: &str, expected: &str) -> String {
    let e = expected.trim();
    let whole = |max: &str| format!("a whole number from 0 to {max}");
    match e {
        "u16" if key.ends_with("port") => "a port between 1 and 65535".into(),
        "u8" => whole("255"),
        "u16" => whole("65535"),
        "u32" => whole("4294967295"),
        "u64" | "usize" => "a whole number, 0 or more".into(),
        "i8" | "i16" | "i32" | "i64" | "isize" => "a whole number".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" => "true or false".into(),
        "a string" | "a borrowed string" => "text in quotes".into(),
        "a sequence" => "a list in brackets, such as [\"a\", \"b\"]".into(),
        "a map" => "a table of keys".into(),
        "socket address" | "a socket address" => {
            "an address and port such as \"127.0.0.1:6432\"".into()
        }
        e if e.starts_with("struct ") => "a table of keys".into(),
        e if e.starts_with("a map") => "a table of keys".into(),
        e if e.starts_with("one of ") || e.starts_with('`') => {
            let known: Vec<String> = names(e).iter().map(|n| format!("\"{n}\"")).collect();
            format!("one of {}", known.join(", "))
        }
        e => e.to_owned(),
    }
}

/// serde's description of what it got, in words.
fn given(got: &str) -> String {
    let g = got.trim();
    for prefix in [
        "string ",
        "integer ",
        "floating point ",
        "boolean ",
        "char ",
    ] {
        if let Some(v) = g.strip_prefix(prefix) {
            return v.trim_matches('`').to_owned();
        }
    }
    match g {
        "sequence" => "a list".into(),
        "map" => "a table".into(),
        "unit value" | "null" => "nothing (null)".into(),
        g => g.to_owned(),
    }
}

/// The names in serde's "expected one of `a`, `b`" (or "`a` or `b`", or "there are no fields").
fn names(text: &str) -> Vec<String> {
    text.split('`')
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .map(|(_, n)| n.to_owned())
        .collect()
}

/// The known name a typo most likely meant: at most a third of its letters apart.
fn nearest<'a>(name: &str, known: &'a [String]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (distance(name, k), k))
        .filter(|(d, k)| *d <= (k.len().max(name.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k.as_str())
}

/// Levenshtein distance over characters.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let here = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(here + 1);
            prev = here;
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_are_said_in_words() {
        assert_eq!(
            in_words("db_port", "invalid type: string \"x\", expected u16"),
            "a port between 1 and 65535, not \"x\""
        );
        assert_eq!(
            in_words("port", "invalid value: integer `70000`, expected u16"),
            "a port between 1 and 65535, not 70000"
        );
        assert_eq!(
            in_words("pool_size", "invalid type: string \"ten\", expected usize"),
            "a whole number, 0 or more, not \"ten\""
        );
        assert_eq!(
            in_words(
                "tcp_keepalive",
                "invalid type: integer `1`, expected a boolean"
            ),
            "true or false, not 1"
        );
        let m = in_words("listen", "invalid type: string \"a\", expected a sequence");
        assert!(m.starts_with("a list in brackets"), "{m}");
    }

    #[test]
    fn unknown_keys_and_variants_name_what_is_known() {
        assert_eq!(
            in_words(
                "pool",
                "unknown field `pool_sise`, expected one of `pool_mode`, `pool_size`"
            ),
            "`pool_sise` is not a key here; did you mean `pool_size`?"
        );
        let m = in_words(
            "pool",
            "unknown field `zzz`, expected `pool_mode` or `pool_size`",
        );
        assert_eq!(
            m,
            "`zzz` is not a key here (the keys here: pool_mode, pool_size)"
        );
        assert_eq!(
            in_words(
                "pool_mode",
                "unknown variant `sesion`, expected one of `session`, `transaction`"
            ),
            "one of \"session\", \"transaction\", not \"sesion\""
        );
        assert_eq!(
            in_words("x", "missing field `db_host`"),
            "`db_host` is required"
        );
    }

    #[test]
    fn edit_distance() {
        assert_eq!(distance("kitten", "sitting"), 3);
        assert_eq!(distance("", "ab"), 2);
        assert_eq!(distance("same", "same"), 0);
    }
}
