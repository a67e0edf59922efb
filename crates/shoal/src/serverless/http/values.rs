//! PostgreSQL's text form of a value as the JSON Neon's HTTP answers carry when raw text is
//! not asked for: `int2`/`int4` as numbers, finite `float4`/`float8` as numbers, `bool` as
//! booleans, `json`/`jsonb` as their JSON, arrays of built-in types as JSON arrays (nested
//! for more dimensions, `NULL` as null, each element by its type); everything else, `int8`
//! and `numeric` included (a JSON number would lose their digits), as a string. `None` means
//! "a string": text that does not read as its type is never an error here.
//!
//! Arrays of types made with `CREATE TYPE` stay text: a row description names only their
//! OID, and which OIDs are arrays would take the catalogue. Pure: bytes in, values out.

use serde_json::Value;

mod oid {
    pub const BOOL: u32 = 16;
    pub const INT2: u32 = 21;
    pub const INT4: u32 = 23;
    pub const FLOAT4: u32 = 700;
    pub const FLOAT8: u32 = 701;
    pub const JSON: u32 = 114;
    pub const JSONB: u32 = 3802;
    pub const TEXT: u32 = 25;
}

/// `v` (the text of a value of type `type_oid`) as JSON, if it is not shown as a string.
pub fn typed(v: &[u8], type_oid: u32) -> Option<Value> {
    if let Some((element, delimiter)) = array_of(type_oid) {
        let text = std::str::from_utf8(v).ok()?;
        return parse_array(text, element, delimiter);
    }
    scalar(v, type_oid)
}

fn scalar(v: &[u8], type_oid: u32) -> Option<Value> {
    match type_oid {
        oid::BOOL => match v {
            b"t" => Some(Value::Bool(true)),
            b"f" => Some(Value::Bool(false)),
            _ => None,
        },
        oid::INT2 | oid::INT4 => std::str::from_utf8(v)
            .ok()?
            .parse::<i64>()
            .ok()
            .map(Value::from),
        // NaN and the infinities have no JSON number: they stay strings.
        oid::FLOAT4 | oid::FLOAT8 => std::str::from_utf8(v)
            .ok()?
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number),
        oid::JSON | oid::JSONB => serde_json::from_slice(v).ok(),
        _ => None,
    }
}

/// The element type and delimiter of a built-in array type (`pg_type`'s `typelem` and
/// `typdelim`); the element types that matter here, and the others that are common (their
/// elements are strings, but the array is a JSON array).
fn array_of(type_oid: u32) -> Option<(u32, u8)> {
    let element = match type_oid {
        1000 => oid::BOOL,
        1005 => oid::INT2,
        1007 => oid::INT4,
        1021 => oid::FLOAT4,
        1022 => oid::FLOAT8,
        199 => oid::JSON,
        3807 => oid::JSONB,
        // box[] is the one built-in array whose elements are separated by ';'.
        1020 => return Some((603, b';')),
        // bytea, char, name, int8, text, oid, tid, xid, cid, xml, point, lseg, path,
        // polygon, line, cidr, money, macaddr, inet, bpchar, varchar, date, time,
        // timestamp, timestamptz, interval, timetz, bit, varbit, numeric, uuid, pg_lsn,
        // macaddr8, regclass, regtype, and the built-in ranges.
        1001 | 1002 | 1003 | 1016 | 1009 | 1028 | 1010 | 1011 | 1012 | 143 | 1017 | 1018 | 1019
        | 1027 | 629 | 651 | 791 | 1040 | 1041 | 1014 | 1015 | 1182 | 1183 | 1115 | 1185 | 1187
        | 1270 | 1561 | 1563 | 1231 | 2951 | 3221 | 775 | 2210 | 2211 | 3905 | 3907 | 3909
        | 3911 | 3913 | 3927 => oid::TEXT,
        _ => return None,
    };
    Some((element, b','))
}

/// Deeper than PostgreSQL allows (6 dimensions) is not an array's text.
const MAX_DEPTH: usize = 6;

/// An array's text (`{1,2}`, `{{"a b",NULL},{c,d}}`, `[0:1]={1,2}`) as a JSON array, or
/// `None` if it is not one. Bounds decoration is dropped: JSON arrays start at zero.
fn parse_array(text: &str, element: u32, delimiter: u8) -> Option<Value> {
    let mut text = text.as_bytes();
    if text.first() == Some(&b'[') {
        let eq = text.iter().position(|&b| b == b'=')?;
        text = &text[eq + 1..];
    }
    let mut p = Parser {
        at: 0,
        text,
        element,
        delimiter,
        scratch: Vec::new(),
    };
    p.skip_space();
    let v = p.array(0)?;
    p.skip_space();
    (p.at == text.len()).then_some(v)
}

/// The white space PostgreSQL's array reader skips (`array_isspace`: vertical tab too).
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
    element: u32,
    delimiter: u8,
    scratch: Vec<u8>,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.text.get(self.at).copied()
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(is_space) {
            self.at += 1;
        }
    }

    /// `{item, item, ...}` at the cursor.
    fn array(&mut self, depth: usize) -> Option<Value> {
        if depth >= MAX_DEPTH || self.peek() != Some(b'{') {
            return None;
        }
        self.at += 1;
        let mut items = Vec::new();
        self.skip_space();
        if self.peek() == Some(b'}') {
            self.at += 1;
            return Some(Value::Array(items));
        }
        loop {
            self.skip_space();
            items.push(self.item(depth)?);
            self.skip_space();
            match self.peek()? {
                b'}' => {
                    self.at += 1;
                    return Some(Value::Array(items));
                }
                d if d == self.delimiter => self.at += 1,
                _ => return None,
            }
        }
    }

    fn item(&mut self, depth: usize) -> Option<Value> {
        match self.peek()? {
            b'{' => self.array(depth + 1),
            b'"' => {
                self.at += 1;
                self.scratch.clear();
                loop {
                    match self.peek()? {
                        b'"' => break,
                        b'\\' => {
                            self.scratch.push(*self.text.get(self.at + 1)?);
                            self.at += 2;
                        }
                        b => {
                            self.scratch.push(b);
                            self.at += 1;
                        }
                    }
                }
                self.at += 1;
                // Quoted, even the word NULL is a value.
                let quoted = std::mem::take(&mut self.scratch);
                let v = self.element_value(&quoted);
                self.scratch = quoted;
                Some(v)
            }
            _ => {
                let start = self.at;
                while self
                    .peek()
                    .is_some_and(|b| b != self.delimiter && b != b'}')
                {
                    self.at += 1;
                }
                let mut item = &self.text[start..self.at];
                while let [rest @ .., last] = item {
                    if !is_space(*last) {
                        break;
                    }
                    item = rest;
                }
                if item.is_empty() {
                    return None;
                }
                Some(if item == b"NULL" {
                    Value::Null
                } else {
                    self.element_value(item)
                })
            }
        }
    }

    fn element_value(&self, v: &[u8]) -> Value {
        scalar(v, self.element)
            .unwrap_or_else(|| Value::String(String::from_utf8_lossy(v).into_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn scalars() {
        assert_eq!(typed(b"42", oid::INT4), Some(json!(42)));
        assert_eq!(typed(b"-7", oid::INT2), Some(json!(-7)));
        assert_eq!(typed(b"42", 20), None, "int8 stays a string");
        assert_eq!(typed(b"1.5", oid::FLOAT8), Some(json!(1.5)));
        assert_eq!(typed(b"NaN", oid::FLOAT4), None);
        assert_eq!(typed(b"-Infinity", oid::FLOAT8), None);
        assert_eq!(typed(b"t", oid::BOOL), Some(json!(true)));
        assert_eq!(typed(b"{\"a\": [1]}", oid::JSONB), Some(json!({"a": [1]})));
        assert_eq!(typed(b"not json", oid::JSON), None);
        assert_eq!(typed(b"26", 26), None, "oid stays a string, as Neon's");
    }

    #[test]
    fn arrays_by_element_type() {
        assert_eq!(typed(b"{1,2,NULL}", 1007), Some(json!([1, 2, null])));
        assert_eq!(typed(b"{t,f}", 1000), Some(json!([true, false])));
        assert_eq!(typed(b"{1.5,NaN}", 1022), Some(json!([1.5, "NaN"])));
        assert_eq!(typed(b"{10,20}", 1016), Some(json!(["10", "20"])));
        assert_eq!(
            typed(br#"{"{\"a\": 1}",NULL}"#, 3807),
            Some(json!([{"a": 1}, null]))
        );
        assert_eq!(typed(b"{}", 1009), Some(json!([])));
    }

    #[test]
    fn text_arrays_quote_and_escape() {
        assert_eq!(
            typed(
                br#"{plain,"with space","a\"q","b\\s","NULL",NULL,""}"#,
                1009
            ),
            Some(json!([
                "plain",
                "with space",
                "a\"q",
                "b\\s",
                "NULL",
                null,
                ""
            ]))
        );
        assert_eq!(
            typed("{ünï,\"c,d\"}".as_bytes(), 1015),
            Some(json!(["ünï", "c,d"]))
        );
    }

    #[test]
    fn dimensions_and_bounds() {
        assert_eq!(typed(b"{{1,2},{3,4}}", 1007), Some(json!([[1, 2], [3, 4]])));
        assert_eq!(typed(b"[0:1]={7,8}", 1007), Some(json!([7, 8])));
        assert_eq!(
            typed(b"[1:1][2:3]={{a,b}}", 1009),
            Some(json!([["a", "b"]]))
        );
        assert_eq!(
            typed(b"{(1,2),(0,0);(3,3),(1,1)}", 1020),
            Some(json!(["(1,2),(0,0)", "(3,3),(1,1)"]))
        );
    }

    #[test]
    fn what_is_not_an_array_is_a_string() {
        for bad in [
            &b"{1,2"[..],
            b"1,2}",
            b"{1,,2}",
            b"{\"open}",
            b"{1} x",
            b"[0:1]",
            b"{{{{{{{1}}}}}}}",
            b"\xff",
        ] {
            assert_eq!(typed(bad, 1007), None, "{:?}", String::from_utf8_lossy(bad));
        }
        assert_eq!(typed(b"{1,2}", 16384), None, "a type of the user's");
    }

    /// PostgreSQL's array output for text elements, written here to check the reading.
    fn pg_text_array(items: &[Option<String>]) -> String {
        let quoted = |s: &str| {
            let plain = !s.is_empty()
                && !s.eq_ignore_ascii_case("null")
                && !s.bytes().any(|b| b"{},\"\\".contains(&b) || is_space(b));
            if plain {
                s.to_owned()
            } else {
                format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
            }
        };
        let inner: Vec<String> = items
            .iter()
            .map(|i| i.as_deref().map_or("NULL".to_owned(), quoted))
            .collect();
        format!("{{{}}}", inner.join(","))
    }

    proptest! {
        #[test]
        fn text_arrays_round_trip(items in proptest::collection::vec(proptest::option::of(".{0,12}"), 0..8)) {
            let text = pg_text_array(&items);
            let want: Vec<Value> = items.iter().map(|i| i.clone().map_or(Value::Null, Value::String)).collect();
            prop_assert_eq!(typed(text.as_bytes(), 1009), Some(Value::Array(want)));
        }

        #[test]
        fn any_bytes_never_panic(v in proptest::collection::vec(any::<u8>(), 0..64), t in prop_oneof![Just(1007u32), Just(1009), Just(1020), Just(3807)]) {
            let _ = typed(&v, t);
        }
    }
}
