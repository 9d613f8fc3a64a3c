//! The tournament tree by which zb-auto's greedy finds the rank to act next.

/// The key of a rank that cannot act (no work left, or waiting for data).
pub(super) const UNSET: u64 = u64::MAX;

/// The rank whose key is least (the lowest rank on a tie) among `p` keys, kept in a tournament
/// tree: a key's change replays the matches above it, up to log2(p), and the winner is the
/// root. zb-auto's greedy asks for it once per decision; a scan of p keys per decision was most
/// of the greedy's time at p = 16 (perf).
pub(super) struct EarliestRank {
    /// Leaves: the next power of two >= p; the padding leaves hold `UNSET`.
    leaves: usize,
    /// `node[i]`: the (key, rank) that wins node i's subtree. Node 1 is the root, node i's
    /// children are 2i and 2i + 1 (side by side, so a match reads one pair), the leaves are
    /// `leaves..2 * leaves`. Keeping the key in the node saves a dependent load per match.
    node: Vec<(u64, u32)>,
}

impl EarliestRank {
    /// `p` ranks, all keys `UNSET`.
    pub(super) fn new(p: usize) -> Self {
        let leaves = p.max(1).next_power_of_two();
        let mut node = vec![(UNSET, 0); 2 * leaves];
        for q in 0..leaves {
            node[leaves + q].1 = q as u32;
        }
        for i in (1..leaves).rev() {
            node[i] = Self::play(node[2 * i], node[2 * i + 1]);
        }
        EarliestRank { leaves, node }
    }
    /// The winner of a match: the right side only when its key is less (the left side holds
    /// the lower ranks, so a tie goes to the lowest rank).
    #[inline]
    fn play(left: (u64, u32), right: (u64, u32)) -> (u64, u32) {
        if right.0 < left.0 { right } else { left }
    }
    /// Sets rank `q`'s key and replays the matches above it.
    #[inline]
    pub(super) fn set(&mut self, q: usize, key: u64) {
        let mut i = self.leaves + q;
        // The winner so far stays in registers: each level reads only the sibling (a chain of
        // stores and loads of the same nodes was a third of the tree's time, perf).
        let mut cur = (key, q as u32);
        self.node[i] = cur;
        while i > 1 {
            let sibling = self.node[i ^ 1];
            let won = if i & 1 == 0 {
                Self::play(cur, sibling)
            } else {
                Self::play(sibling, cur)
            };
            i /= 2;
            // A node whose winner and key stay the same changes nothing above it.
            if self.node[i] == won {
                break;
            }
            self.node[i] = won;
            cur = won;
        }
    }
    /// The least key and its rank (the lowest on a tie).
    #[inline]
    pub(super) fn earliest(&self) -> (u64, usize) {
        let (k, r) = self.node[1];
        (k, r as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tournament tree against a scan for the first least key, over random updates with
    /// many ties and `UNSET` keys, for p = 1 to 19 (powers of two and not).
    #[test]
    fn earliest_rank_is_the_first_least_key() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for p in 1..20usize {
            let mut tree = EarliestRank::new(p);
            let mut keys = vec![UNSET; p];
            assert_eq!(tree.earliest().0, UNSET);
            for _ in 0..2000 {
                let q = (next() % p as u64) as usize;
                let k = match next() % 4 {
                    0 => UNSET,
                    _ => next() % 5,
                };
                tree.set(q, k);
                keys[q] = k;
                let least = *keys.iter().min().unwrap();
                let first = keys.iter().position(|&k| k == least).unwrap();
                let (k, r) = tree.earliest();
                assert_eq!(k, least, "p = {p}");
                if least != UNSET {
                    assert_eq!(r, first, "p = {p}, keys {keys:?}");
                }
            }
        }
    }
}
