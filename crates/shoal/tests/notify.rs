//! LISTEN/NOTIFY in transaction mode, against the real PostgreSQL: the pool's listener
//! connection delivers to exactly the clients listening, while their transactions run on
//! whichever server is free (pools of one server, so listener and notifier always share it).
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::time::Duration;

use common::raw::{Msg, Raw};
use common::*;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::AsyncMessage;

/// A client whose notifications and notices arrive on a channel, in the order the
/// connection read them.
struct Listener {
    client: tokio_postgres::Client,
    messages: mpsc::UnboundedReceiver<AsyncMessage>,
}

async fn listener(conninfo: &str) -> Listener {
    let (client, mut conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let (tx, messages) = mpsc::unbounded_channel();
    let mut stream = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
    tokio::spawn(async move {
        while let Some(Ok(m)) = stream.next().await {
            if tx.send(m).is_err() {
                break;
            }
        }
    });
    Listener { client, messages }
}

impl Listener {
    /// The next notification: (channel, payload), skipping notices.
    async fn next(&mut self) -> (String, String) {
        loop {
            match self.next_message().await {
                AsyncMessage::Notification(n) => {
                    return (n.channel().to_string(), n.payload().to_string())
                }
                _ => continue,
            }
        }
    }

    async fn next_message(&mut self) -> AsyncMessage {
        tokio::time::timeout(Duration::from_secs(20), self.messages.recv())
            .await
            .expect("a message within 20 s")
            .expect("connection open")
    }

    /// Nothing has arrived (what is asserted after a later notification that must come last
    /// has been received).
    fn nothing_else(&mut self) -> Option<String> {
        match self.messages.try_recv() {
            Ok(AsyncMessage::Notification(n)) => Some(format!("{}: {}", n.channel(), n.payload())),
            Ok(AsyncMessage::Notice(n)) => Some(format!("notice: {}", n.message())),
            Ok(_) => Some("other message".into()),
            Err(_) => None,
        }
    }
}

fn transaction_mode(db: &str) -> Shoal {
    shoal_for(db, "[pool]\npool_size = 1\npool_mode = \"transaction\"\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_gets_every_notification_across_many_transactions_on_a_pool_of_one() {
    let db = unique_db("notify");
    let shoal = transaction_mode(&db);
    let info = shoal.conninfo("app", APP_PASSWORD, &db);
    let mut a = listener(&info).await;
    let mut bystander = listener(&info).await;
    let b = shoal.connect(&db).await;
    a.client.batch_execute("LISTEN jobs").await.unwrap();
    bystander
        .client
        .batch_execute("LISTEN other")
        .await
        .unwrap();
    for i in 0..40i64 {
        b.batch_execute(&format!("NOTIFY jobs, 'job {i}'"))
            .await
            .unwrap();
        // The listener keeps running transactions on the one server between notifications.
        let n: i64 = a
            .client
            .query_one("SELECT $1::bigint + 1", &[&i])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, i + 1);
        assert_eq!(a.next().await, ("jobs".into(), format!("job {i}")));
    }
    // pg_notify, and a transaction's notifications after it commits only (sent by a
    // direct connection: through Shoal it would hold the pool's one server).
    let direct = direct(&db).await;
    direct
        .batch_execute("BEGIN; SELECT pg_notify('jobs', 'in a transaction')")
        .await
        .unwrap();
    b.batch_execute("NOTIFY jobs, 'from b'").await.unwrap();
    assert_eq!(a.next().await, ("jobs".into(), "from b".into()));
    direct.batch_execute("COMMIT").await.unwrap();
    assert_eq!(a.next().await, ("jobs".into(), "in a transaction".into()));
    drop(direct);
    // The client listening to another channel saw none of it.
    b.batch_execute("NOTIFY other, 'last'").await.unwrap();
    assert_eq!(bystander.next().await, ("other".into(), "last".into()));
    assert_eq!(bystander.nothing_else(), None);
    assert_eq!(a.nothing_else(), None);
    // One listener connection beside the pool's one server.
    eventually(
        "the direct connection is gone",
        Duration::from_secs(10),
        || pg().backends(&db) == 2,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlisten_rollback_and_discard_all_stop_delivery_as_in_postgresql() {
    let db = unique_db("notify");
    let shoal = transaction_mode(&db);
    let info = shoal.conninfo("app", APP_PASSWORD, &db);
    let mut a = listener(&info).await;
    let b = shoal.connect(&db).await;
    a.client
        .batch_execute("LISTEN a; ")
        .await
        .expect("one statement with a semicolon");
    a.client.batch_execute("LISTEN \"B c\"").await.unwrap();
    a.client.batch_execute("LISTEN mark").await.unwrap();
    // A LISTEN rolled back is not in force; one committed inside a block is.
    a.client
        .batch_execute("BEGIN; LISTEN rolled; ROLLBACK")
        .await
        .unwrap();
    let t = a.client.transaction().await.unwrap();
    t.batch_execute("LISTEN rolled").await.unwrap();
    t.rollback().await.unwrap();
    let t = a.client.transaction().await.unwrap();
    t.batch_execute("LISTEN committed").await.unwrap();
    t.commit().await.unwrap();
    a.client.batch_execute("UNLISTEN a").await.unwrap();
    b.batch_execute(
        "NOTIFY a, '1'; NOTIFY \"B c\", '2'; NOTIFY rolled, '3'; NOTIFY committed, '4'; NOTIFY mark, 'end'",
    )
    .await
    .unwrap();
    assert_eq!(a.next().await, ("B c".into(), "2".into()));
    assert_eq!(a.next().await, ("committed".into(), "4".into()));
    assert_eq!(a.next().await, ("mark".into(), "end".into()));
    assert_eq!(a.nothing_else(), None);
    // UNLISTEN * and DISCARD ALL: nothing more, until the client listens again.
    a.client.batch_execute("UNLISTEN *").await.unwrap();
    b.batch_execute("NOTIFY \"B c\", 'x'; NOTIFY mark, 'x'")
        .await
        .unwrap();
    a.client.batch_execute("LISTEN mark").await.unwrap();
    a.client.batch_execute("DISCARD ALL").await.unwrap();
    b.batch_execute("NOTIFY mark, 'y'").await.unwrap();
    a.client.batch_execute("LISTEN mark").await.unwrap();
    b.batch_execute("NOTIFY mark, 'z'").await.unwrap();
    assert_eq!(a.next().await, ("mark".into(), "z".into()));
    assert_eq!(a.nothing_else(), None);
    // LISTEN among other statements is not carried, and the client is told so.
    a.client
        .batch_execute("SELECT 1; LISTEN multi")
        .await
        .unwrap();
    match a.next_message().await {
        AsyncMessage::Notice(n) => assert!(n.message().contains("of its own"), "{}", n.message()),
        _ => panic!("expected a warning"),
    }
    b.batch_execute("NOTIFY multi, 'lost'; NOTIFY mark, 'after multi'")
        .await
        .unwrap();
    assert_eq!(a.next().await, ("mark".into(), "after multi".into()));
    assert_eq!(a.nothing_else(), None);
    // The client listens to nothing: the listener connection closes.
    a.client.batch_execute("UNLISTEN mark").await.unwrap();
    eventually(
        "the listener connection closes",
        Duration::from_secs(10),
        || pg().backends(&db) == 1,
    )
    .await;
}

/// A NotificationResponse's process id.
fn notification_pid(m: &Msg) -> i32 {
    i32::from_be_bytes(m.body[0..4].try_into().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_notify_arrives_before_its_ready_for_query_with_its_process_id() {
    let db = unique_db("notify");
    let shoal = transaction_mode(&db);
    let mut a = Raw::login(shoal.addr, "raw", &db, &[]).await;
    a.simple("LISTEN me").await.unwrap();
    for round in 0..5 {
        let mut out = bytes::BytesMut::new();
        common::raw::query(&mut out, &format!("NOTIFY me, 'round {round}'"));
        a.send(&out).await;
        let replies = a.until_ready().await;
        let tags: Vec<char> = replies.iter().map(|m| m.tag).collect();
        assert_eq!(tags, vec!['C', 'A', 'Z'], "PostgreSQL's order");
        let n = &replies[1];
        assert_eq!(
            notification_pid(n),
            a.key.0,
            "the sender is the client as Shoal named it"
        );
        assert!(n.body.ends_with(format!("round {round}\0").as_bytes()));
    }
    // Sent by another client of the pool, through a prepared pg_notify as well: that
    // client's process id, as each sees its own in BackendKeyData.
    let mut c = Raw::login(shoal.addr, "raw", &db, &[]).await;
    c.simple("NOTIFY me, 'from c'").await.unwrap();
    let m = a.recv().await.unwrap();
    assert_eq!((m.tag, notification_pid(&m)), ('A', c.key.0));
    let mut out = bytes::BytesMut::new();
    common::raw::parse(&mut out, "n", "SELECT pg_notify('me', $1)");
    common::raw::bind(&mut out, "", "n", &["prepared"]);
    common::raw::execute(&mut out, "");
    common::raw::sync(&mut out);
    c.send(&out).await;
    c.until_ready().await;
    let mut out = bytes::BytesMut::new();
    common::raw::bind(&mut out, "", "n", &["bound again"]);
    common::raw::execute(&mut out, "");
    common::raw::sync(&mut out);
    c.send(&out).await;
    c.until_ready().await;
    for payload in ["prepared", "bound again"] {
        let m = a.recv().await.unwrap();
        assert_eq!((m.tag, notification_pid(&m)), ('A', c.key.0));
        assert!(m.body.ends_with(format!("{payload}\0").as_bytes()));
    }
    // Sent from another pool: that server's process id.
    let b = shoal.connect(&db).await;
    b.batch_execute("NOTIFY me, 'from b'").await.unwrap();
    let m = a.recv().await.unwrap();
    assert_eq!(m.tag, 'A');
    assert_ne!(notification_pid(&m), a.key.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_listener_connection_is_replaced_and_its_clients_warned() {
    let db = unique_db("notify");
    let shoal = shoal_for(
        &db,
        "[pool]\npool_size = 1\n[metrics]\nlisten = \"127.0.0.1:0\"\n",
    );
    let info = shoal.conninfo("app", APP_PASSWORD, &db);
    let mut a = listener(&info).await;
    let b = shoal.connect(&db).await;
    a.client.batch_execute("LISTEN survive").await.unwrap();
    b.batch_execute("NOTIFY survive, 'before'").await.unwrap();
    assert_eq!(a.next().await, ("survive".into(), "before".into()));
    let killed = pg().psql_admin(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{db}' AND query = 'LISTEN \"survive\"'"
    ));
    assert!(
        killed.contains('t'),
        "the listener connection was found: {killed}"
    );
    // Warned once the listener is back...
    match a.next_message().await {
        AsyncMessage::Notice(n) => assert!(
            n.message().contains("were not delivered"),
            "{}",
            n.message()
        ),
        _ => panic!("expected a warning first"),
    }
    // ...and what is sent afterwards arrives.
    b.batch_execute("NOTIFY survive, 'after'").await.unwrap();
    assert_eq!(a.next().await, ("survive".into(), "after".into()));
    let metrics = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", shoal.metrics.unwrap())])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&metrics.stdout);
    let lost = text
        .lines()
        .find(|l| l.starts_with("shoal_pool_listener_connections_lost_total{") && l.contains(&db))
        .unwrap_or_else(|| panic!("no listener metric in:\n{text}"));
    assert!(lost.ends_with(" 1"), "{lost}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_no_notifications_is_closed_and_others_keep_theirs() {
    let db = unique_db("notify");
    let shoal = transaction_mode(&db);
    let info = shoal.conninfo("app", APP_PASSWORD, &db);
    let mut slow = Raw::login(shoal.addr, "raw", &db, &[]).await;
    slow.simple("LISTEN flood").await.unwrap();
    let mut good = listener(&info).await;
    good.client.batch_execute("LISTEN flood").await.unwrap();
    let b = shoal.connect(&db).await;
    let payload = "x".repeat(7000);
    // 24 MB: more than the slow client's socket buffers and Shoal's bound for it.
    for i in 0..3500 {
        b.execute(
            "SELECT pg_notify('flood', $1)",
            &[&format!("{i} {payload}")],
        )
        .await
        .unwrap();
        let (_, p) = good.next().await;
        assert!(p.starts_with(&format!("{i} ")), "in order");
    }
    // The slow client finds its notifications cut short, then its connection closed (with
    // a FATAL if there was room for it on the socket).
    let mut notifications = 0;
    while let Some(m) = slow.recv().await {
        match m.tag {
            'A' => notifications += 1,
            'E' => assert_eq!(m.code(), "54000", "{}", m.text()),
            _ => panic!("unexpected {m:?}"),
        }
    }
    assert!(notifications < 3500, "{notifications}");
    // Logged as the connection ends, which the client may see first.
    eventually("the overflow logged", Duration::from_secs(10), || {
        shoal.log_contains("notifications unread")
    })
    .await;
    // Others go on.
    b.batch_execute("NOTIFY flood, 'after'").await.unwrap();
    assert_eq!(good.next().await, ("flood".into(), "after".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_passes_listen_through_on_the_clients_own_server() {
    let db = unique_db("notify");
    let shoal = shoal_for(&db, "[pool]\npool_size = 2\npool_mode = \"session\"\n");
    let info = shoal.conninfo("app", APP_PASSWORD, &db);
    let mut a = listener(&info).await;
    let b = shoal.connect(&db).await;
    a.client.batch_execute("LISTEN s").await.unwrap();
    b.batch_execute("NOTIFY s, 'hi'").await.unwrap();
    assert_eq!(a.next().await, ("s".into(), "hi".into()));
    assert_eq!(
        pg().backends(&db),
        2,
        "no listener connection in session mode"
    );
}
