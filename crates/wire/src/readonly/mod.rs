//! Whether SQL is proven to only read, so that a read replica may run it.
//!
//! A replica refuses writes, but a write sent there is still a failure the client did not
//! ask for; and a statement that only looks like a read (`SELECT ... FOR UPDATE`, a
//! data-modifying `WITH`, `SELECT nextval(...)`) must reach the primary. So this is a proof,
//! not a guess: the text is parsed by PostgreSQL's own grammar (libpg_query) and the tree is
//! walked by a whitelist. Every node type the walk does not know, every statement kind other
//! than a plain query, `SHOW`, `SET`, `EXPLAIN` of a read, and transaction control, and every
//! text that does not parse, means "may write". Function calls are not judged here: their
//! names are returned, for the caller to check against the database's catalogue (a function
//! is read-only only if PostgreSQL knows it as `STABLE` or `IMMUTABLE`).
//!
//! What no parse can see: a `STABLE` function that writes anyway (PostgreSQL does not stop
//! it), or an operator backed by a volatile function. Both are documented limits.

use pg_query::protobuf::{self, node::Node as N, TransactionStmtKind};
use pg_query::NodeEnum;

mod normalize;
#[cfg(test)]
mod tests;

pub use normalize::normalized;

/// What a read-only text needs of the database: the functions it calls, by name (lower
/// case, schema-qualified as written, `.`-joined), each of which must be non-volatile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reads {
    /// Functions called, as the parser names them (unquoted names folded, quoted ones kept:
    /// `"G"()` is `G`, not `g`), qualified when written so.
    pub functions: Vec<String>,
    /// Operators used (`=`, `||`, `~~` for LIKE, `>=` and `<=` for BETWEEN, ...): each runs
    /// the function behind it (`oprcode`), which may be anything.
    pub operators: Vec<String>,
    /// Types cast to (`x::t`, `CAST(x AS t)`, `t 'literal'`; `_t` for an array of `t`): a
    /// cast runs the type's input function or a cast function.
    pub casts: Vec<String>,
    /// Those of `casts` whose value is computed, not a constant or a parameter: a constant's
    /// input can be looked at (`'now'`), a computed one's cannot (`('n'||'ow')::date`).
    pub computed_casts: Vec<String>,
    /// The text opens a transaction block declared `READ ONLY`: the statements that follow
    /// it until its end are the client's promise, enforced by PostgreSQL.
    pub opens_read_only: bool,
    /// The relations it reads, as written (a `WITH` query's own names left out), sorted:
    /// what a cached result of it depends on.
    pub relations: Vec<Relation>,
    /// It reads the clock (`CURRENT_DATE`, `CURRENT_TIMESTAMP`, `LOCALTIME`, ...): its
    /// result changes with time alone.
    pub clock: bool,
    /// Every statement is a plain query (`SELECT`, `VALUES`, `TABLE`, set operations), and
    /// how many there are: only such texts have a result worth keeping.
    pub only_queries: bool,
    pub statements: usize,
    /// Names a `WITH` defines (dropped from `relations` when the walk ends).
    ctes: Vec<String>,
}

/// A relation a query reads: its schema when written, and its name (the parser folded
/// unquoted names to lower case).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Relation {
    pub schema: Option<String>,
    pub name: String,
}

/// `Some` when every statement of `sql` (one or several) only reads, given that the
/// functions named are non-volatile; `None` when it writes, might, or cannot be parsed.
pub fn classify(sql: &str) -> Option<Reads> {
    on_parse_stack(sql, || classify_here(sql)).flatten()
}

/// Runs `parse` (which parses `sql` with libpg_query) where the parse cannot overflow the
/// stack: on the caller's own thread (a data-plane thread never waits for another), and only
/// for texts that cannot nest deeper than `MAX_NESTING` (see [`nesting_estimate`]); `None`
/// for deeper ones, which the caller treats as unknown (fail closed).
pub(crate) fn on_parse_stack<R>(sql: &str, parse: impl FnOnce() -> R) -> Option<R> {
    if nesting_bound(sql.as_bytes()) > MAX_NESTING && nesting_estimate(sql) > MAX_NESTING {
        return None;
    }
    Some(parse())
}

fn classify_here(sql: &str) -> Option<Reads> {
    reads_of(&pg_query::parse(sql).ok()?)
}

/// [`classify`] of a text parsed already.
pub(crate) fn reads_of(parsed: &pg_query::ParseResult) -> Option<Reads> {
    let mut reads = Reads {
        only_queries: true,
        ..Reads::default()
    };
    if parsed.protobuf.stmts.is_empty() {
        reads.only_queries = false;
        return Some(reads);
    }
    for raw in &parsed.protobuf.stmts {
        let node = raw.stmt.as_ref()?.node.as_ref()?;
        if !matches!(node, N::SelectStmt(_)) {
            reads.only_queries = false;
        }
        reads.statements += 1;
        statement(node, &mut reads)?;
    }
    for v in [
        &mut reads.functions,
        &mut reads.operators,
        &mut reads.casts,
        &mut reads.computed_casts,
    ] {
        v.sort();
        v.dedup();
    }
    let ctes = std::mem::take(&mut reads.ctes);
    reads
        .relations
        .retain(|r| r.schema.is_some() || !ctes.contains(&r.name));
    reads.relations.sort();
    reads.relations.dedup();
    Some(reads)
}

/// libpg_query turns its tree into protobuf by recursion, on the caller's stack: a
/// client's `SELECT 1+1+...+1` about a thousand deep overflows a thread's 2 MiB and aborts
/// the process. A tree more than about fifty levels deep cannot be proven anyway (the
/// protobuf decoder gives up at 100 nested messages, two per level), so texts that may nest
/// deeper than this are not parsed at all: they are unknown. Parsing up to this depth takes
/// about half of a thread's usual 2 MiB stack in an unoptimised build (the unit test
/// parses them on 2 MiB), under a third optimised.
const MAX_NESTING: usize = 300;

/// An upper bound on how deep `sql`'s parse tree can nest: every level needs an operator
/// character, an opening parenthesis or a word (a keyword or a name; not a number). Counted
/// over the whole text, strings and comments included, so it only ever overcounts.
fn nesting_bound(sql: &[u8]) -> usize {
    let mut n = 0;
    let mut in_word = false;
    for &b in sql {
        let word = b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
        if word && !in_word && !b.is_ascii_digit() {
            n += 1;
        }
        in_word = word;
        if b"+-*/<>=~!@#%^&|`?(:".contains(&b) {
            n += 1;
        }
    }
    n
}

/// A tighter upper bound than [`nesting_bound`], for texts that one finds long: brackets
/// nest, and within one bracket level only operators and the keywords that build on what
/// is before or after them (`NOT`, `IS`, `UNION`, `JOIN`, ...) can nest; a comma, a `;`, an
/// `AND` or an `OR` ends a run (the grammar flattens `AND` and `OR` chains into one node,
/// so each depth counts three levels for that node, its bracket and a mix of the two).
/// Strings, quoted names and comments are skipped. Summing each depth's longest run can
/// only overcount.
fn nesting_estimate(sql: &str) -> usize {
    use crate::sql::{ClientEncoding, Lexer, Token};
    const NESTING_WORDS: &[&str] = &[
        "not",
        "is",
        "isnull",
        "notnull",
        "case",
        "like",
        "ilike",
        "similar",
        "between",
        "collate",
        "at",
        "overlaps",
        "union",
        "intersect",
        "except",
        "join",
        "in",
        "any",
        "all",
        "some",
        "exists",
        "array",
        "row",
        "escape",
        "operator",
    ];
    let bytes = sql.as_bytes();
    // Longest run at each depth, and the run at the current depth.
    let mut longest: Vec<usize> = vec![0];
    let mut runs: Vec<usize> = vec![0];
    let mut lex = Lexer::new(bytes, ClientEncoding::Utf8);
    let mut last_operator_end = usize::MAX;
    let end_run = |longest: &mut Vec<usize>, runs: &mut Vec<usize>| {
        let d = runs.len() - 1;
        longest[d] = longest[d].max(runs[d]);
        runs[d] = 0;
    };
    while let Some(t) = lex.next() {
        let at = lex.offset();
        let byte = bytes.get(at.wrapping_sub(1)).copied().unwrap_or(0);
        let open = t == Token::OpenParen || (t == Token::Other && byte == b'[');
        let close = t == Token::CloseParen || (t == Token::Other && byte == b']');
        if open {
            runs.push(0);
            if longest.len() < runs.len() {
                longest.push(0);
            }
        } else if close {
            end_run(&mut longest, &mut runs);
            if runs.len() > 1 {
                runs.pop();
            }
        } else if t == Token::Semicolon
            || (t == Token::Other && byte == b',')
            || t.is("and")
            || t.is("or")
        {
            end_run(&mut longest, &mut runs);
        } else if t == Token::Other && b"+-*/<>=~!@#%^&|`?:".contains(&byte) {
            // A run of operator characters is one operator (`||`, `->>`, `::`).
            if last_operator_end != at - 1 {
                *runs.last_mut().unwrap_or(&mut 0) += 1;
            }
            last_operator_end = at;
        } else if NESTING_WORDS.iter().any(|w| t.is(w)) {
            *runs.last_mut().unwrap_or(&mut 0) += 1;
        }
    }
    end_run(&mut longest, &mut runs);
    3 * longest.len() + longest.iter().sum::<usize>()
}

/// One top-level statement.
fn statement(node: &NodeEnum, r: &mut Reads) -> Option<()> {
    match node {
        N::SelectStmt(s) => select(s, r),
        N::VariableShowStmt(_) => Some(()),
        N::VariableSetStmt(s) => {
            // `SET TRANSACTION ...` and `SET SESSION CHARACTERISTICS` change what the
            // transaction may do: the primary decides.
            let name = s.name.to_ascii_lowercase();
            if name.starts_with("transaction") || name == "session_characteristics" {
                return None;
            }
            list(&s.args, r)
        }
        N::ExplainStmt(e) => {
            // EXPLAIN ANALYZE runs its statement: the statement must read, as anything
            // explained must, so one rule covers both.
            let inner = e.query.as_deref()?.node.as_ref()?;
            match inner {
                N::SelectStmt(s) => select(s, r),
                _ => None,
            }
        }
        N::TransactionStmt(t) => transaction(t, r),
        _ => None,
    }
}

fn transaction(t: &protobuf::TransactionStmt, r: &mut Reads) -> Option<()> {
    match TransactionStmtKind::try_from(t.kind).ok()? {
        TransactionStmtKind::TransStmtBegin | TransactionStmtKind::TransStmtStart => {
            // Only a block declared READ ONLY may run on a replica; without it, the whole
            // transaction goes to the primary.
            let read_only = t.options.iter().any(|o| match o.node.as_ref() {
                Some(N::DefElem(d)) if d.defname == "transaction_read_only" => {
                    matches!(
                        d.arg.as_deref().and_then(|a| a.node.as_ref()),
                        Some(N::AConst(c)) if matches!(
                            c.val,
                            Some(protobuf::a_const::Val::Ival(protobuf::Integer { ival: 1 }))
                        )
                    )
                }
                _ => false,
            });
            if !read_only {
                return None;
            }
            r.opens_read_only = true;
            Some(())
        }
        TransactionStmtKind::TransStmtCommit
        | TransactionStmtKind::TransStmtRollback
        | TransactionStmtKind::TransStmtSavepoint
        | TransactionStmtKind::TransStmtRelease
        | TransactionStmtKind::TransStmtRollbackTo => Some(()),
        // Two-phase commit writes state files; anything new is unknown.
        _ => None,
    }
}

fn select(s: &protobuf::SelectStmt, r: &mut Reads) -> Option<()> {
    if s.into_clause.is_some() || !s.locking_clause.is_empty() {
        return None;
    }
    if let Some(w) = &s.with_clause {
        // A CTE that is not itself a SELECT (INSERT/UPDATE/DELETE/MERGE ... RETURNING) is
        // refused by `node` below, as any node it does not know.
        list(&w.ctes, r)?;
    }
    for l in [
        &s.distinct_clause,
        &s.target_list,
        &s.from_clause,
        &s.group_clause,
        &s.window_clause,
        &s.values_lists,
        &s.sort_clause,
    ] {
        list(l, r)?;
    }
    for n in [
        &s.where_clause,
        &s.having_clause,
        &s.limit_offset,
        &s.limit_count,
    ] {
        opt(n, r)?;
    }
    for side in [&s.larg, &s.rarg].into_iter().flatten() {
        select(side, r)?;
    }
    Some(())
}

fn list(nodes: &[protobuf::Node], r: &mut Reads) -> Option<()> {
    nodes.iter().try_for_each(|n| node(n, r))
}

fn opt(n: &Option<Box<protobuf::Node>>, r: &mut Reads) -> Option<()> {
    match n {
        Some(n) => node(n, r),
        None => Some(()),
    }
}

/// One node inside a query. The whitelist: node types that only compute, each walked
/// through every field that can hold another node. Anything else fails the proof.
fn node(n: &protobuf::Node, r: &mut Reads) -> Option<()> {
    let Some(n) = n.node.as_ref() else {
        return Some(());
    };
    match n {
        N::SelectStmt(s) => select(s, r),
        N::String(_)
        | N::Integer(_)
        | N::Float(_)
        | N::Boolean(_)
        | N::BitString(_)
        | N::AConst(_)
        | N::AStar(_)
        | N::ParamRef(_)
        | N::ColumnRef(_) => Some(()),
        N::SqlvalueFunction(f) => {
            use protobuf::SqlValueFunctionOp as Op;
            if !matches!(
                Op::try_from(f.op),
                Ok(Op::SvfopCurrentRole
                    | Op::SvfopCurrentUser
                    | Op::SvfopUser
                    | Op::SvfopSessionUser
                    | Op::SvfopCurrentCatalog
                    | Op::SvfopCurrentSchema)
            ) {
                r.clock = true;
            }
            Some(())
        }
        N::RangeVar(v) => {
            r.relations.push(Relation {
                schema: (!v.schemaname.is_empty()).then(|| v.schemaname.clone()),
                name: v.relname.clone(),
            });
            Some(())
        }
        N::List(l) => list(&l.items, r),
        N::ResTarget(t) => {
            list(&t.indirection, r)?;
            opt(&t.val, r)
        }
        N::AExpr(e) => {
            let op = e.name.last().and_then(|p| match p.node.as_ref() {
                Some(N::String(s)) => Some(s.sval.as_str()),
                _ => None,
            })?;
            if op.bytes().any(|b| b.is_ascii_alphabetic()) {
                // BETWEEN and its kin compare with `>=` and `<=`.
                r.operators.extend([">=".to_string(), "<=".to_string()]);
            } else {
                r.operators.push(op.to_string());
            }
            opt(&e.lexpr, r)?;
            opt(&e.rexpr, r)
        }
        N::BoolExpr(e) => list(&e.args, r),
        N::FuncCall(f) => {
            let name: Vec<&str> = f
                .funcname
                .iter()
                .map(|p| match p.node.as_ref() {
                    Some(N::String(s)) => Some(s.sval.as_str()),
                    _ => None,
                })
                .collect::<Option<_>>()?;
            r.functions.push(name.join("."));
            list(&f.args, r)?;
            list(&f.agg_order, r)?;
            opt(&f.agg_filter, r)?;
            if let Some(w) = &f.over {
                window(w, r)?;
            }
            Some(())
        }
        N::NamedArgExpr(a) => opt(&a.arg, r),
        N::JoinExpr(j) => {
            opt(&j.larg, r)?;
            opt(&j.rarg, r)?;
            list(&j.using_clause, r)?;
            opt(&j.quals, r)
        }
        N::RangeSubselect(s) => opt(&s.subquery, r),
        N::RangeFunction(f) => {
            list(&f.functions, r)?;
            list(&f.coldeflist, r)
        }
        N::ColumnDef(c) => match &c.type_name {
            Some(t) => type_name(t, r),
            None => Some(()),
        },
        N::SubLink(s) => {
            opt(&s.testexpr, r)?;
            opt(&s.subselect, r)
        }
        N::TypeCast(c) => {
            opt(&c.arg, r)?;
            let constant = c
                .arg
                .as_ref()
                .and_then(|a| a.node.as_ref())
                .is_some_and(|a| matches!(a, N::AConst(_) | N::ParamRef(_)));
            match &c.type_name {
                Some(t) => {
                    type_name(t, r)?;
                    if !constant {
                        if let Some(last) = r.casts.last().cloned() {
                            r.computed_casts.push(last);
                        }
                    }
                    Some(())
                }
                None => Some(()),
            }
        }
        N::TypeName(t) => type_name(t, r),
        N::CommonTableExpr(c) => {
            if c.search_clause.is_some() || c.cycle_clause.is_some() {
                return None;
            }
            r.ctes.push(c.ctename.clone());
            opt(&c.ctequery, r)
        }
        N::CaseExpr(c) => {
            opt(&c.arg, r)?;
            list(&c.args, r)?;
            opt(&c.defresult, r)
        }
        N::CaseWhen(w) => {
            opt(&w.expr, r)?;
            opt(&w.result, r)
        }
        N::NullTest(t) => opt(&t.arg, r),
        N::BooleanTest(t) => opt(&t.arg, r),
        N::CoalesceExpr(c) => list(&c.args, r),
        N::MinMaxExpr(m) => list(&m.args, r),
        N::NullIfExpr(e) => list(&e.args, r),
        N::AIndirection(i) => {
            opt(&i.arg, r)?;
            list(&i.indirection, r)
        }
        N::AIndices(i) => {
            opt(&i.lidx, r)?;
            opt(&i.uidx, r)
        }
        N::AArrayExpr(a) => list(&a.elements, r),
        N::RowExpr(e) => list(&e.args, r),
        N::SortBy(s) => opt(&s.node, r),
        N::WindowDef(w) => window(w, r),
        N::CollateClause(c) => opt(&c.arg, r),
        N::GroupingSet(g) => list(&g.content, r),
        N::GroupingFunc(g) => list(&g.args, r),
        _ => None,
    }
}

fn window(w: &protobuf::WindowDef, r: &mut Reads) -> Option<()> {
    list(&w.partition_clause, r)?;
    list(&w.order_clause, r)?;
    opt(&w.start_offset, r)?;
    opt(&w.end_offset, r)
}

fn type_name(t: &protobuf::TypeName, r: &mut Reads) -> Option<()> {
    let name = t.names.last().and_then(|p| match p.node.as_ref() {
        Some(N::String(s)) => Some(s.sval.as_str()),
        _ => None,
    })?;
    r.casts.push(if t.array_bounds.is_empty() {
        name.to_string()
    } else {
        format!("_{name}")
    });
    list(&t.typmods, r)?;
    list(&t.array_bounds, r)
}
