//! Which subscriber gets which change of a batch: the bindings a change matches (table,
//! event, filters), the checks the batch needs (one per table and identity), and the
//! messages queued once they are answered, in commit order. Pure.

use std::collections::HashMap;
use std::sync::Arc;

use shoal_realtime::changes::{self, Binding, Cell, Change, Kind};
use shoal_realtime::feed::Target;
use shoal_realtime::hub::Frame;

use super::authorize::Access;
use super::stream::{Rel, Row, Value};

/// A subscription as a batch sees it.
pub(super) struct Listener<'a> {
    pub topic: &'a str,
    pub bindings: &'a [Binding],
    /// Its identity's position among the batch's distinct identities.
    pub identity: usize,
    pub target: &'a Target,
}

/// One authorization a batch needs.
pub(super) struct Need {
    pub rel: Arc<Rel>,
    pub identity: usize,
    /// Batch rows whose visibility must be looked up (INSERTs and UPDATEs).
    pub rows: Vec<usize>,
}

pub(super) struct Plan {
    /// Per batch row: the listeners it matches and the ids of their bindings it matches.
    matches: Vec<Vec<(usize, Vec<u64>)>>,
    pub needs: Vec<Need>,
}

/// The bindings of `bindings` that `row` matches, by id.
fn matching(bindings: &[Binding], row: &Row) -> Vec<u64> {
    let rel = &row.rel;
    let value = |name: &str| -> Option<(&str, Option<&str>)> {
        let i = rel.columns.iter().position(|c| c.name == name)?;
        let v = if row.kind == Kind::Delete {
            row.old.get(i)
        } else {
            row.value(i)
        }?;
        match v {
            Value::Unchanged => None,
            v => Some((rel.columns[i].typname.as_str(), v.text())),
        }
    };
    let mut ids: Vec<u64> = bindings
        .iter()
        .filter(|b| b.covers(&rel.schema, &rel.table, row.kind))
        .filter(|b| shoal_realtime::filter::passes(&b.filters, value))
        .map(Binding::id)
        .collect();
    ids.dedup();
    ids
}

/// Which listener each row goes to (before authorization), and the checks needed.
pub(super) fn plan(rows: &[Row], listeners: &[Listener<'_>]) -> Plan {
    let mut matches = Vec::with_capacity(rows.len());
    let mut needs: HashMap<(u32, usize), Need> = HashMap::new();
    let mut order = Vec::new();
    for (at, row) in rows.iter().enumerate() {
        let mut here = Vec::new();
        for (l, listener) in listeners.iter().enumerate() {
            let ids = matching(listener.bindings, row);
            if ids.is_empty() {
                continue;
            }
            let key = (row.rel.oid, listener.identity);
            let need = needs.entry(key).or_insert_with(|| {
                order.push(key);
                Need {
                    rel: row.rel.clone(),
                    identity: listener.identity,
                    rows: Vec::new(),
                }
            });
            if row.kind != Kind::Delete && need.rows.last() != Some(&at) {
                need.rows.push(at);
            }
            here.push((l, ids));
        }
        matches.push(here);
    }
    let needs = order.iter().filter_map(|k| needs.remove(k)).collect();
    Plan { matches, needs }
}

/// Queues every authorised change to its listeners, in the batch's order; how many
/// messages were queued. `access` answers each [`Need`] (missing: nothing may be seen).
pub(super) fn deliver(
    plan: &Plan,
    rows: &[Row],
    listeners: &[Listener<'_>],
    access: &HashMap<(u32, usize), Access>,
) -> usize {
    let mut queued = 0;
    for (at, (row, matched)) in rows.iter().zip(&plan.matches).enumerate() {
        // What a subscriber is sent depends only on the columns it may read and the
        // bindings matched: one payload for each, one frame for each topic and version,
        // shared by every subscriber it goes to.
        type Shape<'s> = (&'s [usize], &'s [u64]);
        let mut payloads: HashMap<Shape<'_>, String> = HashMap::new();
        let mut frames: HashMap<(Shape<'_>, &str, bool), Option<Frame>> = HashMap::new();
        for (l, ids) in matched {
            let listener = &listeners[*l];
            let Some(a) = access.get(&(row.rel.oid, listener.identity)) else {
                continue;
            };
            if row.kind != Kind::Delete && !a.sees(at) {
                continue;
            }
            let shape = (a.indices.as_slice(), ids.as_slice());
            let v1 = listener.target.vsn == shoal_realtime::protocol::Vsn::V1;
            let frame = frames
                .entry((shape, listener.topic, v1))
                .or_insert_with(|| {
                    let payload = payloads
                        .entry(shape)
                        .or_insert_with(|| payload(ids, row, a, listener.bindings))
                        .clone();
                    shoal_realtime::feed::change_frame(listener.target.vsn, listener.topic, payload)
                });
            if let Some(f) = frame {
                if listener.target.push(f.clone()) {
                    queued += 1;
                }
            }
        }
    }
    queued
}

/// The message payload of `row` for bindings `ids`, with the columns `a` may read that
/// the bindings select (all, when one of them selects none). The payload depends only on
/// `a` and `ids`: a binding's id covers its `select`.
fn payload(ids: &[u64], row: &Row, a: &Access, bindings: &[Binding]) -> String {
    let matched = || bindings.iter().filter(|b| ids.contains(&b.id()));
    let (indices, columns);
    let (indices, columns) = if matched().any(|b| b.select.is_none()) {
        (a.indices.as_slice(), a.columns.as_slice())
    } else {
        let keep: Vec<usize> = (0..a.indices.len())
            .filter(|&p| {
                let key = row.rel.primary.get(a.indices[p]).copied().unwrap_or(false);
                matched().any(|b| b.selects(&a.columns[p].name, key))
            })
            .collect();
        indices = keep.iter().map(|&p| a.indices[p]).collect::<Vec<_>>();
        columns = keep
            .iter()
            .map(|&p| a.columns[p].clone())
            .collect::<Vec<_>>();
        (indices.as_slice(), columns.as_slice())
    };
    let new = cells(indices, &row.new);
    let old = cells(indices, &row.old);
    changes::payload(
        ids,
        &Change {
            schema: &row.rel.schema,
            table: &row.rel.table,
            kind: row.kind,
            commit_time: row.commit_time,
            columns,
            new: &new,
            old: &old,
        },
    )
}

/// The cells of `values` at `indices` (none for a tuple the change has not).
fn cells<'a>(indices: &[usize], values: &'a [Value]) -> Vec<Cell<'a>> {
    if values.is_empty() {
        return Vec::new();
    }
    indices
        .iter()
        .map(|&i| match values.get(i) {
            Some(Value::Text(t)) => Cell::Text(t),
            Some(Value::Null) => Cell::Null,
            Some(Value::Unchanged) | None => Cell::Unchanged,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_realtime::changes::Column;

    fn rel() -> Arc<Rel> {
        Arc::new(Rel {
            oid: 7,
            schema: "public".into(),
            table: "notes".into(),
            qualified: "\"public\".\"notes\"".into(),
            columns: vec![
                Column {
                    name: "id".into(),
                    typname: "int4".into(),
                },
                Column {
                    name: "owner".into(),
                    typname: "text".into(),
                },
            ],
            key: vec![true, false],
            primary: vec![true, false],
        })
    }

    fn row(kind: Kind, id: &str, owner: &str) -> Row {
        let vals = vec![Value::Text(id.into()), Value::Text(owner.into())];
        let (new, old) = match kind {
            Kind::Delete => (vec![], vec![Value::Text(id.into()), Value::Null]),
            _ => (vals, vec![]),
        };
        Row {
            rel: rel(),
            kind,
            commit_time: 0,
            new,
            old,
        }
    }

    fn binding(v: serde_json::Value) -> Binding {
        Binding::parse(&v).unwrap()
    }

    fn texts(rx: &mut tokio::sync::mpsc::Receiver<Frame>) -> Vec<serde_json::Value> {
        let mut v = Vec::new();
        while let Ok(Frame::Text(t)) = rx.try_recv() {
            v.push(serde_json::from_str(t.as_str()).unwrap());
        }
        v
    }

    #[test]
    fn changes_go_to_matching_authorised_listeners_in_order() {
        let hub = Arc::new(shoal_realtime::hub::Hub::default());
        let mk = |id: u64| {
            let (out, rx) = shoal_realtime::hub::Outbox::new(64);
            let sub = shoal_realtime::hub::Subscriber {
                socket: id,
                join_ref: Some("1".into()),
                vsn: shoal_realtime::protocol::Vsn::V2,
                receive_own: false,
                presence: false,
                out,
            };
            let identity = shoal_realtime::feed::Identity {
                role: "authenticated".into(),
                claims: "{}".into(),
            };
            let (s, _h) = shoal_realtime::feed::subscription(
                hub.clone(),
                sub,
                shoal_realtime::feed::Join {
                    topic: "realtime:notes",
                    private: false,
                    msg_ref: None,
                    replication_ready: false,
                    replay: None,
                },
                vec![],
                Arc::new(std::sync::Mutex::new(identity)),
            );
            (s.target, rx)
        };
        let (ta, mut ra) = mk(1);
        let (tb, mut rb) = mk(2);
        let all = [binding(
            serde_json::json!({"event": "*", "schema": "public", "table": "notes"}),
        )];
        let only_bob = [binding(serde_json::json!({
            "event": "INSERT", "schema": "public", "table": "notes", "filter": "owner=eq.bob"
        }))];
        let listeners = [
            Listener {
                topic: "realtime:notes",
                bindings: &all,
                identity: 0,
                target: &ta,
            },
            Listener {
                topic: "realtime:notes",
                bindings: &only_bob,
                identity: 1,
                target: &tb,
            },
        ];
        let rows = [
            row(Kind::Insert, "1", "alice"),
            row(Kind::Insert, "2", "bob"),
            row(Kind::Delete, "1", ""),
        ];
        let plan = plan(&rows, &listeners);
        // One check per table and identity; DELETEs are never looked up.
        assert_eq!(plan.needs.len(), 2);
        assert_eq!(plan.needs[0].rows, vec![0, 1]);
        assert_eq!(plan.needs[1].rows, vec![1]);
        let r = rel();
        let access = HashMap::from([
            (
                (7, 0),
                Access {
                    indices: vec![0, 1],
                    columns: r.columns.clone(),
                    // Identity 0 may not see row 1.
                    rows: Some([0].into()),
                },
            ),
            (
                (7, 1),
                Access {
                    // `owner` is not readable by identity 1.
                    indices: vec![0],
                    columns: vec![r.columns[0].clone()],
                    rows: Some([1].into()),
                },
            ),
        ]);
        assert_eq!(deliver(&plan, &rows, &listeners, &access), 3);
        let a = texts(&mut ra);
        assert_eq!(a.len(), 2);
        assert_eq!(a[0][3], "postgres_changes");
        assert_eq!(
            a[0][4]["data"]["record"],
            serde_json::json!({"id": 1, "owner": "alice"})
        );
        assert_eq!(a[1][4]["data"]["type"], "DELETE");
        assert_eq!(
            a[1][4]["data"]["old_record"],
            serde_json::json!({"id": 1, "owner": null})
        );
        let b = texts(&mut rb);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0][4]["ids"], serde_json::json!([only_bob[0].id()]));
        assert_eq!(b[0][4]["data"]["record"], serde_json::json!({"id": 2}));
        assert_eq!(
            b[0][4]["data"]["columns"],
            serde_json::json!([{"name": "id", "type": "int4"}])
        );
    }
}
