//! The chunking rule every collective and the ZeRO sharding share.

use std::ops::Range;

/// The elements of a flat tensor of `len` elements that rank `rank` of
/// `world` owns: contiguous chunks in rank order, the first `len % world`
/// ranks one element longer than the others.
///
/// A rank outside `0..world` (or `world == 0`) owns nothing: `len..len`.
///
/// ```
/// use amp_comm::shard_range;
/// // 7 elements over 3 ranks: 3, 2, 2.
/// assert_eq!(shard_range(7, 0, 3), 0..3);
/// assert_eq!(shard_range(7, 1, 3), 3..5);
/// assert_eq!(shard_range(7, 2, 3), 5..7);
/// // Fewer elements than ranks: the last ranks get empty chunks.
/// assert_eq!(shard_range(1, 3, 4), 1..1);
/// ```
pub fn shard_range(len: usize, rank: usize, world: usize) -> Range<usize> {
    if rank >= world {
        return len..len;
    }
    let base = len / world;
    let rem = len % world;
    let start = rank * base + rank.min(rem);
    let end = start + base + usize::from(rank < rem);
    start..end
}

/// The length of [`shard_range`].
pub fn shard_len(len: usize, rank: usize, world: usize) -> usize {
    shard_range(len, rank, world).len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_range_in_order() {
        for world in 1..=9 {
            for len in [0, 1, 2, 7, 8, 9, 1001] {
                let mut next = 0;
                for rank in 0..world {
                    let r = shard_range(len, rank, world);
                    assert_eq!(r.start, next, "len {len} world {world} rank {rank}");
                    let expected = len / world + usize::from(rank < len % world);
                    assert_eq!(r.len(), expected);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn out_of_range_ranks_own_nothing() {
        assert_eq!(shard_range(10, 4, 4), 10..10);
        assert_eq!(shard_range(10, 0, 0), 10..10);
        assert_eq!(shard_len(10, 7, 2), 0);
    }
}
