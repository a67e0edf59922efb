//! Broadcasts from the database and private channels against a real PostgreSQL:
//! `realtime.send` to public and private channels, `realtime.broadcast_changes` from a
//! trigger with the stream cut in between (none lost), and private channels let in, and
//! let send, only as the tenant's policies on `realtime.messages` say.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::changes::*;
use common::phoenix::Phx;
use common::*;

/// Waits for Shoal's `realtime` schema in the tenant's database (installed when the tenant
/// is stored), then runs `policies`.
async fn with_policies(s: &Setup, policies: &str) {
    eventually(
        "Shoal installs realtime.messages",
        Duration::from_secs(20),
        || {
            run_sql(
                s.pg,
                &s.db,
                "SELECT to_regclass('realtime.messages') IS NOT NULL",
            ) == "t"
        },
    )
    .await;
    run_sql(s.pg, &s.db, policies);
}

/// Joins `topic` (private or not) and waits for the answer.
async fn join(p: &mut Phx, topic: &str, private: bool) -> serde_json::Value {
    p.join(topic, serde_json::json!({ "private": private }))
        .await
}

/// The next broadcast's payload (`{type, event, payload, meta}`).
async fn broadcast(p: &mut Phx) -> serde_json::Value {
    p.until(|m| m["event"] == "broadcast").await["payload"].clone()
}

const OWN_ROOM: &str = "(current_setting('request.jwt.claims', true)::json->>'sub')";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_channels_follow_the_policies_and_realtime_send_reaches_each_kind() {
    let s = setup("rt_private", "SELECT 1");
    with_policies(
        &s,
        &format!(
            "CREATE POLICY read_own ON realtime.messages FOR SELECT TO authenticated
               USING (realtime.topic() = 'room:' || {OWN_ROOM});
             CREATE POLICY alice_writes ON realtime.messages FOR INSERT TO authenticated
               WITH CHECK (realtime.topic() = 'room:' || {OWN_ROOM} AND {OWN_ROOM} = 'alice');"
        ),
    )
    .await;
    let mut alice = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let mut alice2 = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let mut bob = Phx::connect(s.rt, "acme", &token("bob")).await.unwrap();
    let mut public = Phx::connect(s.rt, "acme", &token("eve")).await.unwrap();
    assert_eq!(
        join(&mut alice, "realtime:room:alice", true).await["status"],
        "ok"
    );
    assert_eq!(
        join(&mut alice2, "realtime:room:alice", true).await["status"],
        "ok"
    );
    let refused = join(&mut bob, "realtime:room:alice", true).await;
    assert_eq!(
        refused["response"]["reason"],
        "Unauthorized: You do not have permissions to read from this Channel topic: room:alice",
        "{refused}"
    );
    assert_eq!(
        join(&mut bob, "realtime:room:bob", true).await["status"],
        "ok"
    );
    // The public channel of the same name is another channel.
    assert_eq!(
        join(&mut public, "realtime:room:alice", false).await["status"],
        "ok"
    );

    // From the database: private to the private channel, public to the public one.
    run_sql(
        s.pg,
        &s.db,
        "SELECT realtime.send('{\"n\": 1}', 'note', 'room:alice', true);
         SELECT realtime.send('{\"n\": 2}', 'note', 'room:alice', false);",
    );
    let got = broadcast(&mut alice).await;
    assert_eq!(got["event"], "note");
    assert_eq!(got["payload"]["n"], 1);
    // The message's id, in the payload (as Supabase's realtime.send adds it) and the meta.
    assert!(got["meta"]["id"].is_string(), "{got}");
    assert_eq!(got["payload"]["id"], got["meta"]["id"], "{got}");
    assert_eq!(broadcast(&mut alice2).await["payload"]["n"], 1);
    assert_eq!(broadcast(&mut public).await["payload"]["n"], 2);

    // Sending on a private channel needs the write policy.
    alice
        .push(
            "realtime:room:alice",
            "broadcast",
            serde_json::json!({"type": "broadcast", "event": "hi", "payload": {"from": "alice"}}),
        )
        .await;
    let got = broadcast(&mut alice2).await;
    assert_eq!(got["payload"]["from"], "alice", "{got}");
    let r = bob
        .push(
            "realtime:room:bob",
            "broadcast",
            serde_json::json!({"type": "broadcast", "event": "hi", "payload": {}}),
        )
        .await;
    let reply = bob.reply(&r).await;
    assert_eq!(
        reply["response"]["reason"],
        "Unauthorized: You do not have permissions to write to this Channel topic: room:bob",
        "{reply}"
    );
    // Nothing of Alice's private channel reached the public one but its own message.
    run_sql(
        s.pg,
        &s.db,
        "SELECT realtime.send('{\"n\": 3}', 'note', 'room:alice', false)",
    );
    assert_eq!(broadcast(&mut public).await["payload"]["n"], 3);
    // A token for someone else on Alice's channel: checked again, and shut.
    alice2
        .push(
            "realtime:room:alice",
            "access_token",
            serde_json::json!({"access_token": token("bob")}),
        )
        .await;
    let system = alice2.until(|m| m["event"] == "system").await;
    assert_eq!(
        system["payload"]["message"],
        "Unauthorized: You do not have permissions to read from this Channel topic: room:alice",
        "{system}"
    );
    alice2.until(|m| m["event"] == "phx_close").await;
    // Alice's own channel goes on, and the shut one gets nothing more.
    run_sql(
        s.pg,
        &s.db,
        "SELECT realtime.send('{\"n\": 4}', 'note', 'room:alice', true)",
    );
    assert_eq!(broadcast(&mut alice).await["payload"]["n"], 4);
    // Over HTTP too: a private message needs the write policy.
    let (status, body) = post_broadcast(&s, &token("bob"), "room:alice", 5);
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(
            "Unauthorized: You do not have permissions to write to this Channel topic: room:alice"
        ),
        "{body}"
    );
    let (status, body) = post_broadcast(&s, &token("alice"), "room:alice", 6);
    assert_eq!(status, 202, "{body}");
    assert_eq!(broadcast(&mut alice).await["payload"]["n"], 6);
}

/// POSTs a private message `{"n": n}` to `topic` over HTTP; the status and body.
fn post_broadcast(s: &Setup, token: &str, topic: &str, n: i32) -> (u16, String) {
    let body = serde_json::json!({"messages": [
        {"topic": topic, "event": "note", "payload": {"n": n}, "private": true}
    ]});
    let out = std::process::Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "-X", "POST"])
        .arg(format!("http://{}/t/acme/api/broadcast", s.rt))
        .args(["-H", &format!("Authorization: Bearer {token}")])
        .args([
            "-H",
            "Content-Type: application/json",
            "-d",
            &body.to_string(),
        ])
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (status.trim().parse().unwrap_or(0), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_changes_from_a_trigger_arrive_across_a_cut_stream() {
    let s = setup(
        "rt_bchanges",
        "CREATE TABLE orders (id int PRIMARY KEY, item text);
         CREATE FUNCTION orders_changed() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           PERFORM realtime.broadcast_changes('orders', TG_OP, TG_OP, TG_TABLE_NAME,
             TG_TABLE_SCHEMA, NEW, OLD);
           RETURN NULL;
         END $$;
         CREATE TRIGGER orders_changed AFTER INSERT OR UPDATE OR DELETE ON orders
           FOR EACH ROW EXECUTE FUNCTION orders_changed();",
    );
    with_policies(
        &s,
        "CREATE POLICY orders_feed ON realtime.messages FOR SELECT TO authenticated
           USING (realtime.topic() = 'orders');",
    )
    .await;
    let mut p = Phx::connect(s.rt, "acme", &token("clerk")).await.unwrap();
    assert_eq!(join(&mut p, "realtime:orders", true).await["status"], "ok");
    run_sql(s.pg, &s.db, "INSERT INTO orders VALUES (1, 'tea')");
    let first = broadcast(&mut p).await;
    assert_eq!(first["event"], "INSERT");
    assert_eq!(first["payload"]["operation"], "INSERT");
    assert_eq!(first["payload"]["table"], "orders");
    assert_eq!(first["payload"]["schema"], "public");
    assert_eq!(
        first["payload"]["record"],
        serde_json::json!({"id": 1, "item": "tea"})
    );
    assert!(first["payload"]["old_record"].is_null());
    // The stream is cut; what is written meanwhile still arrives, once, in order.
    s.pg.psql_admin(&format!(
        "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots \
         WHERE slot_name LIKE 'shoal_realtime_%' AND database = '{}'",
        s.db
    ));
    run_sql(
        s.pg,
        &s.db,
        "UPDATE orders SET item = 'coffee' WHERE id = 1; DELETE FROM orders WHERE id = 1;
         INSERT INTO orders VALUES (2, 'cake');",
    );
    let update = broadcast(&mut p).await;
    assert_eq!(update["event"], "UPDATE");
    assert_eq!(update["payload"]["record"]["item"], "coffee");
    assert_eq!(update["payload"]["old_record"]["item"], "tea");
    let delete = broadcast(&mut p).await;
    assert_eq!(delete["event"], "DELETE");
    assert!(delete["payload"]["record"].is_null());
    let insert = broadcast(&mut p).await;
    assert_eq!(insert["payload"]["record"]["id"], 2);
}

const CLIENTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/clients/realtime/");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn realtime_js_joins_a_private_channel_only_as_the_policies_allow() {
    use tokio::io::AsyncBufReadExt;
    let s = setup("rt_private_js", "SELECT 1");
    with_policies(
        &s,
        &format!(
            "CREATE POLICY read_own ON realtime.messages FOR SELECT TO authenticated
               USING (realtime.topic() = 'room:' || {OWN_ROOM});"
        ),
    )
    .await;
    for (user, let_in) in [("alice", true), ("bob", false)] {
        let mut child = tokio::process::Command::new("node")
            .arg(format!("{CLIENTS}private.mjs"))
            .env("RT_URL", format!("ws://{}/t/acme/realtime/v1", s.rt))
            .env("RT_TOKEN", token(user))
            .env("RT_EXPECT", "1")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("node runs");
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first: serde_json::Value =
            serde_json::from_str(&lines.next_line().await.unwrap().expect("a line")).unwrap();
        assert_eq!(first["subscribed"], let_in, "{user}: {first}");
        if !let_in {
            assert!(
                first["error"].as_str().unwrap().contains(
                    "You do not have permissions to read from this Channel topic: room:alice"
                ),
                "{first}"
            );
            continue;
        }
        run_sql(
            s.pg,
            &s.db,
            "SELECT realtime.send('{\"to\": \"alice\"}', 'note', 'room:alice', true)",
        );
        let last: serde_json::Value =
            serde_json::from_str(&lines.next_line().await.unwrap().expect("the notes")).unwrap();
        let notes = last["got"].as_array().expect("the notes");
        assert_eq!(notes.len(), 1, "{last}");
        assert_eq!(notes[0]["to"], "alice", "{last}");
        assert!(notes[0]["id"].is_string(), "{last}");
        child.wait().await.unwrap();
    }
}
