//! Tables with an entry per connection or stream. A connect storm grows them to its peak, and
//! a hash table never shrinks by itself: one sized for 30,000 link streams kept 3 MB after
//! its clients parked, 300 bytes for each of them.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};

/// Below this capacity a table is never shrunk (it costs little, and churn would rehash it).
const KEEP: usize = 1024;

/// Removes `key`, and gives most of the table's memory back once it is seven-eighths empty.
/// It is shrunk to room for twice what it holds, so shrinking again takes at least half of
/// those entries going: the rehash is paid for by the removals before it.
pub fn remove<K: Hash + Eq, V, S: BuildHasher>(map: &mut HashMap<K, V, S>, key: &K) -> Option<V> {
    let removed = map.remove(key);
    if map.capacity() > KEEP && map.len() < map.capacity() / 8 {
        map.shrink_to(map.len() * 2);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_emptied_after_a_peak_gives_its_room_back() {
        let mut map: HashMap<u32, [u8; 64]> = HashMap::new();
        for i in 0..100_000 {
            map.insert(i, [0; 64]);
        }
        let peak = map.capacity();
        for i in 10..100_000 {
            assert!(remove(&mut map, &i).is_some());
        }
        assert_eq!(map.len(), 10);
        assert!(map.capacity() <= KEEP, "{} of {peak} kept", map.capacity());
        assert!((0..10).all(|i| map.contains_key(&i)));
    }

    #[test]
    fn a_table_in_steady_use_is_not_shrunk() {
        let mut map: HashMap<u32, u8> = HashMap::new();
        for i in 0..10_000 {
            map.insert(i, 0);
        }
        // Half the entries churn: the table keeps its room (what `capacity` reports also
        // drops by the slots removals mark, until a rehash reclaims them).
        for i in 0..5_000 {
            remove(&mut map, &i);
            map.insert(i + 100_000, 0);
        }
        assert!(map.capacity() >= 10_000, "shrunk to {}", map.capacity());
    }
}
