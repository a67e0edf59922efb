//! Postgres Changes filters as realtime-js sends them in a binding's `filter`
//! (`column=op.value`), read into their parts: the operators `eq`, `neq`, `lt`, `lte`,
//! `gt`, `gte` and `in` (`id=in.(1,2,3)`), PostgREST's `like` and `ilike` (SQL patterns,
//! `*` standing for `%` as in PostgREST's URLs), `match` and `imatch` (regular
//! expressions, `~` and `~*`), `is` (`null`, `true`, `false`, `unknown`) and `isdistinct`
//! (`IS DISTINCT FROM`), each negated by a `not.` prefix (`id=not.eq.5`), several joined by
//! commas meaning AND (`id=gt.0,id=lt.100`). A value may be double-quoted
//! (`name=eq."a,b"`, with `\` escaping), as may an `in` list's items.
//!
//! Pure. The errors say what to fix, and the join is refused with them.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Eq,
    Neq,
    Lt,
    Lte,
    Gt,
    Gte,
    In,
    Like,
    Ilike,
    Match,
    Imatch,
    Is,
    IsDistinct,
}

impl Op {
    fn parse(s: &str) -> Option<Op> {
        Some(match s {
            "eq" => Op::Eq,
            "neq" => Op::Neq,
            "lt" => Op::Lt,
            "lte" => Op::Lte,
            "gt" => Op::Gt,
            "gte" => Op::Gte,
            "in" => Op::In,
            "like" => Op::Like,
            "ilike" => Op::Ilike,
            "match" => Op::Match,
            "imatch" => Op::Imatch,
            "is" => Op::Is,
            "isdistinct" => Op::IsDistinct,
            _ => return None,
        })
    }
}

/// One condition: `column op values` (one value, or an `in` list), maybe negated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub column: String,
    pub op: Op,
    pub values: Vec<String>,
    pub negate: bool,
    /// `like`, `ilike`, `match` and `imatch`: the value, compiled once at the join.
    pub pattern: Option<Pattern>,
}

/// A compiled pattern; equal when written the same.
#[derive(Debug, Clone)]
pub struct Pattern(regex::Regex);

impl PartialEq for Pattern {
    fn eq(&self, other: &Pattern) -> bool {
        self.0.as_str() == other.0.as_str()
    }
}

impl Eq for Pattern {}

/// A pattern's compiled size limit: a client's filter must not cost the server much
/// memory (the regex engine's matching time is linear in the value either way).
const PATTERN_SIZE: usize = 256 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    #[error("filter must not contain empty segments (check for extra commas)")]
    EmptySegment,
    #[error("filter {0:?} is not column=operator.value")]
    Shape(String),
    #[error("filter operator {0:?} is not one of eq, neq, lt, lte, gt, gte, in, like, ilike, match, imatch, is, isdistinct")]
    Operator(String),
    #[error("`is` filter value {0:?} is not one of null, true, false, unknown")]
    IsValue(String),
    #[error("filter pattern {0:?} is not a valid regular expression: {1}")]
    Pattern(String, String),
    #[error("`in` filter value must be wrapped by parentheses")]
    InList,
    #[error("filter {0:?} has an unclosed quote")]
    Quote(String),
    #[error("`in` filter has more than 100 values")]
    TooMany,
}

/// Reads a binding's filter; no filter (empty or blank) is no condition.
pub fn parse(filter: &str) -> Result<Vec<Filter>, FilterError> {
    let filter = filter.trim();
    if filter.is_empty() {
        return Ok(Vec::new());
    }
    split_top_level(filter)?
        .into_iter()
        .map(|segment| parse_segment(segment.trim()))
        .collect()
}

/// Splits at commas outside quotes and parentheses.
fn split_top_level(s: &str) -> Result<Vec<&str>, FilterError> {
    let mut parts = Vec::new();
    let (mut depth, mut quoted, mut escaped, mut start) = (0usize, false, false, 0);
    for (i, c) in s.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '(' if !quoted => depth += 1,
            ')' if !quoted => depth = depth.saturating_sub(1),
            ',' if !quoted && depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if quoted {
        return Err(FilterError::Quote(s.to_owned()));
    }
    parts.push(&s[start..]);
    Ok(parts)
}

fn parse_segment(segment: &str) -> Result<Filter, FilterError> {
    if segment.is_empty() {
        return Err(FilterError::EmptySegment);
    }
    let shape = || FilterError::Shape(segment.to_owned());
    let (column, rest) = segment.split_once('=').ok_or_else(shape)?;
    let (negate, rest) = match rest.strip_prefix("not.") {
        Some(r) => (true, r),
        None => (false, rest),
    };
    let (op, value) = rest.split_once('.').ok_or_else(shape)?;
    if column.is_empty() {
        return Err(shape());
    }
    let op = Op::parse(op).ok_or_else(|| FilterError::Operator(op.to_owned()))?;
    let values = if op == Op::In {
        let list = value
            .strip_prefix('(')
            .and_then(|v| v.strip_suffix(')'))
            .ok_or(FilterError::InList)?;
        let items = split_top_level(list)?;
        if items.len() > 100 {
            return Err(FilterError::TooMany);
        }
        items
            .into_iter()
            .map(|i| unquote(i.trim()))
            .collect::<Result<_, _>>()?
    } else {
        vec![unquote(value)?]
    };
    if op == Op::Is {
        let v = values[0].to_ascii_lowercase();
        if !["null", "true", "false", "unknown"].contains(&v.as_str()) {
            return Err(FilterError::IsValue(values[0].clone()));
        }
    }
    let pattern = match op {
        Op::Like | Op::Ilike => Some(compile(
            &like_to_regex(&values[0]),
            op == Op::Ilike,
            &values[0],
        )?),
        Op::Match | Op::Imatch => Some(compile(&values[0], op == Op::Imatch, &values[0])?),
        _ => None,
    };
    Ok(Filter {
        column: column.to_owned(),
        op,
        values,
        negate,
        pattern,
    })
}

fn compile(regex: &str, case_insensitive: bool, written: &str) -> Result<Pattern, FilterError> {
    regex::RegexBuilder::new(regex)
        .case_insensitive(case_insensitive)
        .size_limit(PATTERN_SIZE)
        .dfa_size_limit(PATTERN_SIZE)
        .build()
        .map(Pattern)
        .map_err(|e| FilterError::Pattern(written.to_owned(), e.to_string()))
}

/// A LIKE pattern as an anchored regular expression: `%` (or PostgREST's `*`) any run of
/// characters, `_` any one, `\` making the next character plain.
fn like_to_regex(like: &str) -> String {
    let mut out = String::with_capacity(like.len() + 8);
    out.push_str("(?s)^");
    let mut chars = like.chars();
    while let Some(c) = chars.next() {
        match c {
            '%' | '*' => out.push_str(".*"),
            '_' => out.push('.'),
            '\\' => {
                if let Some(next) = chars.next() {
                    out.push_str(&regex::escape(next.encode_utf8(&mut [0; 4])));
                }
            }
            c => out.push_str(&regex::escape(c.encode_utf8(&mut [0; 4]))),
        }
    }
    out.push('$');
    out
}

impl Filter {
    /// Whether a column value passes: `value` as PostgreSQL writes a value of type
    /// `typname` (`None` for NULL, which passes no condition, negated or not, as in SQL).
    /// Numbers compare as numbers, booleans as booleans, UUIDs without regard to case, and
    /// everything else as text, by code point.
    pub fn passes(&self, typname: &str, value: Option<&str>) -> bool {
        let kind = ValueKind::of(typname);
        let written = self.values.first().map(String::as_str).unwrap_or_default();
        // The operators whose answer is never NULL: negation applies to NULLs too.
        match self.op {
            Op::Is => {
                let hit = match (written.to_ascii_lowercase().as_str(), value) {
                    ("null" | "unknown", v) => v.is_none(),
                    (_, None) => false,
                    (want, Some(v)) => {
                        matches!(kind, ValueKind::Bool)
                            && kind.compare(v, want) == Some(std::cmp::Ordering::Equal)
                    }
                };
                return hit != self.negate;
            }
            Op::IsDistinct => {
                let distinct = match value {
                    _ if written.eq_ignore_ascii_case("null") => value.is_some(),
                    None => true,
                    Some(v) => match kind.compare(v, written) {
                        Some(ord) => ord.is_ne(),
                        None => return false,
                    },
                };
                return distinct != self.negate;
            }
            _ => {}
        }
        let Some(value) = value else {
            return false;
        };
        if let Some(Pattern(re)) = &self.pattern {
            return re.is_match(value) != self.negate;
        }
        let mut any = false;
        for v in &self.values {
            let Some(ord) = kind.compare(value, v) else {
                // A filter value that is no value of the column's type matches nothing.
                return false;
            };
            let hit = match self.op {
                Op::Eq | Op::In => ord.is_eq(),
                Op::Neq => ord.is_ne(),
                Op::Lt => ord.is_lt(),
                Op::Lte => ord.is_le(),
                Op::Gt => ord.is_gt(),
                Op::Gte => ord.is_ge(),
                // Answered above.
                Op::Like | Op::Ilike | Op::Match | Op::Imatch | Op::Is | Op::IsDistinct => false,
            };
            any |= hit;
        }
        any != self.negate
    }
}

/// How a type's values compare.
#[derive(Clone, Copy)]
enum ValueKind {
    Integer,
    Decimal,
    Bool,
    Uuid,
    Text,
}

impl ValueKind {
    fn of(typname: &str) -> ValueKind {
        match typname {
            "int2" | "int4" | "int8" | "oid" | "xid" => ValueKind::Integer,
            "float4" | "float8" | "numeric" | "money" => ValueKind::Decimal,
            "bool" => ValueKind::Bool,
            "uuid" => ValueKind::Uuid,
            _ => ValueKind::Text,
        }
    }

    /// The column's value against a filter's, or `None` when either is not of the kind.
    fn compare(self, value: &str, filter: &str) -> Option<std::cmp::Ordering> {
        match self {
            ValueKind::Integer => {
                let a: i128 = value.trim().parse().ok()?;
                let b: i128 = filter.trim().parse().ok()?;
                Some(a.cmp(&b))
            }
            ValueKind::Decimal => {
                let num = |s: &str| s.trim().trim_start_matches('$').replace(',', "");
                let a: f64 = num(value).parse().ok()?;
                let b: f64 = num(filter).parse().ok()?;
                a.partial_cmp(&b)
            }
            ValueKind::Bool => {
                let b = |s: &str| match s.trim().to_ascii_lowercase().as_str() {
                    "t" | "true" | "y" | "yes" | "on" | "1" => Some(true),
                    "f" | "false" | "n" | "no" | "off" | "0" => Some(false),
                    _ => None,
                };
                Some(b(value)?.cmp(&b(filter)?))
            }
            ValueKind::Uuid => Some(
                value
                    .to_ascii_lowercase()
                    .cmp(&filter.trim().to_ascii_lowercase()),
            ),
            ValueKind::Text => Some(value.cmp(filter)),
        }
    }
}

/// Whether a row passes every filter; `column` gives a column's type and value (`None`
/// for a column the row does not carry, which passes nothing).
pub fn passes<'a>(
    filters: &[Filter],
    column: impl Fn(&str) -> Option<(&'a str, Option<&'a str>)>,
) -> bool {
    filters
        .iter()
        .all(|f| column(&f.column).is_some_and(|(typname, value)| f.passes(typname, value)))
}

/// A value without its double quotes and escapes, when quoted.
fn unquote(v: &str) -> Result<String, FilterError> {
    let Some(inner) = v.strip_prefix('"') else {
        return Ok(v.to_owned());
    };
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e) => out.push(e),
                None => break,
            },
            '"' if chars.as_str().is_empty() => return Ok(out),
            '"' => break,
            c => out.push(c),
        }
    }
    Err(FilterError::Quote(v.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn f(column: &str, op: Op, values: &[&str], negate: bool) -> Filter {
        Filter {
            column: column.into(),
            op,
            values: values.iter().map(|v| v.to_string()).collect(),
            negate,
            pattern: None,
        }
    }

    #[test]
    fn filters_read_as_realtime_js_writes_them() {
        assert_eq!(parse("").unwrap(), vec![]);
        assert_eq!(parse("   ").unwrap(), vec![]);
        assert_eq!(
            parse("id=eq.5").unwrap(),
            vec![f("id", Op::Eq, &["5"], false)]
        );
        assert_eq!(
            parse("subject=in.(hidee,ho)").unwrap(),
            vec![f("subject", Op::In, &["hidee", "ho"], false)]
        );
        assert_eq!(
            parse("id=gt.0, id=lt.100").unwrap(),
            vec![
                f("id", Op::Gt, &["0"], false),
                f("id", Op::Lt, &["100"], false)
            ]
        );
        assert_eq!(
            parse("id=not.eq.5").unwrap(),
            vec![f("id", Op::Eq, &["5"], true)]
        );
        assert_eq!(
            parse(r#"name=eq."a,b",tag=in.("x,y",z)"#).unwrap(),
            vec![
                f("name", Op::Eq, &["a,b"], false),
                f("tag", Op::In, &["x,y", "z"], false)
            ]
        );
        assert_eq!(
            parse(r#"name=eq."say \"hi\"""#).unwrap(),
            vec![f("name", Op::Eq, &[r#"say "hi""#], false)]
        );
        assert_eq!(
            parse("v=lte.a.b").unwrap(),
            vec![f("v", Op::Lte, &["a.b"], false)]
        );
        for (op, o) in [("neq", Op::Neq), ("gte", Op::Gte)] {
            assert_eq!(parse(&format!("c={op}.1")).unwrap()[0].op, o);
        }
    }

    #[test]
    fn bad_filters_say_what_is_wrong() {
        assert_eq!(parse("id=eq.1,").unwrap_err(), FilterError::EmptySegment);
        assert_eq!(parse("id").unwrap_err(), FilterError::Shape("id".into()));
        assert_eq!(
            parse("=eq.1").unwrap_err(),
            FilterError::Shape("=eq.1".into())
        );
        assert_eq!(
            parse("id=between.1").unwrap_err(),
            FilterError::Operator("between".into())
        );
        assert_eq!(
            parse("id=is.maybe").unwrap_err(),
            FilterError::IsValue("maybe".into())
        );
        assert!(matches!(
            parse("name=match.(a"),
            Err(FilterError::Pattern(..))
        ));
        assert!(matches!(
            parse("name=match.a{1000}{1000}"),
            Err(FilterError::Pattern(..))
        ));
        assert_eq!(parse("id=in.1,2").unwrap_err(), FilterError::InList);
        assert!(matches!(parse(r#"n=eq."open"#), Err(FilterError::Quote(_))));
        let many = (0..101)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            parse(&format!("id=in.({many})")).unwrap_err(),
            FilterError::TooMany
        );
    }

    #[test]
    fn values_pass_filters_by_their_type() {
        let one = |text: &str| parse(text).unwrap().remove(0);
        assert!(one("id=eq.5").passes("int4", Some("5")));
        assert!(!one("id=eq.5").passes("int4", Some("50")));
        // Numbers as numbers, not text.
        assert!(one("id=gt.9").passes("int8", Some("10")));
        assert!(one("p=lt.10.5").passes("numeric", Some("9.75")));
        assert!(one("p=gte.2").passes("float8", Some("2.0")));
        assert!(!one("id=eq.abc").passes("int4", Some("1")));
        // Text by code point.
        assert!(one("name=gt.a").passes("text", Some("b")));
        assert!(one("name=lte.b").passes("varchar", Some("b")));
        assert!(one("done=eq.true").passes("bool", Some("t")));
        assert!(one("done=neq.true").passes("bool", Some("f")));
        assert!(one("u=eq.A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11")
            .passes("uuid", Some("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11")));
        assert!(one("id=in.(1,2,3)").passes("int4", Some("2")));
        assert!(!one("id=in.(1,2,3)").passes("int4", Some("4")));
        assert!(one("id=not.in.(1,2,3)").passes("int4", Some("4")));
        assert!(!one("id=not.eq.5").passes("int4", Some("5")));
        // NULL passes nothing, negated or not.
        assert!(!one("id=eq.5").passes("int4", None));
        assert!(!one("id=not.eq.5").passes("int4", None));
        let both = parse("id=gt.0,id=lt.10").unwrap();
        let row = |v: &'static str| move |c: &str| (c == "id").then_some(("int4", Some(v)));
        assert!(passes(&both, row("5")));
        assert!(!passes(&both, row("10")));
        // A column the row does not carry passes nothing.
        assert!(!passes(&parse("other=eq.1").unwrap(), row("1")));
        assert!(passes(&[], row("1")));
    }

    #[test]
    fn postgrest_s_pattern_and_null_operators_pass_as_in_sql() {
        let one = |text: &str| parse(text).unwrap().remove(0);
        assert!(one("name=like.ab%").passes("text", Some("abc")));
        assert!(one("name=like.*b*").passes("text", Some("abc")));
        assert!(!one("name=like.ab%").passes("text", Some("Abc")));
        assert!(one("name=ilike.ab%").passes("text", Some("ABC")));
        assert!(one("name=like.a_c").passes("text", Some("abc")));
        assert!(!one("name=like.a_c").passes("text", Some("abbc")));
        // Regular-expression characters in a LIKE pattern are plain; `\` escapes.
        assert!(one("name=like.a.c").passes("text", Some("a.c")));
        assert!(!one("name=like.a.c").passes("text", Some("abc")));
        assert!(one(r"name=like.100\%").passes("text", Some("100%")));
        assert!(!one(r"name=like.100\%").passes("text", Some("1000")));
        assert!(one("name=match.^a.c$").passes("text", Some("abc")));
        assert!(one("name=match.b").passes("text", Some("abc")));
        assert!(!one("name=match.B").passes("text", Some("abc")));
        assert!(one("name=imatch.B").passes("text", Some("abc")));
        assert!(one("name=not.like.x%").passes("text", Some("abc")));
        // NULL: LIKE and its kind answer NULL, negated or not; IS and IS DISTINCT never do.
        assert!(!one("name=like.%").passes("text", None));
        assert!(!one("name=not.like.x").passes("text", None));
        assert!(one("name=is.null").passes("text", None));
        assert!(!one("name=is.null").passes("text", Some("")));
        assert!(one("name=not.is.null").passes("text", Some("a")));
        assert!(one("done=is.true").passes("bool", Some("t")));
        assert!(!one("done=is.true").passes("bool", None));
        assert!(one("done=is.unknown").passes("bool", None));
        assert!(one("done=not.is.true").passes("bool", None));
        assert!(one("done=is.FALSE").passes("bool", Some("f")));
        assert!(!one("n=is.true").passes("int4", Some("1")));
        assert!(one("n=isdistinct.5").passes("int4", None));
        assert!(one("n=isdistinct.5").passes("int4", Some("6")));
        assert!(!one("n=isdistinct.5").passes("int4", Some("5")));
        assert!(one("n=not.isdistinct.5").passes("int4", Some("5")));
        assert!(one("n=isdistinct.null").passes("int4", Some("5")));
        assert!(!one("n=isdistinct.null").passes("int4", None));
    }

    proptest! {
        #[test]
        fn any_text_parses_or_fails_cleanly(s in ".{0,80}") {
            let _ = parse(&s);
        }
    }
}
