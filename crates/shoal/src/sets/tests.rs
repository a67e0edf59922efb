use super::*;

#[test]
fn recognises_session_sets() {
    assert_eq!(
        parse("SET search_path = a, b;"),
        Some(SetOp::Set {
            name: "search_path".into(),
            sql: "SET search_path = a, b".into()
        })
    );
    assert!(
        matches!(parse("set session TimeZone to 'UTC'"), Some(SetOp::Set { name, .. }) if &*name == "timezone")
    );
    assert!(
        matches!(parse("SET TIME ZONE 'UTC'"), Some(SetOp::Set { name, .. }) if &*name == "timezone")
    );
    assert!(matches!(parse("SET x.y=1"), Some(SetOp::Set { name, .. }) if &*name == "x.y"));
    assert!(matches!(
        parse("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"),
        Some(SetOp::Set { name, .. }) if &*name == "session characteristics"
    ));
    assert!(matches!(parse("SET ROLE x"), Some(SetOp::Set { name, .. }) if &*name == "role"));
    assert!(
        matches!(parse("SET SESSION AUTHORIZATION x"), Some(SetOp::Set { name, .. }) if &*name == "session authorization")
    );
    assert!(
        matches!(parse("/* c */ -- d\n SET a.b = 1"), Some(SetOp::Set { sql, .. }) if &*sql == "SET a.b = 1")
    );
    assert_eq!(parse("RESET ALL"), Some(SetOp::ResetAll));
    assert_eq!(parse("discard all"), Some(SetOp::DiscardAll));
    assert_eq!(
        parse("LISTEN \"a;b\""),
        Some(SetOp::Listen((*b"a;b").into()))
    );
    assert_eq!(parse("unlisten *;"), Some(SetOp::UnlistenAll));
    assert_eq!(parse("LISTEN a; LISTEN b"), None);
    assert_eq!(
        parse("RESET work_mem"),
        Some(SetOp::Reset {
            name: "work_mem".into()
        })
    );
    for no in [
        "SET LOCAL work_mem = 1",
        "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        "SET a = 1; SELECT 1",
        "SELECT 1",
        "DISCARD PLANS",
    ] {
        assert_eq!(parse(no), None, "{no}");
    }
}

#[test]
fn sets_hold_on_commit_and_vanish_on_rollback() {
    let mut s = SessionSets::default();
    s.executed(parse("SET work_mem = '8MB'").unwrap());
    s.ready(b'I');
    assert_eq!(s.replay_sql(), "SET work_mem = '8MB'");
    let fp = s.fingerprint;
    assert_ne!(fp, 0);
    s.executed(parse("SET work_mem = '16MB'").unwrap());
    s.ready(b'T');
    s.transaction_end(false);
    s.ready(b'I');
    assert_eq!(s.replay_sql(), "SET work_mem = '8MB'", "rolled back");
    s.executed(parse("SET statement_timeout = 5").unwrap());
    s.ready(b'T');
    s.transaction_end(true);
    s.ready(b'I');
    assert_eq!(
        s.replay_sql(),
        "SET work_mem = '8MB'\n;SET statement_timeout = 5"
    );
    s.executed(parse("RESET ALL").unwrap());
    s.ready(b'I');
    assert_eq!(s.fingerprint, 0);
}

/// LISTEN holds once its transaction commits, as a SET does; DISCARD ALL unlistens too.
#[test]
fn listening_follows_transactions() {
    let run = |s: &mut SessionSets, sql: &str| s.executed(parse(sql).unwrap());
    let mut s = SessionSets::default();
    run(&mut s, "LISTEN a");
    assert!(s.listener_due_before_ready());
    s.ready(b'I');
    assert_eq!(s.listening, vec![Box::from(&b"a"[..])]);
    assert!(s.listening_changed);
    s.listening_changed = false;
    assert_eq!(s.fingerprint, 0, "listening is no SET to replay");
    // Rolled back: nothing changes.
    run(&mut s, "LISTEN b");
    s.ready(b'T');
    s.transaction_end(false);
    s.ready(b'I');
    assert!(!s.listening_changed);
    // A failed implicit transaction.
    run(&mut s, "UNLISTEN a");
    s.error();
    assert!(!s.listener_due_before_ready());
    s.ready(b'I');
    assert_eq!(s.listening.len(), 1);
    // A NOTIFY by a listening client is due to reach it.
    s.notified = true;
    assert!(s.listener_due_before_ready());
    s.ready(b'I');
    assert!(!s.notified);
    run(&mut s, "SET work_mem = '1MB'");
    run(&mut s, "DISCARD ALL");
    s.ready(b'I');
    assert!(s.listening.is_empty() && s.listening_changed && s.held.is_empty());
}

/// What a client listens to, against a model of PostgreSQL: random LISTEN/UNLISTEN/
/// `UNLISTEN *`/`DISCARD ALL` in autocommit and in transaction blocks that commit, roll
/// back, or fail first; `listening_changed` is set whenever the set changed.
mod listening_model {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[derive(Debug, Clone)]
    enum Stmt {
        Listen(u8),
        Unlisten(u8),
        UnlistenAll,
    }

    #[derive(Debug, Clone)]
    enum Step {
        Auto(Stmt),
        Discard,
        /// A block of statements, then COMMIT (0), ROLLBACK (1), or an error and ROLLBACK (2).
        Block(Vec<Stmt>, u8),
    }

    fn stmt() -> impl Strategy<Value = Stmt> {
        prop_oneof![
            (0u8..4).prop_map(Stmt::Listen),
            (0u8..4).prop_map(Stmt::Unlisten),
            Just(Stmt::UnlistenAll),
        ]
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => stmt().prop_map(Step::Auto),
            1 => Just(Step::Discard),
            2 => (prop::collection::vec(stmt(), 0..4), 0u8..3).prop_map(|(v, e)| Step::Block(v, e)),
        ]
    }

    fn op(s: &Stmt) -> SetOp {
        let sql = match s {
            Stmt::Listen(c) => format!("LISTEN c{c}"),
            Stmt::Unlisten(c) => format!("UNLISTEN c{c}"),
            Stmt::UnlistenAll => "UNLISTEN *".into(),
        };
        parse(&sql).unwrap()
    }

    fn apply(model: &mut BTreeSet<u8>, s: &Stmt) {
        match s {
            Stmt::Listen(c) => {
                model.insert(*c);
            }
            Stmt::Unlisten(c) => {
                model.remove(c);
            }
            Stmt::UnlistenAll => model.clear(),
        }
    }

    proptest! {
        #[test]
        fn listening_matches_postgresql(steps in prop::collection::vec(step(), 0..30)) {
            let mut s = SessionSets::default();
            let mut model = BTreeSet::new();
            for step in &steps {
                let before = model.clone();
                match step {
                    Step::Auto(st) => {
                        s.executed(op(st));
                        s.ready(b'I');
                        apply(&mut model, st);
                    }
                    Step::Discard => {
                        s.executed(parse("DISCARD ALL").unwrap());
                        s.ready(b'I');
                        model.clear();
                    }
                    Step::Block(stmts, end) => {
                        s.ready(b'T');
                        let mut pending = model.clone();
                        for st in stmts {
                            s.executed(op(st));
                            s.ready(b'T');
                            apply(&mut pending, st);
                        }
                        if *end == 2 {
                            s.error();
                            s.ready(b'E');
                        }
                        s.transaction_end(*end == 0);
                        s.ready(b'I');
                        if *end == 0 {
                            model = pending;
                        }
                    }
                }
                let got: BTreeSet<u8> = s
                    .listening
                    .iter()
                    .map(|c| c[1] - b'0')
                    .collect();
                prop_assert_eq!(&got, &model, "after {:?}", step);
                prop_assert_eq!(s.listening.len(), model.len(), "no channel twice");
                if before != model {
                    prop_assert!(s.listening_changed, "a change is flagged for the listener");
                }
                s.listening_changed = false;
            }
        }
    }
}

/// A SET rolled back to a savepoint is gone; one released with its savepoint stays; a
/// ROLLBACK AND CHAIN drops what came before it even though the chained transaction
/// commits; an error in an implicit transaction rolls its SETs back.
#[test]
fn savepoints_chains_and_failed_pipelines() {
    let run = |s: &mut SessionSets, sql: &str| s.executed(parse(sql).unwrap());
    let mut s = SessionSets::default();
    run(&mut s, "SET work_mem = '1MB'");
    run(&mut s, "SAVEPOINT a");
    run(&mut s, "SET ROLE other");
    run(&mut s, "ROLLBACK TO SAVEPOINT a");
    run(&mut s, "savepoint \"B\"");
    run(&mut s, "SET statement_timeout = 5");
    run(&mut s, "RELEASE \"B\"");
    run(&mut s, "rollback work to a");
    s.ready(b'T');
    s.transaction_end(true);
    s.ready(b'I');
    assert_eq!(s.replay_sql(), "SET work_mem = '1MB'");
    // A savepoint made before Shoal followed anything: everything after it is undone.
    run(&mut s, "SET search_path = x");
    run(&mut s, "ROLLBACK TO unknown");
    s.transaction_end(true);
    assert_eq!(s.replay_sql(), "SET work_mem = '1MB'");
    // ROLLBACK AND CHAIN, then COMMIT.
    run(&mut s, "SET ROLE other");
    s.transaction_end(false);
    run(&mut s, "SET search_path = y");
    s.transaction_end(true);
    s.ready(b'I');
    assert_eq!(s.replay_sql(), "SET work_mem = '1MB'\n;SET search_path = y");
    // A pipeline whose later statement failed.
    run(&mut s, "RESET ALL");
    s.error();
    s.ready(b'I');
    assert_eq!(s.held.len(), 2);
    assert_eq!(parse("ROLLBACK"), None);
    assert_eq!(parse("ROLLBACK AND CHAIN"), None);
    assert_eq!(parse("SAVEPOINT a; SET x = 1"), None);
    assert_eq!(
        parse("rollback to savepoint A"),
        Some(SetOp::RollbackTo("a".into()))
    );
}
