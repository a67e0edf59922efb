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
    // Whole again by moving its start back over what was consumed, never by allocating: a
    // buffer that cannot be (one never allocated, as a new session's, or one split from
    // another) is not worth keeping.
    if !buf.try_reclaim(BUF_SIZE) || buf.capacity() > MAX_KEPT_CAPACITY {
        return;
    }
    FREE.with(|f| {
        let mut f = f.borrow_mut();
        if f.len() < KEEP {
            f.push(buf);
        }
    });
}

#[cfg(test)]
mod tests {
    use bytes::{Buf, BufMut};

    use super::{give, take, BUF_SIZE, FREE};

    fn kept() -> usize {
        FREE.with(|f| f.borrow().len())
    }

    #[test]
    fn a_consumed_buffer_comes_back_whole_without_a_new_allocation() {
        let mut b = take();
        b.put_slice(&[7u8; 3000]);
        b.advance(2500);
        let at = b.as_ptr() as usize - 2500;
        let before = kept();
        give(b);
        assert_eq!(kept(), before + 1);
        let again = take();
        assert!(again.is_empty());
        assert!(again.capacity() >= BUF_SIZE);
        assert_eq!(
            again.as_ptr() as usize,
            at,
            "the same allocation, from its start"
        );
    }

    #[test]
    fn buffers_that_would_need_an_allocation_are_not_kept() {
        let before = kept();
        give(bytes::BytesMut::new());
        let mut small = bytes::BytesMut::with_capacity(64);
        small.put_slice(b"abc");
        give(small);
        assert_eq!(
            kept(),
            before,
            "an empty or small buffer is dropped, not grown"
        );
    }
}
