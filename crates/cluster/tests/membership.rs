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
