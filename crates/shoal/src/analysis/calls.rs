//! What runs behind the names a statement uses, from the pool's catalogue: the functions of
//! the operators, casts and views the client (or anyone) made. `SELECT 1 ### 2` calls the
//! operator's function, `x::t` a cast's, `SELECT * FROM v` whatever the view's definition
//! calls; a query rule naming that function must see it.
//!
//! Only objects made in the database count (object ids past PostgreSQL's own): the
//! built-in operators and casts run built-in comparison and conversion functions that no
//! rule names. Views are followed through views. The catalogue is read off the data path
//! (see [`load`]) and read again after DDL passes through Shoal, and every minute.

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

/// One row of JSON: the database's own operators, casts and views.
pub const CATALOGUE: &str = "SELECT json_build_object(\
 'operators', (SELECT coalesce(json_agg(json_build_array(o.oprname, \
   pn.nspname || '.' || p.proname)), '[]') FROM pg_operator o \
   JOIN pg_proc p ON p.oid = o.oprcode JOIN pg_namespace pn ON pn.oid = p.pronamespace \
   WHERE o.oid >= 16384), \
 'casts', (SELECT coalesce(json_agg(json_build_array(t.typname, \
   pn.nspname || '.' || p.proname)), '[]') FROM pg_cast c \
   JOIN pg_type t ON t.oid = c.casttarget JOIN pg_proc p ON p.oid = c.castfunc \
   JOIN pg_namespace pn ON pn.oid = p.pronamespace WHERE c.oid >= 16384), \
 'views', (SELECT coalesce(json_agg(json_build_array(c.relname, pg_get_viewdef(c.oid))), '[]') \
   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
   WHERE c.relkind IN ('v', 'm') AND c.oid >= 16384))::text";

#[derive(serde::Deserialize)]
struct Row {
    operators: Vec<(String, String)>,
    casts: Vec<(String, String)>,
    views: Vec<(String, String)>,
}

impl Calls {
    /// Builds it from the catalogue's row ([`CATALOGUE`]); views' definitions are parsed
    /// here. `None` for a row that is not what the query returns.
    pub fn from_row(text: &str) -> Option<Calls> {
        let row: Row = serde_json::from_str(text).ok()?;
        let mut c = Calls::default();
        for (name, f) in row.operators {
            c.operators.entry(name).or_default().push(f.to_lowercase());
        }
        for (name, f) in row.casts {
            c.casts.entry(name).or_default().push(f.to_lowercase());
        }
        // A view that cannot be parsed calls anything: it is named as calling "*", which
        // no rule names, and refused by `unknown` instead.
        let defs: HashMap<String, Option<Facts>> = row
            .views
            .into_iter()
            .map(|(name, def)| {
                let facts = shoal_wire::facts::facts(&def).ok();
                (name, facts)
            })
            .collect();
        for name in defs.keys() {
            let mut seen = HashSet::new();
            let mut out = Vec::new();
            c.view_calls(name, &defs, &mut seen, &mut out);
            out.sort();
            out.dedup();
            c.relations.insert(name.clone(), out);
        }
        Some(c)
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
        let row = serde_json::json!({
            "operators": [["##", "pg_catalog.pg_sleep"]],
            "casts": [["mood", "public.to_mood"]],
            "views": [
                ["slow", "SELECT pg_sleep(1) AS s"],
                ["on_slow", "SELECT * FROM slow"],
                ["via_op", "SELECT ## 1.0 AS s"],
                ["plain", "SELECT 1 AS n"],
            ],
        })
        .to_string();
        let c = Calls::from_row(&row).unwrap();
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
