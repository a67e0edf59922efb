//! Rendezvous (highest-random-weight) hashing: each pool is owned by the live node with the
//! highest weight for it. Every node computes the same owner from the same membership, with
//! no coordination, and a node joining or leaving changes the owner of only the pools it
//! wins or held (about 1/n of them), unlike `hash mod n`.
//!
//! The weight must be the same in every process of a cluster, across builds and Rust
//! versions (nodes are upgraded one at a time), so it is defined here: 64-bit FNV-1a over
//! the node id, a separator and the pool key, finished with SplitMix64's mixer so that
//! similar inputs spread over the whole range.

/// The weight of `node` for `key`.
pub fn weight(node: &str, key: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h = OFFSET;
    for b in node.bytes().chain([0xff]).chain(key.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    }
    mix(h)
}

/// SplitMix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The node that owns `key` among `nodes` (ties, which need equal 64-bit weights, go to the
/// smaller id so every node agrees).
pub fn owner<'a>(key: &str, nodes: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    nodes
        .into_iter()
        .map(|n| (weight(n, key), n))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn weights_are_fixed_across_builds() {
        // Pinned: a change here would move every pool of a running cluster at upgrade.
        assert_eq!(weight("a", "b"), PINNED_A_B);
        assert_ne!(
            weight("a", "bc"),
            weight("ab", "c"),
            "the separator keeps fields apart"
        );
    }

    const PINNED_A_B: u64 = 6_137_638_104_319_202_169;

    #[test]
    fn no_nodes_no_owner() {
        assert_eq!(owner("k", std::iter::empty()), None);
        assert_eq!(owner("k", ["only"]), Some("only"));
    }

    #[test]
    fn pools_spread_evenly() {
        let nodes = ["n1", "n2", "n3", "n4"];
        let mut counts = [0usize; 4];
        for i in 0..10_000 {
            let o = owner(&format!("pool-{i}"), nodes).unwrap();
            counts[nodes.iter().position(|n| *n == o).unwrap()] += 1;
        }
        for c in counts {
            assert!((2_200..=2_800).contains(&c), "{counts:?}");
        }
    }

    proptest! {
        /// A node joining takes only pools it wins (the others keep their owner); a node
        /// leaving gives away only the pools it held.
        #[test]
        fn membership_changes_move_only_their_share(
            n in 1usize..8,
            keys in prop::collection::vec("[a-z0-9:/]{1,24}", 1..200),
        ) {
            let nodes: Vec<String> = (0..n).map(|i| format!("node-{i}")).collect();
            let joined: Vec<String> = nodes.iter().cloned().chain(["newcomer".to_string()]).collect();
            for k in &keys {
                let before = owner(k, nodes.iter().map(String::as_str)).unwrap();
                let after = owner(k, joined.iter().map(String::as_str)).unwrap();
                prop_assert!(after == before || after == "newcomer");
                // Leaving: node-0's pools move, nobody else's.
                let left = owner(k, nodes.iter().skip(1).map(String::as_str));
                if before != "node-0" {
                    prop_assert_eq!(left, Some(before));
                }
            }
        }
    }
}
