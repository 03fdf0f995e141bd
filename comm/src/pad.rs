//! Uneven chunks as NCCL's even ones: NCCL's reduce-scatter moves `N`
//! chunks of one length, [`shard_range`](crate::shard_range) cuts `len`
//! elements into chunks whose lengths differ by one. Padding each chunk to
//! `ceil(len / N)` maps one onto the other.
//! Plain tensor ops, so they run (and are tested) on the CPU too.
// Only the NCCL backend calls these; the CPU build keeps them for its tests.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use candle_core::{Result, Tensor};

/// The padded chunk length, `ceil(len / world)`.
pub(crate) fn padded_len(len: usize, world: usize) -> usize {
    len.div_ceil(world.max(1))
}

/// `flat` (1-D, `len` elements) as `[world, padded_len]`: row `j` holds
/// chunk `j` of [`shard_range`](crate::shard_range), zero-padded at its end.
pub(crate) fn pad_rows(flat: &Tensor, world: usize) -> Result<Tensor> {
    let len = flat.elem_count();
    let (base, rem) = (len / world, len % world);
    if rem == 0 {
        return flat.reshape((world, base));
    }
    let c = base + 1;
    let head = flat.narrow(0, 0, rem * c)?.reshape((rem, c))?;
    let tail = flat
        .narrow(0, rem * c, len - rem * c)?
        .reshape((world - rem, base))?
        .pad_with_zeros(1, 0, 1)?;
    Tensor::cat(&[&head, &tail], 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::shard_range;
    use candle_core::Device;

    #[test]
    fn rows_hold_the_shards() {
        for world in 1..=5 {
            for len in [0, 1, 2, 4, 7, 10, 13] {
                let flat = Tensor::arange(1u32, len as u32 + 1, &Device::Cpu).unwrap();
                let rows = pad_rows(&flat, world).unwrap();
                let c = padded_len(len, world);
                assert_eq!(rows.dims(), &[world, c], "len {len} world {world}");
                let v = rows.to_vec2::<u32>().unwrap();
                for (j, row) in v.iter().enumerate() {
                    let r = shard_range(len, j, world);
                    let want: Vec<u32> = (r.start as u32 + 1..=r.end as u32).collect();
                    assert_eq!(&row[..r.len()], &want[..]);
                    assert!(row[r.len()..].iter().all(|&x| x == 0));
                }
            }
        }
    }
}
