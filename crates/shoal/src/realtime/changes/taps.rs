//! The capture task's other consumers: the taps of its database (the cache's
//! invalidation, see [`crate::wal`]), served from the same slot as Realtime's
//! subscriptions. Only the database's first task serves them, so each tap hears each
//! commit once.

use std::sync::{Arc, Weak};

use crate::app::App;
use crate::server::{ServerConn, ServerError, Upstream};
use crate::wal::{DbKey, Tap};

use super::stream::{CaptureError, Row, TIMEOUT};

pub(super) struct Taps {
    db: DbKey,
    /// Whether this task serves its database's taps.
    serves: bool,
    app: Weak<App>,
    /// Tables added to the publication whose marker has not come back, by marker.
    pending: Vec<(u64, Arc<dyn Tap>, String)>,
}

impl Taps {
    pub(super) fn new(db: DbKey, serves: bool, app: Weak<App>) -> Taps {
        Taps {
            db,
            serves,
            app,
            pending: Vec::new(),
        }
    }

    pub(super) fn live(&self) -> Vec<Arc<dyn Tap>> {
        match self.app.upgrade().filter(|_| self.serves) {
            Some(app) => app.routes.captures.taps(&self.db),
            None => Vec::new(),
        }
    }

    /// Who logs in for the stream when no tenant does.
    pub(super) fn upstream(&self) -> Option<Upstream> {
        self.live().first().map(|t| t.upstream())
    }

    /// What a tap wanting a table covered wakes.
    pub(super) fn wake(&self) -> Arc<tokio::sync::Notify> {
        match self.app.upgrade().filter(|_| self.serves) {
            Some(app) => app.routes.captures.wake(&self.db),
            None => Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// A transaction committed `rows` and truncated `truncated`.
    pub(super) fn committed(&self, rows: &[Row], truncated: &[String]) {
        if !self.serves {
            return;
        }
        let mut tables: Vec<&str> = Vec::new();
        for name in rows
            .iter()
            .map(|r| r.rel.table.as_str())
            .chain(truncated.iter().map(String::as_str))
        {
            if !tables.contains(&name) {
                tables.push(name);
            }
        }
        if tables.is_empty() {
            return;
        }
        for tap in self.live() {
            tap.committed(&tables);
        }
    }

    /// Marker `seq` came back: the tables it was written for are covered.
    pub(super) fn marker(&mut self, seq: u64) {
        self.pending.retain(|(m, tap, name)| {
            if *m <= seq {
                tap.covered(name);
                return false;
            }
            true
        });
    }

    pub(super) fn started(&self, slot: &str) {
        for tap in self.live() {
            tap.started(slot);
        }
    }

    /// The stream stopped: markers on their way are lost with it.
    pub(super) fn lost(&mut self, why: Option<&str>) {
        self.pending.clear();
        for tap in self.live() {
            tap.lost(why);
        }
    }

    pub(super) fn confirmed(&self, lsn: u64) {
        for tap in self.live() {
            tap.confirmed(lsn);
        }
    }

    /// Adds the tables the taps want covered to `publication`; those added wait for the
    /// next marker (see [`Taps::marked`]).
    pub(super) async fn cover(
        &mut self,
        control: &mut ServerConn,
        publication: &str,
    ) -> Result<Vec<(Arc<dyn Tap>, String)>, CaptureError> {
        let mut covering = Vec::new();
        for tap in self.live() {
            let pending: Vec<String> = self.pending.iter().map(|(_, _, n)| n.clone()).collect();
            'cover: for c in tap.to_cover(&pending) {
                for q in &c.qualified {
                    if let Err(why) = add_table(control, publication, q).await? {
                        tap.refused(&c.name, &why);
                        continue 'cover;
                    }
                }
                covering.push((tap.clone(), c.name));
            }
        }
        Ok(covering)
    }

    /// `covering` waits for marker `seq`.
    pub(super) fn marked(&mut self, seq: u64, covering: Vec<(Arc<dyn Tap>, String)>) {
        self.pending
            .extend(covering.into_iter().map(|(tap, name)| (seq, tap, name)));
    }
}

/// Adds `qualified` to `publication` (already in it is fine); `Ok(Err(why))` when the
/// database refuses (privileges, not a table).
pub(super) async fn add_table(
    control: &mut ServerConn,
    publication: &str,
    qualified: &str,
) -> Result<Result<(), String>, CaptureError> {
    let sql = format!("ALTER PUBLICATION {publication} ADD TABLE {qualified}");
    match crate::timer::timeout(TIMEOUT, control.simple_query(&sql)).await {
        Ok(Ok(())) => Ok(Ok(())),
        Ok(Err(ServerError::Db(e))) if e.code == "42710" => Ok(Ok(())),
        Ok(Err(ServerError::Db(e))) if !e.is_fatal() => Ok(Err(e.message)),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(CaptureError::Timeout("ALTER PUBLICATION")),
    }
}
