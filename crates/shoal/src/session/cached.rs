//! The result cache in a transaction-mode session: a unit the pool's cache holds a current
//! reply for is answered without a server; a miss that may be kept runs with its reply
//! copied as it goes to the client (see [`crate::cache::capture`]), on the pool's own
//! server (never a replica, whose state may be older than what the versions say).
//!
//! Only for an idle client outside a transaction block (between transactions, which is
//! where this runs), not listening (its notifications come with its replies), with no
//! error to skip past.

use crate::features::PoolFeatures;
use std::sync::atomic::Ordering;

use shoal_wire::sql::ClientEncoding;

use crate::cache::{Fill, QueryCache};

use super::{Extras, Session, SessionError};

/// How many times a client waits for others' fills of its key before running it itself.
const WAITS: usize = 2;

impl Session {
    /// Answers the unit at the head of the client's buffer from the cache, if it can.
    /// Returns true when it did; false when the unit needs a server (with a fill set up
    /// in the client's extras when its reply is to be kept).
    pub(super) async fn answer_from_cache(&mut self) -> Result<bool, SessionError> {
        let Some(cache) = self.pool.cache() else {
            return Ok(false);
        };
        if self.skip_until_sync
            || self.extras.as_ref().is_some_and(|x| {
                x.listen.is_some() || x.capture.is_some() || x.holds_state || x.recoding
            })
            || super::encoding_of(&self.extras) != ClientEncoding::Utf8
        {
            // Its server's session may differ from what the key says: state the client left
            // there that Shoal does not replay (a `set_config`, a temporary table, `SET ROLE`
            // among other statements), or text in another encoding. Such a client neither
            // fills nor is served.
            return Ok(false);
        }
        // A new pool's first statements wait for the catalogue (once, briefly) rather than
        // all pass uncached.
        cache
            .freshness
            .catalogue
            .loaded(self.pool.settings.connect_timeout)
            .await;
        let prefix = self.cache_prefix();
        let Some(candidate) = cache.candidate(&self.cbuf, self.statements.as_deref(), prefix)
        else {
            return Ok(false);
        };
        for attempt in 0..=WAITS {
            if let Some(reply) = cache.lookup(&candidate.key) {
                cache.stats.hits.fetch_add(1, Ordering::Relaxed);
                if let Some(body) = candidate.unnamed_parse.clone() {
                    // As if the Parse had reached a server: the client's unnamed statement.
                    self.statements
                        .get_or_insert_with(Default::default)
                        .unnamed_parsed_without_server(&self.cbuf[body], ClientEncoding::Utf8);
                }
                self.stream.write_all(&reply).await?;
                bytes::Buf::advance(&mut self.cbuf, candidate.len);
                return Ok(true);
            }
            if attempt == WAITS {
                break;
            }
            let notify = match cache.begin_fill(&candidate) {
                Fill::Lead(capture) => {
                    cache.stats.misses.fetch_add(1, Ordering::Relaxed);
                    Extras::get(&mut self.extras).capture = Some(capture);
                    return Ok(false);
                }
                Fill::Skip => {
                    cache.stats.misses.fetch_add(1, Ordering::Relaxed);
                    return Ok(false);
                }
                Fill::Wait(n) => n,
            };
            cache.stats.waits.fetch_add(1, Ordering::Relaxed);
            wait_for_fill(&cache, &candidate.key, &notify).await;
        }
        cache.stats.misses.fetch_add(1, Ordering::Relaxed);
        Ok(false)
    }

    /// What every key of this client starts with: its startup parameters and the settings
    /// it holds (its role, `search_path`, ...), length-prefixed so no two differ only in
    /// where one ends.
    fn cache_prefix(&self) -> Vec<u8> {
        let mut key = Vec::with_capacity(128);
        let mut put = |b: &[u8]| {
            key.extend_from_slice(&(b.len() as u32).to_be_bytes());
            key.extend_from_slice(b);
        };
        for (k, v) in self.params.iter() {
            put(k.as_bytes());
            put(v.as_bytes());
        }
        put(b"");
        if let Some(x) = &self.extras {
            for (name, sql) in &x.sets.held {
                put(name.as_bytes());
                put(sql.as_bytes());
            }
        }
        put(b"");
        key
    }
}

/// Waits until the client filling `key` is done (or [`crate::cache::FILL_WAIT`] passes).
async fn wait_for_fill(cache: &QueryCache, key: &[u8], notify: &tokio::sync::Notify) {
    let notified = notify.notified();
    let mut notified = std::pin::pin!(notified);
    // Registered before looking: a fill ending after the look wakes this wait.
    notified.as_mut().enable();
    if !cache.filling(key) {
        return;
    }
    let _ = crate::timer::timeout(crate::cache::FILL_WAIT, notified).await;
}

/// Notes what the client message `msg` (about to go to the pool's primary) may write:
/// a Query's text, the statement a Bind runs, or anything for a FunctionCall.
pub(super) fn note_writes(
    cache: &QueryCache,
    msg: &[u8],
    statements: Option<&crate::prepared::ClientStatements>,
    touched: &mut crate::cache::Touched,
    enc: ClientEncoding,
) {
    use shoal_wire::frontend::tag as fe;
    let body = &msg[shoal_wire::frame::HEADER_LEN..];
    let cstr = |b: &[u8]| -> usize { b.iter().position(|&c| c == 0).unwrap_or(b.len()) };
    let text = match msg[0] {
        fe::QUERY => &body[..cstr(body)],
        fe::BIND => {
            let rest = &body[(cstr(body) + 1).min(body.len())..];
            let name = &rest[..cstr(rest)];
            match statements.and_then(|s| s.text_of(name)) {
                Some(t) => t,
                None => {
                    touched.add(crate::cache::analysis::Touches::Everything);
                    return;
                }
            }
        }
        fe::FUNCTION_CALL => {
            touched.add(crate::cache::analysis::Touches::Everything);
            return;
        }
        _ => return,
    };
    touched.add(cache.touches(text, enc));
}
