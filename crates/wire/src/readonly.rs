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

/// The text with its literal values taken out: every string constant becomes `'?'`, every
/// number `0`, comments and runs of blanks one space, unquoted words lower case. Two texts
/// with the same form differ only in values, comments, blanks and case: what [`classify`]
/// says of one it says of the other, so a client that writes its values into the text
/// (the simple protocol's usual way) is parsed once per statement shape, not once per
/// value. `None` when the text has what this cannot take apart with certainty (a dollar
/// quote, a backslash in a plain string, an unterminated quote or comment, a NUL): such a
/// text is judged as it is.
pub fn normalized(sql: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(sql.len());
    let mut i = 0;
    let word_char = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
    let blank = |out: &mut Vec<u8>| {
        if out.last().is_some_and(|&b| b != b' ') {
            out.push(b' ');
        }
    };
    while i < sql.len() {
        let b = sql[i];
        match b {
            0 => return None,
            b' ' | b'\t' | b'\n' | b'\r' | 0x0c => {
                blank(&mut out);
                i += 1;
            }
            b'-' if sql.get(i + 1) == Some(&b'-') => {
                while i < sql.len() && !matches!(sql[i], b'\n' | b'\r') {
                    i += 1;
                }
                blank(&mut out);
            }
            b'/' if sql.get(i + 1) == Some(&b'*') => {
                let mut depth = 0usize;
                loop {
                    match (sql.get(i), sql.get(i + 1)) {
                        (Some(b'/'), Some(b'*')) => {
                            depth += 1;
                            i += 2;
                        }
                        (Some(b'*'), Some(b'/')) => {
                            depth -= 1;
                            i += 2;
                            if depth == 0 {
                                break;
                            }
                        }
                        (Some(_), _) => i += 1,
                        (None, _) => return None,
                    }
                }
                blank(&mut out);
            }
            b'\'' => {
                i = skip_string(sql, i + 1, false)?;
                out.extend_from_slice(b"'?'");
            }
            b'"' => {
                let start = i;
                i += 1;
                loop {
                    match sql.get(i) {
                        Some(b'"') if sql.get(i + 1) == Some(&b'"') => i += 2,
                        Some(b'"') => break,
                        Some(_) => i += 1,
                        None => return None,
                    }
                }
                i += 1;
                out.extend_from_slice(&sql[start..i]);
            }
            b'0'..=b'9' | b'.' if b != b'.' || sql.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                // A number (PostgreSQL's forms: 12, 1.5, .5, 1e-3, 0x1F, 1_000): one token up
                // to the next character that cannot continue it.
                i += 1;
                while let Some(&c) = sql.get(i) {
                    let exponent_sign =
                        matches!(c, b'+' | b'-') && matches!(sql[i - 1], b'e' | b'E');
                    if c.is_ascii_alphanumeric() || c == b'.' || c == b'_' || exponent_sign {
                        i += 1;
                    } else {
                        break;
                    }
                }
                out.push(b'0');
            }
            b'$' if sql.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                // A parameter: its number matters.
                let start = i;
                i += 1;
                while sql.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
                out.extend_from_slice(&sql[start..i]);
            }
            b'$' => return None,
            _ if word_char(b) => {
                let start = i;
                while sql.get(i).is_some_and(|&c| word_char(c)) {
                    i += 1;
                }
                let word = &sql[start..i];
                if word.contains(&b'$') {
                    // A dollar quote may start inside a word's tail (`x$$`): not taken apart.
                    return None;
                }
                match (word, sql.get(i)) {
                    // E'...': backslash escapes.
                    (w, Some(b'\'')) if w.eq_ignore_ascii_case(b"e") => {
                        i = skip_string(sql, i + 1, true)?;
                        out.extend_from_slice(b"e'?'");
                    }
                    // B'...', X'...', N'...': constants of their kind.
                    (w, Some(b'\''))
                        if w.len() == 1
                            && matches!(w[0].to_ascii_lowercase(), b'b' | b'x' | b'n') =>
                    {
                        i = skip_string(sql, i + 1, false)?;
                        out.push(w[0].to_ascii_lowercase());
                        out.extend_from_slice(b"'?'");
                    }
                    _ => out.extend(word.iter().map(u8::to_ascii_lowercase)),
                }
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    if out.last() == Some(&b' ') {
        out.pop();
    }
    Some(out)
}

/// Past a string constant whose opening quote is before `i`: `''` stands for a quote; with
/// `escapes`, a backslash escapes the next byte. A backslash in a plain string depends on
/// `standard_conforming_strings`, which the caller does not know: `None` then, as for an
/// unterminated string.
fn skip_string(sql: &[u8], mut i: usize, escapes: bool) -> Option<usize> {
    loop {
        match sql.get(i)? {
            b'\\' if escapes => i += 2,
            b'\\' => return None,
            b'\'' if sql.get(i + 1) == Some(&b'\'') => i += 2,
            b'\'' => return Some(i + 1),
            _ => i += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trees_too_deep_to_prove_are_not_parsed() {
        // Each would overflow a 2 MiB stack inside libpg_query: refused before parsing, on a
        // small stack to prove it, with no thread of its own.
        let deep = [
            format!("SELECT {}1", "1+".repeat(100_000)),
            format!("SELECT {}1{}", "abs(".repeat(100_000), ")".repeat(100_000)),
            format!("SELECT {}true", "NOT ".repeat(100_000)),
            format!("SELECT 1{}", " IS NULL".repeat(50_000)),
            format!("SELECT 1{}", " UNION SELECT 1".repeat(5_000)),
            format!("SELECT {}1{}", "ARRAY[".repeat(5_000), "]".repeat(5_000)),
        ];
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                for sql in &deep {
                    assert_eq!(classify(sql), None);
                    assert_eq!(
                        crate::facts::facts(sql),
                        Err(crate::facts::FactsError::TooDeep)
                    );
                }
            })
            .unwrap()
            .join()
            .unwrap();
        // The deepest texts within the bound parse on a thread's usual 2 MiB, unoptimised
        // (and fail to prove: deeper than the decoder goes, which is unknown, not a
        // statement PostgreSQL would refuse).
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(|| {
                let depth = MAX_NESTING - 2;
                for sql in [
                    format!("SELECT {}1", "1+".repeat(depth)),
                    format!("SELECT {}true", "NOT ".repeat(depth)),
                    format!(
                        "SELECT {}1{}",
                        "abs(".repeat(depth / 3 - 4),
                        ")".repeat(depth / 3 - 4)
                    ),
                ] {
                    assert!(nesting_estimate(&sql) <= MAX_NESTING + 2, "{}", &sql[..20]);
                    assert_eq!(classify(&sql), None);
                    assert_eq!(
                        crate::facts::facts(&sql),
                        Err(crate::facts::FactsError::TooDeep)
                    );
                }
            })
            .unwrap()
            .join()
            .unwrap();
        // Long but flat texts are still proven: a long IN list, a wide ORM select, a WHERE
        // of many conditions.
        let ids: Vec<String> = (0..5000).map(|i| i.to_string()).collect();
        assert!(classify(&format!("SELECT * FROM t WHERE id IN ({})", ids.join(", "))).is_some());
        let cols: Vec<String> = (0..400)
            .map(|i| format!("\"t0\".\"c{i}\" AS \"x{i}\""))
            .collect();
        assert!(classify(&format!("SELECT {} FROM t AS t0", cols.join(", "))).is_some());
        let conds: Vec<String> = (0..2000).map(|i| format!("c{i} = {i}")).collect();
        assert!(classify(&format!("SELECT * FROM t WHERE {}", conds.join(" AND "))).is_some());
    }

    #[test]
    fn values_comments_and_case_are_taken_out() {
        let n = |s: &str| String::from_utf8(normalized(s.as_bytes()).expect(s)).unwrap();
        assert_eq!(
            n("SELECT * FROM t WHERE id = 42 AND name = 'bob''s'"),
            n("select *  from t where id = 7 and name = 'x' -- note")
        );
        assert_eq!(n("SELECT 1.5e-3, .5, 0x1F, 1_000"), "select 0, 0, 0, 0");
        assert_eq!(
            n("SELECT E'a\\'b', B'101', X'1f', N'z'"),
            "select e'?', b'?', x'?', n'?'"
        );
        assert_eq!(
            n("SELECT \"Mixed Case\", $1, $12 /* a /* nested */ c */"),
            "select \"Mixed Case\", $1, $12"
        );
        assert_eq!(n("SELECT a1, x_2"), "select a1, x_2");
        assert_ne!(n("SELECT a - 1"), n("SELECT a + 1"));
        assert_ne!(n("SELECT \"A\""), n("SELECT \"a\""));
        for unsure in [
            "SELECT 'a\\'b'",
            "SELECT $$x$$",
            "SELECT $tag$x$tag$",
            "SELECT 'open",
            "SELECT \"open",
            "SELECT 1 /* open",
            "SELECT x$$",
        ] {
            assert_eq!(normalized(unsure.as_bytes()), None, "{unsure}");
        }
    }

    proptest::proptest! {
        /// Texts of one shape get one verdict: whatever values are written into a
        /// statement, it is read-only exactly when its first form is.
        #[test]
        fn one_shape_one_verdict(
            shape in proptest::sample::select(vec![
                "SELECT v FROM t WHERE id = {n} AND s = '{s}'",
                "UPDATE t SET v = {n} WHERE s = '{s}'",
                "SELECT nextval('{s}') + {n}",
                "SELECT * FROM t WHERE a IN ({n}, {n}) FOR UPDATE",
                "WITH d AS (DELETE FROM t WHERE id = {n} RETURNING '{s}') SELECT * FROM d",
                "SET search_path = '{s}'",
                "BEGIN READ ONLY; SELECT {n}, E'{s}'; COMMIT",
            ]),
            n in 0u32..1_000_000,
            s in "[a-z ;()'-]{0,12}",
        ) {
            let quoted = s.replace('\'', "''");
            let text = shape.replace("{n}", &n.to_string()).replace("{s}", &quoted);
            let first = shape.replace("{n}", "1").replace("{s}", "x");
            proptest::prop_assert_eq!(normalized(text.as_bytes()), normalized(first.as_bytes()));
            proptest::prop_assert_eq!(classify(&text).is_some(), classify(&first).is_some());
        }
    }

    fn reads(sql: &str) -> Vec<String> {
        classify(sql)
            .unwrap_or_else(|| panic!("{sql:?} should be proven read-only"))
            .functions
    }

    fn writes(sql: &str) {
        assert_eq!(classify(sql), None, "{sql:?} must go to the primary");
    }

    #[test]
    fn plain_reads_are_proven() {
        for sql in [
            "SELECT 1",
            "select * from t where a = $1 order by b limit 10 offset 5",
            "SELECT a, b FROM t JOIN u USING (id) LEFT JOIN v ON v.x = t.x",
            "SELECT * FROM (SELECT 1) s, LATERAL (SELECT 2) l",
            "WITH c AS (SELECT 1 AS x) SELECT x FROM c",
            "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 5) SELECT n FROM r",
            "VALUES (1, 'one'), (2, 'two')",
            "TABLE t",
            "SELECT 1 UNION SELECT 2 EXCEPT SELECT 3",
            "SELECT CASE WHEN a IS NULL THEN 0 ELSE a END, COALESCE(b, 1), NULLIF(c, 2) FROM t",
            "SELECT a[1], (r).f, ARRAY[1,2], ROW(1,2), x::int, CURRENT_TIMESTAMP FROM t",
            "SELECT EXISTS (SELECT 1 FROM t WHERE t.a = u.a) FROM u WHERE a IN (1,2,3)",
            "SHOW search_path",
            "SET search_path TO app, public",
            "EXPLAIN SELECT 1",
            "EXPLAIN ANALYZE SELECT * FROM t",
            "BEGIN READ ONLY",
            "START TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY",
            "COMMIT",
            "ROLLBACK",
            "BEGIN READ ONLY; SELECT 1; COMMIT",
            "SELECT 1; SELECT 2",
            "/* shoal */ SELECT $$a;b$$, 'c;d' -- end",
            "",
        ] {
            classify(sql).unwrap_or_else(|| panic!("{sql:?} should be proven read-only"));
        }
    }

    #[test]
    fn relations_read_are_named_for_a_cache() {
        let rel = |schema: Option<&str>, name: &str| Relation {
            schema: schema.map(str::to_owned),
            name: name.to_owned(),
        };
        let r = classify(
            "WITH c AS (SELECT * FROM Base) SELECT * FROM c JOIN app.\"Odd\" o ON true \
             WHERE EXISTS (SELECT 1 FROM sub) AND x IN (SELECT y FROM app.c)",
        )
        .unwrap();
        assert_eq!(
            r.relations,
            vec![
                rel(None, "base"),
                rel(None, "sub"),
                rel(Some("app"), "Odd"),
                rel(Some("app"), "c"),
            ]
        );
        assert!(r.only_queries && r.statements == 1 && !r.clock);
        assert!(classify("SELECT CURRENT_DATE").unwrap().clock);
        assert!(classify("SELECT LOCALTIMESTAMP(2)").unwrap().clock);
        assert!(
            !classify("SELECT CURRENT_USER, current_schema")
                .unwrap()
                .clock
        );
        assert!(!classify("SHOW search_path").unwrap().only_queries);
        assert!(!classify("BEGIN READ ONLY; SELECT 1").unwrap().only_queries);
        assert!(!classify("").unwrap().only_queries);
        assert_eq!(classify("SELECT 1; SELECT 2").unwrap().statements, 2);
    }

    #[test]
    fn functions_are_named_for_the_catalogue() {
        assert_eq!(
            reads("SELECT count(*), pg_catalog.now(), Lower(name) FROM t GROUP BY name"),
            ["count", "lower", "pg_catalog.now"]
        );
        assert_eq!(
            reads("SELECT * FROM generate_series(1, 3)"),
            ["generate_series"]
        );
        assert_eq!(
            reads("SELECT x FROM t WHERE y = (SELECT max(z) FROM u)"),
            ["max"]
        );
        assert_eq!(
            reads("SELECT sum(a) OVER (PARTITION BY b ORDER BY c) FROM t"),
            ["sum"]
        );
        // Functions that write are named too: the catalogue knows them as volatile.
        assert_eq!(reads("SELECT nextval('s')"), ["nextval"]);
        assert_eq!(reads("SELECT pg_advisory_lock(1)"), ["pg_advisory_lock"]);
        assert_eq!(
            reads("SELECT set_config('a.b', 'c', false)"),
            ["set_config"]
        );
    }

    #[test]
    fn writes_and_possible_writes_are_not() {
        for sql in [
            "INSERT INTO t VALUES (1)",
            "UPDATE t SET a = 1",
            "DELETE FROM t",
            "MERGE INTO t USING u ON t.a = u.a WHEN MATCHED THEN DELETE",
            "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
            "WITH i AS (INSERT INTO t VALUES (1) RETURNING a) SELECT a FROM i",
            "SELECT * FROM t FOR UPDATE",
            "SELECT * FROM t FOR SHARE",
            "SELECT * FROM t FOR NO KEY UPDATE SKIP LOCKED",
            "SELECT * INTO new_t FROM t",
            "CREATE TABLE x (a int)",
            "CREATE TEMP TABLE x (a int)",
            "DROP TABLE t",
            "TRUNCATE t",
            "COPY t FROM STDIN",
            "COPY t TO STDOUT",
            "LISTEN ch",
            "NOTIFY ch",
            "LOCK TABLE t",
            "BEGIN",
            "START TRANSACTION",
            "BEGIN READ WRITE",
            "BEGIN; SELECT 1; COMMIT",
            "SELECT 1; INSERT INTO t VALUES (1)",
            "EXPLAIN ANALYZE INSERT INTO t VALUES (1)",
            "CALL p()",
            "DO $$ BEGIN END $$",
            "PREPARE p AS SELECT 1",
            "EXECUTE p",
            "DECLARE c CURSOR FOR SELECT 1",
            "SET TRANSACTION READ WRITE",
            "SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
            "PREPARE TRANSACTION 'x'",
            "VACUUM t",
            "REFRESH MATERIALIZED VIEW v",
            "DISCARD ALL",
            "SELEC 1",
            "SELECT (",
        ] {
            writes(sql);
        }
    }
}
