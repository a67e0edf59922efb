//! The statement analysis of one pool: every text its clients send, read as the server
//! reads it (in the client's encoding), analysed once by [`shoal_wire::statement`] and
//! remembered. Query rules, the result cache and the replica split all decide on what this
//! gives; none of them parses a text of its own.
//!
//! A text is remembered by itself and by its shape (its values taken out, see
//! [`shoal_wire::readonly::normalized`]): a client that writes its values into the text is
//! parsed once per statement shape, not once per value. What depends on the catalogue
//! (which functions are volatile, which relations are views) is not remembered here: each
//! feature judges the analysis against its catalogue of the moment.

pub mod catalogue;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use shoal_wire::encoding::Unreadable;
use shoal_wire::readonly;
use shoal_wire::sql::ClientEncoding;
use shoal_wire::statement::Analysis;

/// Texts remembered; past it the memory starts over (a workload with more distinct shapes
/// than this is parsed more often, never wrongly).
const REMEMBERED: usize = 8192;
/// Longer texts are analysed each time rather than kept.
const LONGEST_KEPT: usize = 16 * 1024;

type Known = HashMap<Box<[u8]>, Arc<Analysis>, foldhash::fast::RandomState>;

thread_local! {
    /// The last text this thread analysed, and its analysis (the buffer is reused).
    static LAST: std::cell::RefCell<(Vec<u8>, Option<Arc<Analysis>>)> =
        const { std::cell::RefCell::new((Vec::new(), None)) };
}

#[derive(Default)]
pub struct Analyses {
    known: Mutex<Known>,
}

impl Analyses {
    /// The analysis of `text` in the client's encoding `enc`, or why it cannot be read as
    /// the server will read it (the caller fails closed).
    pub fn of(&self, text: &[u8], enc: ClientEncoding) -> Result<Arc<Analysis>, Unreadable> {
        let text = enc.as_utf8(text)?;
        Ok(self.of_utf8(&text))
    }

    /// The analysis of `text`, UTF-8 already (a UTF8 client's, or one decoded).
    pub fn of_utf8(&self, text: &[u8]) -> Arc<Analysis> {
        // Features ask about one statement one after the other (the cache before it runs,
        // then what it touched): the thread's last text answers the second without the
        // shape's cost. An analysis depends on the text alone, whichever pool asks.
        if let Some(a) = LAST.with_borrow(|(t, a)| a.as_ref().filter(|_| t == text).cloned()) {
            return a;
        }
        let a = self.look_up(text);
        if text.len() <= LONGEST_KEPT {
            LAST.with_borrow_mut(|(t, last)| {
                t.clear();
                t.extend_from_slice(text);
                *last = Some(a.clone());
            });
        }
        a
    }

    fn look_up(&self, text: &[u8]) -> Arc<Analysis> {
        if let Some(a) = self.lock().get(text) {
            return a.clone();
        }
        let shape = readonly::normalized(text).filter(|s| s.as_slice() != text);
        if let Some(a) = shape.as_deref().and_then(|s| self.lock().get(s).cloned()) {
            return a;
        }
        // Not UTF-8: the server refuses it before it parses anything, and the structure it
        // would have seen survives the replacement characters.
        let a = Arc::new(shoal_wire::statement::analyse(&String::from_utf8_lossy(
            text,
        )));
        if text.len() <= LONGEST_KEPT {
            let mut known = self.lock();
            if known.len() + 2 > REMEMBERED {
                known.clear();
            }
            if let Some(shape) = shape {
                known.insert(shape.into(), a.clone());
            }
            known.insert(text.into(), a.clone());
        }
        a
    }

    /// Texts remembered now (for tests and the console).
    pub fn remembered(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_is_analysed_once_per_shape_and_encoding() {
        let a = Analyses::default();
        let one = a.of_utf8(b"SELECT * FROM t WHERE id = 1");
        let n = a.remembered();
        let two = a.of_utf8(b"select * from t where id = 2");
        assert!(Arc::ptr_eq(&one, &two), "found by its shape");
        assert_eq!(a.remembered(), n);
        let sjis = ClientEncoding::Split(shoal_wire::encoding::Split::Sjis);
        let hidden = a
            .of(b"SELECT E'\x83\x5c'; DROP TABLE t; --'", sjis)
            .unwrap();
        let kinds = &hidden.facts.as_ref().unwrap().kinds;
        assert!(kinds.iter().any(|k| k == "DROP"), "{kinds:?}");
        assert_eq!(
            a.of(b"SELECT '\xe9'", ClientEncoding::Unknown).err(),
            Some(Unreadable::UnknownEncoding)
        );
    }
}
