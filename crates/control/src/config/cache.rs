//! The query result cache's settings: `[databases.NAME] cache`, `cache_ttl`,
//! `cache_all_reads`, `cache_fingerprints`, `cache_max_memory` (a tenant's JSON has the same
//! keys), and `[users.NAME] cache` to turn it off or on for one user.

use std::time::Duration;

/// Entries live this long unless a hint or the database says otherwise.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// A pool's cache holds at most this many bytes of results unless told otherwise.
pub const DEFAULT_MAX_MEMORY: u64 = 64 << 20;
/// The longest TTL a hint may ask for.
pub const MAX_TTL: Duration = Duration::from_secs(24 * 3600);

/// The cache keys of a database as written (a `[databases.NAME]` section's, or a tenant's).
#[derive(Debug, Default, Clone, Copy)]
pub struct CacheKeys<'a> {
    pub cache: Option<bool>,
    pub cache_ttl: Option<&'a str>,
    pub cache_all_reads: Option<bool>,
    pub cache_fingerprints: &'a [String],
    pub cache_max_memory: Option<&'a str>,
}

/// A database's cache, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cache {
    pub enabled: bool,
    /// For entries whose statement's hint names none.
    pub ttl: Duration,
    /// Every read-only statement is cached, not only hinted or listed ones.
    pub all_reads: bool,
    /// pg_query fingerprints (hex) of statements cached without a hint.
    pub fingerprints: Vec<String>,
    /// Bytes of results (and their keys) one pool's cache holds at most.
    pub max_memory: u64,
}

impl Default for Cache {
    fn default() -> Self {
        Cache {
            enabled: false,
            ttl: DEFAULT_TTL,
            all_reads: false,
            fingerprints: Vec::new(),
            max_memory: DEFAULT_MAX_MEMORY,
        }
    }
}

/// Validates the keys; errors name the key (`{section}.cache_ttl`).
pub fn validate(section: &str, k: &CacheKeys<'_>) -> Result<Cache, String> {
    let mut c = Cache {
        enabled: k.cache.unwrap_or(false),
        all_reads: k.cache_all_reads.unwrap_or(false),
        ..Cache::default()
    };
    if let Some(t) = k.cache_ttl {
        c.ttl = parse_ttl(t).map_err(|e| format!("{section}.cache_ttl: {e}"))?;
    }
    if let Some(m) = k.cache_max_memory {
        c.max_memory = parse_size(m).map_err(|e| format!("{section}.cache_max_memory: {e}"))?;
        if c.max_memory < 64 << 10 {
            return Err(format!("{section}.cache_max_memory: at least 64kB"));
        }
    }
    for f in k.cache_fingerprints {
        let hex = f.trim().to_ascii_lowercase();
        if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "{section}.cache_fingerprints: \"{f}\" is not a fingerprint (16 hex digits, as SHOW CACHE and pg_query give)"
            ));
        }
        c.fingerprints.push(hex);
    }
    Ok(c)
}

/// A TTL as written (see [`super::duration`]): `"30s"`, `"500ms"`, `"5m"`, `30`; at least a
/// millisecond, at most [`MAX_TTL`].
pub fn parse_ttl(text: &str) -> Result<Duration, String> {
    let d = super::duration::parse(text)?;
    if d < Duration::from_millis(1) || d > MAX_TTL {
        return Err(format!("\"{text}\" is outside 1ms..24h"));
    }
    Ok(d)
}

/// A size as written: `"64MB"`, `"512kB"`, `"1GB"`, `"4096B"`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("\"{t}\" has no unit (B, kB, MB, GB)"))?;
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("\"{t}\" does not start with a number"))?;
    let scale = match unit.trim() {
        "B" => 1.0,
        "kB" | "KB" => 1024.0,
        "MB" => 1024.0 * 1024.0,
        "GB" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("\"{u}\" is not a unit (B, kB, MB, GB)")),
    };
    Ok((n * scale) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked_and_named() {
        let fp = ["0123456789ABCDEF".to_owned()];
        let c = validate(
            "databases.app",
            &CacheKeys {
                cache: Some(true),
                cache_ttl: Some("2m"),
                cache_all_reads: None,
                cache_fingerprints: &fp,
                cache_max_memory: Some("8MB"),
            },
        )
        .unwrap();
        assert!(c.enabled && !c.all_reads);
        assert_eq!(c.ttl, Duration::from_secs(120));
        assert_eq!(c.max_memory, 8 << 20);
        assert_eq!(c.fingerprints, vec!["0123456789abcdef"]);
        let bad = |k: CacheKeys<'_>| validate("databases.app", &k).unwrap_err();
        assert!(bad(CacheKeys {
            cache_ttl: Some("soon"),
            ..Default::default()
        })
        .starts_with("databases.app.cache_ttl"));
        assert!(bad(CacheKeys {
            cache_ttl: Some("2d"),
            ..Default::default()
        })
        .contains("outside"));
        assert!(bad(CacheKeys {
            cache_max_memory: Some("12"),
            ..Default::default()
        })
        .contains("no unit"));
        let wrong = ["xyz".to_owned()];
        assert!(bad(CacheKeys {
            cache_fingerprints: &wrong,
            ..Default::default()
        })
        .contains("not a fingerprint"));
        assert_eq!(
            validate("d", &CacheKeys::default()).unwrap(),
            Cache::default()
        );
    }
}
