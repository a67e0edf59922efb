//! Network partitions for the cluster's tests: each Shoal node runs in a network namespace
//! of its own (`ip netns`), joined by a veth pair to a bridge in the test's namespace, where
//! etcd and PostgreSQL listen on the bridge's address (the *hub*). nftables rules in a
//! node's namespace cut it from chosen peers or ports silently, dropping packets both ways,
//! as a real partition does (no refusal, no reset: only silence).

use std::process::{Command, Stdio};

/// A bridge and the namespaces of the nodes on it; all removed when dropped.
pub struct Net {
    bridge: String,
    prefix: String,
    tag: String,
    spaces: Vec<String>,
}

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{} runs: {e}", args[0]));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn run_quiet(args: &[&str]) {
    let _ = Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Piped to `nft -f -` in namespace `ns`.
fn nft(ns: &str, script: &str) {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nft runs (Debian package nftables)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nft failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A silent drop, both ways, in `ns`: what `rules` name (nftables matches, one per line:
/// "ip daddr A", "tcp dport P" and the like, with their reverse).
fn cut(ns: &str, outgoing: &[String], incoming: &[String]) {
    let out: String = outgoing.iter().map(|r| format!("{r} drop;\n")).collect();
    let inc: String = incoming.iter().map(|r| format!("{r} drop;\n")).collect();
    nft(
        ns,
        &format!(
            "table inet partition {{\n\
             chain out {{ type filter hook output priority 0;\n{out}}}\n\
             chain in {{ type filter hook input priority 0;\n{inc}}}\n}}\n"
        ),
    );
}

impl Net {
    /// A bridge for the test named by `tag` (a small number, distinct among a binary's
    /// tests) in this process: its subnet is 10.(200 + tag).(pid).0/24.
    pub fn new(tag: u8) -> Net {
        assert!(tag < 50);
        let pid = std::process::id();
        let net = Net {
            bridge: format!("shb{}{tag}", pid % 10_000),
            prefix: format!("10.{}.{}", 200 + u32::from(tag), pid % 250),
            tag: format!("{}{tag}", pid % 10_000),
            spaces: Vec::new(),
        };
        run_quiet(&["ip", "link", "del", &net.bridge]);
        run(&["ip", "link", "add", &net.bridge, "type", "bridge"]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{}/24", net.hub()),
            "dev",
            &net.bridge,
        ]);
        run(&["ip", "link", "set", &net.bridge, "up"]);
        net
    }

    /// Whether this machine lets a test make namespaces and filter in them (root with
    /// CAP_NET_ADMIN and CAP_SYS_ADMIN, `ip` and `nft` installed).
    pub fn available() -> bool {
        let ok = |args: &[&str]| {
            Command::new(args[0])
                .args(&args[1..])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        ok(&["nft", "--version"]) && ok(&["unshare", "-n", "true"])
    }

    /// The test namespace's address on the bridge: etcd and PostgreSQL listen there.
    pub fn hub(&self) -> String {
        format!("{}.1", self.prefix)
    }

    /// Makes namespace number `n` (2..250) on the bridge; returns its name and address.
    pub fn node(&mut self, n: u8) -> (String, String) {
        let ns = format!("shn{}-{n}", self.tag);
        let (outer, inner) = (format!("shv{}{n}", self.tag), format!("shp{}{n}", self.tag));
        let addr = format!("{}.{n}", self.prefix);
        run_quiet(&["ip", "netns", "del", &ns]);
        run(&["ip", "netns", "add", &ns]);
        self.spaces.push(ns.clone());
        run(&[
            "ip", "link", "add", &outer, "type", "veth", "peer", "name", &inner,
        ]);
        run(&["ip", "link", "set", &inner, "netns", &ns]);
        run(&["ip", "link", "set", &outer, "master", &self.bridge, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["ip", "netns", "exec", &ns];
            all.extend_from_slice(args);
            run(&all);
        };
        inside(&["ip", "addr", "add", &format!("{addr}/24"), "dev", &inner]);
        inside(&["ip", "link", "set", &inner, "up"]);
        inside(&["ip", "link", "set", "lo", "up"]);
        (ns, addr)
    }

    /// Cuts namespace `ns` from the addresses `peers`, both ways.
    pub fn cut_from_hosts(&self, ns: &str, peers: &[&str]) {
        let out: Vec<String> = peers.iter().map(|p| format!("ip daddr {p}")).collect();
        let inc: Vec<String> = peers.iter().map(|p| format!("ip saddr {p}")).collect();
        cut(ns, &out, &inc);
    }

    /// Cuts namespace `ns` from TCP port `port` of `host`, both ways.
    pub fn cut_from_port(&self, ns: &str, host: &str, port: u16) {
        cut(
            ns,
            &[format!("ip daddr {host} tcp dport {port}")],
            &[format!("ip saddr {host} tcp sport {port}")],
        );
    }

    /// Lifts every cut of namespace `ns`.
    pub fn heal(&self, ns: &str) {
        run(&[
            "ip",
            "netns",
            "exec",
            ns,
            "nft",
            "delete",
            "table",
            "inet",
            "partition",
        ]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in &self.spaces {
            run_quiet(&["ip", "netns", "del", ns]);
        }
        run_quiet(&["ip", "link", "del", &self.bridge]);
    }
}
