//! Read replicas of a database: where they are, which statements may go to them, and how
//! stale a replica may be before it gets none (see `docs/replicas.md`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where a client's reads go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ReadRouting {
    /// Everything to the primary (replicas unused).
    #[default]
    Primary,
    /// Every transaction to a replica (for read-only users); the primary only when no
    /// replica is usable and `replica_fallback = "primary"`.
    Replicas,
    /// Each transaction by what it does: proven read-only to a replica, anything else to
    /// the primary.
    Split,
}

/// What a read does when no replica is usable (all down, banned or lagging).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ReplicaFallback {
    /// Run it on the primary.
    #[default]
    Primary,
    /// Fail it with an error (SQLSTATE 08006) rather than load the primary.
    Error,
}

/// What a client asks of its server with the `target_session_attrs` startup parameter
/// (libpq's names): it overrides the database's `read_routing` for that client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TargetSessionAttrs {
    /// The database's `read_routing`.
    Any,
    /// Every transaction on the primary.
    ReadWrite,
    Primary,
    /// Every transaction on a replica; an error when none is usable.
    ReadOnly,
    Standby,
    /// Every transaction on a replica; the primary when none is usable.
    PreferStandby,
}

impl TargetSessionAttrs {
    pub fn parse(value: &str) -> Option<TargetSessionAttrs> {
        Some(match value {
            "any" => TargetSessionAttrs::Any,
            "read-write" => TargetSessionAttrs::ReadWrite,
            "primary" => TargetSessionAttrs::Primary,
            "read-only" => TargetSessionAttrs::ReadOnly,
            "standby" => TargetSessionAttrs::Standby,
            "prefer-standby" => TargetSessionAttrs::PreferStandby,
            _ => return None,
        })
    }

    /// The routing and fallback this asks for (`None`: the database's).
    pub fn routing(self) -> Option<(ReadRouting, ReplicaFallback)> {
        match self {
            TargetSessionAttrs::Any => None,
            TargetSessionAttrs::ReadWrite | TargetSessionAttrs::Primary => {
                Some((ReadRouting::Primary, ReplicaFallback::Primary))
            }
            TargetSessionAttrs::ReadOnly | TargetSessionAttrs::Standby => {
                Some((ReadRouting::Replicas, ReplicaFallback::Error))
            }
            TargetSessionAttrs::PreferStandby => {
                Some((ReadRouting::Replicas, ReplicaFallback::Primary))
            }
        }
    }
}

/// One replica as written: `{ host = "...", port = N, weight = W, zone = "..." }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSection {
    pub host: String,
    #[serde(default = "default_port")]
    pub port: u16,
    #[serde(default = "default_weight")]
    pub weight: u32,
    pub zone: Option<String>,
}

fn default_port() -> u16 {
    5432
}

fn default_weight() -> u32 {
    1
}

/// A database's replicas and how reads reach them, validated.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Replicas {
    pub hosts: Vec<ReplicaHost>,
    pub routing: ReadRouting,
    pub max_lag: MaxLag,
    pub fallback: ReplicaFallback,
    /// How often each backend's role, health and lag are checked.
    pub check_interval: Duration,
    /// How long a replica that failed gets no traffic before it is tried again.
    pub ban_time: Duration,
    /// `prefer_zone`: replicas in this availability zone get reads first.
    pub zone: Option<String>,
}

impl Replicas {
    /// Whether reads may leave the primary at all.
    pub fn in_use(&self) -> bool {
        !self.hosts.is_empty() && self.routing != ReadRouting::Primary
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReplicaHost {
    pub host: String,
    pub port: u16,
    pub weight: u32,
    pub zone: Option<String>,
}

/// How far behind a replica may be and still get reads: WAL bytes not yet replayed, and
/// time since the primary's last transaction it has not replayed. Either limit may be off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxLag {
    pub bytes: Option<u64>,
    pub time: Option<Duration>,
}

impl Default for MaxLag {
    fn default() -> Self {
        MaxLag {
            bytes: None,
            time: Some(Duration::from_secs(10)),
        }
    }
}

/// `max_replica_lag` as written: seconds (a number), or a string with a unit: `"500ms"`,
/// `"5s"`, `"1m"`, or bytes of WAL: `"16MB"`, `"1GB"`, `"65536B"`. Several limits join
/// with `,` (`"5s, 64MB"`); `"off"` lifts the limit.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum MaxLagSection {
    Seconds(f64),
    Text(String),
}

impl MaxLagSection {
    pub fn parse(&self) -> Result<MaxLag, String> {
        let text = match self {
            MaxLagSection::Seconds(s) if s.is_finite() && *s >= 0.0 => {
                return Ok(MaxLag {
                    bytes: None,
                    time: Some(Duration::from_secs_f64(*s)),
                })
            }
            MaxLagSection::Seconds(_) => return Err("a number of seconds ≥ 0".into()),
            MaxLagSection::Text(t) => t,
        };
        let mut lag = MaxLag {
            bytes: None,
            time: None,
        };
        if text.trim().eq_ignore_ascii_case("off") {
            return Ok(lag);
        }
        for part in text.split(',').map(str::trim) {
            let split = part
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(|| format!("\"{part}\" has no unit (ms, s, m, B, kB, MB, GB)"))?;
            let (num, unit) = part.split_at(split);
            let n: f64 = num
                .parse()
                .map_err(|_| format!("\"{part}\" does not start with a number"))?;
            let unit = unit.trim();
            let time = |secs: f64| Some(Duration::from_secs_f64(secs));
            match unit {
                "ms" => lag.time = time(n / 1000.0),
                "s" => lag.time = time(n),
                "m" | "min" => lag.time = time(n * 60.0),
                "B" => lag.bytes = Some(n as u64),
                "kB" | "KB" => lag.bytes = Some((n * 1024.0) as u64),
                "MB" => lag.bytes = Some((n * 1024.0 * 1024.0) as u64),
                "GB" => lag.bytes = Some((n * 1024.0 * 1024.0 * 1024.0) as u64),
                _ => {
                    return Err(format!(
                        "\"{unit}\" is not a unit (ms, s, m, B, kB, MB, GB)"
                    ))
                }
            }
        }
        Ok(lag)
    }
}

/// The replica keys of a database as written (a `[databases.NAME]` section's, or a
/// tenant's).
pub struct ReplicaKeys<'a> {
    pub replicas: &'a [ReplicaSection],
    pub read_routing: Option<ReadRouting>,
    pub max_replica_lag: Option<&'a MaxLagSection>,
    pub replica_fallback: Option<ReplicaFallback>,
    pub replica_check_interval: Option<f64>,
    pub replica_ban_time: Option<f64>,
    pub prefer_zone: Option<&'a str>,
}

impl super::DatabaseSection {
    pub fn replica_keys(&self) -> ReplicaKeys<'_> {
        ReplicaKeys {
            replicas: &self.replicas,
            read_routing: self.read_routing,
            max_replica_lag: self.max_replica_lag.as_ref(),
            replica_fallback: self.replica_fallback,
            replica_check_interval: self.replica_check_interval,
            replica_ban_time: self.replica_ban_time,
            prefer_zone: self.prefer_zone.as_deref(),
        }
    }
}

/// Replica keys, validated; `section` names where they were written, for messages.
pub fn validate(section: &str, d: &ReplicaKeys<'_>) -> Result<Replicas, String> {
    let hosts = d.replicas;
    let routing = d.read_routing;
    let routing = routing.unwrap_or_default();
    if routing != ReadRouting::Primary && hosts.is_empty() {
        return Err(format!(
            "{section}.read_routing = \"{}\" needs replicas: list them in {section}.replicas",
            match routing {
                ReadRouting::Replicas => "replicas",
                _ => "split",
            }
        ));
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(hosts.len());
    for h in hosts {
        if h.host.is_empty() {
            return Err(format!("{section}.replicas: a replica has an empty host"));
        }
        if h.weight == 0 {
            return Err(format!(
                "{section}.replicas: {}:{} has weight 0 (at least 1; remove it to send it nothing)",
                h.host, h.port
            ));
        }
        if !seen.insert((h.host.clone(), h.port)) {
            return Err(format!(
                "{section}.replicas: {}:{} is listed twice",
                h.host, h.port
            ));
        }
        out.push(ReplicaHost {
            host: h.host.clone(),
            port: h.port,
            weight: h.weight,
            zone: h.zone.clone(),
        });
    }
    let max_lag = match d.max_replica_lag {
        Some(m) => m
            .parse()
            .map_err(|e| format!("{section}.max_replica_lag: {e}"))?,
        None => MaxLag::default(),
    };
    let secs = |key: &str, v: Option<f64>, default: f64, min: f64| match v {
        None => Ok(Duration::from_secs_f64(default)),
        Some(s) if s.is_finite() && s >= min => Ok(Duration::from_secs_f64(s)),
        Some(_) => Err(format!(
            "{section}.{key} must be a number of seconds ≥ {min}"
        )),
    };
    Ok(Replicas {
        hosts: out,
        routing,
        max_lag,
        fallback: d.replica_fallback.unwrap_or_default(),
        check_interval: secs(
            "replica_check_interval",
            d.replica_check_interval,
            1.0,
            0.05,
        )?,
        ban_time: secs("replica_ban_time", d.replica_ban_time, 10.0, 0.0)?,
        zone: d.prefer_zone.map(str::to_owned),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lag(s: &str) -> Result<MaxLag, String> {
        MaxLagSection::Text(s.into()).parse()
    }

    #[test]
    fn lag_limits_read_as_written() {
        assert_eq!(
            lag("5s").unwrap(),
            MaxLag {
                bytes: None,
                time: Some(Duration::from_secs(5))
            }
        );
        assert_eq!(
            lag("250ms, 16MB").unwrap(),
            MaxLag {
                bytes: Some(16 << 20),
                time: Some(Duration::from_millis(250))
            }
        );
        assert_eq!(
            lag("off").unwrap(),
            MaxLag {
                bytes: None,
                time: None
            }
        );
        assert_eq!(
            MaxLagSection::Seconds(1.5).parse().unwrap().time,
            Some(Duration::from_millis(1500))
        );
        assert!(lag("5").unwrap_err().contains("no unit"));
        assert!(lag("5 parsecs").unwrap_err().contains("not a unit"));
        assert!(MaxLagSection::Seconds(-1.0).parse().is_err());
    }

    #[test]
    fn replicas_are_checked() {
        let r = |host: &str, port, weight| ReplicaSection {
            host: host.into(),
            port,
            weight,
            zone: None,
        };
        let v = |hosts: &[ReplicaSection], routing| {
            let toml = "host = \"p\"\n";
            let mut d: crate::config::DatabaseSection = toml::from_str(toml).unwrap();
            d.replicas = hosts.to_vec();
            d.read_routing = routing;
            validate("databases.app", &d.replica_keys())
        };
        let err = v(&[], Some(ReadRouting::Split)).unwrap_err();
        assert!(err.contains("needs replicas"), "{err}");
        let err = v(&[r("a", 1, 1), r("a", 1, 2)], None).unwrap_err();
        assert!(err.contains("listed twice"), "{err}");
        let err = v(&[r("a", 1, 0)], None).unwrap_err();
        assert!(err.contains("weight 0"), "{err}");
        let ok = v(&[r("a", 1, 1), r("b", 1, 3)], Some(ReadRouting::Split)).unwrap();
        assert!(ok.in_use());
        assert_eq!(ok.check_interval, Duration::from_secs(1));
        assert!(!v(&[r("a", 1, 1)], None).unwrap().in_use());
    }
}
