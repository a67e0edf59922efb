//! What an HTTP query asks for, read from Neon's headers and JSON body: who logs in (the
//! `Neon-Connection-String` header), the statements with their parameters, and how the
//! answer is shaped. Pure: no I/O, so every malformed input is unit-tested here.

use serde_json::Value;
use thiserror::Error;

/// The protocol's limit on a statement's parameters.
const MAX_PARAMS: usize = u16::MAX as usize;

/// Who logs in: the connection string's user, password, database and `application_name`.
#[derive(Debug, PartialEq, Eq)]
pub struct Login {
    pub user: String,
    pub password: String,
    pub database: String,
    pub application_name: Option<String>,
}

/// One statement and its parameters as text (`None`: NULL).
#[derive(Debug, PartialEq, Eq)]
pub struct Statement {
    pub text: String,
    pub params: Vec<Option<String>>,
}

/// The statements of one request: one statement runs in an implicit transaction of its own;
/// a batch (`{"queries": [...]}`) runs between `begin` and COMMIT, all or nothing.
#[derive(Debug, PartialEq, Eq)]
pub enum Work {
    One(Statement),
    Batch {
        begin: String,
        statements: Vec<Statement>,
    },
}

impl Work {
    pub fn statements(&self) -> &[Statement] {
        match self {
            Work::One(s) => std::slice::from_ref(s),
            Work::Batch { statements, .. } => statements,
        }
    }

    /// Whether every statement is plain DML or a query that leaves nothing in the session
    /// (`shoal_wire::sql::is_plain`, the analysis server hygiene uses), so the session can
    /// serve the next request as a fresh one would.
    pub fn leaves_session_clean(&self) -> bool {
        use shoal_wire::sql::{is_plain, FirstWord};
        self.statements().iter().all(|s| {
            let text = s.text.as_bytes();
            is_plain(FirstWord::of(text), text)
        })
    }
}

/// How rows come back: arrays (`Neon-Array-Mode`) or objects keyed by column name, and
/// every value as PostgreSQL's text (`Neon-Raw-Text-Output`, what the driver asks for) or
/// booleans, numbers and JSON as JSON.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shape {
    pub array_mode: bool,
    pub raw_text: bool,
}

/// Why a request cannot be run: each is the client's mistake, answered 400.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RequestError {
    #[error("the Neon-Connection-String header is missing: it carries postgresql://USER:PASSWORD@HOST/DATABASE")]
    NoConnectionString,
    #[error("the Neon-Connection-String header is not a connection string: {0}")]
    BadConnectionString(&'static str),
    #[error("the {header} header must be {expected}, not \"{value}\"")]
    BadHeader {
        header: &'static str,
        expected: &'static str,
        value: String,
    },
    #[error("the body is not the JSON of a query: {0}")]
    BadBody(String),
    #[error(
        "the Authorization header must be \"Bearer\" and a JWT (what the driver's authToken sends)"
    )]
    BadAuthorization,
}

/// The bearer token of an `Authorization` header (the driver's `authToken`), if one came.
/// A header of another form is refused rather than ignored: its author expects it to
/// decide what the query may see. Its value is never logged or echoed.
pub fn bearer(header: Option<&[u8]>) -> Result<Option<&str>, RequestError> {
    let Some(value) = header else {
        return Ok(None);
    };
    let value = std::str::from_utf8(value).map_err(|_| RequestError::BadAuthorization)?;
    let (scheme, token) = value
        .split_once(' ')
        .ok_or(RequestError::BadAuthorization)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(RequestError::BadAuthorization);
    }
    Ok(Some(token))
}

/// Reads the connection string: `postgres://` or `postgresql://`, a user, a database, the
/// password (empty when absent); percent-escapes decoded. Host and port are the driver's
/// business (they chose this endpoint), and parameters other than `application_name`
/// (`sslmode`, say) have no meaning past the front door.
pub fn login(connection_string: &str) -> Result<Login, RequestError> {
    use RequestError::BadConnectionString as Bad;
    let rest = connection_string
        .strip_prefix("postgresql://")
        .or_else(|| connection_string.strip_prefix("postgres://"))
        .ok_or(Bad("it must start with postgresql:// or postgres://"))?;
    let (authority_and_path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let (authority, path) = authority_and_path
        .split_once('/')
        .ok_or(Bad("it names no database (…/DATABASE)"))?;
    let (userinfo, _host) = authority
        .rsplit_once('@')
        .ok_or(Bad("it names no user (USER:PASSWORD@HOST)"))?;
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let decode = |s: &str, what: &'static str| -> Result<String, RequestError> {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|c| c.into_owned())
            .map_err(|_| Bad(what))
    };
    let user = decode(user, "its user is not UTF-8 once decoded")?;
    let password = decode(password, "its password is not UTF-8 once decoded")?;
    let database = decode(path, "its database is not UTF-8 once decoded")?;
    if user.is_empty() {
        return Err(Bad("it names no user (USER:PASSWORD@HOST)"));
    }
    if database.is_empty() {
        return Err(Bad("it names no database (…/DATABASE)"));
    }
    if [&user, &password, &database]
        .iter()
        .any(|s| s.contains('\0'))
    {
        return Err(Bad("it holds a NUL character"));
    }
    let application_name = form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "application_name")
        .map(|(_, v)| v.replace('\0', ""));
    Ok(Login {
        user,
        password,
        database,
        application_name,
    })
}

/// A header that is `true` or `false` (absent: false).
pub fn flag(header: &'static str, value: Option<&str>) -> Result<bool, RequestError> {
    match value.map(str::trim) {
        None => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("true") => Ok(true),
        Some(v) if v.eq_ignore_ascii_case("false") => Ok(false),
        Some(v) => Err(RequestError::BadHeader {
            header,
            expected: "true or false",
            value: v.to_owned(),
        }),
    }
}

/// The BEGIN a batch runs under, from `Neon-Batch-Isolation-Level`, `-Read-Only` and
/// `-Deferrable`.
pub fn begin(
    isolation: Option<&str>,
    read_only: Option<&str>,
    deferrable: Option<&str>,
) -> Result<String, RequestError> {
    let mut begin = String::from("BEGIN");
    if let Some(level) = isolation.map(str::trim) {
        let sql = match level {
            "Serializable" => "SERIALIZABLE",
            "RepeatableRead" => "REPEATABLE READ",
            "ReadCommitted" => "READ COMMITTED",
            "ReadUncommitted" => "READ UNCOMMITTED",
            other => {
                return Err(RequestError::BadHeader {
                    header: "Neon-Batch-Isolation-Level",
                    expected: "Serializable, RepeatableRead, ReadCommitted or ReadUncommitted",
                    value: other.to_owned(),
                })
            }
        };
        begin.push_str(" ISOLATION LEVEL ");
        begin.push_str(sql);
    }
    if flag("Neon-Batch-Read-Only", read_only)? {
        begin.push_str(" READ ONLY");
    }
    if flag("Neon-Batch-Deferrable", deferrable)? {
        begin.push_str(" DEFERRABLE");
    }
    Ok(begin)
}

/// Reads the body: `{"query": TEXT, "params": [...]}` or `{"queries": [those]}`.
pub fn work(body: &[u8], begin: String) -> Result<Work, RequestError> {
    let bad = |m: &str| RequestError::BadBody(m.to_owned());
    let value: Value =
        serde_json::from_slice(body).map_err(|e| RequestError::BadBody(e.to_string()))?;
    let Value::Object(mut body) = value else {
        return Err(bad("it must be an object with \"query\" or \"queries\""));
    };
    match body.remove("queries") {
        Some(Value::Array(queries)) => {
            if queries.is_empty() {
                return Err(bad("\"queries\" is empty"));
            }
            let statements = queries
                .into_iter()
                .map(|q| match q {
                    Value::Object(q) => statement(q),
                    _ => Err(bad("each of \"queries\" must be an object with \"query\"")),
                })
                .collect::<Result<_, _>>()?;
            Ok(Work::Batch { begin, statements })
        }
        Some(_) => Err(bad("\"queries\" must be an array")),
        None => statement(body).map(Work::One),
    }
}

fn statement(mut q: serde_json::Map<String, Value>) -> Result<Statement, RequestError> {
    let bad = |m: &str| RequestError::BadBody(m.to_owned());
    let text = match q.remove("query") {
        Some(Value::String(t)) => t,
        Some(_) => return Err(bad("\"query\" must be a string")),
        None => return Err(bad("a query has no \"query\"")),
    };
    if text.contains('\0') {
        return Err(bad("a query holds a NUL character"));
    }
    let params = match q.remove("params") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ps)) => ps.into_iter().map(param).collect(),
        Some(_) => return Err(bad("\"params\" must be an array")),
    };
    if params.len() > MAX_PARAMS {
        return Err(bad("a query has more than 65,535 parameters"));
    }
    Ok(Statement { text, params })
}

/// A parameter as PostgreSQL's text: strings as they are, numbers and booleans as written,
/// arrays as array literals, objects as JSON.
fn param(v: Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s),
        Value::Array(items) => {
            let mut out = String::new();
            array_literal(&items, &mut out);
            Some(out)
        }
        other => Some(other.to_string()),
    }
}

fn array_literal(items: &[Value], out: &mut String) {
    out.push('{');
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        match item {
            Value::Null => out.push_str("NULL"),
            Value::Array(inner) => array_literal(inner, out),
            Value::String(s) => quoted(s, out),
            other => quoted(&other.to_string(), out),
        }
    }
    out.push('}');
}

fn quoted(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens() {
        assert_eq!(bearer(None), Ok(None));
        assert_eq!(bearer(Some(b"Bearer eyJ.a.b")), Ok(Some("eyJ.a.b")));
        assert_eq!(bearer(Some(b"bearer  eyJ.a.b ")), Ok(Some("eyJ.a.b")));
        for bad in [
            &b"Basic dXNlcjpwdw=="[..],
            b"Bearer",
            b"Bearer ",
            b"eyJ.a.b",
            b"\xff x",
        ] {
            let e = bearer(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("authToken") && !e.contains("dXNl"), "{e}");
        }
    }

    #[test]
    fn connection_strings() {
        let l = login(
            "postgresql://app%40x:p%3Ass@db.example.com:5432/my%20db?sslmode=require&application_name=pkg%3Anpm%2F%40neondatabase+x",
        )
        .unwrap();
        assert_eq!(l.user, "app@x");
        assert_eq!(l.password, "p:ss");
        assert_eq!(l.database, "my db");
        assert_eq!(
            l.application_name.as_deref(),
            Some("pkg:npm/@neondatabase x")
        );
        let l = login("postgres://u@h/d").unwrap();
        assert_eq!((l.password.as_str(), l.application_name), ("", None));
        // The password may hold '@' unescaped: the host is after the last one.
        assert_eq!(login("postgres://u:a@b@h/d").unwrap().password, "a@b");
        for bad in [
            "mysql://u:p@h/d",
            "postgres://u:p@h",
            "postgres://u:p@h/",
            "postgres://h/d",
            "postgres://:p@h/d",
            "postgres://u:%ff@h/d",
            "postgres://u:p%00@h/d",
        ] {
            assert!(
                matches!(login(bad), Err(RequestError::BadConnectionString(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn clean_sessions() {
        let one = |sql: &str| {
            Work::One(Statement {
                text: sql.into(),
                params: vec![],
            })
        };
        assert!(one("SELECT $1::int").leaves_session_clean());
        assert!(one("INSERT INTO t VALUES (1) RETURNING id").leaves_session_clean());
        for dirty in [
            "SET search_path = x",
            "SELECT set_config('search_path', 'x', false)",
            "CREATE TEMP TABLE t (i int)",
            "SELECT pg_advisory_lock(1)",
            "LISTEN c",
            "PREPARE p AS SELECT 1",
        ] {
            assert!(!one(dirty).leaves_session_clean(), "{dirty}");
        }
    }

    #[test]
    fn batch_headers() {
        assert_eq!(begin(None, None, None).unwrap(), "BEGIN");
        assert_eq!(
            begin(Some("Serializable"), Some("true"), Some("TRUE")).unwrap(),
            "BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY DEFERRABLE"
        );
        assert_eq!(
            begin(Some("ReadCommitted"), Some("false"), None).unwrap(),
            "BEGIN ISOLATION LEVEL READ COMMITTED"
        );
        assert!(begin(Some("serializable; DROP TABLE x"), None, None).is_err());
        assert!(begin(None, Some("yes"), None).is_err());
    }

    #[test]
    fn bodies() {
        let w = work(
            br#"{"query":"SELECT $1, $2, $3, $4, $5, $6","params":["a",null,1,true,[1,"x\"y",null,[2]],{"k":1}]}"#,
            "BEGIN".into(),
        )
        .unwrap();
        let Work::One(s) = w else { panic!() };
        assert_eq!(s.text, "SELECT $1, $2, $3, $4, $5, $6");
        assert_eq!(
            s.params,
            vec![
                Some("a".into()),
                None,
                Some("1".into()),
                Some("true".into()),
                Some(r#"{"1","x\"y",NULL,{"2"}}"#.into()),
                Some(r#"{"k":1}"#.into()),
            ]
        );
        let w = work(
            br#"{"queries":[{"query":"SELECT 1"},{"query":"SELECT $1","params":["2"]}]}"#,
            "BEGIN READ ONLY".into(),
        )
        .unwrap();
        let Work::Batch { begin, statements } = w else {
            panic!()
        };
        assert_eq!((begin.as_str(), statements.len()), ("BEGIN READ ONLY", 2));
        for bad in [
            &b"not json"[..],
            b"[1]",
            br#"{"params":[]}"#,
            br#"{"query":1}"#,
            br#"{"query":"SELECT 1","params":"x"}"#,
            br#"{"queries":[]}"#,
            br#"{"queries":{}}"#,
            br#"{"queries":[1]}"#,
            br#"{"query":"SELECT \u0000"}"#,
        ] {
            assert!(
                matches!(work(bad, "BEGIN".into()), Err(RequestError::BadBody(_))),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
