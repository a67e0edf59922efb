//! A memory budget for large client messages that must be buffered whole
//! (a query text, a Bind with large values): each client is bounded by `max_packet_size`,
//! and all of them together by `server.max_large_message_memory`, so a handful of clients
//! sending huge queries cannot take the process's memory. Messages Shoal streams through
//! (COPY data) need no budget.

use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::BytesMut;
use shoal_wire::frontend::tag as fe;
use shoal_wire::sqlstate;

use super::SessionError;
use crate::error::ErrorKind;

/// Messages up to this size are ordinary and need no budget.
pub const LARGE: usize = 1 << 20;

/// Reserves budget (KiB, counted in `in_use_kib`: the App's, shared by all its clients) for
/// the large message at `buf[at..]` (the bytes before it are messages already handled,
/// waiting in place to be written), or releases what this client holds once no large
/// message is buffered (and gives the memory back). `reserved_kib` is the client's share;
/// `budget` the limit in bytes. `streaming_copy`: COPY data is streamed by the caller and
/// needs no budget.
// `fetch_update` is renamed `try_update` in newer Rust; Shoal still builds with 1.87.
#[allow(deprecated)]
pub fn account(
    in_use_kib: &AtomicUsize,
    buf: &mut BytesMut,
    at: usize,
    reserved_kib: &mut u32,
    budget: usize,
    streaming_copy: bool,
) -> Result<(), SessionError> {
    let next = buf.get(at..).unwrap_or_default();
    let large = (next.len() >= 5 && !(streaming_copy && next[0] == fe::COPY_DATA))
        .then(|| u32::from_be_bytes([next[1], next[2], next[3], next[4]]) as usize + 1)
        .filter(|&total| total > LARGE);
    let Some(total) = large else {
        if *reserved_kib > 0 {
            release(in_use_kib, reserved_kib);
            if buf.capacity() > LARGE {
                // The large message is gone: do not keep its buffer either.
                let rest = BytesMut::from(&buf[..]);
                *buf = rest;
            }
        }
        return Ok(());
    };
    let need = total.div_ceil(1024) as u32;
    if *reserved_kib >= need {
        return Ok(());
    }
    let more = (need - *reserved_kib) as usize;
    let limit = budget / 1024;
    let granted = in_use_kib
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
            (used + more <= limit).then_some(used + more)
        })
        .is_ok();
    if !granted {
        return Err(SessionError::fatal(
            ErrorKind::ClientLimit,
            sqlstate::OUT_OF_MEMORY,
            format!(
                "message of {total} bytes refused: Shoal's memory for large messages (server.max_large_message_memory, {budget} bytes) is in use by other clients; retry later or send smaller messages"
            ),
        ));
    }
    *reserved_kib = need;
    Ok(())
}

/// Gives back what a client holds (when it leaves).
pub fn release(in_use_kib: &AtomicUsize, reserved_kib: &mut u32) {
    in_use_kib.fetch_sub(*reserved_kib as usize, Ordering::Relaxed);
    *reserved_kib = 0;
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BufMut;

    fn header(tag: u8, len: usize) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_u8(tag);
        b.put_u32(len as u32 - 1);
        b
    }

    #[test]
    fn large_messages_share_one_budget() {
        let used = AtomicUsize::new(0);
        let budget = 3 * LARGE;
        let (mut a, mut b) = (0u32, 0u32);
        let mut m = header(b'Q', 2 * LARGE);
        account(&used, &mut m, 0, &mut a, budget, true).unwrap();
        assert_eq!(a as usize, 2 * LARGE / 1024);
        let mut m2 = header(b'Q', 2 * LARGE);
        let e = account(&used, &mut m2, 0, &mut b, budget, true).unwrap_err();
        assert!(e.to_string().contains("max_large_message_memory"), "{e}");
        // Small messages, and COPY data being streamed, need nothing.
        let mut small = header(b'Q', 100);
        account(&used, &mut small, 0, &mut b, budget, true).unwrap();
        let mut copy = header(b'd', 10 * LARGE);
        account(&used, &mut copy, 0, &mut b, budget, true).unwrap();
        assert_eq!(b, 0);
        // Once A's message is consumed, its share returns.
        let mut empty = BytesMut::new();
        account(&used, &mut empty, 0, &mut a, budget, true).unwrap();
        assert_eq!(a, 0);
        account(&used, &mut m2, 0, &mut b, budget, true).unwrap();
        release(&used, &mut b);
        assert_eq!(used.load(Ordering::Relaxed), 0, "everything given back");
    }

    #[test]
    fn the_message_after_those_waiting_in_place_is_the_one_accounted() {
        let used = AtomicUsize::new(0);
        let budget = 3 * LARGE;
        let mut waiting = header(b'Q', 2 * LARGE);
        waiting.truncate(5);
        waiting.extend_from_slice(&header(b'Q', 100));
        let mut a = 0u32;
        // At 0 the large message is the head; at 5 (it waits in place) the small one is.
        account(&used, &mut waiting, 5, &mut a, budget, true).unwrap();
        assert_eq!(a, 0);
        account(&used, &mut waiting, 0, &mut a, budget, true).unwrap();
        assert_eq!(a as usize, 2 * LARGE / 1024);
        account(&used, &mut waiting, 5, &mut a, budget, true).unwrap();
        assert_eq!(a, 0, "released once the large message is behind");
        assert_eq!(waiting.len(), 10, "nothing waiting is lost");
        assert_eq!(used.load(Ordering::Relaxed), 0);
    }
}
