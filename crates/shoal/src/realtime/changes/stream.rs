//! The replication connection of a tenant's capture: `START_REPLICATION` on this node's
//! slot with `pgoutput`, and its messages turned into whole committed transactions of row
//! changes, markers and keepalives.
//!
//! Values come as text, written by the walsender with the connection's settings:
//! `TimeZone=UTC` and `DateStyle=ISO` make them what Realtime renders. The names of a
//! relation's types are read from the catalogue (on the control connection) when the
//! stream describes it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use shoal_realtime::changes::{Column, Kind};
use shoal_wire::backend::tag as be;
use shoal_wire::pgoutput::{self, Message, OldKind, ReplicationMessage};

use crate::server::{ServerConn, ServerError, Upstream};

pub(super) const TIMEOUT: Duration = Duration::from_secs(10);

/// The settings values are written with (see the module's doc).
pub(super) const SETTINGS: [(&str, &str); 4] = [
    ("TimeZone", "UTC"),
    ("DateStyle", "ISO"),
    ("IntervalStyle", "postgres"),
    // Binary broadcasts are read from bytea's text form, whatever the server's default.
    ("bytea_output", "hex"),
];

/// The prefix of the capture's markers in the WAL.
pub(super) const MARKER: &str = "shoal-realtime";

#[derive(Debug, thiserror::Error)]
pub(super) enum CaptureError {
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("{0}")]
    Refused(String),
    #[error("the change stream sent something unexpected: {0}")]
    Protocol(String),
    #[error("{0} timed out")]
    Timeout(&'static str),
}

impl CaptureError {
    /// Whether trying again cannot help until someone changes the database or the tenant
    /// (waiting joins are refused with it rather than left to time out).
    pub(super) fn is_lasting(&self) -> bool {
        match self {
            CaptureError::Refused(_) => true,
            CaptureError::Server(ServerError::Db(e)) => {
                // Privileges, authentication, missing objects, configuration.
                ["42501", "28000", "28P01", "3D000", "55000", "42704"].contains(&e.code.as_str())
            }
            _ => false,
        }
    }
}

/// A table as the stream describes it, with what the catalogue adds.
#[derive(Debug)]
pub(super) struct Rel {
    pub oid: u32,
    pub schema: String,
    pub table: String,
    /// `"schema"."table"`, quoted for SQL.
    pub qualified: String,
    pub columns: Vec<Column>,
    /// Which columns are the replica identity (the key a DELETE carries).
    pub key: Vec<bool>,
    /// Which columns are the primary key (the replica identity's columns for a table
    /// without one): sent whatever a binding's `select` names.
    pub primary: Vec<bool>,
}

/// One column value of a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Value {
    Null,
    Text(String),
    Unchanged,
}

impl Value {
    pub fn text(&self) -> Option<&str> {
        match self {
            Value::Text(t) => Some(t),
            _ => None,
        }
    }
}

/// One row change.
#[derive(Debug)]
pub(super) struct Row {
    pub rel: Arc<Rel>,
    pub kind: Kind,
    pub commit_time: i64,
    pub new: Vec<Value>,
    pub old: Vec<Value>,
}

impl Row {
    /// The value of column `i` the change is about: the new row's, else the old one's.
    pub fn value(&self, i: usize) -> Option<&Value> {
        match self.new.get(i) {
            Some(Value::Unchanged) | None => self.old.get(i),
            v => v,
        }
    }
}

/// What the stream says.
pub(super) enum Event {
    /// A committed transaction's row changes (maybe none), the tables it truncated (by
    /// name), and where its commit ends.
    Commit {
        end_lsn: u64,
        rows: Vec<Row>,
        truncated: Vec<String>,
    },
    /// A marker written by the capture came back.
    Marker(u64),
    /// The server has sent everything up to `wal_end`.
    Keepalive { wal_end: u64, reply: bool },
}

pub(super) struct Stream {
    conn: ServerConn,
    rels: HashMap<u32, Arc<Rel>>,
    /// Type oid to `typname`.
    types: HashMap<u32, String>,
    /// The transaction being read: its commit time and rows.
    txn: Option<(i64, Vec<Row>)>,
    /// The tables the transaction being read truncated.
    truncated: Vec<String>,
}

impl Stream {
    /// Starts streaming from `slot` after `from` (0: where the slot stands).
    pub async fn start(
        up: &Upstream,
        slot: &str,
        publication: &str,
        from: u64,
    ) -> Result<Stream, CaptureError> {
        let mut conn = replication_connection(up).await?;
        let sql = format!(
            "START_REPLICATION SLOT {slot} LOGICAL {:X}/{:X} \
             (proto_version '1', publication_names '{publication}', messages 'true')",
            from >> 32,
            from & 0xffff_ffff
        );
        crate::timer::timeout(TIMEOUT, conn.start_replication(&sql))
            .await
            .map_err(|_| CaptureError::Timeout("START_REPLICATION"))??;
        Ok(Stream {
            conn,
            rels: HashMap::new(),
            types: HashMap::new(),
            txn: None,
            truncated: Vec::new(),
        })
    }

    /// The next message's frame. Cancel-safe: nothing is lost if it is dropped.
    pub async fn read_frame(&mut self) -> Result<shoal_wire::frame::Frame, ServerError> {
        self.conn.read_frame().await
    }

    pub async fn close(self) {
        self.conn.close().await;
    }

    pub async fn confirm(&mut self, lsn: u64) -> Result<(), CaptureError> {
        Ok(self.conn.standby_status(lsn).await?)
    }

    /// Whether a transaction is being read (its commit has not come yet).
    pub fn in_transaction(&self) -> bool {
        self.txn.is_some()
    }

    /// Reads one frame; the catalogue is asked on `control` about relations it describes.
    pub async fn on_frame(
        &mut self,
        control: &mut ServerConn,
        frame: &shoal_wire::frame::Frame,
    ) -> Result<Option<Event>, CaptureError> {
        match frame.tag() {
            be::COPY_DATA => {}
            be::ERROR_RESPONSE => {
                let e =
                    shoal_wire::backend::parse_error(frame.body()).map_err(ServerError::from)?;
                return Err(ServerError::Db(e).into());
            }
            b'c' => return Err(CaptureError::Protocol("the server ended the stream".into())),
            _ => return Ok(None),
        }
        let bad = |e: pgoutput::PgOutputError| CaptureError::Protocol(e.to_string());
        match pgoutput::replication_message(frame.body()).map_err(bad)? {
            ReplicationMessage::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => Ok(Some(Event::Keepalive {
                wal_end,
                reply: reply_requested,
            })),
            ReplicationMessage::XLogData { data, .. } => {
                let m = pgoutput::message(data).map_err(bad)?;
                self.on_message(control, m).await
            }
        }
    }

    async fn on_message(
        &mut self,
        control: &mut ServerConn,
        m: Message<'_>,
    ) -> Result<Option<Event>, CaptureError> {
        match m {
            Message::Begin { commit_time, .. } => self.txn = Some((commit_time, Vec::new())),
            Message::Commit { end_lsn, .. } => {
                let rows = self.txn.take().map(|(_, rows)| rows).unwrap_or_default();
                let truncated = std::mem::take(&mut self.truncated);
                return Ok(Some(Event::Commit {
                    end_lsn,
                    rows,
                    truncated,
                }));
            }
            Message::Truncate { relations, .. } => {
                for r in relations {
                    let rel = self.rels.get(&r).ok_or_else(|| {
                        CaptureError::Protocol(format!(
                            "a truncation of relation {r} before its description"
                        ))
                    })?;
                    self.truncated.push(rel.table.clone());
                }
            }
            Message::Relation(r) => {
                let rel = self.describe(control, &r).await?;
                self.rels.insert(r.id, Arc::new(rel));
            }
            Message::Insert { relation, new } => {
                self.push(relation, Kind::Insert, &new.0, &[], OldKind::Row)?
            }
            Message::Update { relation, old, new } => {
                let (kind, old) = old
                    .as_ref()
                    .map_or((OldKind::Row, &[][..]), |(k, t)| (*k, &t.0[..]));
                self.push(relation, Kind::Update, &new.0, old, kind)?
            }
            Message::Delete { relation, old } => {
                self.push(relation, Kind::Delete, &[], &old.1 .0, old.0)?
            }
            Message::LogicalMessage {
                prefix, content, ..
            } if prefix == MARKER => {
                let seq = std::str::from_utf8(content)
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok());
                return Ok(seq.map(Event::Marker));
            }
            _ => {}
        }
        Ok(None)
    }

    fn push(
        &mut self,
        relation: u32,
        kind: Kind,
        new: &[pgoutput::Column<'_>],
        old: &[pgoutput::Column<'_>],
        old_kind: OldKind,
    ) -> Result<(), CaptureError> {
        let rel = self.rels.get(&relation).cloned().ok_or_else(|| {
            CaptureError::Protocol(format!(
                "a change to relation {relation} before its description"
            ))
        })?;
        let (commit_time, rows) = self
            .txn
            .as_mut()
            .ok_or_else(|| CaptureError::Protocol("a change outside a transaction".into()))?;
        let mut old = values(old);
        if old_kind == OldKind::Key {
            // A key tuple's other columns are sent as NULLs: they are not known.
            for (v, key) in old.iter_mut().zip(&rel.key) {
                if !key {
                    *v = Value::Unchanged;
                }
            }
        }
        rows.push(Row {
            rel,
            kind,
            commit_time: *commit_time,
            new: values(new),
            old,
        });
        Ok(())
    }

    /// What a Relation message and the catalogue say of a table.
    async fn describe(
        &mut self,
        control: &mut ServerConn,
        r: &pgoutput::Relation<'_>,
    ) -> Result<Rel, CaptureError> {
        let missing: Vec<String> = r
            .columns
            .iter()
            .filter(|c| !self.types.contains_key(&c.type_oid))
            .map(|c| c.type_oid.to_string())
            .collect();
        let sql = "SELECT coalesce(json_object_agg(oid::text, typname), '{}')::text \
                   FROM pg_type WHERE oid = ANY($1::oid[])";
        let oids = format!("{{{}}}", missing.join(","));
        if !missing.is_empty() {
            let row = crate::timer::timeout(TIMEOUT, control.query_row(sql, &[&oids]))
                .await
                .map_err(|_| CaptureError::Timeout("reading a table's types"))??;
            let text = row
                .and_then(|r| r.into_iter().next().flatten())
                .unwrap_or_default();
            let types: HashMap<String, String> =
                serde_json::from_str(&text).map_err(|e| CaptureError::Protocol(e.to_string()))?;
            for (oid, name) in types {
                if let Ok(oid) = oid.parse() {
                    self.types.insert(oid, name);
                }
            }
        }
        let columns: Vec<Column> = r
            .columns
            .iter()
            .map(|c| Column {
                name: c.name.to_owned(),
                typname: self.types.get(&c.type_oid).cloned().unwrap_or_default(),
            })
            .collect();
        let sql = "SELECT coalesce(json_agg(a.attname::text), '[]')::text FROM pg_index i \
                   JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) \
                   WHERE i.indrelid = $1::oid AND i.indisprimary";
        let row = crate::timer::timeout(TIMEOUT, control.query_row(sql, &[&r.id.to_string()]))
            .await
            .map_err(|_| CaptureError::Timeout("reading a table's primary key"))??;
        let text = row
            .and_then(|r| r.into_iter().next().flatten())
            .unwrap_or_default();
        let pk: Vec<String> =
            serde_json::from_str(&text).map_err(|e| CaptureError::Protocol(e.to_string()))?;
        let key: Vec<bool> = r.columns.iter().map(|c| c.key).collect();
        let primary = if pk.is_empty() {
            key.clone()
        } else {
            columns.iter().map(|c| pk.contains(&c.name)).collect()
        };
        Ok(Rel {
            oid: r.id,
            schema: r.schema.to_owned(),
            table: r.name.to_owned(),
            qualified: format!("{}.{}", quote_ident(r.schema), quote_ident(r.name)),
            columns,
            key,
            primary,
        })
    }
}

/// A replication connection (`replication=database`) with the capture's settings.
pub(super) async fn replication_connection(up: &Upstream) -> Result<ServerConn, CaptureError> {
    let mut params = vec![("replication", "database")];
    params.extend(SETTINGS);
    Ok(ServerConn::connect_with(up, TIMEOUT, &params).await?)
}

fn values(cols: &[pgoutput::Column<'_>]) -> Vec<Value> {
    cols.iter()
        .map(|c| match c {
            pgoutput::Column::Null => Value::Null,
            pgoutput::Column::Unchanged => Value::Unchanged,
            pgoutput::Column::Text(t) | pgoutput::Column::Binary(t) => {
                Value::Text(String::from_utf8_lossy(t).into_owned())
            }
        })
        .collect()
}

/// `name` as an SQL identifier.
pub(super) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
