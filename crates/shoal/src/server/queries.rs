//! What Shoal itself asks of a server beside its clients' traffic: queries with parameters
//! and their rows, pipelines and prepared groups (the catalogue, authorization, the cache),
//! and the replication protocol's start and standby status.

use bytes::BytesMut;
use shoal_wire::backend::{self, tag, ErrorFields};
use shoal_wire::frontend;

use super::{ServerConn, ServerError};

impl ServerConn {
    /// Runs `sql` with text parameters over the extended protocol (unnamed statement), so
    /// values a client supplied are never spliced into SQL text.
    pub async fn query_with_params(
        &mut self,
        sql: &str,
        params: &[&str],
    ) -> Result<(), ServerError> {
        let mut out = BytesMut::new();
        frontend::parse_bind_execute(&mut out, sql, params);
        self.session.unnamed_dropped();
        self.stream.write_all(&out).await?;
        self.read_until_ready().await
    }

    /// Sends pooler-issued requests (`out`, answered by `replies` ReadyForQuery messages) in
    /// one write and reads every reply; fails with the first error once all are read, so
    /// the connection is left at a boundary either way (or is broken).
    pub async fn run_batch(&mut self, out: &[u8], replies: usize) -> Result<(), ServerError> {
        self.stream.write_all(out).await?;
        let mut first = None;
        for _ in 0..replies {
            match self.read_until_ready().await {
                Ok(()) => {}
                Err(ServerError::Db(f)) if !f.is_fatal() => {
                    first.get_or_insert(f);
                }
                Err(e) => return Err(e),
            }
        }
        first.map_or(Ok(()), |f| Err(ServerError::Db(f)))
    }

    /// Runs `sql` with text `params` and returns its first row as text columns (`None`
    /// columns are NULL), or `None` when it returned no row.
    pub async fn query_row(
        &mut self,
        sql: &str,
        params: &[&str],
    ) -> Result<Option<Vec<Option<String>>>, ServerError> {
        let mut out = BytesMut::new();
        frontend::parse_bind_execute(&mut out, sql, params);
        self.session.unnamed_dropped();
        self.stream.write_all(&out).await?;
        let mut row = None;
        let mut first_error = None;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag() {
                b'D' if row.is_none() => row = Some(data_row(frame.body())?),
                tag::ERROR_RESPONSE => {
                    let e = backend::parse_error(frame.body())?;
                    if e.is_fatal() {
                        return Err(ServerError::Db(e));
                    }
                    first_error.get_or_insert(e);
                }
                tag::READY_FOR_QUERY => {
                    return match first_error {
                        Some(e) => Err(ServerError::Db(e)),
                        None => Ok(row),
                    }
                }
                _ => {}
            }
        }
    }

    /// Runs `statements` (SQL and text parameters) in one round trip and one implicit
    /// transaction, so a `set_config(..., true)` in one holds for those after it and ends
    /// with them; the first row of each (as [`ServerConn::query_row`]), or the first error.
    pub async fn pipeline(
        &mut self,
        statements: &[(&str, &[&str])],
    ) -> Result<Vec<Option<Vec<Option<String>>>>, ServerError> {
        match self.pipeline_partly(statements).await? {
            (rows, None) => Ok(rows),
            (_, Some((_, e))) => Err(ServerError::Db(e)),
        }
    }

    /// [`ServerConn::pipeline`], keeping what the statements before a failing one
    /// returned: the rows, and which statement failed with what (the rest were skipped).
    pub async fn pipeline_partly(
        &mut self,
        statements: &[(&str, &[&str])],
    ) -> Result<PipelineResult, ServerError> {
        let mut out = BytesMut::new();
        for (sql, params) in statements {
            frontend::parse_bind_execute_unsynced(&mut out, sql, params);
        }
        frontend::sync(&mut out);
        self.session.unnamed_dropped();
        self.stream.write_all(&out).await?;
        let mut rows: Vec<Option<Vec<Option<String>>>> = vec![None; statements.len()];
        let mut at = 0;
        let mut first_error = None;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag() {
                b'D' => {
                    if let Some(slot) = rows.get_mut(at).filter(|r| r.is_none()) {
                        *slot = Some(data_row(frame.body())?);
                    }
                }
                // CommandComplete, EmptyQueryResponse: the next statement's results follow.
                b'C' | b'I' => at += 1,
                tag::ERROR_RESPONSE => {
                    let e = backend::parse_error(frame.body())?;
                    if e.is_fatal() {
                        return Err(ServerError::Db(e));
                    }
                    first_error.get_or_insert((at, e));
                }
                tag::READY_FOR_QUERY => return Ok((rows, first_error)),
                _ => {}
            }
        }
    }

    /// Prepares `sql` as statement `name` on this connection (one round trip).
    pub async fn prepare_named(&mut self, name: &str, sql: &str) -> Result<(), ServerError> {
        let mut out = BytesMut::new();
        frontend::parse(&mut out, name, sql);
        frontend::sync(&mut out);
        self.stream.write_all(&out).await?;
        self.read_until_ready().await
    }

    /// Runs many transactions in one round trip: each group's prepared statements (names
    /// and text parameters) in one implicit transaction, closed by its own Sync, so one
    /// group's failure leaves the others be. Per group: the first row of its last
    /// statement, or its first non-fatal error.
    pub async fn run_prepared_groups(
        &mut self,
        groups: &[Vec<(&str, Vec<&str>)>],
    ) -> Result<Vec<Result<Option<Vec<Option<String>>>, ErrorFields>>, ServerError> {
        let mut out = BytesMut::new();
        for g in groups {
            for (name, params) in g {
                frontend::bind_execute(&mut out, name, params);
            }
            frontend::sync(&mut out);
        }
        self.session.unnamed_dropped();
        self.stream.write_all(&out).await?;
        let mut results = Vec::with_capacity(groups.len());
        for g in groups {
            let last = g.len().saturating_sub(1);
            let (mut at, mut row, mut error) = (0, None, None);
            loop {
                let frame = self.read_frame().await?;
                match frame.tag() {
                    b'D' if at == last && row.is_none() => row = Some(data_row(frame.body())?),
                    b'C' | b'I' => at += 1,
                    tag::ERROR_RESPONSE => {
                        let e = backend::parse_error(frame.body())?;
                        if e.is_fatal() {
                            return Err(ServerError::Db(e));
                        }
                        error.get_or_insert(e);
                    }
                    tag::READY_FOR_QUERY => break,
                    _ => {}
                }
            }
            results.push(match error {
                Some(e) => Err(e),
                None => Ok(row),
            });
        }
        Ok(results)
    }

    /// Sends `START_REPLICATION ...` (`sql`) on a replication connection and waits until
    /// the server streams (CopyBothResponse).
    pub async fn start_replication(&mut self, sql: &str) -> Result<(), ServerError> {
        let mut out = BytesMut::new();
        frontend::query(&mut out, sql);
        self.stream.write_all(&out).await?;
        loop {
            let frame = self.read_frame().await?;
            match frame.tag() {
                tag::COPY_BOTH_RESPONSE => return Ok(()),
                tag::ERROR_RESPONSE => {
                    return Err(ServerError::Db(backend::parse_error(frame.body())?));
                }
                _ => {}
            }
        }
    }

    /// Tells a replication stream's server that WAL up to `lsn` was received, flushed
    /// and applied (so the slot may let it go, and a restart begins after it).
    pub async fn standby_status(&mut self, lsn: u64) -> Result<(), ServerError> {
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64)
            - shoal_wire::pgoutput::PG_EPOCH_OFFSET_US;
        let mut payload = Vec::with_capacity(34);
        shoal_wire::pgoutput::status_update(&mut payload, lsn, now_us, false);
        let mut out = BytesMut::with_capacity(5 + payload.len());
        bytes::BufMut::put_u8(&mut out, tag::COPY_DATA);
        bytes::BufMut::put_u32(&mut out, 4 + payload.len() as u32);
        out.extend_from_slice(&payload);
        self.stream.write_all(&out).await?;
        Ok(())
    }
}

/// A DataRow's columns as text (`None` for NULL).
fn data_row(body: &[u8]) -> Result<Vec<Option<String>>, ServerError> {
    let mut r = shoal_wire::frame::Reader::new(body);
    let n = r.u16()?;
    let mut cols = Vec::new();
    for _ in 0..n {
        let len = r.i32()?;
        cols.push(if len < 0 {
            None
        } else {
            Some(String::from_utf8_lossy(r.bytes(len as usize)?).into_owned())
        });
    }
    Ok(cols)
}

/// What [`ServerConn::pipeline_partly`] returns: each statement's first row, and the
/// failing statement's position and error.
pub type PipelineResult = (
    Vec<Option<Vec<Option<String>>>>,
    Option<(usize, ErrorFields)>,
);
