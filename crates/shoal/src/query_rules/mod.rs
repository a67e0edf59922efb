//! Query rules in force for a pool (its database's and its user's), and their verdict on
//! each client message that carries SQL: a Query, a Parse, a Bind (judged by the text of the
//! statement it binds, so a statement prepared before a rule existed is held to it), a
//! FunctionCall, and the statements an SQL `EXECUTE` runs. The session refuses what a `deny`
//! rule matches (see `session::hooks`); `log` rules are logged and let through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use shoal_control::config::rules::{Action, Matcher, Rule};
use shoal_wire::encoding::Unreadable;
use shoal_wire::facts::{Facts, FactsError};
use shoal_wire::frame::HEADER_LEN;
use shoal_wire::frontend::tag as fe;
use shoal_wire::sql::ClientEncoding;
use shoal_wire::sqlstate;

use crate::analysis::catalogue::{calls, Source};
use crate::prepared::ClientStatements;

/// Statement texts whose verdict is remembered; past it the memory starts over.
const REMEMBERED: usize = 8192;

/// What the rules say of one text: the first deny rule it matches, else the log rules it
/// matches (indexes into the rules); `Unchecked` for a text too deep to take apart.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Pass,
    Log(Vec<usize>),
    Deny(usize),
    Unchecked,
    /// It uses an operator, a cast or a relation, and the catalogue saying what runs
    /// behind them has not been read yet.
    NoCatalogue,
}

/// Verdicts by text, made on one reading of the catalogue.
#[derive(Default)]
struct Known {
    generation: u64,
    verdicts: HashMap<Box<[u8]>, Arc<Judged>, foldhash::fast::RandomState>,
}

/// A verdict, the SQL-level statements the text EXECUTEs and those it PREPAREs.
type Judged = (Verdict, Vec<String>, Vec<String>);

pub struct QueryRules {
    rules: Vec<Rule>,
    /// Statements each rule matched (refused or logged) since this rule set took effect.
    matched: Vec<AtomicU64>,
    /// A function rule is in force: a FunctionCall message (which names its function by
    /// OID) is refused, since it could not be checked.
    functions: bool,
    /// Verdicts by text (the text's analysis is the pool's: see [`crate::analysis`]).
    known: Mutex<Known>,
    analyses: Arc<crate::analysis::Analyses>,
    /// What runs behind the database's operators, casts and views (the pool's catalogue,
    /// see [`crate::analysis::catalogue`]); only function rules need it.
    catalogue: Arc<Source>,
}

impl QueryRules {
    /// `None` when there are no rules.
    pub fn new(
        rules: Vec<Rule>,
        analyses: Arc<crate::analysis::Analyses>,
        catalogue: Arc<Source>,
    ) -> Option<QueryRules> {
        if rules.is_empty() {
            return None;
        }
        let functions = rules
            .iter()
            .any(|r| matches!(r.matcher, Matcher::Function(_)));
        Some(QueryRules {
            matched: rules.iter().map(|_| AtomicU64::new(0)).collect(),
            rules,
            functions,
            known: Mutex::default(),
            analyses,
            catalogue,
        })
    }

    /// Whether the rules need the catalogue (a rule names a function).
    pub fn needs_catalogue(&self) -> bool {
        self.functions
    }

    /// Waits (up to `timeout`) until the catalogue has been read once, when the rules need
    /// it: until then, a statement with an operator, a cast or a relation cannot be
    /// checked, and is refused.
    pub async fn catalogue_read(&self, timeout: std::time::Duration) {
        if self.functions {
            self.catalogue.loaded(timeout).await;
        }
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }

    /// Each rule with the statements it matched.
    pub fn counts(&self) -> impl Iterator<Item = (&Rule, u64)> {
        self.rules
            .iter()
            .zip(self.matched.iter().map(|m| m.load(Ordering::Relaxed)))
    }

    /// The SQLSTATE and message an ErrorResponse carries when `msg` (a whole client frame,
    /// its text in the client's encoding `enc`) is refused, or `None` when it may pass.
    /// `pool` names the pool in log lines.
    pub fn refusal(
        &self,
        msg: &[u8],
        statements: Option<&ClientStatements>,
        pool: &str,
        enc: ClientEncoding,
    ) -> Option<(&'static str, String)> {
        let body = &msg[HEADER_LEN..];
        let text = match msg[0] {
            fe::QUERY => cstr(body),
            fe::PARSE => cstr(cstr_rest(body)),
            fe::BIND => {
                let name = cstr(cstr_rest(body));
                // A statement Shoal does not know: the server will say it does not exist.
                statements.and_then(|s| s.text_of(name))?
            }
            fe::FUNCTION_CALL if self.functions => return Some((
                sqlstate::INSUFFICIENT_PRIVILEGE,
                "FunctionCall messages are refused while a query rule names a function: use SQL"
                    .into(),
            )),
            _ => return None,
        };
        self.judge_text(text, statements, pool, 0, enc)
    }

    fn judge_text(
        &self,
        text: &[u8],
        statements: Option<&ClientStatements>,
        pool: &str,
        depth: u8,
        enc: ClientEncoding,
    ) -> Option<(&'static str, String)> {
        // Judged as the server will read it: in the client's encoding, as UTF-8.
        let text = match enc.as_utf8(text) {
            Ok(t) => t,
            Err(why) => return Some(unreadable(why)),
        };
        let judged = self.verdict(&text);
        let (verdict, executes, prepares) = &*judged;
        match *verdict {
            Verdict::Deny(i) => {
                self.matched[i].fetch_add(1, Ordering::Relaxed);
                return Some((sqlstate::INSUFFICIENT_PRIVILEGE, self.denied(i)));
            }
            Verdict::Unchecked => {
                return Some((
                    sqlstate::INSUFFICIENT_PRIVILEGE,
                    "permission denied: the query rules cannot check this statement (it nests too deep, or reads a view Shoal cannot read)"
                        .into(),
                ))
            }
            Verdict::NoCatalogue => {
                return Some((
                    sqlstate::CANNOT_CONNECT_NOW,
                    "the query rules cannot check this statement yet: the database's catalogue (what runs behind its operators, casts and views) has not been read; try again"
                        .into(),
                ))
            }
            Verdict::Log(ref matched) => {
                for &i in matched {
                    self.matched[i].fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pool = %pool, rule = %self.rules[i].name, "query rule matched (action log)");
                }
            }
            Verdict::Pass => {}
        }
        // `EXECUTE name`: the statement it runs is held to the rules too, whenever it was
        // prepared (a protocol-level statement, or one made by SQL `PREPARE`). One made in
        // the same text was judged with it. One whose text Shoal never read cannot be
        // shown harmless.
        if depth == 0 {
            for name in executes {
                let made_here = prepares.contains(name);
                let known = statements.and_then(|s| {
                    s.text_of(name.as_bytes())
                        .or_else(|| s.sql_prepared_text(name.as_bytes()))
                });
                match known {
                    Some(t) => {
                        if let Some(r) = self.judge_text(t, statements, pool, 1, enc) {
                            return Some(r);
                        }
                    }
                    None if made_here => {}
                    None => {
                        return Some((
                            sqlstate::INSUFFICIENT_PRIVILEGE,
                            format!("permission denied: the query rules cannot check what EXECUTE {name} runs (Shoal did not see it prepared: a PREPARE among other statements, or from a function); PREPARE it as a statement of its own"),
                        ))
                    }
                }
            }
        }
        None
    }

    fn denied(&self, i: usize) -> String {
        format!(
            "permission denied: the statement is refused by query rule \"{}\"",
            self.rules[i].name
        )
    }

    /// The verdict on `text` (UTF-8, as the server reads it), and the SQL-level statements
    /// it EXECUTEs and PREPAREs. The verdict is remembered by text; what the text does comes
    /// from the pool's analysis, which the cache and the replica split read as well.
    fn verdict(&self, text: &[u8]) -> Arc<Judged> {
        // Taken first: a verdict made on an older reading is not remembered past a newer.
        let generation = self.catalogue.generation();
        if let Some(v) = self.lock(generation).verdicts.get(text) {
            return v.clone();
        }
        let s = String::from_utf8_lossy(text);
        let analysis = self.analyses.of_utf8(text);
        let judged = match &analysis.facts {
            Ok(f) if self.functions && hides_calls(f) => {
                // Functions behind its operators, casts and views count as called.
                let catalogue = self.catalogue.current();
                if !catalogue.loaded {
                    // Not remembered: the catalogue may come any moment.
                    return Arc::new((Verdict::NoCatalogue, Vec::new(), Vec::new()));
                }
                let behind = catalogue.calls.behind(f);
                if behind.iter().any(|b| b == calls::UNKNOWN) {
                    (Verdict::Unchecked, Vec::new(), Vec::new())
                } else {
                    let mut seen = f.clone();
                    seen.functions.extend(behind);
                    self.judge_facts(&seen, &s)
                }
            }
            Ok(f) => self.judge_facts(f, &s),
            // PostgreSQL cannot parse it either, and runs none of it; regular expressions
            // still apply to the text.
            Err(FactsError::Parse(_)) => {
                let deny = self.rules.iter().position(|r| {
                    r.action == Action::Deny
                        && matches!(r.matcher, Matcher::Regex(_))
                        && r.matches(&Default::default(), &s)
                });
                (
                    deny.map_or(Verdict::Pass, Verdict::Deny),
                    Vec::new(),
                    Vec::new(),
                )
            }
            // Cannot be shown harmless.
            Err(FactsError::TooDeep) => (Verdict::Unchecked, Vec::new(), Vec::new()),
        };
        let judged = Arc::new(judged);
        let mut known = self.lock(generation);
        if known.generation == generation {
            if known.verdicts.len() >= REMEMBERED {
                known.verdicts.clear();
            }
            known.verdicts.insert(text.into(), judged.clone());
        }
        judged
    }

    /// The first deny rule `f` (of text `s`) matches, else the log rules it matches.
    fn judge_facts(&self, f: &Facts, s: &str) -> Judged {
        let mut logs = Vec::new();
        let mut deny = None;
        for (i, r) in self.rules.iter().enumerate() {
            if r.matches(f, s) {
                match r.action {
                    Action::Deny => {
                        deny = Some(i);
                        break;
                    }
                    Action::Log => logs.push(i),
                }
            }
        }
        let v = match deny {
            Some(i) => Verdict::Deny(i),
            None if logs.is_empty() => Verdict::Pass,
            None => Verdict::Log(logs),
        };
        (v, f.executes.clone(), f.prepares.clone())
    }

    /// The remembered verdicts, forgotten when the catalogue moved past them.
    fn lock(&self, generation: u64) -> std::sync::MutexGuard<'_, Known> {
        let mut known = self.known.lock().unwrap_or_else(|e| e.into_inner());
        if known.generation < generation {
            known.verdicts.clear();
            known.generation = generation;
        }
        known
    }
}

/// Whether a statement uses a name something may run behind: an operator, a cast, or a
/// relation (a view).
fn hides_calls(f: &Facts) -> bool {
    !(f.operators.is_empty() && f.casts.is_empty() && f.relations.is_empty())
}

/// The refusal of a text the rules cannot read as the server will (see
/// [`shoal_wire::encoding`]): never judged as bytes.
fn unreadable(why: Unreadable) -> (&'static str, String) {
    match why {
        Unreadable::Invalid => (
            sqlstate::CHARACTER_NOT_IN_REPERTOIRE,
            "invalid byte sequence for the client's encoding: the query rules cannot read this statement (PostgreSQL would refuse it too)".into(),
        ),
        Unreadable::UnknownEncoding => (
            sqlstate::FEATURE_NOT_SUPPORTED,
            "the query rules cannot read this statement: it was sent before the server confirmed a change of client_encoding; send it after that statement completes".into(),
        ),
        Unreadable::NoTable => (
            sqlstate::FEATURE_NOT_SUPPORTED,
            "the query rules cannot read statements in this client_encoding (Shoal reads UTF8, LATIN*, WIN*, KOI8*, EUC_JP, EUC_KR, EUC_CN, SJIS, BIG5, GBK, UHC and GB18030): set client_encoding to UTF8 and let the server convert".into(),
        ),
    }
}

/// A NUL-terminated string at the head of `b`.
fn cstr(b: &[u8]) -> &[u8] {
    &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]
}

/// What follows the NUL-terminated string at the head of `b`.
fn cstr_rest(b: &[u8]) -> &[u8] {
    match b.iter().position(|&c| c == 0) {
        Some(i) => &b[i + 1..],
        None => &[],
    }
}

/// The `shoal_rule_matches` metric family: statements each rule of each pool matched.
pub fn encode(
    pools: &[(Arc<crate::pool::Pool>, Arc<QueryRules>)],
    e: &mut prometheus_client::encoding::DescriptorEncoder<'_>,
) -> Result<(), std::fmt::Error> {
    use crate::metrics::LabelValue;
    let mut rows = Vec::new();
    for (p, rules) in pools {
        for (rule, n) in rules.counts() {
            let action = match rule.action {
                Action::Deny => "deny",
                Action::Log => "log",
            };
            rows.push((
                vec![
                    ("pool", LabelValue::new(&p.name)),
                    ("rule", LabelValue::new(&rule.name)),
                    ("action", LabelValue::new(action)),
                ],
                n,
            ));
        }
    }
    if rows.is_empty() {
        return Ok(());
    }
    shoal_control::metrics::counter(
        e,
        "shoal_rule_matches",
        "Statements a query rule matched (refused for deny, logged for log) since its rule set took effect",
        &rows,
    )
}
