//! One way to write a duration, whichever key takes it: a number of seconds (`5`, `0.25`) or
//! text with a unit (`"5s"`, `"250ms"`, `"2m"`, `"1h 30m"`, humantime's forms). Text that is
//! only a number means seconds too. Keys kept as numbers (`lease_ttl`) and keys kept as text
//! (`cache_ttl`) read the same forms, so `lease_ttl = "3s"` and `cache_ttl = 30` both work.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};

/// What a person is told when a duration cannot be read.
pub const EXPECTED: &str =
    "a duration such as \"5s\", \"250ms\" or \"2m\" (a bare number is seconds)";

/// A duration as written in text: a unit, or a bare number of seconds.
pub fn parse(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    if let Ok(secs) = t.parse::<f64>() {
        return from_secs(secs).ok_or_else(|| format!("\"{text}\" is not {EXPECTED}"));
    }
    humantime::parse_duration(t).map_err(|_| format!("\"{text}\" is not {EXPECTED}"))
}

fn from_secs(secs: f64) -> Option<Duration> {
    (secs.is_finite() && secs >= 0.0)
        .then(|| Duration::try_from_secs_f64(secs).ok())
        .flatten()
}

/// Reads either form; `Written` keeps what each key's code wants from it, and what a null
/// (JSON's, for an optional key) means, if anything.
struct Written<T>(fn(Duration, Option<String>) -> T, Option<T>);

impl<T> Visitor<'_> for Written<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(EXPECTED)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        from_secs(v)
            .map(|d| (self.0)(d, None))
            .ok_or_else(|| E::custom(format!("{v} is not {EXPECTED}")))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        self.visit_f64(v as f64)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        self.visit_f64(v as f64)
    }

    fn visit_unit<E: de::Error>(self) -> Result<T, E> {
        match self.1 {
            Some(none) => Ok(none),
            None => Err(E::custom(format!("null is not {EXPECTED}"))),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        parse(v)
            .map(|d| (self.0)(d, Some(v.to_owned())))
            .map_err(E::custom)
    }
}

/// For a key kept as seconds (`f64`): `#[serde(deserialize_with = "duration::seconds")]`.
pub fn seconds<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(Written(|d, _| d.as_secs_f64(), None))
}

/// For an optional key kept as seconds (`Option<f64>`, with `#[serde(default)]`).
pub fn opt_seconds<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_any(Written(|d, _| Some(d.as_secs_f64()), Some(None)))
}

/// For a key kept as whole seconds (`u64`), rounded up so a short duration is never 0 (off).
pub fn whole_seconds<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(Written(
        |d, _| d.as_secs() + u64::from(d.subsec_nanos() > 0),
        None,
    ))
}

/// For an optional key kept as text (`Option<String>`, with `#[serde(default)]`) and read
/// later with [`parse`]: a number becomes its text, which [`parse`] reads as seconds.
pub fn opt_text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_any(Written(
        |d, text| Some(text.unwrap_or_else(|| format!("{}", d.as_secs_f64()))),
        Some(None),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    struct Keys {
        #[serde(deserialize_with = "seconds")]
        a: f64,
        #[serde(default, deserialize_with = "opt_seconds")]
        b: Option<f64>,
        #[serde(default, deserialize_with = "opt_text")]
        c: Option<String>,
        #[serde(default, deserialize_with = "whole_seconds")]
        d: u64,
    }

    #[test]
    fn numbers_and_text_mean_the_same() {
        let k: Keys = toml::from_str("a = \"3s\"\nb = 0.5\nc = 30\nd = \"1500ms\"").unwrap();
        assert_eq!((k.a, k.b, k.d), (3.0, Some(0.5), 2));
        assert_eq!(parse(k.c.as_deref().unwrap()), Ok(Duration::from_secs(30)));
        let k: Keys = toml::from_str("a = 3\nc = \"2m\"").unwrap();
        assert_eq!((k.a, k.b), (3.0, None));
        assert_eq!(parse("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse(" 1.5 "), Ok(Duration::from_millis(1500)));
    }

    #[test]
    fn json_null_is_an_optional_key_left_out() {
        let k: Keys = serde_json::from_str(r#"{"a": 1, "b": null, "c": null}"#).unwrap();
        assert_eq!((k.b, k.c), (None, None));
        assert!(serde_json::from_str::<Keys>(r#"{"a": null}"#).is_err());
    }

    #[test]
    fn wrong_forms_are_told_in_words() {
        for text in ["a = \"3 parsecs\"", "a = -1", "a = true", "a = \"nan\""] {
            let e = toml::from_str::<Keys>(text).unwrap_err().to_string();
            assert!(e.contains("a duration such as \"5s\""), "{text}: {e}");
        }
    }
}
