//! Turns the session's answer to an HTTP query into Neon's JSON, message by message, as
//! the rows arrive (no row is held twice): per statement `fields` (with type OIDs), `rows`,
//! `command`, `rowCount`, `rowAsArray`; a batch's as `{"results": [...]}`; an error as an
//! object of PostgreSQL's error fields under the names the driver reads. Pure: frames in,
//! bytes out.

use serde_json::Value;
use shoal_wire::backend::{self, tag};
use shoal_wire::frame::FrameError;

use super::request::Shape;

/// What the exchange must do after a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    More,
    /// ReadyForQuery, with its transaction status.
    Ready(u8),
    /// The statement is `COPY … FROM STDIN`, which HTTP cannot feed: send CopyFail.
    CopyIn,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AnswerError {
    #[error("the answer would exceed [serverless] max_response_size ({0} bytes)")]
    TooLarge(usize),
    #[error("the session sent a malformed message: {0}")]
    Malformed(#[from] FrameError),
}

/// Builds the JSON answer of one request.
pub struct Answer {
    shape: Shape,
    limit: usize,
    /// A batch: its results go in a list.
    batch: bool,
    /// Statements whose answers are not shown, at the start (a batch's BEGIN, a bearer
    /// token's claims) and at the end (a batch's COMMIT).
    hidden_first: usize,
    hidden_last: usize,
    /// Statements sent, the hidden ones included.
    statements: usize,
    /// Statements answered so far.
    done: usize,
    /// The results written so far.
    out: Vec<u8>,
    /// The current result's column names as JSON strings (objects mode) and type OIDs.
    names: Vec<Vec<u8>>,
    types: Vec<u32>,
    rows: u64,
    in_result: bool,
    error: Option<Vec<u8>>,
}

impl Answer {
    pub fn new(shape: Shape, limit: usize, batch: bool, statements: usize) -> Answer {
        let mut out = Vec::with_capacity(256);
        if batch {
            out.extend_from_slice(br#"{"results":["#);
        }
        Answer {
            shape,
            limit,
            batch,
            hidden_first: batch as usize,
            hidden_last: batch as usize,
            statements,
            done: 0,
            out,
            names: Vec::new(),
            types: Vec::new(),
            rows: 0,
            in_result: false,
            error: None,
        }
    }

    /// One more statement, before the shown ones, whose answer is not shown (counted in
    /// `statements` given to [`Answer::new`]).
    pub fn after_preamble(mut self) -> Answer {
        self.hidden_first += 1;
        self
    }

    fn shown(&self) -> bool {
        self.done >= self.hidden_first && self.done + self.hidden_last < self.statements
    }

    /// Takes one message of the session's answer.
    pub fn take(&mut self, tag: u8, body: &[u8]) -> Result<Step, AnswerError> {
        match tag {
            tag::ROW_DESCRIPTION | tag::NO_DATA if self.in_result => {
                return Err(
                    FrameError::Malformed("a second description before the result ended").into(),
                )
            }
            // One statement, one result: a second would glue two JSON objects together.
            tag::ROW_DESCRIPTION | tag::NO_DATA if !self.batch && !self.out.is_empty() => {
                return Err(FrameError::Malformed("a second result for one statement").into())
            }
            tag::ROW_DESCRIPTION => {
                let fields = backend::parse_row_description(body)?;
                self.begin_result(&fields);
            }
            tag::NO_DATA => self.begin_result(&[]),
            tag::DATA_ROW if self.in_result => self.row(body)?,
            tag::COMMAND_COMPLETE => {
                let text = body.strip_suffix(b"\0").unwrap_or(body);
                self.end_result(&String::from_utf8_lossy(text));
            }
            tag::EMPTY_QUERY_RESPONSE => self.end_result(""),
            tag::ERROR_RESPONSE if self.error.is_none() => {
                self.error = Some(error_json(body)?);
                self.in_result = false;
            }
            tag::COPY_IN_RESPONSE => return Ok(Step::CopyIn),
            tag::READY_FOR_QUERY => return Ok(Step::Ready(body.first().copied().unwrap_or(b'I'))),
            // ParseComplete, BindComplete, notices, parameter changes, notifications,
            // a COPY TO STDOUT's data: nothing to show.
            _ => {}
        }
        if self.out.len() > self.limit {
            return Err(AnswerError::TooLarge(self.limit));
        }
        Ok(Step::More)
    }

    fn begin_result(&mut self, fields: &[backend::FieldDescription<'_>]) {
        self.in_result = self.shown();
        if !self.in_result {
            return;
        }
        if self.batch && self.done > self.hidden_first {
            self.out.push(b',');
        }
        self.out.extend_from_slice(br#"{"fields":["#);
        self.names.clear();
        self.types.clear();
        for (i, f) in fields.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            let mut name = Vec::with_capacity(f.name.len() + 2);
            json_string(&mut name, f.name);
            self.out.extend_from_slice(br#"{"name":"#);
            self.out.extend_from_slice(&name);
            let format = if f.format == 0 { "text" } else { "binary" };
            self.out.extend_from_slice(
                format!(
                    r#","tableID":{},"columnID":{},"dataTypeID":{},"dataTypeSize":{},"dataTypeModifier":{},"format":"{format}"}}"#,
                    f.table_oid, f.column, f.type_oid, f.type_size, f.type_modifier
                )
                .as_bytes(),
            );
            self.names.push(name);
            self.types.push(f.type_oid);
        }
        self.out.extend_from_slice(br#"],"rows":["#);
        self.rows = 0;
    }

    fn row(&mut self, body: &[u8]) -> Result<(), AnswerError> {
        if self.rows > 0 {
            self.out.push(b',');
        }
        self.rows += 1;
        let (open, close) = if self.shape.array_mode {
            (b'[', b']')
        } else {
            (b'{', b'}')
        };
        self.out.push(open);
        let mut i = 0;
        let (out, names, types, shape) = (&mut self.out, &self.names, &self.types, self.shape);
        backend::for_each_value(body, |v| {
            if i > 0 {
                out.push(b',');
            }
            if !shape.array_mode {
                if let Some(name) = names.get(i) {
                    out.extend_from_slice(name);
                    out.push(b':');
                }
            }
            value(out, v, types.get(i).copied().unwrap_or(0), shape.raw_text);
            i += 1;
        })?;
        self.out.push(close);
        Ok(())
    }

    fn end_result(&mut self, command_tag: &str) {
        if !self.in_result {
            // No Describe answer came (a batch's BEGIN, or an error before it).
            self.done += 1;
            return;
        }
        let (command, count) = command_and_count(command_tag);
        self.out.extend_from_slice(br#"],"command":"#);
        json_string(&mut self.out, command.as_bytes());
        self.out.extend_from_slice(br#","rowCount":"#);
        match count {
            Some(n) => self.out.extend_from_slice(n.to_string().as_bytes()),
            None => self.out.extend_from_slice(b"null"),
        }
        self.out.extend_from_slice(if self.shape.array_mode {
            br#","rowAsArray":true}"#
        } else {
            br#","rowAsArray":false}"#
        });
        self.in_result = false;
        self.done += 1;
    }

    /// The first error, as the JSON object to answer with.
    pub fn error(&self) -> Option<&[u8]> {
        self.error.as_deref()
    }

    /// The whole answer, once ReadyForQuery came without an error; an error if the
    /// messages did not make one (a result begun and not ended, or none at all).
    pub fn finish(mut self) -> Result<Vec<u8>, AnswerError> {
        if self.in_result || (!self.batch && self.out.is_empty()) {
            return Err(FrameError::Malformed("the answer holds no complete result").into());
        }
        if self.batch {
            self.out.extend_from_slice(b"]}");
        }
        Ok(self.out)
    }
}

/// `INSERT 0 5` → ("INSERT", 5); `CREATE TABLE` → ("CREATE", none), as node-postgres reads
/// a command tag.
fn command_and_count(tag: &str) -> (&str, Option<u64>) {
    let command = tag.split(' ').next().unwrap_or("");
    let count = tag
        .rsplit(' ')
        .next()
        .filter(|_| tag.contains(' '))
        .and_then(|n| n.parse().ok());
    (command, count)
}

fn value(out: &mut Vec<u8>, v: Option<&[u8]>, type_oid: u32, raw_text: bool) {
    let Some(v) = v else {
        out.extend_from_slice(b"null");
        return;
    };
    if !raw_text {
        if let Some(t) = super::values::typed(v, type_oid) {
            // Writing a Value to a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *out, &t);
            return;
        }
    }
    json_string(out, v);
}

/// `s` (UTF-8, the session's client encoding; anything else replaced) as a JSON string.
fn json_string(out: &mut Vec<u8>, s: &[u8]) {
    let text = String::from_utf8_lossy(s);
    let _ = serde_json::to_writer(&mut *out, text.as_ref());
}

/// An ErrorResponse as the driver's `NeonDbError` fields.
pub(super) fn error_json(body: &[u8]) -> Result<Vec<u8>, FrameError> {
    let mut map = serde_json::Map::new();
    for (field, v) in backend::error_fields(body)? {
        let name = match field {
            b'M' => "message",
            b'S' => "severity",
            b'C' => "code",
            b'D' => "detail",
            b'H' => "hint",
            b'P' => "position",
            b'p' => "internalPosition",
            b'q' => "internalQuery",
            b'W' => "where",
            b's' => "schema",
            b't' => "table",
            b'c' => "column",
            b'd' => "dataType",
            b'n' => "constraint",
            b'F' => "file",
            b'L' => "line",
            b'R' => "routine",
            _ => continue,
        };
        map.insert(
            name.into(),
            Value::String(String::from_utf8_lossy(v).into_owned()),
        );
    }
    Ok(serde_json::to_vec(&Value::Object(map)).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use shoal_wire::backend::{put_cstr, put_message};

    fn row_description(fields: &[(&str, u32)]) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_i16(fields.len() as i16);
        for (name, oid) in fields {
            put_cstr(&mut b, name);
            b.put_i32(0);
            b.put_i16(0);
            b.put_u32(*oid);
            b.put_i16(-1);
            b.put_i32(-1);
            b.put_i16(0);
        }
        b
    }

    fn data_row(values: &[Option<&str>]) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_i16(values.len() as i16);
        for v in values {
            match v {
                Some(v) => {
                    b.put_i32(v.len() as i32);
                    b.put_slice(v.as_bytes());
                }
                None => b.put_i32(-1),
            }
        }
        b
    }

    fn cstr(s: &str) -> Vec<u8> {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        v
    }

    fn select(a: &mut Answer) {
        let fields = row_description(&[("n", 23), ("b", 16), ("j", 3802)]);
        assert_eq!(a.take(b'1', b"").unwrap(), Step::More);
        a.take(b'2', b"").unwrap();
        a.take(b'T', &fields).unwrap();
        a.take(
            b'D',
            &data_row(&[Some("1"), Some("t"), Some(r#"{"a": [1]}"#)]),
        )
        .unwrap();
        a.take(b'D', &data_row(&[None, Some("f"), Some("\"q\\\"\"")]))
            .unwrap();
        a.take(b'C', &cstr("SELECT 2")).unwrap();
    }

    #[test]
    fn one_statement_as_arrays_of_text() {
        let shape = Shape {
            array_mode: true,
            raw_text: true,
        };
        let mut a = Answer::new(shape, 1 << 20, false, 1);
        select(&mut a);
        assert_eq!(a.take(b'Z', b"I").unwrap(), Step::Ready(b'I'));
        let v: Value = serde_json::from_slice(&a.finish().unwrap()).unwrap();
        assert_eq!(v["command"], "SELECT");
        assert_eq!(v["rowCount"], 2);
        assert_eq!(v["rowAsArray"], true);
        assert_eq!(v["fields"][1]["name"], "b");
        assert_eq!(v["fields"][1]["dataTypeID"], 16);
        assert_eq!(
            v["rows"],
            serde_json::json!([["1", "t", "{\"a\": [1]}"], [null, "f", "\"q\\\"\""]])
        );
    }

    #[test]
    fn objects_with_json_values() {
        let mut a = Answer::new(Shape::default(), 1 << 20, false, 1);
        select(&mut a);
        let v: Value = serde_json::from_slice(&a.finish().unwrap()).unwrap();
        assert_eq!(
            v["rows"],
            serde_json::json!([{"n": 1, "b": true, "j": {"a": [1]}}, {"n": null, "b": false, "j": "q\""}])
        );
    }

    #[test]
    fn a_batch_hides_its_begin_and_commit() {
        let shape = Shape {
            array_mode: true,
            raw_text: true,
        };
        let mut a = Answer::new(shape, 1 << 20, true, 4);
        a.take(b'C', &cstr("BEGIN")).unwrap();
        select(&mut a);
        a.take(b'n', b"").unwrap();
        a.take(b'C', &cstr("INSERT 0 3")).unwrap();
        a.take(b'C', &cstr("COMMIT")).unwrap();
        a.take(b'Z', b"I").unwrap();
        let v: Value = serde_json::from_slice(&a.finish().unwrap()).unwrap();
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), 2);
        assert_eq!(results[1]["command"], "INSERT");
        assert_eq!(results[1]["rowCount"], 3);
        assert_eq!(results[1]["fields"], serde_json::json!([]));
    }

    /// A bearer token's claims statement (sent without Describe) shows in neither a
    /// one-shot answer nor a batch's.
    #[test]
    fn a_preamble_is_hidden() {
        for batch in [false, true] {
            let statements = if batch { 4 } else { 2 };
            let mut a = Answer::new(Shape::default(), 1 << 20, batch, statements).after_preamble();
            if batch {
                a.take(b'C', &cstr("BEGIN")).unwrap();
            }
            a.take(b'1', b"").unwrap();
            a.take(b'2', b"").unwrap();
            a.take(b'D', &data_row(&[Some("reader"), Some("{}")]))
                .unwrap();
            a.take(b'C', &cstr("SELECT 1")).unwrap();
            select(&mut a);
            if batch {
                a.take(b'C', &cstr("COMMIT")).unwrap();
            }
            a.take(b'Z', b"I").unwrap();
            let v: Value = serde_json::from_slice(&a.finish().unwrap()).unwrap();
            let result = if batch {
                let results = v["results"].as_array().unwrap();
                assert_eq!(results.len(), 1, "{v}");
                results[0].clone()
            } else {
                v
            };
            assert_eq!(result["rowCount"], 2, "{result}");
            assert!(!result.to_string().contains("reader"), "{result}");
        }
    }

    #[test]
    fn errors_keep_postgresql_fields() {
        let mut a = Answer::new(Shape::default(), 1 << 20, true, 3);
        a.take(b'C', &cstr("BEGIN")).unwrap();
        let mut e = BytesMut::new();
        put_message(&mut e, b'E', |b| {
            for (f, v) in [
                (b'S', "ERROR"),
                (b'C', "42601"),
                (b'M', "syntax"),
                (b'P', "8"),
            ] {
                b.put_u8(f);
                put_cstr(b, v);
            }
            b.put_u8(0);
        });
        a.take(b'E', &e[5..]).unwrap();
        assert_eq!(a.take(b'Z', b"E").unwrap(), Step::Ready(b'E'));
        let v: Value = serde_json::from_slice(a.error().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"severity": "ERROR", "code": "42601", "message": "syntax", "position": "8"})
        );
    }

    #[test]
    fn a_large_answer_stops() {
        let mut a = Answer::new(Shape::default(), 300, false, 1);
        a.take(b'T', &row_description(&[("t", 25)])).unwrap();
        let big = "x".repeat(100);
        assert_eq!(a.take(b'D', &data_row(&[Some(&big)])), Ok(Step::More));
        assert_eq!(
            a.take(b'D', &data_row(&[Some(&big)])),
            Err(AnswerError::TooLarge(300))
        );
    }

    #[test]
    fn a_second_result_for_one_statement_is_malformed() {
        let mut a = Answer::new(Shape::default(), 1 << 20, false, 1);
        a.take(b'n', b"").unwrap();
        a.take(b'C', &cstr("SELECT 0")).unwrap();
        assert!(matches!(
            a.take(b'T', &row_description(&[("t", 25)])),
            Err(AnswerError::Malformed(_))
        ));
    }

    #[test]
    fn command_tags() {
        assert_eq!(command_and_count("INSERT 0 5"), ("INSERT", Some(5)));
        assert_eq!(command_and_count("SELECT 1"), ("SELECT", Some(1)));
        assert_eq!(command_and_count("CREATE TABLE"), ("CREATE", None));
        assert_eq!(command_and_count("BEGIN"), ("BEGIN", None));
        assert_eq!(command_and_count(""), ("", None));
    }

    use proptest::prelude::*;

    proptest! {
        /// Any messages at all, in any order: never a panic, and an answer that finishes
        /// is JSON.
        #[test]
        fn any_messages_give_json_or_an_error(
            batch in any::<bool>(),
            shape in (any::<bool>(), any::<bool>()),
            steps in proptest::collection::vec(
                (proptest::sample::select(&b"12TnDCIEZGNSAs"[..]), proptest::collection::vec(any::<u8>(), 0..40)),
                0..40,
            ),
        ) {
            let shape = Shape { array_mode: shape.0, raw_text: shape.1 };
            let mut a = Answer::new(shape, 1 << 16, batch, 3);
            let mut ready = false;
            for (tag, body) in &steps {
                match a.take(*tag, body) {
                    Ok(Step::Ready(_)) => ready = true,
                    Ok(_) => ready = false,
                    Err(_) => {
                        ready = false;
                        break;
                    }
                }
            }
            if let Some(e) = a.error() {
                prop_assert!(serde_json::from_slice::<Value>(e).is_ok());
            } else if ready {
                // What the exchange answers with, after ReadyForQuery: JSON, or an error.
                if let Ok(out) = a.finish() {
                    prop_assert!(
                        serde_json::from_slice::<Value>(&out).is_ok(),
                        "{}", String::from_utf8_lossy(&out)
                    );
                }
            }
        }

        /// Well-formed answers of any text: the JSON holds every row and value as sent.
        #[test]
        fn rows_round_trip(
            names in proptest::collection::vec("[^\\x00]{0,8}", 1..4),
            rows in proptest::collection::vec(proptest::collection::vec(proptest::option::of("[^\\x00]{0,12}"), 4), 0..6),
        ) {
            let shape = Shape { array_mode: true, raw_text: true };
            let mut a = Answer::new(shape, 1 << 20, false, 1);
            let fields: Vec<(&str, u32)> = names.iter().map(|n| (n.as_str(), 25)).collect();
            a.take(b'T', &row_description(&fields)).unwrap();
            for r in &rows {
                let values: Vec<Option<&str>> = r[..names.len()].iter().map(|v| v.as_deref()).collect();
                a.take(b'D', &data_row(&values)).unwrap();
            }
            a.take(b'C', &cstr(&format!("SELECT {}", rows.len()))).unwrap();
            prop_assert_eq!(a.take(b'Z', b"I").unwrap(), Step::Ready(b'I'));
            let v: Value = serde_json::from_slice(&a.finish().unwrap()).unwrap();
            prop_assert_eq!(v["rowCount"].as_u64(), Some(rows.len() as u64));
            for (i, r) in rows.iter().enumerate() {
                for (j, cell) in r[..names.len()].iter().enumerate() {
                    let got = &v["rows"][i][j];
                    match cell {
                        Some(text) => prop_assert_eq!(got.as_str(), Some(text.as_str())),
                        None => prop_assert!(got.is_null()),
                    }
                }
            }
        }
    }

    #[test]
    fn malformed_rows_are_errors_not_panics() {
        let mut a = Answer::new(Shape::default(), 1 << 20, false, 1);
        a.take(b'T', &row_description(&[("t", 25)])).unwrap();
        assert!(a.take(b'D', &[0, 1, 0, 0, 0, 9, b'x']).is_err());
        assert!(a.take(b'T', &[0, 5]).is_err());
    }
}
