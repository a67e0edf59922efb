//! Reading a whole document and naming every key serde refuses, not only the first: each
//! refused key is taken out of the tree and the rest read again, so a file with three typos
//! gets three messages in one run. Shared by the configuration file (TOML) and the tenant
//! API (JSON).

use std::collections::HashMap;

use serde::de::DeserializeOwned;
use serde_path_to_error::Segment;

/// One step of a path into a document.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Part {
    Key(String),
    Index(usize),
}

/// A refused key: where (its path) and why, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: Vec<Part>,
    pub message: String,
    /// The key is not one the document has (a typo): what the rest means does not depend on
    /// it, unlike a known key whose value was refused.
    pub unknown_key: bool,
}

impl Problem {
    /// `users[0].pool_size`, as serde_path_to_error writes paths.
    pub fn path_text(&self) -> String {
        let mut out = String::new();
        for p in &self.path {
            match p {
                Part::Key(k) if out.is_empty() => out.push_str(k),
                Part::Key(k) => {
                    out.push('.');
                    out.push_str(k);
                }
                Part::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        out
    }
}

/// A document tree a refused key can be taken out of.
pub trait Tree: Clone {
    /// Takes out what `path` names; false when nothing is there (then reading stops).
    fn remove(&mut self, path: &[Part]) -> bool;
}

/// At most this many keys are refused in one read: a document that is wrong everywhere is
/// told its first problems, not an endless list.
const MAX_PROBLEMS: usize = 50;

/// `T` from `doc`, and every key refused on the way. `T` is `None` when what is left cannot
/// be read at all (a required key was refused).
pub fn read_every<T, V>(doc: &V) -> (Option<T>, Vec<Problem>)
where
    T: DeserializeOwned,
    V: Tree + for<'de> serde::Deserializer<'de>,
    for<'de> <V as serde::Deserializer<'de>>::Error: std::fmt::Display,
{
    let mut doc = doc.clone();
    let mut problems: Vec<Problem> = Vec::new();
    // Items taken out of each list so far, by the list's path.
    let mut taken: HashMap<Vec<Part>, usize> = HashMap::new();
    while problems.len() < MAX_PROBLEMS {
        let e = match serde_path_to_error::deserialize::<_, T>(doc.clone()) {
            Ok(t) => return (Some(t), problems),
            Err(e) => e,
        };
        let mut path: Vec<Part> = e
            .path()
            .iter()
            .filter_map(|s| match s {
                Segment::Map { key } => Some(Part::Key(key.clone())),
                Segment::Seq { index } => Some(Part::Index(*index)),
                Segment::Enum { .. } | Segment::Unknown => None,
            })
            .collect();
        let raw = e.inner().to_string();
        let raw = raw.lines().next().unwrap_or("").to_owned();
        // An unknown or missing key is reported at its table: point at the key itself.
        let unknown_key = raw.starts_with("unknown field `");
        if let Some(name) = raw
            .strip_prefix("unknown field `")
            .or_else(|| raw.strip_prefix("missing field `"))
            .and_then(|r| r.split_once('`'))
            .map(|(n, _)| n.to_owned())
        {
            if path.last() != Some(&Part::Key(name.clone())) {
                path.push(Part::Key(name));
            }
        }
        let key = path
            .iter()
            .rev()
            .find_map(|p| match p {
                Part::Key(k) => Some(k.as_str()),
                Part::Index(_) => None,
            })
            .unwrap_or("");
        let message = super::words::in_words(key, &raw);
        let told = as_sent(&path, &taken);
        let repeated = problems.iter().any(|p| p.path == told);
        let removed = !repeated && !path.is_empty() && doc.remove(&path);
        if !repeated {
            problems.push(Problem {
                path: told,
                message,
                unknown_key,
            });
        }
        if !removed {
            return (None, problems);
        }
        if let Some((Part::Index(_), list)) = path.split_last() {
            *taken.entry(list.to_vec()).or_default() += 1;
        }
    }
    (None, problems)
}

/// `path` (into the document as it is now) as the user wrote it: a list's items taken out
/// before shift the later ones down, and serde visits items in order, so every item taken
/// out of a list came before the one named now.
fn as_sent(path: &[Part], taken: &HashMap<Vec<Part>, usize>) -> Vec<Part> {
    path.iter()
        .enumerate()
        .map(|(j, p)| match p {
            Part::Index(i) => Part::Index(i + taken.get(&path[..j]).copied().unwrap_or(0)),
            Part::Key(k) => Part::Key(k.clone()),
        })
        .collect()
}

impl Tree for toml::Value {
    fn remove(&mut self, path: &[Part]) -> bool {
        let Some((last, parents)) = path.split_last() else {
            return false;
        };
        let mut here = self;
        for p in parents {
            let next = match (p, here) {
                (Part::Key(k), toml::Value::Table(t)) => t.get_mut(k),
                (Part::Index(i), toml::Value::Array(a)) => a.get_mut(*i),
                _ => None,
            };
            match next {
                Some(n) => here = n,
                None => return false,
            }
        }
        match (last, here) {
            (Part::Key(k), toml::Value::Table(t)) => t.remove(k).is_some(),
            (Part::Index(i), toml::Value::Array(a)) if *i < a.len() => {
                a.remove(*i);
                true
            }
            _ => false,
        }
    }
}

impl Tree for serde_json::Value {
    fn remove(&mut self, path: &[Part]) -> bool {
        let Some((last, parents)) = path.split_last() else {
            return false;
        };
        let mut here = self;
        for p in parents {
            let next = match (p, here) {
                (Part::Key(k), serde_json::Value::Object(o)) => o.get_mut(k),
                (Part::Index(i), serde_json::Value::Array(a)) => a.get_mut(*i),
                _ => None,
            };
            match next {
                Some(n) => here = n,
                None => return false,
            }
        }
        match (last, here) {
            (Part::Key(k), serde_json::Value::Object(o)) => o.remove(k).is_some(),
            (Part::Index(i), serde_json::Value::Array(a)) if *i < a.len() => {
                a.remove(*i);
                true
            }
            _ => false,
        }
    }
}

/// The 1-based line of what `path` names in TOML `text`, when it is written there.
pub fn toml_line(text: &str, path: &[Part]) -> Option<usize> {
    let doc = toml_edit::ImDocument::parse(text).ok()?;
    let mut item = doc.as_item();
    let mut span = None;
    for p in path {
        match p {
            Part::Key(k) => {
                if let Some(t) = item.as_table_like() {
                    if let Some((key, _)) = t.get_key_value(k) {
                        span = key.span().or(span);
                    }
                }
                item = item.get(k.as_str())?;
            }
            Part::Index(i) => item = item.get(*i)?,
        }
        span = item.span().or(span);
    }
    let start = span?.start;
    Some(text[..start.min(text.len())].matches('\n').count() + 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Doc {
        #[serde(default)]
        a: Inner,
        #[serde(default)]
        list: Vec<Inner>,
    }

    #[derive(Deserialize, Debug, Default)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        #[serde(default)]
        port: u16,
        #[serde(default)]
        on: bool,
    }

    #[test]
    fn every_refused_key_is_named_with_its_line() {
        let text = "[a]\nport = \"x\"\non = 3\nbogus = 1\n\n[[list]]\nport = 99999\n";
        let doc: toml::Value = toml::from_str(text).unwrap();
        let (got, problems) = read_every::<Doc, _>(&doc);
        assert!(got.is_some(), "the rest reads once the bad keys are out");
        let said: Vec<(String, String, Option<usize>)> = problems
            .iter()
            .map(|p| (p.path_text(), p.message.clone(), toml_line(text, &p.path)))
            .collect();
        assert_eq!(
            said,
            vec![
                (
                    "a.bogus".into(),
                    "`bogus` is not a key here (the keys here: port, on)".into(),
                    Some(4)
                ),
                ("a.on".into(), "true or false, not 3".into(), Some(3)),
                (
                    "a.port".into(),
                    "a port between 1 and 65535, not \"x\"".into(),
                    Some(2)
                ),
                (
                    "list[0].port".into(),
                    "a port between 1 and 65535, not 99999".into(),
                    Some(7)
                ),
            ]
        );
    }

    #[test]
    fn json_items_keep_their_indexes() {
        let doc = serde_json::json!({"list": [7, {"port": "x"}, 8, {"port": 1, "on": "yes"}]});
        let (got, problems) = read_every::<Doc, _>(&doc);
        assert!(got.is_some());
        let paths: Vec<String> = problems.iter().map(Problem::path_text).collect();
        assert_eq!(
            paths,
            ["list[0]", "list[1].port", "list[2]", "list[3].on"].map(String::from)
        );
    }
}
