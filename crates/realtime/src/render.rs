//! Column values as Postgres Changes messages carry them: the JSON PostgreSQL's `to_jsonb`
//! gives for the value, as Supabase Realtime renders them, computed from the value's text
//! form (as `pgoutput` sends it, with `DateStyle` ISO and `TimeZone` UTC) and its type's
//! name (`pg_type.typname`; an array type's name starts with `_`).
//!
//! Pure: checked against real PostgreSQL's `to_jsonb` type by type in Shoal's tests.

/// The JSON text of a value of type `typname` whose text form is `text`.
pub fn render(typname: &str, text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    render_into(&mut out, typname, text);
    out
}

fn render_into(out: &mut String, typname: &str, text: &str) {
    if let Some(element) = typname.strip_prefix('_') {
        return array(out, element, text);
    }
    match typname {
        "bool" => out.push_str(if matches!(text, "t" | "true") {
            "true"
        } else {
            "false"
        }),
        "int2" | "int4" | "int8" | "oid" | "xid" | "cid" | "regproc" if is_integer(text) => {
            out.push_str(text)
        }
        "float4" | "float8" | "numeric" if is_json_number(text) => out.push_str(text),
        "json" | "jsonb" => out.push_str(text),
        "timestamptz" => string(out, &iso_timestamp(text, true)),
        "timestamp" => string(out, &iso_timestamp(text, false)),
        _ => string(out, text),
    }
}

fn is_integer(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// Whether `text` is a JSON number as PostgreSQL writes numbers (`NaN` and the infinities
/// are not, and become strings).
fn is_json_number(text: &str) -> bool {
    let t = text.strip_prefix('-').unwrap_or(text);
    let (mantissa, exponent) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], Some(&t[i + 1..])),
        None => (t, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (mantissa, None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let int_ok = digits(int) && (int == "0" || !int.starts_with('0'));
    let frac_ok = frac.is_none_or(digits);
    let exp_ok = exponent.is_none_or(|e| digits(e.strip_prefix(['+', '-']).unwrap_or(e)));
    int_ok && frac_ok && exp_ok
}

/// `2024-01-02 03:04:05.5+00` as `to_jsonb` writes it: `2024-01-02T03:04:05.5+00:00`.
fn iso_timestamp(text: &str, zoned: bool) -> String {
    // `infinity`, `-infinity` and BC dates are left as PostgreSQL wrote them.
    if text.as_bytes().get(10).is_none_or(|b| *b != b' ') || text.ends_with(" BC") {
        return text.to_owned();
    }
    let mut s = format!("{}T{}", &text[..10], &text[11..]);
    if zoned {
        // The offset is the last `+hh`, `-hh`, `+hh:mm` or `+hh:mm:ss` after the time.
        if let Some(i) = s[11..].rfind(['+', '-']).map(|i| i + 11) {
            if s.len() - i == 3 {
                s.push_str(":00");
            }
        }
    }
    s
}

fn string(out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// An array literal (`{1,2,NULL}`, `{{"a b",c},{d,e}}`, `[0:1]={1,2}`) as a JSON array of
/// its elements rendered as `element`s.
fn array(out: &mut String, element: &str, text: &str) {
    let body = match text.find("={") {
        Some(i) if text.starts_with('[') => &text[i + 1..],
        _ => text,
    };
    let mut chars = body.chars().peekable();
    if !array_level(out, element, &mut chars) {
        // Not an array literal after all: the text, as a string.
        out.clear();
        string(out, text);
    }
}

/// One `{...}` level; false when the text is not an array literal.
fn array_level(
    out: &mut String,
    element: &str,
    chars: &mut std::iter::Peekable<std::str::Chars<'_>>,
) -> bool {
    if chars.next() != Some('{') {
        return false;
    }
    out.push('[');
    if chars.peek() == Some(&'}') {
        chars.next();
        out.push(']');
        return true;
    }
    loop {
        match chars.peek() {
            Some('{') => {
                if !array_level(out, element, chars) {
                    return false;
                }
            }
            Some('"') => {
                chars.next();
                let mut item = String::new();
                loop {
                    match chars.next() {
                        Some('\\') => match chars.next() {
                            Some(c) => item.push(c),
                            None => return false,
                        },
                        Some('"') => break,
                        Some(c) => item.push(c),
                        None => return false,
                    }
                }
                render_into(out, element, &item);
            }
            Some(_) => {
                let mut item = String::new();
                while let Some(&c) = chars.peek() {
                    if c == ',' || c == '}' {
                        break;
                    }
                    item.push(c);
                    chars.next();
                }
                if item == "NULL" {
                    out.push_str("null");
                } else {
                    render_into(out, element, &item);
                }
            }
            None => return false,
        }
        match chars.next() {
            Some(',') => out.push(','),
            Some('}') => {
                out.push(']');
                return true;
            }
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(typname: &str, text: &str) -> serde_json::Value {
        let r = render(typname, text);
        serde_json::from_str(&r).unwrap_or_else(|e| panic!("{typname} {text}: {r}: {e}"))
    }

    #[test]
    fn scalars_render_as_to_jsonb_does() {
        use serde_json::json as j;
        assert_eq!(json("bool", "t"), j!(true));
        assert_eq!(json("int8", "-9007199254740993"), j!(-9007199254740993i64));
        assert_eq!(json("numeric", "12.50"), j!(12.5));
        assert_eq!(render("numeric", "12.50"), "12.50", "digits kept");
        assert_eq!(json("numeric", "NaN"), j!("NaN"));
        assert_eq!(json("float8", "-Infinity"), j!("-Infinity"));
        assert_eq!(json("float8", "1e+20"), j!(1e20));
        assert_eq!(json("jsonb", r#"{"a": [1, null]}"#), j!({"a": [1, null]}));
        assert_eq!(
            json("timestamptz", "2024-01-02 03:04:05.123+00"),
            j!("2024-01-02T03:04:05.123+00:00")
        );
        assert_eq!(
            json("timestamptz", "2024-01-02 03:04:05+05:30"),
            j!("2024-01-02T03:04:05+05:30")
        );
        assert_eq!(
            json("timestamp", "2024-01-02 03:04:05"),
            j!("2024-01-02T03:04:05")
        );
        assert_eq!(json("timestamptz", "infinity"), j!("infinity"));
        assert_eq!(json("bytea", r"\x00ff"), j!(r"\x00ff"));
        assert_eq!(json("text", "a \"q\"\n\u{1}"), j!("a \"q\"\n\u{1}"));
        assert_eq!(json("mood", "happy"), j!("happy"), "an enum");
    }

    #[test]
    fn arrays_render_element_by_element() {
        use serde_json::json as j;
        assert_eq!(json("_int4", "{1,2,NULL}"), j!([1, 2, null]));
        assert_eq!(json("_int4", "{{1,2},{3,4}}"), j!([[1, 2], [3, 4]]));
        assert_eq!(
            json("_text", r#"{"a b","c\"d",NULL,"NULL"}"#),
            j!(["a b", "c\"d", null, "NULL"])
        );
        assert_eq!(json("_int4", "[0:1]={5,6}"), j!([5, 6]));
        assert_eq!(json("_text", "{}"), j!([]));
        assert_eq!(json("_bool", "{t,f}"), j!([true, false]));
        assert_eq!(json("_int4", "{1,2"), j!("{1,2"), "broken: its text");
    }

    #[test]
    fn numbers_are_json_numbers_only_when_json_allows() {
        for ok in ["0", "-1", "1.5", "1e+20", "2E-3", "0.001"] {
            assert!(is_json_number(ok), "{ok}");
        }
        for bad in ["NaN", "Infinity", "01", "1.", ".5", "1e", "", "-"] {
            assert!(!is_json_number(bad), "{bad}");
        }
    }
}
