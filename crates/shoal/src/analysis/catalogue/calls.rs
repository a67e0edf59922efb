//! What runs behind the names a statement uses, from the pool's catalogue: the functions of
//! the operators, casts and views the client (or anyone) made. `SELECT 1 ### 2` calls the
//! operator's function, `x::t` a cast's, `SELECT * FROM v` whatever the view's definition
//! calls; a query rule naming that function must see it.
//!
//! Only objects made in the database count (object ids past PostgreSQL's own): the
//! built-in operators and casts run built-in comparison and conversion functions that no
//! rule names. Views are followed through views. Built with the rest of the pool's
//! catalogue (see [`super`]).

use std::collections::{HashMap, HashSet};

use shoal_wire::facts::Facts;

/// The functions behind the names a database defines, by name (a name stands for every
/// object of that name, in any schema).
#[derive(Debug, Default)]
pub struct Calls {
    /// Operator name → the functions (`schema.name`) of every operator of that name.
    operators: HashMap<String, Vec<String>>,
    /// Type name → the functions of every cast to it.
    casts: HashMap<String, Vec<String>>,
    /// Relation name → every function its definition runs (views, through views).
    relations: HashMap<String, Vec<String>>,
}

impl Calls {
    /// Builds it from the catalogue's lists (see [`super::row`]): operators and casts made
    /// in the database with their functions, and views with their definitions (parsed here).
    pub(super) fn new(
        operators: &[(String, String)],
        casts: &[(String, String)],
        views: &[(&str, &str)],
    ) -> Calls {
        let mut c = Calls::default();
        for (name, f) in operators {
            c.operators
                .entry(name.clone())
                .or_default()
                .push(f.to_lowercase());
        }
        for (name, f) in casts {
            c.casts
                .entry(name.clone())
                .or_default()
                .push(f.to_lowercase());
        }
        // A view that cannot be parsed calls anything: it is named as calling "*", which
        // no rule names, and refused by `unknown` instead.
        let defs: HashMap<String, Option<Facts>> = views
            .iter()
            .map(|(name, def)| (name.to_string(), shoal_wire::facts::facts(def).ok()))
            .collect();
        for name in defs.keys() {
            let mut seen = HashSet::new();
            let mut out = Vec::new();
            c.view_calls(name, &defs, &mut seen, &mut out);
            out.sort();
            out.dedup();
            c.relations.insert(name.clone(), out);
        }
        c
    }

    /// Every function `name`'s definition runs, and those of the views it reads.
    fn view_calls(
        &self,
        name: &str,
        defs: &HashMap<String, Option<Facts>>,
        seen: &mut HashSet<String>,
        out: &mut Vec<String>,
    ) {
        if !seen.insert(name.to_owned()) {
            return;
        }
        let Some(def) = defs.get(name) else { return };
        let Some(f) = def else {
            out.push(UNKNOWN.into());
            return;
        };
        out.extend(f.functions.iter().cloned());
        self.direct(f, out);
        for rel in &f.relations {
            self.view_calls(rel, defs, seen, out);
        }
    }

    /// The functions behind `f`'s operators and casts.
    fn direct(&self, f: &Facts, out: &mut Vec<String>) {
        for op in &f.operators {
            out.extend(self.operators.get(op).into_iter().flatten().cloned());
        }
        for t in &f.casts {
            out.extend(self.casts.get(t).into_iter().flatten().cloned());
        }
    }

    /// The functions a statement runs without naming them: behind its operators, its
    /// casts and the views it reads ([`UNKNOWN`] for a view that could not be read).
    pub fn behind(&self, f: &Facts) -> Vec<String> {
        let mut out = Vec::new();
        self.direct(f, &mut out);
        for rel in &f.relations {
            out.extend(self.relations.get(rel).into_iter().flatten().cloned());
        }
        out
    }
}

/// Stands for whatever a view Shoal could not parse calls.
pub const UNKNOWN: &str = "*";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn functions_behind_operators_casts_and_views_are_found() {
        let c = Calls::new(
            &[("##".into(), "pg_catalog.pg_sleep".into())],
            &[("mood".into(), "public.to_mood".into())],
            &[
                ("slow", "SELECT pg_sleep(1) AS s"),
                ("on_slow", "SELECT * FROM slow"),
                ("via_op", "SELECT ## 1.0 AS s"),
                ("plain", "SELECT 1 AS n"),
            ],
        );
        let behind = |sql: &str| c.behind(&shoal_wire::facts::facts(sql).unwrap());
        assert_eq!(behind("SELECT ## 0.1"), ["pg_catalog.pg_sleep"]);
        assert_eq!(behind("SELECT 1::mood"), ["public.to_mood"]);
        assert_eq!(behind("SELECT * FROM on_slow"), ["pg_sleep"]);
        assert_eq!(behind("SELECT * FROM via_op"), ["pg_catalog.pg_sleep"]);
        assert!(behind("SELECT * FROM plain").is_empty());
        assert!(
            behind("SELECT 1 + 1").is_empty(),
            "built-in operators call nothing named"
        );
    }
}
