//! A property test of the transaction-mode state machine against a real PostgreSQL: random
//! interleavings of two clients' protocol traffic (simple and extended queries, named and
//! unnamed statements, errors inside batches, transaction blocks, session SETs, malformed
//! messages, session changes hidden from simple lexers, SQL naming the pooler's statements,
//! COPY messages outside a COPY, clients vanishing mid-message, SETs rolled back to a
//! savepoint) over a pool of ONE server. A model of each client says exactly what it must
//! receive; the property is that no client ever receives a row, an error or a setting that
//! was produced for the other, and that every request is answered (a server released before
//! a true boundary would leave the next client hanging or reading foreign replies). A client
//! whose lasting state the other's turn cleaned away is told so once (`55000`), its request
//! not run.
//!
//! Cases are bounded (`SHOAL_PROPTEST_CASES`, default 40) so the suite stays quick; raise it
//! to search longer.
// Tests run on tokio runtimes with a time driver: tokio's timers are fine here.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::OnceLock;

use bytes::{BufMut, BytesMut};
use common::raw::{self, Msg, Raw};
use common::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// `SELECT '<client>:<n>'` as a simple query.
    Simple,
    /// The same in a transaction block, several statements in one query.
    Block,
    /// Parse/Bind/Execute/Sync of the unnamed statement in one flight.
    Unnamed,
    /// Parse of the unnamed statement alone (pgx does this), answered by Sync.
    ParseUnnamed,
    /// Bind/Execute/Sync of whatever unnamed statement the client has.
    BindUnnamed,
    /// Parse of named statement `s<k>` (a duplicate if the client has it).
    ParseNamed(u8),
    /// Bind/Execute/Sync of named statement `s<k>`.
    BindNamed(u8),
    /// Close of `s<k>`, then Sync.
    CloseNamed(u8),
    /// A batch whose Execute fails; the rest up to Sync is skipped.
    FailingBatch,
    /// `SET application_name = '<client>-<n>'`.
    SetName,
    /// `SHOW application_name`.
    ShowName,
    /// A Flush with a body: Shoal refuses it; the client reconnects.
    Malformed,
    /// A session change hidden from a simple lexer: a `--` comment ended by `\r`, a `U&`
    /// identifier with `UESCAPE`, an `UPDATE pg_settings`.
    HiddenSearchPath(u8),
    /// `SHOW search_path`.
    ShowSearchPath,
    /// SQL naming the pooler's statements through those tricks: refused with 26000.
    ReservedName(u8),
    /// CopyData, CopyDone and CopyFail outside a COPY (ignored), then a query.
    StrayCopy,
    /// A query and the start of a long CopyData, then the client vanishes and reconnects.
    VanishMidMessage,
    /// A SET rolled back to a savepoint (separate statements): it is gone.
    SavepointSet,
    /// `DECLARE ... WITH HOLD` with its WITH HOLD after the eighth word.
    LateHoldCursor,
    /// How many cursors the session has.
    ShowCursors,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        Just(Op::Simple),
        Just(Op::Block),
        Just(Op::Unnamed),
        Just(Op::ParseUnnamed),
        Just(Op::BindUnnamed),
        (0u8..3).prop_map(Op::ParseNamed),
        (0u8..3).prop_map(Op::BindNamed),
        (0u8..3).prop_map(Op::CloseNamed),
        Just(Op::FailingBatch),
        Just(Op::SetName),
        Just(Op::ShowName),
        Just(Op::Malformed),
        (0u8..3).prop_map(Op::HiddenSearchPath),
        Just(Op::ShowSearchPath),
        (0u8..3).prop_map(Op::ReservedName),
        Just(Op::StrayCopy),
        Just(Op::VanishMidMessage),
        Just(Op::SavepointSet),
        Just(Op::LateHoldCursor),
        Just(Op::ShowCursors),
    ]
}

/// What a client has, as PostgreSQL would see it on a connection of its own.
#[derive(Default)]
struct Model {
    /// The text the client's unnamed statement returns, if it has one.
    unnamed: Option<String>,
    /// Named statements: k → the text it returns.
    named: [Option<String>; 3],
    /// The application_name the client set ('' at start).
    app_name: String,
    /// The client changed its search_path in a way Shoal cleans but does not carry: what
    /// it sees itself depends on whether the other client needed the server since.
    own_search_path: bool,
    /// The same for WITH HOLD cursors.
    own_cursors: bool,
}

struct Client {
    tag: char,
    raw: Raw,
    model: Model,
    n: u32,
}

struct Env {
    addr: std::net::SocketAddr,
    db: String,
    _shoal: Shoal,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let db = unique_db("model");
        let shoal = shoal_for(&db, "[pool]\npool_size = 1\n");
        Env {
            addr: shoal.addr,
            db,
            _shoal: shoal,
        }
    })
}

async fn login() -> Raw {
    let e = env();
    Raw::login(e.addr, "raw", &e.db, &[]).await
}

fn rows(msgs: &[Msg]) -> Vec<String> {
    msgs.iter()
        .filter(|m| m.tag == 'D')
        .map(raw::first_column)
        .collect()
}

fn errors(msgs: &[Msg]) -> Vec<String> {
    msgs.iter()
        .filter(|m| m.tag == 'E')
        .map(|m| m.code())
        .collect()
}

impl Client {
    async fn new(tag: char) -> Client {
        Client {
            tag,
            raw: login().await,
            model: Model::default(),
            n: 0,
        }
    }

    fn value(&mut self) -> String {
        self.n += 1;
        format!("{}:{}", self.tag, self.n)
    }

    async fn round(&mut self, out: &BytesMut) -> Vec<Msg> {
        self.raw.send(out).await;
        let msgs = self.raw.until_ready().await;
        let lost = msgs.iter().any(|m| m.tag == 'E' && m.code() == "55000");
        if lost && (self.model.own_search_path || self.model.own_cursors) {
            // The other client needed the pool's one server while this one held state on
            // it: that state is gone, and this client is told once, its request not run.
            self.model.own_search_path = false;
            self.model.own_cursors = false;
            self.raw.send(out).await;
            return self.raw.until_ready().await;
        }
        msgs
    }

    /// Runs one operation and checks every reply against the model.
    async fn run(&mut self, op: &Op) -> Result<(), String> {
        let mut out = BytesMut::new();
        let ctx = format!("client {} {op:?}", self.tag);
        match op {
            Op::Simple => {
                let v = self.value();
                raw::query(&mut out, &format!("SELECT '{v}'"));
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, rows(&msgs), vec![v])?;
            }
            Op::Block => {
                let v = self.value();
                raw::query(&mut out, &format!("BEGIN; SELECT '{v}'; COMMIT"));
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, rows(&msgs), vec![v])?;
            }
            Op::Unnamed => {
                let v = self.value();
                raw::parse(&mut out, "", &format!("SELECT '{v}'::text || $1"));
                raw::bind(&mut out, "", "", &["!"]);
                raw::execute(&mut out, "");
                raw::sync(&mut out);
                let msgs = self.round(&out).await;
                self.model.unnamed = Some(v.clone());
                expect(&ctx, rows(&msgs), vec![format!("{v}!")])?;
            }
            Op::ParseUnnamed => {
                let v = self.value();
                raw::parse(&mut out, "", &format!("SELECT '{v}'::text || $1"));
                raw::sync(&mut out);
                let msgs = self.round(&out).await;
                self.model.unnamed = Some(v);
                expect(&ctx, tags(&msgs), "1Z".into())?;
            }
            Op::BindUnnamed => {
                raw::bind(&mut out, "", "", &["?"]);
                raw::execute(&mut out, "");
                raw::sync(&mut out);
                let msgs = self.round(&out).await;
                match &self.model.unnamed {
                    Some(v) => expect(&ctx, rows(&msgs), vec![format!("{v}?")])?,
                    None => expect(&ctx, errors(&msgs), vec!["26000".into()])?,
                }
            }
            Op::ParseNamed(k) => {
                let v = format!("{}:s{k}", self.tag);
                raw::parse(&mut out, &format!("s{k}"), &format!("SELECT '{v}'"));
                raw::sync(&mut out);
                let msgs = self.round(&out).await;
                if self.model.named[*k as usize].is_some() {
                    expect(&ctx, errors(&msgs), vec!["42P05".into()])?;
                } else {
                    expect(&ctx, tags(&msgs), "1Z".into())?;
                    self.model.named[*k as usize] = Some(v);
                }
            }
            Op::BindNamed(k) => {
                raw::bind(&mut out, "", &format!("s{k}"), &[]);
                raw::execute(&mut out, "");
                raw::sync(&mut out);
                let msgs = self.round(&out).await;
                match &self.model.named[*k as usize] {
                    Some(v) => expect(&ctx, rows(&msgs), vec![v.clone()])?,
                    None => expect(&ctx, errors(&msgs), vec!["26000".into()])?,
                }
            }
            Op::CloseNamed(k) => {
                raw::close_statement(&mut out, &format!("s{k}"));
                raw::sync(&mut out);
                let msgs = self.round(&out).await;
                expect(&ctx, tags(&msgs), "3Z".into())?;
                self.model.named[*k as usize] = None;
            }
            Op::FailingBatch => {
                let v = self.value();
                raw::parse(&mut out, "", "SELECT 1 / 0");
                raw::bind(&mut out, "", "", &[]);
                raw::execute(&mut out, "");
                raw::parse(&mut out, "", &format!("SELECT '{v}'"));
                raw::sync(&mut out);
                let msgs = self.round(&out).await;
                // The first Parse succeeded; the error skipped the second.
                self.model.unnamed = None;
                expect(&ctx, errors(&msgs), vec!["22012".into()])?;
                expect(&ctx, rows(&msgs), vec![])?;
            }
            Op::SetName => {
                let v = format!("{}-{}", self.tag, self.n);
                raw::query(&mut out, &format!("SET application_name = '{v}'"));
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, errors(&msgs), vec![])?;
                self.model.app_name = v;
            }
            Op::ShowName => {
                raw::query(&mut out, "SHOW application_name");
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, rows(&msgs), vec![self.model.app_name.clone()])?;
            }
            Op::HiddenSearchPath(k) => {
                let sql = match k {
                    0 => "select 1 --x\r; select set_config('search_path', 'pg_catalog', false)",
                    1 => "select U&\"!0073et_config\" UESCAPE '!'('search_path', 'pg_catalog', false)",
                    _ => "UPDATE pg_settings SET setting = 'pg_catalog' WHERE name = 'search_path'",
                };
                raw::query(&mut out, sql);
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, errors(&msgs), vec![])?;
                self.model.own_search_path = true;
            }
            Op::ShowSearchPath => {
                raw::query(&mut out, "SHOW search_path");
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                let seen = rows(&msgs);
                let default = vec!["\"$user\", public".to_string()];
                if !self.model.own_search_path || seen != vec!["pg_catalog".to_string()] {
                    expect(&ctx, seen, default)?;
                }
            }
            Op::ReservedName(k) => {
                let sql = match k {
                    0 => "execute U&\"!0073hoal_1\" UESCAPE '!'",
                    1 => "select 1 --x\r; deallocate shoal_1",
                    _ => "explain execute shoal_2",
                };
                raw::query(&mut out, sql);
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, errors(&msgs), vec!["26000".into()])?;
            }
            Op::StrayCopy => {
                let v = self.value();
                put_copy_data(&mut out, 10, 10);
                out.extend_from_slice(&[b'c', 0, 0, 0, 4]);
                out.extend_from_slice(&[b'f', 0, 0, 0, 7, b'n', b'o', 0]);
                raw::query(&mut out, &format!("SELECT '{v}'"));
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, rows(&msgs), vec![v])?;
                expect(&ctx, errors(&msgs), vec![])?;
            }
            Op::VanishMidMessage => {
                let v = self.value();
                raw::query(&mut out, &format!("SELECT '{v}'"));
                put_copy_data(&mut out, 70_000, 100);
                // Not sent twice (see `round`): the CopyData it starts never ends.
                self.raw.send(&out).await;
                let msgs = self.raw.until_ready().await;
                let told = errors(&msgs) == ["55000"]
                    && (self.model.own_search_path || self.model.own_cursors);
                if !told {
                    expect(&ctx, rows(&msgs), vec![v])?;
                }
                *self = Client::new(self.tag).await;
            }
            Op::SavepointSet => {
                for sql in [
                    "BEGIN",
                    "SAVEPOINT s",
                    "SET application_name = 'rolled-back'",
                    "ROLLBACK TO SAVEPOINT s",
                    "COMMIT",
                ] {
                    let mut q = BytesMut::new();
                    raw::query(&mut q, sql);
                    let msgs = self.round(&q).await;
                    expect(&ctx, errors(&msgs), vec![])?;
                }
                self.model.unnamed = None;
            }
            Op::LateHoldCursor => {
                self.n += 1;
                raw::query(
                    &mut out,
                    &format!("BEGIN; declare c{}{} binary insensitive no scroll cursor with hold for select 1; COMMIT", self.tag, self.n),
                );
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                expect(&ctx, errors(&msgs), vec![])?;
                self.model.own_cursors = true;
            }
            Op::ShowCursors => {
                raw::query(&mut out, "SELECT count(*) FROM pg_cursors");
                let msgs = self.round(&out).await;
                self.model.unnamed = None;
                // Another client's cursor is never seen; one's own stays while no other
                // client needed the server.
                if !self.model.own_cursors {
                    expect(&ctx, rows(&msgs), vec!["0".to_string()])?;
                }
            }
            Op::Malformed => {
                put_flush_with_body(&mut out);
                self.raw.send(&out).await;
                let m = self.raw.recv().await;
                let code = m.map(|m| m.code()).unwrap_or_default();
                expect(&ctx, code, "08P01".into())?;
                if self.raw.recv().await.is_some() {
                    return Err(format!("{ctx}: not closed after the FATAL"));
                }
                *self = Client::new(self.tag).await;
            }
        }
        Ok(())
    }
}

/// A CopyData declaring `declared` bytes of which `sent` follow.
fn put_copy_data(out: &mut BytesMut, declared: u32, sent: usize) {
    out.put_u8(b'd');
    out.put_u32(declared + 4);
    out.extend_from_slice(&vec![b'x'; sent]);
}

fn put_flush_with_body(out: &mut BytesMut) {
    shoal_wire::backend::put_message(out, b'H', |b| b.put_u8(1));
}

fn tags(msgs: &[Msg]) -> String {
    msgs.iter().map(|m| m.tag).collect()
}

fn expect<T: PartialEq + std::fmt::Debug>(ctx: &str, got: T, want: T) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{ctx}: got {got:?}, expected {want:?}"))
    }
}

fn cases() -> u32 {
    std::env::var("SHOAL_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn two_clients_on_one_server_never_see_each_other(
        ops in proptest::collection::vec((any::<bool>(), op()), 1..30)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let result: Result<(), String> = rt.block_on(async {
            let mut a = Client::new('a').await;
            let mut b = Client::new('b').await;
            for (which, op) in &ops {
                let c = if *which { &mut a } else { &mut b };
                c.run(op).await?;
            }
            Ok(())
        });
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}
