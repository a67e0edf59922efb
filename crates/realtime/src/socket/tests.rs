use super::*;

const LIMITS: Limits = Limits {
    max_channels: 2,
    max_payload: 64,
    max_concurrent_users: None,
    max_events_per_second: None,
    max_joins_per_second: None,
    max_bytes_per_second: None,
    private_only: false,
};

const SECRET: &str = "socket-test-secret";

fn hub_with(limits: Limits) -> Arc<Hub> {
    let hub = std::sync::Arc::new(Hub::default());
    hub.meter().set_limits(limits);
    hub
}

fn token(exp: i64) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &serde_json::json!({"role": "authenticated", "exp": exp}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

fn socket(id: SocketId, vsn: Vsn) -> (Socket, tokio::sync::mpsc::Receiver<Frame>) {
    let (out, rx) = Outbox::new(16);
    let verifier = Arc::new(Verifier::new(Some(SECRET), None));
    let claims = verifier
        .verify(&token(crate::jwt::now() + 3600), crate::jwt::now())
        .unwrap();
    (Socket::new(id, vsn, out, verifier, &claims), rx)
}

fn texts(rx: &mut tokio::sync::mpsc::Receiver<Frame>) -> Vec<String> {
    let mut v = Vec::new();
    while let Ok(f) = rx.try_recv() {
        v.push(match f {
            Frame::Text(t) => t.to_string(),
            Frame::Binary(b) => format!("binary {:?}", &b[..]),
        });
    }
    v
}

#[test]
fn heartbeats_joins_and_leaves_get_their_replies() {
    let hub = hub_with(LIMITS);
    let (mut s, mut rx) = socket(1, Vsn::V2);
    s.on_text(&hub, r#"[null,"1","phoenix","heartbeat",{}]"#)
        .unwrap();
    let join = format!(
        r#"["2","2","realtime:room","phx_join",{{"config":{{"broadcast":{{"self":true,"ack":true}}}},"access_token":"{}"}}]"#,
        token(crate::jwt::now() + 60)
    );
    s.on_text(&hub, &join).unwrap();
    assert_eq!(hub.subscribers("realtime:room"), 1);
    s.on_text(
        &hub,
        r#"["2","3","realtime:nope","broadcast",{"type":"broadcast","event":"e","payload":{}}]"#,
    )
    .unwrap();
    s.on_text(&hub, r#"["2","4","realtime:room","phx_leave",{}]"#)
        .unwrap();
    assert_eq!(
        texts(&mut rx),
        vec![
            r#"[null,"1","phoenix","phx_reply",{"status":"ok","response":{}}]"#,
            r#"["2","2","realtime:room","phx_reply",{"status":"ok","response":{"postgres_changes":[]}}]"#,
            r#"["2","3","realtime:nope","phx_reply",{"status":"error","response":{"reason":"unmatched topic"}}]"#,
            r#"["2","4","realtime:room","phx_reply",{"status":"ok","response":{}}]"#,
            r#"["2","4","realtime:room","phx_close",{}]"#,
        ]
    );
    assert_eq!(hub.subscribers("realtime:room"), 0);
    assert!(s.on_text(&hub, "not a frame").is_err());
}

#[test]
fn broadcasts_go_to_the_others_with_self_and_ack_as_asked() {
    let hub = hub_with(LIMITS);
    let (mut a, mut ra) = socket(1, Vsn::V1);
    let (mut b, mut rb) = socket(2, Vsn::V2);
    a.on_text(
        &hub,
        r#"{"topic":"realtime:room","event":"phx_join","payload":{"config":{"broadcast":{"ack":true}}},"ref":"1","join_ref":"1"}"#,
    )
    .unwrap();
    b.on_text(
        &hub,
        r#"["1","1","realtime:room","phx_join",{"config":{"broadcast":{"self":true}}}]"#,
    )
    .unwrap();
    texts(&mut ra);
    texts(&mut rb);
    a.on_text(
        &hub,
        r#"{"topic":"realtime:room","event":"broadcast","payload":{"type":"broadcast","event":"hi","payload":{"x":1}},"ref":"2","join_ref":"1"}"#,
    )
    .unwrap();
    // `a` did not ask for its own, but asked for an ack.
    assert_eq!(
        texts(&mut ra),
        vec![
            r#"{"topic":"realtime:room","event":"phx_reply","payload":{"status":"ok","response":{}},"ref":"2","join_ref":"1"}"#
        ]
    );
    let got = texts(&mut rb);
    assert_eq!(got.len(), 1);
    assert!(got[0].starts_with("binary [4, 13, 2, 0, 1"), "{got:?}");
    // A 2.0 binary push from `b` reaches `a` as 1.0 text, and `b` itself (`self`).
    let mut push = vec![3, 1, 1, 13, 2, 0, 1];
    push.extend_from_slice(b"12realtime:roomyo");
    push.extend_from_slice(br#"{"y":2}"#);
    b.on_binary(&hub, &push).unwrap();
    assert_eq!(
        texts(&mut ra),
        vec![
            r#"{"topic":"realtime:room","event":"broadcast","payload":{"type":"broadcast","event":"yo","payload":{"y":2}},"ref":null,"join_ref":null}"#
        ]
    );
    assert_eq!(texts(&mut rb).len(), 1);
}

#[test]
fn limits_refuse_with_a_reason() {
    let hub = hub_with(LIMITS);
    let (mut s, mut rx) = socket(1, Vsn::V2);
    for t in ["a", "b", "c"] {
        s.on_text(&hub, &format!(r#"["{t}","{t}","{t}","phx_join",{{}}]"#))
            .unwrap();
    }
    assert_eq!(s.channels(), 2);
    let big = "x".repeat(100);
    s.on_text(
        &hub,
        &format!(
            r#"["a","9","a","broadcast",{{"type":"broadcast","event":"e","payload":"{big}"}}]"#
        ),
    )
    .unwrap();
    let replies = texts(&mut rx);
    assert!(
        replies[2].contains("ChannelRateLimitReached: Too many channels"),
        "{replies:?}"
    );
    assert!(replies[3].contains("max_payload_size_in_kb"), "{replies:?}");
    s.close(&hub);
    assert_eq!(hub.topics(), 0);
}

#[test]
fn tokens_are_checked_on_join_and_update_and_expiry_shuts_the_channel() {
    let hub = hub_with(LIMITS);
    let (mut s, mut rx) = socket(1, Vsn::V2);
    let now = crate::jwt::now();
    // An expired or foreign token in the join is refused with Realtime's reason.
    let join = |topic: &str, token: &str| {
        format!(r#"["1","1","{topic}","phx_join",{{"config":{{}},"access_token":"{token}"}}]"#)
    };
    s.on_text(&hub, &join("realtime:a", &token(now - 5)))
        .unwrap();
    s.on_text(&hub, &join("realtime:a", "x.y.z")).unwrap();
    let replies = texts(&mut rx);
    assert!(
        replies[0].contains(r#""reason":"InvalidJWTToken: Token has expired 5 seconds ago""#)
            || replies[0].contains("Token has expired 6 seconds ago"),
        "{replies:?}"
    );
    assert!(replies[1].contains("MalformedJWT"), "{replies:?}");
    assert_eq!(s.channels(), 0);
    // A channel on a short token expires on its own; one on the socket's token does not.
    s.on_text(&hub, &join("realtime:a", &token(now + 10)))
        .unwrap();
    s.on_text(&hub, r#"["2","2","realtime:b","phx_join",{}]"#)
        .unwrap();
    texts(&mut rx);
    assert_eq!(s.expiry(), Some(now + 10));
    s.expire(&hub, now + 12);
    assert_eq!(
        texts(&mut rx),
        vec![
            r#"["1",null,"realtime:a","system",{"channel":"a","extension":"system","message":"Token has expired 2 seconds ago","status":"error"}]"#,
            r#"["1",null,"realtime:a","phx_close",{}]"#,
        ]
    );
    assert_eq!((s.channels(), hub.subscribers("realtime:a")), (1, 0));
    // A good update moves the expiry; a bad one shuts the channel down.
    let update =
        |t: &str| format!(r#"["2","3","realtime:b","access_token",{{"access_token":"{t}"}}]"#);
    s.on_text(&hub, &update(&token(now + 7))).unwrap();
    assert_eq!(s.expiry(), Some(now + 7));
    let other = jsonwebtoken::encode(
        &jsonwebtoken::Header::default(),
        &serde_json::json!({"role": "anon", "exp": now + 60}),
        &jsonwebtoken::EncodingKey::from_secret(b"another secret"),
    )
    .unwrap();
    s.on_text(&hub, &update(&other)).unwrap();
    let got = texts(&mut rx);
    assert!(
        got[0].contains("Failed to validate JWT signature"),
        "{got:?}"
    );
    assert_eq!(s.channels(), 0);
}

#[test]
fn tenant_rates_and_private_channels_are_enforced_on_joins_and_messages() {
    let hub = hub_with(Limits {
        max_joins_per_second: Some(1),
        max_events_per_second: Some(2),
        ..LIMITS
    });
    let (mut s, mut rx) = socket(1, Vsn::V2);
    s.on_text(&hub, r#"["1","1","realtime:a","phx_join",{}]"#)
        .unwrap();
    s.on_text(&hub, r#"["2","2","realtime:b","phx_join",{}]"#)
        .unwrap();
    let got = texts(&mut rx);
    assert!(got[1].contains("Too many joins per second"), "{got:?}");
    let push =
        r#"["1","3","realtime:a","broadcast",{"type":"broadcast","event":"e","payload":{}}]"#;
    for _ in 0..3 {
        s.on_text(&hub, push).unwrap();
    }
    let got = texts(&mut rx);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        got[0].contains(r#""message":"Too many messages per second""#),
        "{got:?}"
    );
    assert!(got[1].contains("phx_close"), "{got:?}");
    assert_eq!(s.channels(), 0);

    let hub = hub_with(Limits {
        private_only: true,
        ..LIMITS
    });
    s.on_text(&hub, r#"["1","1","realtime:a","phx_join",{}]"#)
        .unwrap();
    s.on_text(
        &hub,
        r#"["2","2","realtime:b","phx_join",{"config":{"private":true}}]"#,
    )
    .unwrap();
    let got = texts(&mut rx);
    assert!(
        got[0].contains("PrivateOnly: This project only allows private channels"),
        "{got:?}"
    );
    assert!(
        got[1].contains("You do not have permissions to read from this Channel topic: b"),
        "{got:?}"
    );
}

/// A resumed socket's re-join with the same config keeps the channel (and its presence):
/// answered as a join, under the new join ref; a second re-join, or one with another
/// config, replaces it as usual.
#[test]
fn a_resumed_socket_keeps_channels_rejoined_alike() {
    let hub = hub_with(LIMITS);
    let (mut s, mut rx) = socket(1, Vsn::V2);
    let (mut other, mut orx) = socket(2, Vsn::V2);
    let join = |r: &str, key: &str| {
        format!(
            r#"["{r}","{r}","realtime:room","phx_join",{{"config":{{"presence":{{"key":"{key}","enabled":true}}}}}}]"#
        )
    };
    s.on_text(&hub, &join("1", "a")).unwrap();
    s.on_text(
        &hub,
        r#"["1","2","realtime:room","presence",{"type":"presence","event":"track","payload":{"x":1}}]"#,
    )
    .unwrap();
    other.on_text(&hub, &join("1", "b")).unwrap();
    assert_eq!(hub.present("realtime:room"), 1);
    texts(&mut rx);
    texts(&mut orx);

    let verifier = Arc::new(Verifier::new(Some(SECRET), None));
    let claims = verifier
        .verify(&token(crate::jwt::now() + 3600), crate::jwt::now())
        .unwrap();
    s.resumed(verifier, &claims);
    s.on_text(&hub, &join("7", "a")).unwrap();
    let got = texts(&mut rx);
    assert_eq!(
        got[0],
        r#"["7","7","realtime:room","phx_reply",{"status":"ok","response":{"postgres_changes":[]}}]"#
    );
    assert!(
        got[1].contains("presence_state") && got[1].contains(r#""a""#),
        "{got:?}"
    );
    assert_eq!(hub.subscribers("realtime:room"), 2);
    assert_eq!(hub.present("realtime:room"), 1, "the presence stayed");
    assert!(
        texts(&mut orx).iter().all(|t| !t.contains("presence_diff")),
        "the other socket saw no leave and join"
    );
    assert_eq!(s.join_ref("realtime:room"), Some("7"));

    // Once only: the next re-join replaces the channel (its presence leaves).
    s.on_text(&hub, &join("8", "a")).unwrap();
    assert_eq!(hub.present("realtime:room"), 0);
    assert!(texts(&mut orx).iter().any(|t| t.contains("presence_diff")));
}
