//! The result cache in a transaction-mode session: a unit the pool's cache holds a current
//! reply for is answered without a server; a miss that may be kept runs with its reply
//! copied as it goes to the client, on the pool's own server (never a replica, whose state
//! may be older than what the versions say). The cache itself is behind
//! [`crate::seam::Features`]; what is the session's is here: which clients may ask, and the
//! key's prefix.
//!
//! Only for an idle client outside a transaction block (between transactions, which is
//! where this runs), not listening (its notifications come with its replies), with no
//! error to skip past.

use bytes::Buf;
use shoal_wire::sql::ClientEncoding;

use super::{Extras, Session, SessionError};
use crate::seam::{CacheUnit, Features as _, FromCache};
use crate::Plugged;

impl Session {
    /// Answers the unit at the head of the client's buffer from the cache, if it can.
    /// Returns true when it did; false when the unit needs a server (with a fill set up
    /// in the client's extras when its reply is to be kept). For a pool with a cache.
    pub(super) async fn answer_from_cache(&mut self) -> Result<bool, SessionError> {
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
        let unit = CacheUnit {
            buf: &self.cbuf,
            statements: self.statements.as_deref(),
            prefix: self.cache_prefix(),
        };
        match Plugged::from_cache(&self.pool, unit).await {
            FromCache::Hit {
                reply,
                len,
                unnamed_parse,
            } => {
                if let Some(body) = unnamed_parse {
                    // As if the Parse had reached a server: the client's unnamed statement.
                    self.statements
                        .get_or_insert_with(Default::default)
                        .unnamed_parsed_without_server(&self.cbuf[body], ClientEncoding::Utf8);
                }
                self.stream.write_all(&reply).await?;
                self.cbuf.advance(len);
                Ok(true)
            }
            FromCache::Fill(capture) => {
                Extras::get(&mut self.extras).capture = Some(capture);
                Ok(false)
            }
            FromCache::Pass => Ok(false),
        }
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
