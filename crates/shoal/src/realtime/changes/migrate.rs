//! Shoal's objects in a realtime tenant's database, in schema `realtime`: the `messages`
//! table that broadcasts from the database go through (partitioned by day), and the
//! functions Supabase's users call: `realtime.send`, `realtime.broadcast_changes` and
//! `realtime.topic()` (for policies on `realtime.messages`).
//!
//! Versioned in `realtime.shoal_migrations`: each step runs once, in a transaction, under
//! an advisory lock so two nodes never run one together.

use super::stream::{CaptureError, TIMEOUT};
use crate::server::ServerConn;

/// The steps, in order; a step's number is its position plus one.
const STEPS: &[&str] = &[
    r#"
CREATE TABLE realtime.messages (
    topic text NOT NULL,
    extension text NOT NULL,
    payload jsonb,
    event text,
    private boolean NOT NULL DEFAULT false,
    updated_at timestamp NOT NULL DEFAULT now(),
    inserted_at timestamp NOT NULL DEFAULT now(),
    id uuid NOT NULL DEFAULT gen_random_uuid(),
    PRIMARY KEY (id, inserted_at)
) PARTITION BY RANGE (inserted_at);
-- Rows of a day without its own partition (none should be: days are made ahead).
CREATE TABLE realtime.messages_default PARTITION OF realtime.messages DEFAULT;
ALTER TABLE realtime.messages ENABLE ROW LEVEL SECURITY;
GRANT USAGE ON SCHEMA realtime TO PUBLIC;
GRANT SELECT, INSERT ON realtime.messages TO PUBLIC;

-- The channel a policy is being asked about (the topic without `realtime:`).
CREATE FUNCTION realtime.topic() RETURNS text
LANGUAGE sql STABLE
AS $$ SELECT nullif(current_setting('realtime.topic', true), '') $$;

-- Broadcasts `payload` as `event` to the channel `topic` (private by default), as the
-- calling role: the table's policies decide who may.
CREATE FUNCTION realtime.send(payload jsonb, event text, topic text, private boolean DEFAULT true)
RETURNS void
LANGUAGE sql SET search_path = ''
AS $$
  INSERT INTO realtime.messages (payload, event, topic, private, extension)
  VALUES (payload, event, topic, private, 'broadcast')
$$;

-- Broadcasts a row change (from a trigger) to the private channel `topic_name`.
CREATE FUNCTION realtime.broadcast_changes(
    topic_name text, event_name text, operation text, table_name text, table_schema text,
    new record, old record, level text DEFAULT 'ROW')
RETURNS void
LANGUAGE plpgsql SET search_path = ''
AS $$
BEGIN
  PERFORM realtime.send(
    jsonb_build_object(
      'schema', table_schema,
      'table', table_name,
      'operation', operation,
      'record', CASE WHEN new IS NULL THEN NULL ELSE to_jsonb(new) END,
      'old_record', CASE WHEN old IS NULL THEN NULL ELSE to_jsonb(old) END),
    event_name, topic_name, true);
END
$$;

-- Makes the partitions of today and the next three days, and drops those (and default
-- rows) older than three days.
CREATE FUNCTION realtime.shoal_maintain() RETURNS void
LANGUAGE plpgsql SET search_path = ''
AS $$
DECLARE
  d date;
  p record;
BEGIN
  FOR i IN 0..3 LOOP
    d := current_date + i;
    BEGIN
      EXECUTE format(
        'CREATE TABLE IF NOT EXISTS realtime.%I PARTITION OF realtime.messages FOR VALUES FROM (%L) TO (%L)',
        'messages_' || to_char(d, 'YYYY_MM_DD'), d, d + 1);
    EXCEPTION WHEN check_violation THEN
      -- The default partition holds rows of that day: they stay there.
      NULL;
    END;
  END LOOP;
  FOR p IN
    SELECT c.relname FROM pg_inherits i
    JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'realtime.messages'::regclass
      AND c.relname ~ '^messages_\d{4}_\d{2}_\d{2}$'
      AND to_date(substr(c.relname, 10), 'YYYY_MM_DD') < current_date - 3
  LOOP
    EXECUTE format('DROP TABLE realtime.%I', p.relname);
  END LOOP;
  DELETE FROM realtime.messages_default WHERE inserted_at < current_date - 3;
END
$$;
"#,
    r#"
-- Binary broadcasts from the database (realtime.send_binary): delivered as binary payloads.
ALTER TABLE realtime.messages ADD COLUMN binary_payload bytea;
-- Times in UTC whatever the writer's TimeZone: a replay's `since` is read as UTC.
ALTER TABLE realtime.messages ALTER COLUMN inserted_at SET DEFAULT (now() AT TIME ZONE 'UTC');
ALTER TABLE realtime.messages ALTER COLUMN updated_at SET DEFAULT (now() AT TIME ZONE 'UTC');

-- Broadcasts `payload` as `event` to the channel `topic` (private by default), as the
-- calling role: the table's policies decide who may, and they see the channel in
-- realtime.topic() as they do when a client joins or sends. A broadcast that cannot be
-- sent (a policy refuses it, the table is gone) is a WARNING, never the caller's error: a
-- trigger that broadcasts must not undo the write that fired it. The message's id is added
-- to an object payload as `id` (unless it has one), as Supabase does.
CREATE OR REPLACE FUNCTION realtime.send(payload jsonb, event text, topic text, private boolean DEFAULT true)
RETURNS void
LANGUAGE plpgsql SET search_path = ''
AS $$
DECLARE
  message uuid := gen_random_uuid();
  outer_topic text := current_setting('realtime.topic', true);
BEGIN
  PERFORM set_config('realtime.topic', topic, true);
  BEGIN
    INSERT INTO realtime.messages (id, payload, event, topic, private, extension)
    VALUES (message,
            CASE WHEN jsonb_typeof(payload) = 'object' AND NOT payload ? 'id'
                 THEN payload || jsonb_build_object('id', message) ELSE payload END,
            event, topic, private, 'broadcast');
  EXCEPTION WHEN OTHERS THEN
    RAISE WARNING 'realtime.send: the broadcast to "%" was not sent: % (SQLSTATE %)', topic, SQLERRM, SQLSTATE;
  END;
  PERFORM set_config('realtime.topic', coalesce(outer_topic, ''), true);
END
$$;

-- The same with a binary payload, delivered to clients as one (protocol 2.0's binary
-- broadcast frame).
CREATE FUNCTION realtime.send_binary(payload bytea, event text, topic text, private boolean DEFAULT true)
RETURNS void
LANGUAGE plpgsql SET search_path = ''
AS $$
DECLARE
  outer_topic text := current_setting('realtime.topic', true);
BEGIN
  PERFORM set_config('realtime.topic', topic, true);
  BEGIN
    INSERT INTO realtime.messages (binary_payload, event, topic, private, extension)
    VALUES (payload, event, topic, private, 'broadcast');
  EXCEPTION WHEN OTHERS THEN
    RAISE WARNING 'realtime.send_binary: the broadcast to "%" was not sent: % (SQLSTATE %)', topic, SQLERRM, SQLSTATE;
  END;
  PERFORM set_config('realtime.topic', coalesce(outer_topic, ''), true);
END
$$;
"#,
];

/// Brings the database's `realtime` schema up to date, and its partitions.
pub(super) async fn run(c: &mut ServerConn) -> Result<(), CaptureError> {
    let setup = "CREATE SCHEMA IF NOT EXISTS realtime; \
        CREATE TABLE IF NOT EXISTS realtime.shoal_migrations \
          (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())";
    simple(c, setup).await?;
    for (i, step) in STEPS.iter().enumerate() {
        let version = i + 1;
        // The lock is held to the end of the transaction; a step another node ran
        // meanwhile is seen once it is taken.
        let sql = format!(
            "BEGIN; SELECT pg_advisory_xact_lock(hashtext('shoal realtime migrations')); \
             DO $shoal$ BEGIN \
               IF NOT EXISTS (SELECT 1 FROM realtime.shoal_migrations WHERE version = {version}) THEN \
                 EXECUTE $step${step}$step$; \
                 INSERT INTO realtime.shoal_migrations (version) VALUES ({version}); \
               END IF; \
             END $shoal$; COMMIT"
        );
        if let Err(e) = simple(c, &sql).await {
            let _ = simple(c, "ROLLBACK").await;
            return Err(e);
        }
    }
    simple(c, "SELECT realtime.shoal_maintain()").await
}

/// Makes tomorrow's partitions and drops old ones.
pub(super) async fn maintain(c: &mut ServerConn) -> Result<(), CaptureError> {
    simple(c, "SELECT realtime.shoal_maintain()").await
}

async fn simple(c: &mut ServerConn, sql: &str) -> Result<(), CaptureError> {
    crate::timer::timeout(TIMEOUT, c.simple_query(sql))
        .await
        .map_err(|_| CaptureError::Timeout("a migration"))??;
    Ok(())
}
