//! Broadcasts from the database as Supabase's users write them, against a real PostgreSQL:
//! `realtime.send` from a trigger under insert policies written with `realtime.topic()`, a
//! refused broadcast that leaves the caller's write standing, binary payloads, and
//! SUBSCRIBED (and `replication_ready`'s system message) meaning that a send right after it
//! arrives.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::changes::*;
use common::phoenix::Phx;
use common::*;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

const OWN_ROOM: &str = "(current_setting('request.jwt.claims', true)::json->>'sub')";

/// `sql` in one transaction as role `authenticated` with user `sub`'s claims.
fn as_user(sub: &str, sql: &str) -> String {
    format!(
        "BEGIN; SET LOCAL ROLE authenticated; \
         SELECT set_config('request.jwt.claims', '{{\"sub\": \"{sub}\"}}', true); {sql}; COMMIT"
    )
}

async fn schema_installed(s: &Setup) {
    eventually(
        "Shoal installs realtime.send_binary",
        Duration::from_secs(20),
        || {
            run_sql(
                s.pg,
                &s.db,
                "SELECT to_regprocedure('realtime.send_binary(bytea,text,text,boolean)') IS NOT NULL",
            ) == "t"
        },
    )
    .await;
}

/// A policy letting each user read the private channel `room:<its sub>`.
fn users_read_their_own_room(s: &Setup) {
    run_sql(
        s.pg,
        &s.db,
        &format!(
            "CREATE POLICY read_own ON realtime.messages FOR SELECT TO authenticated
               USING (realtime.topic() = 'room:' || {OWN_ROOM});"
        ),
    );
}

async fn broadcast(p: &mut Phx) -> serde_json::Value {
    p.until(|m| m["event"] == "broadcast").await["payload"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcasting_trigger_never_fails_the_write_that_fired_it() {
    let s = setup(
        "rt_send",
        "CREATE TABLE notes (id int PRIMARY KEY, room text);
         GRANT SELECT, INSERT ON notes TO authenticated;
         CREATE FUNCTION notes_added() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           PERFORM realtime.send(jsonb_build_object('note', NEW.id), 'note', 'room:' || NEW.room, true);
           RETURN NULL;
         END $$;
         CREATE TRIGGER notes_added AFTER INSERT ON notes
           FOR EACH ROW EXECUTE FUNCTION notes_added();",
    );
    schema_installed(&s).await;
    // Supabase's documented pattern: who may send is decided on realtime.topic().
    run_sql(
        s.pg,
        &s.db,
        &format!(
            "CREATE POLICY read_own ON realtime.messages FOR SELECT TO authenticated
               USING (realtime.topic() = 'room:' || {OWN_ROOM});
             CREATE POLICY write_own ON realtime.messages FOR INSERT TO authenticated
               WITH CHECK (realtime.topic() = 'room:' || {OWN_ROOM});"
        ),
    );
    let mut alice = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let joined = alice
        .join(
            "realtime:room:alice",
            serde_json::json!({ "private": true }),
        )
        .await;
    assert_eq!(joined["status"], "ok", "{joined}");

    // Alice's write to her own room: the policy sees the channel and lets it through; the
    // payload carries the message's id, as the meta does.
    run_sql(
        s.pg,
        &s.db,
        &as_user("alice", "INSERT INTO notes VALUES (1, 'alice')"),
    );
    let got = broadcast(&mut alice).await;
    assert_eq!(got["event"], "note");
    assert_eq!(got["payload"]["note"], 1);
    let id = got["payload"]["id"].as_str().expect("an id in the payload");
    assert_eq!(got["meta"]["id"], id, "{got}");

    // Bob's write to a note in Alice's room: the broadcast is refused by the policy, which
    // is a WARNING; Bob's row stands, and nothing reaches Alice.
    let (_, warnings) = run_sql_output(
        s.pg,
        &s.db,
        &as_user("bob", "INSERT INTO notes VALUES (2, 'alice')"),
    );
    assert!(
        warnings.contains("realtime.send: the broadcast to \"room:alice\" was not sent")
            && warnings.contains("42501"),
        "{warnings}"
    );
    assert_eq!(run_sql(s.pg, &s.db, "SELECT count(*) FROM notes"), "2");

    // The caller's realtime.topic() is left as it was.
    let (out, _) = run_sql_output(
        s.pg,
        &s.db,
        &as_user(
            "alice",
            "SELECT set_config('realtime.topic', 'before', true); \
             SELECT realtime.send('[1]', 'list', 'room:alice', true); \
             SELECT realtime.topic()",
        ),
    );
    assert_eq!(out.lines().last(), Some("before"), "{out}");
    // A payload that is not an object is sent as it is.
    let list = broadcast(&mut alice).await;
    assert_eq!(list["event"], "list");
    assert_eq!(list["payload"], serde_json::json!([1]));
    // Nothing of Bob's arrived in between.
    assert_ne!(list["payload"]["note"], 2);
}

/// A protocol 2.0 socket: its binary frames carry binary broadcasts.
async fn v2_socket(s: &Setup, sub: &str, topic: &str) -> common::phoenix::Ws {
    let url = format!(
        "ws://{}/t/acme/socket/websocket?vsn=2.0.0&apikey={}",
        s.rt,
        token(sub)
    );
    let tcp = tokio::net::TcpStream::connect(s.rt).await.unwrap();
    let (mut ws, _) = tokio_tungstenite::client_async(url, tcp).await.unwrap();
    let join = serde_json::json!(["1", "1", topic, "phx_join", {"config": {"private": true}}]);
    ws.send(Message::text(join.to_string())).await.unwrap();
    loop {
        let m = next_frame(&mut ws).await;
        if let Message::Text(t) = m {
            let v: serde_json::Value = serde_json::from_str(&t).unwrap();
            if v[3] == "phx_reply" && v[1] == "1" {
                assert_eq!(v[4]["status"], "ok", "{v}");
                return ws;
            }
        }
    }
}

async fn next_frame(ws: &mut common::phoenix::Ws) -> Message {
    tokio::time::timeout(Duration::from_secs(15), ws.next())
        .await
        .expect("a frame within 15 s")
        .expect("the socket is open")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_binary_reaches_protocol_two_sockets_as_a_binary_broadcast() {
    let s = setup("rt_send_bin", "SELECT 1");
    schema_installed(&s).await;
    users_read_their_own_room(&s);
    let mut ws = v2_socket(&s, "alice", "realtime:room:alice").await;
    run_sql(
        s.pg,
        &s.db,
        "SELECT realtime.send_binary('\\x00ff10'::bytea, 'blob', 'room:alice', true)",
    );
    let frame = loop {
        if let Message::Binary(b) = next_frame(&mut ws).await {
            break b;
        }
    };
    // User broadcast (4), the topic's, event's and meta's lengths, binary encoding (0).
    assert_eq!(frame[0], 4, "{frame:?}");
    let (topic_len, event_len, meta_len) =
        (frame[1] as usize, frame[2] as usize, frame[3] as usize);
    assert_eq!(frame[4], 0, "binary encoding");
    let body = &frame[5..];
    assert_eq!(&body[..topic_len], b"realtime:room:alice");
    assert_eq!(&body[topic_len..topic_len + event_len], b"blob");
    assert_eq!(
        &body[topic_len + event_len + meta_len..],
        &[0u8, 255, 16][..]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_right_after_subscribed_arrives_and_replication_ready_says_so() {
    // A tenant without any channel before: its capture starts with this join.
    let s = setup("rt_send_first", "SELECT 1");
    schema_installed(&s).await;
    for round in 0..5 {
        let mut p = Phx::connect(s.rt, "acme", &token("eve")).await.unwrap();
        let topic = format!("realtime:lobby{round}");
        let joined = p
            .join(
                &topic,
                serde_json::json!({ "broadcast": { "replication_ready": true } }),
            )
            .await;
        assert_eq!(joined["status"], "ok", "{joined}");
        let system = p.until(|m| m["event"] == "system").await;
        assert_eq!(system["payload"]["status"], "ok", "{system}");
        assert_eq!(
            system["payload"]["message"],
            "Replication connection established"
        );
        assert_eq!(system["payload"]["extension"], "system");
        run_sql(
            s.pg,
            &s.db,
            &format!(
                "SELECT realtime.send('{{\"round\": {round}}}', 'hello', 'lobby{round}', false)"
            ),
        );
        let got = broadcast(&mut p).await;
        assert_eq!(got["payload"]["round"], round, "{got}");
        // Leaving the only channel ends the capture: the next round starts it again.
        let r = p.push(&topic, "phx_leave", serde_json::json!({})).await;
        p.reply(&r).await;
        eventually(
            "the capture stops with the last channel",
            Duration::from_secs(20),
            || {
                run_sql(
                    s.pg,
                    &s.db,
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'shoal_realtime_%' AND database = current_database()",
                ) == "0"
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_logical_decoding_public_channels_are_joined_without_database_broadcasts() {
    // wal_level = replica: the database cannot be streamed from.
    let s = setup_on(pg(), "rt_send_nolog", "SELECT 1");
    for round in 0..3 {
        let mut p = Phx::connect(s.rt, "acme", &token("eve")).await.unwrap();
        let config =
            serde_json::json!({ "broadcast": { "replication_ready": true, "self": true } });
        let joined = p.join("realtime:lobby", config).await;
        assert_eq!(joined["status"], "ok", "{joined}");
        let system = p.until(|m| m["event"] == "system").await;
        assert_eq!(system["payload"]["status"], "error", "{system}");
        let message = system["payload"]["message"].as_str().unwrap();
        assert!(
            message.starts_with("Unable to capture broadcasts from the database"),
            "{message}"
        );
        // Broadcasts between clients need no database.
        p.broadcast(
            "realtime:lobby",
            "hi",
            serde_json::json!({ "round": round }),
        )
        .await;
        assert_eq!(broadcast(&mut p).await["payload"]["round"], round);
    }
}

/// The next broadcast, which must be a replayed one; its `n`.
async fn replayed(p: &mut Phx) -> i64 {
    let got = broadcast(p).await;
    assert_eq!(got["meta"]["replayed"], true, "{got}");
    assert!(got["meta"]["id"].is_string(), "{got}");
    got["payload"]["n"].as_i64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_channel_replays_earlier_broadcasts_from_the_database() {
    let s = setup("rt_replay", "SELECT 1");
    schema_installed(&s).await;
    users_read_their_own_room(&s);
    let send = |n: i32, room: &str| {
        run_sql(
            s.pg,
            &s.db,
            &format!("SELECT realtime.send('{{\"n\": {n}}}', 'note', 'room:{room}', true)"),
        );
    };
    send(1, "alice");
    let since = run_sql(
        s.pg,
        &s.db,
        "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
    );
    let since: i64 = since.parse().unwrap();
    for n in 2..=4 {
        send(n, "alice");
    }
    send(9, "bob");
    // Everything since `since`, oldest first; then live messages, not marked replayed.
    let mut all = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let config =
        serde_json::json!({ "private": true, "broadcast": { "replay": { "since": since } } });
    let joined = all.join("realtime:room:alice", config).await;
    assert_eq!(joined["status"], "ok", "{joined}");
    for n in 2..=4 {
        assert_eq!(replayed(&mut all).await, n);
    }
    send(5, "alice");
    let live = broadcast(&mut all).await;
    assert_eq!(live["payload"]["n"], 5);
    assert!(live["meta"].get("replayed").is_none(), "{live}");
    // The last `limit` of them.
    let mut two = Phx::connect(s.rt, "acme", &token("alice")).await.unwrap();
    let config = serde_json::json!({ "private": true, "broadcast": { "replay": { "since": since, "limit": 2 } } });
    assert_eq!(
        two.join("realtime:room:alice", config).await["status"],
        "ok"
    );
    assert_eq!(replayed(&mut two).await, 4);
    assert_eq!(replayed(&mut two).await, 5);
    // The policies decide what is replayed: Bob's own room only.
    let mut bob = Phx::connect(s.rt, "acme", &token("bob")).await.unwrap();
    let config = serde_json::json!({ "private": true, "broadcast": { "replay": { "since": 0 } } });
    assert_eq!(bob.join("realtime:room:bob", config).await["status"], "ok");
    assert_eq!(replayed(&mut bob).await, 9);
    // Refused: a public channel, a limit past 25.
    let mut eve = Phx::connect(s.rt, "acme", &token("eve")).await.unwrap();
    let public = eve
        .join(
            "realtime:lobby",
            serde_json::json!({ "broadcast": { "replay": { "since": 0 } } }),
        )
        .await;
    assert_eq!(public["status"], "error");
    assert_eq!(
        public["response"]["reason"],
        "Replay is only available on private channels"
    );
    let too_many = eve
        .join(
            "realtime:room:eve",
            serde_json::json!({ "private": true, "broadcast": { "replay": { "since": 0, "limit": 26 } } }),
        )
        .await;
    assert_eq!(
        too_many["response"]["reason"],
        "Replay limit must be between 1 and 25"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_on_a_tenant_whose_database_is_down_are_answered_at_once() {
    // Nothing listens where the tenant's database should be.
    let (shoal, _data) = shoal_with_token_api_and(pg(), "[realtime]\nlisten = \"127.0.0.1:0\"\n");
    let body = tenant_body(
        pg(),
        "nowhere",
        serde_json::json!({ "jwt_secret": SECRET, "db_port": free_port() }),
    );
    let (status, text) = api(&shoal, "PUT", "/api/tenants/acme?check=false", &body);
    assert_eq!(status, 201, "{text}");
    let rt = shoal.realtime.expect("realtime listens");
    // Joins that arrive together, while the first attempt to reach the database runs, and
    // one after: each is joined, told there are no broadcasts from the database, and can
    // broadcast.
    let mut joins = Vec::new();
    for i in 0..5 {
        joins.push(tokio::spawn(async move {
            let mut p = Phx::connect(rt, "acme", &token("eve")).await.unwrap();
            let config =
                serde_json::json!({ "broadcast": { "replication_ready": true, "self": true } });
            // Answered well before the next attempt, a minute later (heartbeat replies keep
            // the helper's own wait going).
            let answered = tokio::time::timeout(Duration::from_secs(20), async {
                let joined = p.join(&format!("realtime:room{i}"), config).await;
                (joined, p.until(|m| m["event"] == "system").await)
            });
            let (joined, system) = answered.await.expect("the join is answered within 20 s");
            assert_eq!(joined["status"], "ok", "{joined}");
            assert_eq!(system["payload"]["status"], "error", "{system}");
            p.broadcast(
                &format!("realtime:room{i}"),
                "hi",
                serde_json::json!({ "i": i }),
            )
            .await;
            assert_eq!(broadcast(&mut p).await["payload"]["i"], i);
        }));
    }
    for j in joins {
        j.await.unwrap();
    }
}
