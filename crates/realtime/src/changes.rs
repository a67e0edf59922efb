//! A Postgres Changes message as realtime-js reads it: event `postgres_changes`, payload
//! `{"ids": [binding ids], "data": {schema, table, commit_timestamp, type, columns, record,
//! old_record, errors}}`, the values rendered by [`crate::render`] from a change's tuples.
//!
//! As Supabase Realtime: `record` for INSERT and UPDATE, `old_record` for UPDATE and DELETE
//! (what the table's replica identity keeps: the primary key unless `REPLICA IDENTITY
//! FULL`), and a column whose value the WAL left out (an unchanged TOASTed value) taken from
//! the old tuple when it has it, else left out.
//!
//! Pure.

use crate::render::render;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Insert,
    Update,
    Delete,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Insert => "INSERT",
            Kind::Update => "UPDATE",
            Kind::Delete => "DELETE",
        }
    }
}

/// A column of the changed table: its name and its type's name (`pg_type.typname`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub typname: String,
}

/// One value of a tuple, as `pgoutput` sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cell<'a> {
    Null,
    Text(&'a str),
    /// A value the WAL does not carry: an unchanged TOASTed value, or a column outside the
    /// key of a key-only old tuple.
    Unchanged,
}

/// One change of one table.
#[derive(Debug, Clone)]
pub struct Change<'a> {
    pub schema: &'a str,
    pub table: &'a str,
    pub kind: Kind,
    /// The transaction's commit time, in microseconds since 2000-01-01 UTC (as `pgoutput`
    /// sends it).
    pub commit_time: i64,
    pub columns: &'a [Column],
    /// The new tuple (INSERT, UPDATE); empty for DELETE.
    pub new: &'a [Cell<'a>],
    /// The old tuple, or its key (UPDATE with an old tuple, DELETE); empty if none.
    pub old: &'a [Cell<'a>],
}

/// The payload of the `postgres_changes` message for the bindings `ids`.
pub fn payload(ids: &[u64], c: &Change<'_>) -> String {
    let mut out = String::with_capacity(256);
    out.push_str("{\"ids\":[");
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&id.to_string());
    }
    out.push_str("],\"data\":{\"schema\":");
    out.push_str(&json_string(c.schema));
    out.push_str(",\"table\":");
    out.push_str(&json_string(c.table));
    out.push_str(",\"commit_timestamp\":\"");
    out.push_str(&commit_timestamp(c.commit_time));
    out.push_str("\",\"type\":\"");
    out.push_str(c.kind.as_str());
    out.push_str("\",\"columns\":[");
    for (i, col) in c.columns.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"name\":");
        out.push_str(&json_string(&col.name));
        out.push_str(",\"type\":");
        out.push_str(&json_string(&col.typname));
        out.push('}');
    }
    out.push(']');
    if matches!(c.kind, Kind::Insert | Kind::Update) {
        out.push_str(",\"record\":");
        record(&mut out, c.columns, c.new, c.old);
    }
    if matches!(c.kind, Kind::Update | Kind::Delete) {
        out.push_str(",\"old_record\":");
        record(&mut out, c.columns, c.old, &[]);
    }
    out.push_str(",\"errors\":null}}");
    out
}

/// `{column: value}` of `cells`, an unchanged value taken from `fallback` when it has one.
fn record(out: &mut String, columns: &[Column], cells: &[Cell<'_>], fallback: &[Cell<'_>]) {
    out.push('{');
    let mut first = true;
    for (i, (col, cell)) in columns.iter().zip(cells).enumerate() {
        let cell = match cell {
            Cell::Unchanged => match fallback.get(i) {
                Some(c @ (Cell::Text(_) | Cell::Null)) => *c,
                _ => continue,
            },
            c => *c,
        };
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&json_string(&col.name));
        out.push(':');
        match cell {
            Cell::Text(t) => out.push_str(&render(&col.typname, t)),
            _ => out.push_str("null"),
        }
    }
    out.push('}');
}

fn json_string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

/// Microseconds since 2000-01-01 UTC as Realtime writes commit times:
/// `2024-01-02T03:04:05.678Z` (milliseconds, UTC).
pub fn commit_timestamp(us_since_2000: i64) -> String {
    // 2000-01-01 is 10,957 days after 1970-01-01.
    let ms = us_since_2000.div_euclid(1000);
    let days = ms.div_euclid(86_400_000) + 10_957;
    let ms_of_day = ms.rem_euclid(86_400_000);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1000 % 60,
        ms_of_day % 1000
    )
}

/// The Gregorian date `days` after 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cols() -> Vec<Column> {
        [("id", "int4"), ("body", "text"), ("tags", "_text")]
            .iter()
            .map(|(n, t)| Column {
                name: n.to_string(),
                typname: t.to_string(),
            })
            .collect()
    }

    #[test]
    fn commit_times_are_utc_milliseconds() {
        assert_eq!(commit_timestamp(0), "2000-01-01T00:00:00.000Z");
        // 2024-02-29 12:34:56.789123 UTC.
        let us = (8825 * 86_400 + 12 * 3600 + 34 * 60 + 56) * 1_000_000 + 789_123;
        assert_eq!(commit_timestamp(us), "2024-02-29T12:34:56.789Z");
        assert_eq!(commit_timestamp(-1), "1999-12-31T23:59:59.999Z");
    }

    #[test]
    fn changes_carry_what_realtime_js_reads() {
        let columns = cols();
        let new = [
            Cell::Text("7"),
            Cell::Text("hi \"you\""),
            Cell::Text("{a,b}"),
        ];
        let insert = Change {
            schema: "public",
            table: "notes",
            kind: Kind::Insert,
            commit_time: 0,
            columns: &columns,
            new: &new,
            old: &[],
        };
        let v: serde_json::Value = serde_json::from_str(&payload(&[3, 9], &insert)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"ids": [3, 9], "data": {
                "schema": "public", "table": "notes",
                "commit_timestamp": "2000-01-01T00:00:00.000Z", "type": "INSERT",
                "columns": [{"name": "id", "type": "int4"}, {"name": "body", "type": "text"},
                            {"name": "tags", "type": "_text"}],
                "record": {"id": 7, "body": "hi \"you\"", "tags": ["a", "b"]},
                "errors": null}})
        );
        // An UPDATE whose body was an unchanged TOAST value: from the old tuple if it has it.
        let new = [Cell::Text("7"), Cell::Unchanged, Cell::Null];
        let key = [Cell::Text("7"), Cell::Unchanged, Cell::Unchanged];
        let update = Change {
            kind: Kind::Update,
            new: &new,
            old: &key,
            ..insert.clone()
        };
        let v: serde_json::Value = serde_json::from_str(&payload(&[1], &update)).unwrap();
        assert_eq!(
            v["data"]["record"],
            serde_json::json!({"id": 7, "tags": null})
        );
        let full_old = [Cell::Text("7"), Cell::Text("long"), Cell::Null];
        let update = Change {
            old: &full_old,
            ..update
        };
        let v: serde_json::Value = serde_json::from_str(&payload(&[1], &update)).unwrap();
        assert_eq!(v["data"]["record"]["body"], "long");
        assert_eq!(v["data"]["old_record"]["body"], "long");
        let delete = Change {
            kind: Kind::Delete,
            new: &[],
            old: &key,
            ..insert
        };
        let v: serde_json::Value = serde_json::from_str(&payload(&[1], &delete)).unwrap();
        assert!(v["data"].get("record").is_none());
        assert_eq!(
            v["data"]["old_record"],
            serde_json::json!({"id": 7}),
            "the key only"
        );
    }
}

/// A channel's `postgres_changes` binding as realtime-js sends it in the join config:
/// `{"event": "*" | "INSERT" | "UPDATE" | "DELETE", "schema": "public", "table": "notes",
/// "filter": "id=eq.5", "select": ["id", "title"]}` (`table`, `filter` and `select`
/// optional; `schema` `*` or a table `*` for every one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// `None`: every kind of change.
    pub event: Option<Kind>,
    pub schema: String,
    /// `None`: every table of the schema.
    pub table: Option<String>,
    /// The filter as sent (echoed in the join reply), and read.
    pub filter_text: Option<String>,
    pub filters: Vec<crate::filter::Filter>,
    /// Only these columns (and the primary key) are sent; `None`: every column.
    pub select: Option<Vec<String>>,
    /// `select` as sent (echoed in the join reply).
    select_sent: Option<serde_json::Value>,
}

/// Why a binding cannot be served; the join is refused with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BindingError {
    #[error("Invalid value for postgres_changes event: {0:?} (one of *, INSERT, UPDATE, DELETE)")]
    Event(String),
    #[error("postgres_changes binding is not an object with event, schema, table and filter")]
    Shape,
    #[error("Error parsing `filter` params: {0}")]
    Filter(#[from] crate::filter::FilterError),
    #[error("postgres_changes `select` is a list of column names")]
    Select,
}

impl Binding {
    /// Reads one binding of a join's `postgres_changes` list.
    pub fn parse(v: &serde_json::Value) -> Result<Binding, BindingError> {
        let o = v.as_object().ok_or(BindingError::Shape)?;
        let text = |k: &str| -> Result<Option<String>, BindingError> {
            match o.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(BindingError::Shape),
            }
        };
        let event = match text("event")?.as_deref() {
            None | Some("*") => None,
            Some(e) => Some(match e.to_ascii_uppercase().as_str() {
                "INSERT" => Kind::Insert,
                "UPDATE" => Kind::Update,
                "DELETE" => Kind::Delete,
                _ => return Err(BindingError::Event(e.to_owned())),
            }),
        };
        let filter_text = text("filter")?.filter(|f| !f.trim().is_empty());
        let filters = crate::filter::parse(filter_text.as_deref().unwrap_or(""))?;
        // A list of names, or one string of names separated by commas.
        let names: Vec<String> = match o.get("select") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::String(s)) => s.split(',').map(str::to_owned).collect(),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_owned).ok_or(BindingError::Select))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(BindingError::Select),
        };
        let mut select: Vec<String> = names
            .iter()
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty())
            .collect();
        select.sort();
        select.dedup();
        Ok(Binding {
            event,
            schema: text("schema")?.unwrap_or_else(|| "public".into()),
            table: text("table")?.filter(|t| t != "*"),
            filter_text,
            filters,
            select_sent: (!select.is_empty()).then(|| o["select"].clone()),
            select: (!select.is_empty()).then_some(select),
        })
    }

    /// The binding's id: the same for the same event, schema, table and filter, as the
    /// clients match messages to bindings by it.
    pub fn id(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        // FNV-1a: stable across processes and versions (the id is seen by clients).
        struct Fnv(u64);
        impl Hasher for Fnv {
            fn finish(&self) -> u64 {
                self.0
            }
            fn write(&mut self, bytes: &[u8]) {
                for b in bytes {
                    self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
                }
            }
        }
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        (
            self.event.map(Kind::as_str),
            &self.schema,
            &self.table,
            &self.filter_text,
        )
            .hash(&mut h);
        // Bindings that differ only in their columns are told apart (and ids without a
        // `select` stay what they were).
        if let Some(select) = &self.select {
            select.hash(&mut h);
        }
        // Within JavaScript's safe integers.
        h.finish() & ((1 << 53) - 1)
    }

    /// How the join reply echoes the binding (realtime-js checks each against its own).
    pub fn reply(&self) -> serde_json::Value {
        let mut o = serde_json::json!({
            "id": self.id(),
            "event": self.event.map_or("*", Kind::as_str),
            "schema": self.schema,
        });
        if let Some(t) = &self.table {
            o["table"] = t.clone().into();
        }
        if let Some(f) = &self.filter_text {
            o["filter"] = f.clone().into();
        }
        if let Some(s) = &self.select_sent {
            o["select"] = s.clone();
        }
        o
    }

    /// Whether column `name` is sent (the primary key always is).
    pub fn selects(&self, name: &str, key: bool) -> bool {
        key || self
            .select
            .as_ref()
            .is_none_or(|s| s.binary_search_by(|n| n.as_str().cmp(name)).is_ok())
    }

    /// Whether a change of `kind` to `schema.table` is of this binding (its filters apart).
    pub fn covers(&self, schema: &str, table: &str, kind: Kind) -> bool {
        self.event.is_none_or(|e| e == kind)
            && (self.schema == "*" || self.schema == schema)
            && self.table.as_deref().is_none_or(|t| t == table)
    }
}

#[cfg(test)]
mod binding_tests {
    use super::*;

    #[test]
    fn bindings_read_echo_and_cover_as_realtime_js_expects() {
        let b = Binding::parse(&serde_json::json!({
            "event": "INSERT", "schema": "public", "table": "notes", "filter": "id=eq.5"
        }))
        .unwrap();
        assert_eq!(b.event, Some(Kind::Insert));
        assert_eq!(b.filters.len(), 1);
        let reply = b.reply();
        assert_eq!(reply["event"], "INSERT");
        assert_eq!(reply["table"], "notes");
        assert_eq!(reply["filter"], "id=eq.5");
        assert_eq!(reply["id"], b.id());
        assert!(b.covers("public", "notes", Kind::Insert));
        assert!(!b.covers("public", "notes", Kind::Delete));
        assert!(!b.covers("public", "other", Kind::Insert));
        // The same binding has the same id; another has another.
        let same = Binding::parse(&reply).unwrap();
        assert_eq!(same.id(), b.id());
        let all = Binding::parse(&serde_json::json!({"event": "*", "schema": "*"})).unwrap();
        assert_ne!(all.id(), b.id());
        assert!(all.covers("audit", "log", Kind::Delete));
        assert_eq!(
            all.reply(),
            serde_json::json!({"id": all.id(), "event": "*", "schema": "*"})
        );
        // Refusals.
        assert!(matches!(
            Binding::parse(&serde_json::json!({"event": "TRUNCATE", "schema": "public"})),
            Err(BindingError::Event(_))
        ));
        assert!(matches!(
            Binding::parse(&serde_json::json!({"schema": "public", "filter": "id=between.5"})),
            Err(BindingError::Filter(_))
        ));
        assert_eq!(
            Binding::parse(&serde_json::json!("x")),
            Err(BindingError::Shape)
        );
    }

    #[test]
    fn select_names_the_columns_sent() {
        let b = |v: serde_json::Value| Binding::parse(&v).unwrap();
        let all = b(serde_json::json!({"schema": "public", "table": "t"}));
        let some =
            b(serde_json::json!({"schema": "public", "table": "t", "select": ["title", "id"]}));
        let text =
            b(serde_json::json!({"schema": "public", "table": "t", "select": " id, title "}));
        assert_eq!(some.select, Some(vec!["id".to_owned(), "title".to_owned()]));
        assert_eq!(text.select, some.select);
        assert!(some.selects("title", false) && !some.selects("body", false));
        assert!(some.selects("pk", true));
        assert!(all.selects("body", false));
        // Told apart from the same binding without it; echoed as sent.
        assert_ne!(all.id(), some.id());
        assert_eq!(some.reply()["select"], serde_json::json!(["title", "id"]));
        assert!(all.reply().get("select").is_none());
        assert_eq!(
            Binding::parse(&serde_json::json!({"schema": "public", "select": [1]})),
            Err(BindingError::Select)
        );
        assert_eq!(
            b(serde_json::json!({"schema": "public", "select": []})).select,
            None
        );
    }
}
