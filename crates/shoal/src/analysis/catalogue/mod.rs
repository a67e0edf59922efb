//! One database's catalogue, as the features that judge statements need it: which
//! functions, operators and casts are immutable or volatile, which relations are plain
//! tables a standby or the cache may read, what row security reads, and what runs behind
//! the operators, casts and views the database's users made.
//!
//! One reading serves every feature of every pool of the database (the cache, the query
//! rules, the replica split): one query, read off the data path by one task (see
//! [`source`]), again when DDL passes through Shoal and when a cheap version check finds
//! the catalogue changed by anyone else. Each feature judges a statement's analysis
//! against the reading of the moment; names are unqualified, and a name stands for every
//! object of that name in any schema, as safe as the least safe of them.

pub mod calls;
mod row;
pub mod source;

use std::collections::{HashMap, HashSet};

use shoal_wire::readonly::Reads;

pub use calls::Calls;
pub use row::{RelationRow, Row, ViewRow};
pub use source::Source;

/// Functions that are not volatile but take a transaction id, which a standby cannot.
const TAKES_XID: [&str; 2] = ["txid_current", "pg_current_xact_id"];

/// One reading of the catalogue.
#[derive(Debug, Default)]
pub struct Catalogue {
    /// It was read (an empty one proves nothing).
    pub loaded: bool,
    /// What the version check compares (see [`row::VERSION`]).
    pub version: String,
    /// Function names whose every overload is IMMUTABLE: a result calling only these
    /// depends on nothing but its inputs.
    pub immutable: HashSet<String>,
    /// Function names whose every overload is STABLE or IMMUTABLE: a statement calling
    /// only these writes nothing through them.
    pub non_volatile: HashSet<String>,
    /// Operators whose every function is IMMUTABLE or a built-in STABLE one (which reads
    /// only settings a cache key holds: `timestamptz = date` reads `TimeZone`), and those
    /// whose every function is non-volatile (an operator runs its function: `1 ### 2` may
    /// write).
    pub immutable_operators: HashSet<String>,
    pub non_volatile_operators: HashSet<String>,
    /// Types whose input function and every cast to them are IMMUTABLE (`'now'::date` and
    /// `('n'||'ow')::timestamptz` read the clock: `date` and `timestamptz` are not), and
    /// those where they are non-volatile.
    pub immutable_types: HashSet<String>,
    pub non_volatile_types: HashSet<String>,
    /// Relations outside temporary schemas, for the cache.
    pub relations: HashMap<String, Relation>,
    /// Relations a standby reads as the primary would: tables, materialized views, foreign
    /// and partitioned tables, and views whose definitions are proven the same way.
    pub readable: HashSet<String>,
    /// An implicit or assignment cast runs a volatile function: any statement may call it
    /// without naming it, so nothing that calls or casts is proven to only read.
    pub volatile_implicit_casts: bool,
    /// What runs behind the database's own operators, casts and views (for query rules).
    pub calls: Calls,
}

/// Every relation of one name (in any schema), as one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Relation {
    /// Plain, permanent, logged tables outside the system schemas, without inheritance
    /// children, whose row security (if on) depends on nothing but the row and the role:
    /// results reading them may be kept, and the change stream sees every change to them.
    pub cacheable: bool,
    /// Plain tables without triggers or rules: a write to them changes only them.
    pub plain_writes: bool,
    /// `schema.name`, quoted, for the cache's publication.
    pub qualified: Vec<String>,
}

impl Catalogue {
    /// Whether everything `r` calls, applies and casts is IMMUTABLE (`immutable`) or
    /// non-volatile.
    pub fn calls_only(&self, r: &Reads, immutable: bool) -> bool {
        let (functions, operators, types) = if immutable {
            (
                &self.immutable,
                &self.immutable_operators,
                &self.immutable_types,
            )
        } else {
            (
                &self.non_volatile,
                &self.non_volatile_operators,
                &self.non_volatile_types,
            )
        };
        // A constant's cast is looked at by the time-word check; a computed value's is not.
        let casts = if immutable {
            &r.computed_casts
        } else {
            &r.casts
        };
        r.functions
            .iter()
            .all(|f| functions.contains(unqualified(f)))
            && r.operators.iter().all(|o| operators.contains(o))
            && casts.iter().all(|t| types.contains(t))
            && (!immutable || r.casts.iter().all(|t| self.non_volatile_types.contains(t)))
    }

    /// Whether a standby runs `r` as the primary would: nothing it calls is volatile or
    /// takes a transaction id, and every relation it reads is [`readable`](Self::readable).
    pub fn standby_reads(&self, r: &Reads) -> bool {
        self.standby_calls(r)
            && r.relations
                .iter()
                .all(|rel| self.readable.contains(&rel.name))
    }

    fn standby_calls(&self, r: &Reads) -> bool {
        !self.volatile_implicit_casts
            && self.calls_only(r, false)
            && !r
                .functions
                .iter()
                .any(|f| TAKES_XID.contains(&unqualified(f)))
    }
}

fn unqualified(f: &str) -> &str {
    f.rsplit('.').next().unwrap_or(f)
}

#[cfg(test)]
mod tests;
