//! Authorization of a batch of changes, per table and identity (role and JWT claims): the
//! columns the role may read, and the rows its row-level security lets it see, judged on
//! the rows as they were written (the values in the WAL), not as the table holds them when
//! the batch is checked, so a row inserted and deleted at once is still seen by whom it
//! was for.
//!
//! The role's policies are read from the catalogue (`pg_policy`: SELECT and ALL policies
//! that apply to the role, permissive ones OR-ed, restrictive ones AND-ed, as PostgreSQL
//! combines them) and evaluated by PostgreSQL over the batch's rows, under the role and
//! with `request.jwt.claims` set for the transaction, as Supabase sets them: one query per
//! table and identity per batch, all of a batch's sent in one round trip (each its own
//! transaction), as prepared statements. What the catalogue says of a table and role is
//! kept for a second. A role that bypasses row-level security (the table's owner,
//! `BYPASSRLS`, a superuser) or a table without it needs no evaluation. DELETEs are never
//! evaluated: only the old key is known, and is sent.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use shoal_realtime::changes::Column;
use shoal_realtime::feed::Identity;
use shoal_realtime::protocol::{Payload, UserBroadcast};

use super::stream::{quote_ident, CaptureError, Rel, Row, Value, TIMEOUT};
use crate::server::{ServerConn, ServerError};

/// How long what the catalogue says of a table and role is used before it is read again.
const POLICY_TTL: Duration = Duration::from_secs(1);

const SET_IDENTITY: &str =
    "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true)";

/// What one identity may see of one table in a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Access {
    /// The columns it may read: their positions in the table's columns, and themselves.
    pub indices: Vec<usize>,
    pub columns: Vec<Column>,
    /// The batch rows it may see (positions in the batch); `None`: every row.
    pub rows: Option<HashSet<usize>>,
}

impl Access {
    pub fn sees(&self, row: usize) -> bool {
        self.rows.as_ref().is_none_or(|r| r.contains(&row))
    }
}

/// What the catalogue says of a table for a role.
#[derive(Debug, Clone, serde::Deserialize)]
pub(super) struct Policy {
    /// The columns the role may read.
    columns: Vec<String>,
    /// Row-level security does not apply to the role here.
    bypass: bool,
    permissive: Vec<String>,
    restrictive: Vec<String>,
}

impl Policy {
    /// The condition a row must meet; `None` when none can (no permissive policy).
    fn predicate(&self) -> Option<String> {
        if self.permissive.is_empty() {
            return None;
        }
        let any = self
            .permissive
            .iter()
            .map(|q| format!("({q})"))
            .collect::<Vec<_>>()
            .join(" OR ");
        let mut all = vec![format!("({any})")];
        all.extend(self.restrictive.iter().map(|q| format!("({q})")));
        Some(all.join(" AND "))
    }
}

/// Policies read, by table and role, with when they were read.
#[derive(Default)]
pub(super) struct Policies {
    read: HashMap<(u32, String), (Instant, Option<Policy>)>,
    /// Statements prepared on the control connection, by their text.
    statements: HashMap<String, String>,
    /// Authorization queries run (each one round trip).
    pub queries: u64,
}

const DESCRIBE: &str = "SELECT json_build_object(\
 'columns', (SELECT coalesce(json_agg(a.attname), '[]') FROM pg_attribute a \
   WHERE a.attrelid = $1::oid AND a.attnum > 0 AND NOT a.attisdropped \
   AND has_column_privilege($1::oid, a.attnum, 'SELECT')), \
 'bypass', (SELECT NOT c.relrowsecurity OR r.rolsuper OR r.rolbypassrls \
   OR (pg_has_role(current_user, c.relowner, 'USAGE') AND NOT c.relforcerowsecurity) \
   FROM pg_class c, pg_roles r WHERE c.oid = $1::oid AND r.rolname = current_user), \
 'permissive', (SELECT coalesce(json_agg(coalesce(pg_get_expr(p.polqual, p.polrelid), 'true')), '[]') \
   FROM pg_policy p WHERE p.polrelid = $1::oid AND p.polcmd IN ('r', '*') AND p.polpermissive \
   AND (0::oid = ANY(p.polroles) OR EXISTS (SELECT 1 FROM unnest(p.polroles) AS pr(r) \
     WHERE pg_has_role(current_user, pr.r, 'USAGE')))), \
 'restrictive', (SELECT coalesce(json_agg(coalesce(pg_get_expr(p.polqual, p.polrelid), 'true')), '[]') \
   FROM pg_policy p WHERE p.polrelid = $1::oid AND p.polcmd IN ('r', '*') AND NOT p.polpermissive \
   AND (0::oid = ANY(p.polroles) OR EXISTS (SELECT 1 FROM unnest(p.polroles) AS pr(r) \
     WHERE pg_has_role(current_user, pr.r, 'USAGE')))))::text";

/// The first column of the first row of statement `at` of a pipeline's results.
fn cell(rows: &[Option<Vec<Option<String>>>], at: usize) -> Result<String, CaptureError> {
    rows.get(at)
        .cloned()
        .flatten()
        .and_then(|r| r.into_iter().next().flatten())
        .ok_or_else(|| CaptureError::Protocol("an authorization query returned nothing".into()))
}

/// Runs `statements` after setting `identity`; `None` when PostgreSQL refused (no such
/// role, no privilege, a policy failing): the identity may then see nothing.
async fn as_identity(
    control: &mut ServerConn,
    identity: &Identity,
    sql: &str,
    params: &[&str],
) -> Result<Option<String>, CaptureError> {
    let set: &[&str] = &[&identity.role, &identity.claims];
    let statements: [(&str, &[&str]); 2] = [(SET_IDENTITY, set), (sql, params)];
    match crate::timer::timeout(TIMEOUT, control.pipeline(&statements)).await {
        Err(_) => Err(CaptureError::Timeout("an authorization query")),
        Ok(Err(ServerError::Db(e))) if !e.is_fatal() => {
            tracing::debug!(role = %identity.role, error = %e.message,
                "an authorization query was refused: nothing is shown");
            Ok(None)
        }
        Ok(r) => Ok(Some(cell(&r?, 1)?)),
    }
}

impl Policies {
    /// What `identity`'s role may see of `rel`, from the catalogue at most a second old.
    async fn get(
        &mut self,
        control: &mut ServerConn,
        rel: &Rel,
        identity: &Identity,
    ) -> Result<Option<Policy>, CaptureError> {
        let key = (rel.oid, identity.role.clone());
        if let Some((at, p)) = self.read.get(&key) {
            if at.elapsed() < POLICY_TTL {
                return Ok(p.clone());
            }
        }
        let oid = rel.oid.to_string();
        self.queries += 1;
        let policy = match as_identity(control, identity, DESCRIBE, &[&oid]).await? {
            Some(text) => Some(
                serde_json::from_str::<Policy>(&text)
                    .map_err(|e| CaptureError::Protocol(e.to_string()))?,
            ),
            None => None,
        }
        .filter(|p| !p.columns.is_empty());
        self.read.insert(key, (Instant::now(), policy.clone()));
        Ok(policy)
    }
}

/// One authorization a batch needs: what `identity` may see of `rel`, and which of the
/// batch rows `check` (positions and rows: its INSERTs and UPDATEs).
pub(super) struct Question<'a> {
    pub rel: &'a Rel,
    pub identity: &'a Identity,
    pub check: Vec<(usize, &'a Row)>,
}

impl Policies {
    /// The prepared statement running `sql` on this connection (prepared on first use).
    async fn prepared(
        &mut self,
        control: &mut ServerConn,
        sql: &str,
    ) -> Result<Result<String, ServerError>, CaptureError> {
        if let Some(name) = self.statements.get(sql) {
            return Ok(Ok(name.clone()));
        }
        let name = format!("shoal_rt_{}", self.statements.len() + 1);
        match crate::timer::timeout(TIMEOUT, control.prepare_named(&name, sql)).await {
            Err(_) => Err(CaptureError::Timeout("preparing an authorization query")),
            Ok(Err(ServerError::Db(e))) if !e.is_fatal() => Ok(Err(ServerError::Db(e))),
            Ok(r) => {
                r?;
                self.statements.insert(sql.to_owned(), name.clone());
                Ok(Ok(name))
            }
        }
    }

    /// Answers `questions`: `None` where the identity may read nothing of the table. The
    /// policies of a table and role not read in the last second are read first; then every
    /// question that needs rows evaluated is asked in one round trip, each in its own
    /// transaction under its identity.
    pub(super) async fn answer(
        &mut self,
        control: &mut ServerConn,
        questions: &[Question<'_>],
    ) -> Result<Vec<Option<Access>>, CaptureError> {
        let mut answers = Vec::with_capacity(questions.len());
        // (answer, statement, rows as JSON) of each evaluation to run.
        let mut asks: Vec<(usize, String, String)> = Vec::new();
        for q in questions {
            let Some(policy) = self.get(control, q.rel, q.identity).await? else {
                answers.push(None);
                continue;
            };
            let indices: Vec<usize> = (0..q.rel.columns.len())
                .filter(|&i| policy.columns.contains(&q.rel.columns[i].name))
                .collect();
            let columns = indices.iter().map(|&i| q.rel.columns[i].clone()).collect();
            let rows = if policy.bypass || q.check.is_empty() {
                None
            } else if let Some(predicate) = policy.predicate() {
                match self
                    .prepared(control, &evaluate_sql(q.rel, &predicate))
                    .await?
                {
                    Ok(name) => asks.push((answers.len(), name, rows_json(q.rel, &q.check))),
                    Err(e) => tracing::debug!(table = %q.rel.qualified, error = %e,
                        "a table's policies cannot be evaluated: no row is shown"),
                }
                Some(HashSet::new())
            } else {
                Some(HashSet::new())
            };
            answers.push(Some(Access {
                indices,
                columns,
                rows,
            }));
        }
        if asks.is_empty() {
            return Ok(answers);
        }
        let set = self
            .prepared(control, SET_IDENTITY)
            .await?
            .map_err(CaptureError::from)?;
        let groups: Vec<Vec<(&str, Vec<&str>)>> = asks
            .iter()
            .map(|(at, name, json)| {
                let id = questions[*at].identity;
                vec![
                    (set.as_str(), vec![id.role.as_str(), &id.claims]),
                    (name.as_str(), vec![json.as_str()]),
                ]
            })
            .collect();
        self.queries += groups.len() as u64;
        let results = crate::timer::timeout(TIMEOUT, control.run_prepared_groups(&groups))
            .await
            .map_err(|_| CaptureError::Timeout("authorization queries"))??;
        for ((at, _, _), result) in asks.iter().zip(results) {
            let seen: Vec<usize> = match result {
                Ok(row) => {
                    let text = row.and_then(|r| r.into_iter().next().flatten());
                    serde_json::from_str(text.as_deref().unwrap_or("[]"))
                        .map_err(|e| CaptureError::Protocol(e.to_string()))?
                }
                Err(e) => {
                    tracing::debug!(role = %questions[*at].identity.role, error = %e.message,
                        "an authorization query was refused: no row is shown");
                    Vec::new()
                }
            };
            let check = &questions[*at].check;
            if let Some(Some(a)) = answers.get_mut(*at) {
                // 1-based positions in `check`.
                a.rows = Some(
                    seen.into_iter()
                        .filter_map(|k| check.get(k.checked_sub(1)?).map(|(row, _)| *row))
                        .collect(),
                );
            }
        }
        Ok(answers)
    }
}

/// A message that stands for the channel while a private channel's access is checked; it
/// never commits.
const PROBE: &str = "INSERT INTO realtime.messages (topic, extension, private, event, payload) \
     VALUES ($1, 'broadcast', true, 'shoal:probe', '{}')";

/// Whether `identity` may read, and may write, the private channel `topic` (without its
/// `realtime:` prefix), as the tenant's policies on `realtime.messages` say: in a
/// transaction that is rolled back, a message for the topic is written (as Shoal), then,
/// under the role and claims and with `realtime.topic()` set, read back, then written again.
pub(super) async fn private_access(
    control: &mut ServerConn,
    identity: &Identity,
    topic: &str,
) -> Result<(bool, bool), CaptureError> {
    let t: &[&str] = &[topic];
    let set: &[&str] = &[&identity.role, &identity.claims, topic];
    let statements: [(&str, &[&str]); 5] = [
        ("BEGIN", &[]),
        (PROBE, t),
        (
            "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true), \
             set_config('realtime.topic', $3, true)",
            set,
        ),
        (
            "SELECT count(*)::text FROM realtime.messages \
             WHERE topic = $1 AND extension = 'broadcast' AND private",
            t,
        ),
        (PROBE, t),
    ];
    let result = crate::timer::timeout(TIMEOUT, control.pipeline_partly(&statements)).await;
    // Nothing of it stays, whatever happened.
    let rollback = crate::timer::timeout(TIMEOUT, control.simple_query("ROLLBACK")).await;
    let (rows, failed) =
        result.map_err(|_| CaptureError::Timeout("a channel's authorization"))??;
    rollback.map_err(|_| CaptureError::Timeout("a rollback"))??;
    let read = || cell(&rows, 3).is_ok_and(|n| n != "0");
    Ok(match failed {
        None => (read(), true),
        Some((4, _)) => (read(), false),
        Some((_, e)) => {
            tracing::debug!(role = %identity.role, error = %e.message,
                "a private channel's authorization was refused");
            (false, false)
        }
    })
}

/// Supabase's broadcast replay: the broadcasts from the database on the private channel
/// `topic` (as its client calls it, `realtime:` and all) since `replay.since_ms`, the last
/// `replay.limit` of them, oldest first, with `meta.replayed`. Read under the role and
/// claims with `realtime.topic()` set, so the policies decide what may be read, as they
/// did for the join; in a transaction rolled back.
pub(super) async fn replay(
    control: &mut ServerConn,
    identity: &Identity,
    topic: &str,
    replay: shoal_realtime::feed::Replay,
) -> Result<Vec<UserBroadcast>, CaptureError> {
    let channel = topic.strip_prefix("realtime:").unwrap_or(topic);
    let set: &[&str] = &[&identity.role, &identity.claims, channel];
    let (since, limit) = (replay.since_ms.to_string(), replay.limit.to_string());
    let read: &[&str] = &[channel, &since, &limit];
    let statements: [(&str, &[&str]); 3] = [
        ("BEGIN", &[]),
        (
            "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true), \
             set_config('realtime.topic', $3, true)",
            set,
        ),
        (
            "SELECT coalesce(json_agg(m ORDER BY m.inserted_at), '[]')::text FROM ( \
               SELECT id::text, event, payload, binary_payload::text AS binary, inserted_at \
               FROM realtime.messages \
               WHERE topic = $1 AND extension = 'broadcast' AND private \
                 AND inserted_at >= to_timestamp($2::float8 / 1000) AT TIME ZONE 'UTC' \
               ORDER BY inserted_at DESC LIMIT $3::int) m",
            read,
        ),
    ];
    let result = crate::timer::timeout(TIMEOUT, control.pipeline_partly(&statements)).await;
    let rollback = crate::timer::timeout(TIMEOUT, control.simple_query("ROLLBACK")).await;
    let (rows, failed) = result.map_err(|_| CaptureError::Timeout("a channel's replay"))??;
    rollback.map_err(|_| CaptureError::Timeout("a rollback"))??;
    if let Some((_, e)) = failed {
        // Refused by the policies, say: nothing to replay.
        tracing::debug!(role = %identity.role, error = %e.message, "a channel's replay was refused");
        return Ok(Vec::new());
    }
    #[derive(serde::Deserialize)]
    struct Kept {
        id: String,
        event: Option<String>,
        payload: Option<Box<serde_json::value::RawValue>>,
        binary: Option<String>,
    }
    let kept: Vec<Kept> = serde_json::from_str(&cell(&rows, 2)?)
        .map_err(|e| CaptureError::Protocol(e.to_string()))?;
    Ok(kept
        .into_iter()
        .map(|k| UserBroadcast {
            join_ref: None,
            msg_ref: None,
            topic: topic.to_owned(),
            event: k.event.unwrap_or_default(),
            meta: Some(Bytes::from(
                serde_json::json!({ "id": k.id, "replayed": true }).to_string(),
            )),
            payload: match k.binary.as_deref().and_then(super::messages::bytea) {
                Some(b) => Payload::Binary(b),
                None => Payload::Json(Bytes::from(
                    k.payload
                        .map_or_else(|| "{}".to_owned(), |p| p.get().to_owned()),
                )),
            },
        })
        .collect())
}

/// The rows of `check` as JSON objects `json_populate_record` reads: text values as
/// strings, JSON values as themselves, a value the WAL left out taken from the old row
/// (else NULL).
fn rows_json(rel: &Rel, check: &[(usize, &Row)]) -> String {
    let rows: Vec<serde_json::Value> = check
        .iter()
        .map(|(_, row)| {
            let mut o = serde_json::Map::new();
            for (i, c) in rel.columns.iter().enumerate() {
                let v = match row.value(i) {
                    Some(Value::Text(t)) if matches!(c.typname.as_str(), "json" | "jsonb") => {
                        serde_json::from_str(t).unwrap_or_else(|_| t.clone().into())
                    }
                    Some(Value::Text(t)) => t.clone().into(),
                    _ => serde_json::Value::Null,
                };
                o.insert(c.name.clone(), v);
            }
            serde_json::Value::Object(o)
        })
        .collect();
    serde_json::Value::from(rows).to_string()
}

/// Which of the rows `$1` (a JSON array of row objects) meet `predicate` (the table's
/// policies, whose column references name the row by the table's name).
fn evaluate_sql(rel: &Rel, predicate: &str) -> String {
    format!(
        "SELECT coalesce(json_agg(k.i), '[]')::text \
         FROM json_array_elements($1::json) WITH ORDINALITY AS k(v, i) \
         CROSS JOIN LATERAL json_populate_record(NULL::{}, k.v) AS {} WHERE {predicate}",
        rel.qualified,
        quote_ident(&rel.table)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_realtime::changes::Kind;
    use std::sync::Arc;

    fn rel() -> Rel {
        Rel {
            oid: 42,
            schema: "public".into(),
            table: "notes".into(),
            qualified: "\"public\".\"notes\"".into(),
            columns: vec![
                Column {
                    name: "id".into(),
                    typname: "int8".into(),
                },
                Column {
                    name: "body".into(),
                    typname: "text".into(),
                },
            ],
            key: vec![true, false],
            primary: vec![true, false],
        }
    }

    #[test]
    fn policies_combine_as_postgresql_combines_them() {
        let p = |permissive: &[&str], restrictive: &[&str]| Policy {
            columns: vec!["id".into()],
            bypass: false,
            permissive: permissive.iter().map(|s| s.to_string()).collect(),
            restrictive: restrictive.iter().map(|s| s.to_string()).collect(),
        };
        assert_eq!(
            p(&[], &["true"]).predicate(),
            None,
            "no permissive policy: no row"
        );
        assert_eq!(
            p(&["a = 1", "b = 2"], &["c"]).predicate().unwrap(),
            "((a = 1) OR (b = 2)) AND (c)"
        );
        let sql = evaluate_sql(&rel(), "(owner = 'x')");
        assert!(sql.contains("json_populate_record(NULL::\"public\".\"notes\", k.v) AS \"notes\""));
        assert!(sql.ends_with("WHERE (owner = 'x')"));
    }

    #[test]
    fn rows_are_sent_as_json_objects() {
        use super::super::stream::Value;
        let mut r = rel();
        r.columns[1].typname = "jsonb".into();
        let r = Arc::new(r);
        let row = Row {
            rel: r.clone(),
            kind: Kind::Update,
            commit_time: 0,
            new: vec![Value::Text("7".into()), Value::Unchanged],
            old: vec![Value::Text("7".into()), Value::Text(r#"{"a": [1]}"#.into())],
        };
        let null = Row {
            rel: r.clone(),
            kind: Kind::Insert,
            commit_time: 0,
            new: vec![Value::Text("8".into()), Value::Null],
            old: vec![],
        };
        assert_eq!(
            rows_json(&r, &[(0, &row), (3, &null)]),
            r#"[{"body":{"a":[1]},"id":"7"},{"body":null,"id":"8"}]"#
        );
    }
}
