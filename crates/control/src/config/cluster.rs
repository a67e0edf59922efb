//! `[cluster]`: this node's place in a cluster of Shoal nodes coordinated by etcd. No section:
//! a single node, exactly as without it.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

/// `[cluster]` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// etcd endpoints, `http://host:port` or `https://host:port`.
    pub etcd: Vec<String>,
    /// This node's name in the cluster (default: the host name and the first listen port).
    pub node_id: Option<String>,
    /// The address other nodes relay clients to this node on.
    pub relay_listen: SocketAddr,
    /// Seconds a node stays registered without renewing (default 5).
    #[serde(
        deserialize_with = "super::duration::seconds",
        default = "default_lease_ttl"
    )]
    pub lease_ttl: f64,
    /// Seconds a relayed client stays idle before its owner lets its session go (0: never).
    #[serde(
        deserialize_with = "super::duration::seconds",
        default = "default_park_idle_after"
    )]
    pub park_idle_after: f64,
    /// Environment variable holding the secret node links authenticate with.
    pub secret_env: String,
    /// TLS on node links: this node's certificate and key, and the CA of every node's.
    pub tls_cert: Option<std::path::PathBuf>,
    pub tls_key: Option<std::path::PathBuf>,
    pub tls_ca: Option<std::path::PathBuf>,
}

fn default_lease_ttl() -> f64 {
    5.0
}

fn default_park_idle_after() -> f64 {
    10.0
}

/// `[cluster]` checked, with its secret read.
#[derive(Clone)]
pub struct Cluster {
    pub etcd: Vec<String>,
    pub node_id: String,
    pub relay_listen: SocketAddr,
    pub lease_ttl: Duration,
    /// How long a relayed client idles before it is parked (`None`: never).
    pub park_idle_after: Option<Duration>,
    /// Never logged (see the `Debug` impl).
    pub secret: String,
    pub tls: Option<ClusterTls>,
}

/// Certificates for TLS on node links (PEM files).
#[derive(Debug, Clone)]
pub struct ClusterTls {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub ca: std::path::PathBuf,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("etcd", &self.etcd)
            .field("node_id", &self.node_id)
            .field("relay_listen", &self.relay_listen)
            .field("lease_ttl", &self.lease_ttl)
            .field("park_idle_after", &self.park_idle_after)
            .field("secret", &"<redacted>")
            .field("tls", &self.tls)
            .finish()
    }
}

/// Shortest secret accepted: node links are authenticated with it.
const MIN_SECRET: usize = 16;

impl ClusterSection {
    /// Checks the section; `listen_port` names this node by default, `env` reads the secret.
    pub fn resolve(
        self,
        listen_port: Option<u16>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Cluster, String> {
        if self.etcd.is_empty() {
            return Err("cluster.etcd must list at least one endpoint".into());
        }
        if let Some(bad) = self
            .etcd
            .iter()
            .find(|e| !(e.starts_with("http://") || e.starts_with("https://")))
        {
            return Err(format!(
                "cluster.etcd endpoint \"{bad}\" must start with http:// or https://"
            ));
        }
        if !(self.lease_ttl.is_finite() && self.lease_ttl >= 2.0) {
            return Err("cluster.lease_ttl must be at least 2 seconds".into());
        }
        if !(self.park_idle_after.is_finite()
            && (self.park_idle_after == 0.0 || self.park_idle_after >= 0.2))
        {
            return Err(
                "cluster.park_idle_after must be 0 (never park) or at least 0.2 seconds".into(),
            );
        }
        let secret = env(&self.secret_env).ok_or_else(|| {
            format!(
                "cluster.secret_env names {}, which is not set",
                self.secret_env
            )
        })?;
        if secret.len() < MIN_SECRET {
            return Err(format!(
                "the cluster secret ({}) must be at least {MIN_SECRET} bytes",
                self.secret_env
            ));
        }
        let node_id = match self.node_id {
            Some(id) if id.is_empty() || id.contains('/') => {
                return Err("cluster.node_id must be non-empty and without '/'".into())
            }
            Some(id) => id,
            None => format!("{}:{}", host_name(), listen_port.unwrap_or(0)),
        };
        let tls = match (self.tls_cert, self.tls_key, self.tls_ca) {
            (None, None, None) => None,
            (Some(cert), Some(key), Some(ca)) => Some(ClusterTls { cert, key, ca }),
            _ => {
                return Err(
                    "cluster.tls_cert, tls_key and tls_ca go together: give all three or none"
                        .into(),
                )
            }
        };
        if node_id.len() > 255 {
            return Err("cluster.node_id must be at most 255 bytes".into());
        }
        Ok(Cluster {
            tls,
            etcd: self.etcd,
            node_id,
            relay_listen: self.relay_listen,
            lease_ttl: Duration::from_secs_f64(self.lease_ttl),
            park_idle_after: (self.park_idle_after > 0.0)
                .then(|| Duration::from_secs_f64(self.park_idle_after)),
            secret,
        })
    }
}

/// This machine's host name (`localhost` when it has none).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(text: &str) -> ClusterSection {
        toml::from_str(text).unwrap()
    }

    const BASE: &str = "etcd = [\"http://127.0.0.1:2379\"]\nrelay_listen = \"127.0.0.1:7432\"\nsecret_env = \"S\"\n";

    fn env(k: &str) -> Option<String> {
        (k == "S").then(|| "a-long-enough-secret".to_string())
    }

    #[test]
    fn defaults_and_secret() {
        let c = section(BASE).resolve(Some(6432), &env).unwrap();
        assert_eq!(c.lease_ttl, Duration::from_secs(5));
        assert_eq!(c.park_idle_after, Some(Duration::from_secs(10)));
        assert!(c.node_id.ends_with(":6432"), "{}", c.node_id);
        let never = section(&format!(
            "{BASE}park_idle_after = 0
"
        ))
        .resolve(None, &env)
        .unwrap();
        assert_eq!(never.park_idle_after, None);
        assert!(!format!("{c:?}").contains("a-long-enough-secret"));
        let c = section(&format!("{BASE}node_id = \"n1\"\nlease_ttl = 3\n"))
            .resolve(None, &env)
            .unwrap();
        assert_eq!(
            (c.node_id.as_str(), c.lease_ttl),
            ("n1", Duration::from_secs(3))
        );
        assert!(c.tls.is_none());
        let c = section(&format!(
            "{BASE}tls_cert = \"n.crt\"\ntls_key = \"n.key\"\ntls_ca = \"ca.crt\"\n"
        ))
        .resolve(None, &env)
        .unwrap();
        assert_eq!(c.tls.unwrap().ca, std::path::PathBuf::from("ca.crt"));
    }

    #[test]
    fn bad_sections_say_what_is_wrong() {
        let err = |text: &str, env: &dyn Fn(&str) -> Option<String>| {
            section(text).resolve(Some(1), env).unwrap_err()
        };
        assert!(err(&format!("{BASE}lease_ttl = 1\n"), &env).contains("lease_ttl"));
        assert!(err(&format!("{BASE}park_idle_after = 0.01\n"), &env).contains("park_idle_after"));
        assert!(err(&BASE.replace("http://", "tcp://"), &env).contains("http://"));
        assert!(
            err(&BASE.replace("[\"http://127.0.0.1:2379\"]", "[]"), &env).contains("at least one")
        );
        assert!(err(BASE, &|_| None).contains("not set"));
        assert!(err(BASE, &|_| Some("short".into())).contains("at least 16"));
        assert!(err(&format!("{BASE}node_id = \"a/b\"\n"), &env).contains("node_id"));
        assert!(err(&format!("{BASE}tls_cert = \"c.pem\"\n"), &env).contains("all three"));
        assert!(
            toml::from_str::<ClusterSection>("etcd = []\n").is_err(),
            "relay_listen and secret_env are required"
        );
    }
}
