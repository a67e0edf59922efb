//! Membership against a real etcd (Debian's `etcd-server`), started by the test on free
//! loopback ports in a temporary directory.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use shoal_cluster::{ClusterError, Membership, MembershipConfig, NodeInfo};

struct Etcd {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A single-member etcd, ready to serve. A port found free can be taken before etcd binds
/// it (by another test's connection): etcd then exits, and it is started on others.
async fn etcd() -> Etcd {
    for _ in 0..3 {
        if let Some(e) = try_etcd().await {
            return e;
        }
    }
    panic!("etcd did not start on three sets of free ports");
}

/// etcd on fresh free ports, once it answers a read; `None` if it exited first.
async fn try_etcd() -> Option<Etcd> {
    let dir = tempfile::tempdir().unwrap();
    let (client, peer) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{client}");
    let child = Command::new("etcd")
        .args([
            "--name",
            "test",
            "--data-dir",
            dir.path().join("data").to_str().unwrap(),
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
            "--initial-cluster",
            &format!("test=http://127.0.0.1:{peer}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd runs (Debian package etcd-server)");
    let mut e = Etcd {
        child,
        url,
        _dir: dir,
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut c) = etcd_client::Client::connect([&e.url], None).await {
            if c.get("ready", None).await.is_ok() {
                return Some(e);
            }
        }
        if let Ok(Some(_)) = e.child.try_wait() {
            return None;
        }
        assert!(tokio::time::Instant::now() < deadline, "etcd did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn config(etcd: &Etcd, id: &str, ttl: u64) -> MembershipConfig {
    MembershipConfig {
        etcd: vec![etcd.url.clone()],
        node: NodeInfo {
            id: id.into(),
            relay: format!("127.0.0.1:{}", free_port()),
            load: 0,
            slot: 0,
        },
        lease_ttl: Duration::from_secs(ttl),
    }
}

/// Waits until `m`'s view satisfies `cond` (a watch, not a poll), failing after `limit`.
async fn until(m: &Membership, limit: Duration, cond: impl Fn(&[String]) -> bool) -> Duration {
    let start = tokio::time::Instant::now();
    let mut w = m.watch();
    let r = tokio::time::timeout(
        limit,
        w.wait_for(|v| cond(&v.keys().cloned().collect::<Vec<_>>())),
    )
    .await;
    assert!(
        r.is_ok(),
        "view did not change in {limit:?}: {:?}",
        m.nodes()
    );
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_see_each_other_and_a_dead_one_goes_within_its_lease() {
    let etcd = etcd().await;
    let a = Membership::join(config(&etcd, "a", 3)).await.unwrap();
    let b = Membership::join(config(&etcd, "b", 3)).await.unwrap();
    until(&a, Duration::from_secs(5), |v| v == ["a", "b"]).await;
    assert_eq!(b.nodes().keys().collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(a.nodes()["b"].relay, b.nodes()["b"].relay);
    // Each holds a slot of its own, and the others see it.
    assert_eq!((a.slot(), b.slot()), (0, 1));
    assert_eq!(a.nodes()["b"].slot, 1);
    // A node's load, updated, reaches the others.
    b.set_load(7).await.unwrap();
    let mut w = a.watch();
    tokio::time::timeout(Duration::from_secs(5), w.wait_for(|v| v["b"].load == 7))
        .await
        .expect("a sees b's load")
        .unwrap();
    // Renewals keep a live node registered well past its TTL.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(a.nodes().len(), 2);
    assert!(*a.lease_alive().borrow());
    // b dies (stops renewing, as a killed process does): gone within the 3 s lease.
    drop(b);
    let took = until(&a, Duration::from_secs(6), |v| v == ["a"]).await;
    assert!(took <= Duration::from_secs(5), "took {took:?}");
    // A node that leaves is gone at once.
    let c = Membership::join(config(&etcd, "c", 30)).await.unwrap();
    assert_eq!(c.slot(), 1, "a dead node's slot is free again");
    until(&a, Duration::from_secs(5), |v| v == ["a", "c"]).await;
    c.leave().await;
    let took = until(&a, Duration::from_secs(5), |v| v == ["a"]).await;
    assert!(took < Duration::from_secs(2), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_id_registers_once_and_a_short_lease_is_refused() {
    let etcd = etcd().await;
    let _a = Membership::join(config(&etcd, "same", 5)).await.unwrap();
    match Membership::join(config(&etcd, "same", 5)).await {
        Err(ClusterError::DuplicateNode(id)) => assert_eq!(id, "same"),
        Err(e) => panic!("expected a duplicate node error, got {e}"),
        Ok(_) => panic!("a second node with one id registered"),
    }
    assert!(matches!(
        Membership::join(config(&etcd, "x", 1)).await,
        Err(ClusterError::LeaseTooShort(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_is_an_error_not_a_hang() {
    let cfg = MembershipConfig {
        etcd: vec![format!("http://127.0.0.1:{}", free_port())],
        node: NodeInfo {
            id: "lonely".into(),
            relay: "127.0.0.1:1".into(),
            load: 0,
            slot: 0,
        },
        lease_ttl: Duration::from_secs(5),
    };
    let r = tokio::time::timeout(Duration::from_secs(30), Membership::join(cfg)).await;
    assert!(
        matches!(r, Ok(Err(ClusterError::Etcd(_)))),
        "{:?}",
        r.map(|x| x.map(|_| ()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_owner_per_pool_until_its_lease_goes() {
    use shoal_cluster::ownership::{owners, Claim};
    let etcd = etcd().await;
    let a = Membership::join(config(&etcd, "a", 2)).await.unwrap();
    let b = Membership::join(config(&etcd, "b", 30)).await.unwrap();
    until(&b, Duration::from_secs(5), |v| v == ["a", "b"]).await;
    // Both compute the same owner from the same view.
    for p in ["p1", "p2", "tenant:x/app/transaction"] {
        assert_eq!(a.hashed_owner(p), b.hashed_owner(p));
    }
    assert_eq!(a.claim("p").await.unwrap(), Claim::Owned);
    assert_eq!(b.claim("p").await.unwrap(), Claim::OwnedBy("a".into()));
    assert_eq!(
        a.claim("p").await.unwrap(),
        Claim::Owned,
        "claiming again is idempotent"
    );
    assert_eq!(b.claim("q").await.unwrap(), Claim::Owned);
    let mut client = etcd_client::Client::connect([&etcd.url], None)
        .await
        .unwrap();
    let mut all = owners(&mut client).await.unwrap();
    all.sort();
    assert_eq!(all, [("p".into(), "a".into()), ("q".into(), "b".into())]);
    // Every node follows the owners.
    let mut w = a.watch_owners();
    tokio::time::timeout(Duration::from_secs(5), w.wait_for(|o| o.len() == 2))
        .await
        .expect("a sees both claims")
        .unwrap();
    assert_eq!(a.owners()["q"], "b");
    // Only the holder releases.
    assert!(!a.release("q").await.unwrap());
    assert!(b.release("q").await.unwrap());
    assert_eq!(a.claim("q").await.unwrap(), Claim::Owned);
    // a dies: its pools are free once its lease expires, and not before b can see it gone.
    drop(a);
    until(&b, Duration::from_secs(6), |v| v == ["b"]).await;
    assert_eq!(b.claim("p").await.unwrap(), Claim::Owned);
    assert_eq!(b.claim("q").await.unwrap(), Claim::Owned);
}

/// A TCP relay to etcd that can cut the link as a dropped route does: nothing passes, no
/// connection is closed, and a connection cut stays stuck after the link heals (only new
/// connections pass again).
struct Link {
    url: String,
    cuts: std::sync::Arc<std::sync::atomic::AtomicU64>,
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Link {
    async fn to(etcd: &Etcd) -> Link {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let target = etcd.url.trim_start_matches("http://").to_owned();
        let cuts = std::sync::Arc::new(AtomicU64::new(0));
        let down = std::sync::Arc::new(AtomicBool::new(false));
        let (c, d) = (cuts.clone(), down.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                    continue;
                };
                let born = c.load(Ordering::SeqCst);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                for (mut from, mut to) in [(cr, sw), (sr, cw)].map(|(r, w)| (Box::new(r), w)) {
                    let (c, d) = (c.clone(), d.clone());
                    tokio::spawn(async move {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = match from.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            if d.load(Ordering::SeqCst) || c.load(Ordering::SeqCst) != born {
                                // Cut: held open, silent, for good.
                                std::future::pending::<()>().await;
                            }
                            if to.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    });
                }
            }
        });
        Link { url, cuts, down }
    }

    fn cut(&self) {
        self.cuts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.down.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn heal(&self) {
        self.down.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A node whose link to etcd was cut, its connection left stuck, renews on a new one once
/// the link heals; cut past its lease's TTL, it stops as an owner and, once the link
/// heals, learns that its registration is over (so the pooler joins again) instead of
/// retrying the dead connection for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_from_etcd_recovers_when_the_link_heals() {
    let etcd = etcd().await;
    let link = Link::to(&etcd).await;

    // A cut well inside a 10 s lease: once healed, a renewal lands on a new connection
    // long before the lease could expire (the stuck one would never answer again).
    let mut cfg = config(&etcd, "short-cut", 10);
    cfg.etcd = vec![link.url.clone()];
    let m = Membership::join(cfg).await.unwrap();
    let mut renewals = m.renewals();
    link.cut();
    tokio::time::sleep(Duration::from_secs(2)).await;
    link.heal();
    let healed = std::time::Instant::now();
    tokio::time::timeout(
        Duration::from_secs(8),
        renewals.wait_for(|at| *at >= healed),
    )
    .await
    .expect("renewed once the link healed")
    .expect("the registration went on");
    assert!(*m.lease_alive().borrow());
    drop(m);

    // Cut past a 2 s lease: etcd expires it; once the link heals the node hears so, and
    // its registration ends (the renewals stop for good).
    let mut cfg = config(&etcd, "long-cut", 2);
    cfg.etcd = vec![link.url.clone()];
    let m = Membership::join(cfg).await.unwrap();
    let mut alive = m.lease_alive();
    let mut renewals = m.renewals();
    link.cut();
    tokio::time::timeout(Duration::from_secs(5), alive.wait_for(|a| !*a))
        .await
        .expect("stops as an owner while cut")
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    link.heal();
    let ended = tokio::time::timeout(Duration::from_secs(15), async {
        while renewals.changed().await.is_ok() {}
    })
    .await;
    assert!(
        ended.is_ok(),
        "the registration never ended after the link healed"
    );
    assert!(!*m.lease_alive().borrow());
}

/// A node restarted within its old lease's TTL (the old process gone, its registration
/// not yet expired) joins once the stale one expires, instead of failing as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_within_its_lease_replaces_its_stale_registration() {
    let etcd = etcd().await;
    let old = Membership::join(config(&etcd, "again", 3)).await.unwrap();
    drop(old); // stops renewing, as a killed process does
    let started = tokio::time::Instant::now();
    let new = tokio::time::timeout(
        Duration::from_secs(10),
        Membership::join(config(&etcd, "again", 3)),
    )
    .await
    .expect("joins within the old lease's TTL")
    .expect("the stale registration is waited out");
    assert!(
        started.elapsed() <= Duration::from_secs(7),
        "{:?}",
        started.elapsed()
    );
    assert!(new.nodes().contains_key("again"));
}
