//! Recycled read buffers. An idle client holds no buffer, so each transaction needs one for a
//! moment; taking it from a small per-thread free list avoids an allocation and a free per
//! transaction while idle clients still cost nothing.

use std::cell::RefCell;

use bytes::BytesMut;

/// Size of a fresh buffer.
pub const BUF_SIZE: usize = 8192;
/// Buffers kept per worker thread; beyond that they are freed.
const KEEP: usize = 16;
/// Buffers that grew past this (a large message) are freed rather than kept.
const MAX_KEPT_CAPACITY: usize = 64 * 1024;

thread_local! {
    static FREE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

pub fn take() -> BytesMut {
    FREE.with(|f| f.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(BUF_SIZE))
}

/// Returns a buffer; its contents are discarded.
pub fn give(mut buf: BytesMut) {
    buf.clear();
    // Reclaim space consumed from the front, so the buffer is whole again.
    buf.reserve(BUF_SIZE);
    if buf.capacity() > MAX_KEPT_CAPACITY {
        return;
    }
    FREE.with(|f| {
        let mut f = f.borrow_mut();
        if f.len() < KEEP {
            f.push(buf);
        }
    });
}
