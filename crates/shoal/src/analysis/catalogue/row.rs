//! The catalogue's one query and what is made of its row: sets of names by volatility,
//! relations for the cache and the standby, and what runs behind user-made objects.
//! Policies and view definitions are parsed here, off the data path.

use std::collections::{HashMap, HashSet};

use super::{Calls, Catalogue, Relation};

/// What changes when the catalogue does, cheaply: the count and the sum of the row
/// versions' transaction ids of each catalogue Shoal reads. DDL writes new row versions
/// with a newer transaction id (or removes rows), so count or sum move; a temporary
/// object (a client's temp table) is left out, so sessions that make them do not make the
/// catalogue read again. A spurious change (a GRANT, VACUUM FREEZE) costs one reading.
pub const VERSION: &str = "SELECT concat_ws(',', \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_class WHERE relpersistence <> 't'), \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_proc), \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_operator), \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_cast), \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_type WHERE typnamespace NOT IN \
   (SELECT oid FROM pg_namespace WHERE nspname LIKE 'pg\\_temp\\_%' OR nspname LIKE 'pg\\_toast\\_temp\\_%')), \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_rewrite WHERE ev_class NOT IN \
   (SELECT oid FROM pg_class WHERE relpersistence = 't')), \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_policy), \
 (SELECT count(*) || ':' || coalesce(sum(xmin::text::bigint), 0) FROM pg_namespace \
   WHERE nspname NOT LIKE 'pg\\_temp\\_%' AND nspname NOT LIKE 'pg\\_toast\\_temp\\_%'))";

/// Everything, in one row of JSON read in one snapshot (its version with it). A table's
/// row security is judged from its policies' expressions (`pg_depend` records no
/// dependency on built-in functions such as `current_setting`). Only views made in the
/// database are read: PostgreSQL's own (`pg_stat_activity`, `pg_locks`, `pg_settings`)
/// show the state of the server they run on, which a standby's is not, so none is proven
/// readable there.
pub const CATALOGUE: &str = "SELECT json_build_object(\
 'version', (SELECT * FROM (VERSION) v), \
 'functions', (SELECT coalesce(json_agg(json_build_array(proname, i, nv)), '[]') FROM \
   (SELECT proname, bool_and(provolatile = 'i') AS i, bool_and(provolatile <> 'v') AS nv \
    FROM pg_proc GROUP BY proname) f), \
 'operators', (SELECT coalesce(json_agg(json_build_array(oprname, i, nv)), '[]') FROM \
   (SELECT o.oprname, bool_and(p.provolatile = 'i' OR (p.provolatile = 's' AND o.oid < 16384)) AS i, \
      bool_and(p.provolatile <> 'v') AS nv \
    FROM pg_operator o JOIN pg_proc p ON p.oid = o.oprcode GROUP BY o.oprname) x), \
 'types', (SELECT coalesce(json_agg(json_build_array(typname, i, nv)), '[]') FROM \
   (SELECT t.typname, bool_and(i.provolatile = 'i' AND NOT EXISTS (SELECT 1 FROM pg_cast c \
      JOIN pg_proc f ON f.oid = c.castfunc WHERE c.casttarget = t.oid AND f.provolatile <> 'i')) AS i, \
    bool_and(i.provolatile <> 'v' AND NOT EXISTS (SELECT 1 FROM pg_cast c \
      JOIN pg_proc f ON f.oid = c.castfunc WHERE c.casttarget = t.oid AND f.provolatile = 'v')) AS nv \
    FROM pg_type t JOIN pg_proc i ON i.oid = t.typinput GROUP BY t.typname) x), \
 'user_operators', (SELECT coalesce(json_agg(json_build_array(o.oprname, \
   pn.nspname || '.' || p.proname)), '[]') FROM pg_operator o \
   JOIN pg_proc p ON p.oid = o.oprcode JOIN pg_namespace pn ON pn.oid = p.pronamespace \
   WHERE o.oid >= 16384), \
 'user_casts', (SELECT coalesce(json_agg(json_build_array(t.typname, \
   pn.nspname || '.' || p.proname)), '[]') FROM pg_cast c \
   JOIN pg_type t ON t.oid = c.casttarget JOIN pg_proc p ON p.oid = c.castfunc \
   JOIN pg_namespace pn ON pn.oid = p.pronamespace WHERE c.oid >= 16384), \
 'volatile_implicit_casts', EXISTS (SELECT 1 FROM pg_cast c JOIN pg_proc f ON f.oid = c.castfunc \
   WHERE c.castcontext IN ('i', 'a') AND f.provolatile = 'v'), \
 'policies', (SELECT coalesce(json_agg(json_build_array(c.relname, \
   coalesce(pg_get_expr(p.polqual, p.polrelid), 'true'), \
   coalesce(pg_get_expr(p.polwithcheck, p.polrelid), 'true'))), '[]') \
   FROM pg_policy p JOIN pg_class c ON c.oid = p.polrelid), \
 'relations', (SELECT coalesce(json_agg(json_build_array(\
   quote_ident(n.nspname) || '.' || quote_ident(c.relname), c.relname, c.relkind, \
   n.nspname IN ('pg_catalog', 'information_schema'), \
   c.relkind = 'r' AND c.relpersistence = 'p' AND NOT c.relispartition AND NOT c.relhassubclass, \
   c.relkind = 'r' AND NOT c.relhastriggers AND NOT c.relhasrules, c.relrowsecurity)), '[]') \
   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
   WHERE c.relkind IN ('r', 'p', 'v', 'm', 'f') AND c.relpersistence <> 't' \
     AND n.nspname NOT LIKE 'pg\\_toast%'), \
 'views', (SELECT coalesce(json_agg(json_build_array(c.relname, pg_get_viewdef(c.oid), \
   c.relkind, c.oid >= 16384, c.relpersistence = 't')), '[]') \
   FROM pg_class c WHERE c.relkind IN ('v', 'm') AND c.oid >= 16384))::text";

/// The catalogue query's row.
#[derive(Debug, Default, serde::Deserialize)]
pub struct Row {
    pub version: String,
    /// (name, every overload IMMUTABLE, every overload non-volatile).
    pub functions: Vec<(String, bool, bool)>,
    pub operators: Vec<(String, bool, bool)>,
    /// (name, input function and every cast to it IMMUTABLE, ... non-volatile).
    pub types: Vec<(String, bool, bool)>,
    /// Operators and casts made in the database: (name, `schema.function`).
    pub user_operators: Vec<(String, String)>,
    pub user_casts: Vec<(String, String)>,
    pub volatile_implicit_casts: bool,
    /// (table, USING expression, WITH CHECK expression).
    pub policies: Vec<(String, String, String)>,
    pub relations: Vec<RelationRow>,
    pub views: Vec<ViewRow>,
}

/// A relation outside temporary schemas (read from a JSON array, in this order).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct RelationRow {
    /// `schema.name`, quoted.
    pub qualified: String,
    pub name: String,
    /// `relkind`: `r`, `p`, `v`, `m` or `f`.
    pub kind: String,
    /// In `pg_catalog` or `information_schema`.
    pub system: bool,
    /// A plain permanent table without inheritance: cacheable but for row security.
    pub plain: bool,
    /// A plain table without triggers or rules.
    pub plain_writes: bool,
    pub row_security: bool,
}

/// A view or materialized view (read from a JSON array, in this order).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct ViewRow {
    pub name: String,
    pub definition: String,
    pub kind: String,
    /// Made in the database (not one of PostgreSQL's own).
    pub user: bool,
    pub temporary: bool,
}

/// The full query, its version subquery written in.
pub fn query() -> String {
    CATALOGUE.replacen("VERSION", VERSION, 1)
}

impl Catalogue {
    /// Reads the query's row; `None` for a row that is not what the query returns.
    pub fn from_text(text: &str) -> Option<Catalogue> {
        Some(Catalogue::from_row(serde_json::from_str(text).ok()?))
    }

    pub fn from_row(row: Row) -> Catalogue {
        let mut c = Catalogue {
            loaded: true,
            version: row.version,
            volatile_implicit_casts: row.volatile_implicit_casts,
            ..Catalogue::default()
        };
        for (name, immutable, non_volatile) in row.functions {
            sort(
                &mut c.immutable,
                &mut c.non_volatile,
                name,
                immutable,
                non_volatile,
            );
        }
        for (name, immutable, non_volatile) in row.operators {
            let (i, nv) = (&mut c.immutable_operators, &mut c.non_volatile_operators);
            sort(i, nv, name, immutable, non_volatile);
        }
        for (name, immutable, non_volatile) in row.types {
            let (i, nv) = (&mut c.immutable_types, &mut c.non_volatile_types);
            sort(i, nv, name, immutable, non_volatile);
        }
        c.relations = c.cache_relations(&row.policies, &row.relations);
        c.readable = c.standby_readable(&row.relations, &row.views);
        let user_views: Vec<(&str, &str)> = row
            .views
            .iter()
            .filter(|v| v.user)
            .map(|v| (v.name.as_str(), v.definition.as_str()))
            .collect();
        c.calls = Calls::new(&row.user_operators, &row.user_casts, &user_views);
        c
    }

    /// Relations by name for the cache. Row security keeps a table's results only when
    /// every policy depends on nothing but the row and the role (which the key holds): no
    /// other table, nothing but IMMUTABLE calls. `current_setting('request.jwt.claims')`
    /// is STABLE: such a table is not kept.
    fn cache_relations(
        &self,
        policies: &[(String, String, String)],
        relations: &[RelationRow],
    ) -> HashMap<String, Relation> {
        let mut policies_ok: HashMap<&str, bool> = HashMap::new();
        for (table, using, check) in policies {
            let ok = [using, check].iter().all(|expr| {
                shoal_wire::readonly::classify(&format!("SELECT ({expr})")).is_some_and(|r| {
                    r.relations.is_empty() && !r.clock && self.calls_only(&r, true)
                })
            });
            *policies_ok.entry(table).or_insert(true) &= ok;
        }
        let mut out: HashMap<String, Relation> = HashMap::new();
        // The system schemas' names are not the cache's: `information_schema.tables` does
        // not make a table named `tables` uncacheable.
        for rel in relations.iter().filter(|r| !r.system) {
            let cacheable = rel.plain
                && (!rel.row_security
                    || policies_ok.get(rel.name.as_str()).copied().unwrap_or(true));
            let r = out.entry(rel.name.clone()).or_insert(Relation {
                cacheable: true,
                plain_writes: true,
                qualified: Vec::new(),
            });
            // A name in several schemas is as safe as its least safe table.
            r.cacheable &= cacheable;
            r.plain_writes &= rel.plain_writes;
            r.qualified.push(rel.qualified.clone());
        }
        out
    }

    /// The names a standby reads alike. A name any of whose relations is a view is
    /// readable once all its views are proven: each round proves the views whose own
    /// relations are proven; a view that never gets there (a cycle, a write, a volatile
    /// call) stays out.
    fn standby_readable(&self, relations: &[RelationRow], views: &[ViewRow]) -> HashSet<String> {
        let view_names: HashSet<&str> = relations
            .iter()
            .filter(|r| r.kind == "v")
            .map(|r| r.name.as_str())
            .collect();
        let mut readable: HashSet<String> = relations
            .iter()
            .filter(|r| !view_names.contains(r.name.as_str()))
            .map(|r| r.name.clone())
            .collect();
        let proofs: Vec<(&str, Option<shoal_wire::readonly::Reads>)> = views
            .iter()
            .filter(|v| v.kind == "v" && !v.temporary)
            .map(|v| {
                (
                    v.name.as_str(),
                    shoal_wire::readonly::classify(&v.definition),
                )
            })
            .collect();
        loop {
            let mut proven: HashMap<&str, bool> = HashMap::new();
            for (name, proof) in &proofs {
                let ok = proof.as_ref().is_some_and(|r| {
                    r.only_queries
                        && self.standby_calls(r)
                        && r.relations.iter().all(|rel| readable.contains(&rel.name))
                });
                *proven.entry(name).or_insert(true) &= ok;
            }
            let before = readable.len();
            readable.extend(
                proven
                    .into_iter()
                    .filter(|(_, ok)| *ok)
                    .map(|(n, _)| n.to_string()),
            );
            if readable.len() == before {
                return readable;
            }
        }
    }
}

/// Puts `name` in the IMMUTABLE and non-volatile sets it belongs to.
fn sort(
    immutable: &mut HashSet<String>,
    non_volatile: &mut HashSet<String>,
    name: String,
    is_immutable: bool,
    is_non_volatile: bool,
) {
    if is_immutable {
        immutable.insert(name.clone());
    }
    if is_non_volatile {
        non_volatile.insert(name);
    }
}
