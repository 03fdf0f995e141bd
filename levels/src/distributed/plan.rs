//! How a step's gradients are cut into buckets: consecutive tensors, in
//! an order every rank shares, up to a cap of F32-equivalent elements
//! ([`AmpConfig::bucket_mb`](crate::AmpConfig::bucket_mb)); a tensor
//! larger than the cap is a bucket of its own, and a bucket boundary never
//! falls inside a tensor.

use std::ops::Range;

/// Consecutive runs of `items` (element count, a key that must match
/// within a run) of at most `cap` elements each, or one item when it alone
/// is larger.
pub(crate) fn plan<K: PartialEq>(items: &[(usize, K)], cap: usize) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut elems) = (0, 0);
    for (i, (n, key)) in items.iter().enumerate() {
        let fits = elems + n <= cap && items[start].1 == *key;
        if i > start && !fits {
            runs.push(start..i);
            (start, elems) = (i, 0);
        }
        elems += n;
    }
    if start < items.len() {
        runs.push(start..items.len());
    }
    runs
}

/// The cap in elements of `bucket_mb` MiB of F32 (at least one element).
pub(crate) fn cap_elems(bucket_mb: f64) -> usize {
    ((bucket_mb * 1024.0 * 1024.0 / 4.0) as usize).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_up_to_the_cap_and_split_on_the_key() {
        let items = [
            (3, 'a'),
            (4, 'a'),
            (2, 'a'),
            (10, 'a'),
            (1, 'b'),
            (1, 'b'),
            (1, 'a'),
        ];
        assert_eq!(plan(&items, 7), vec![0..2, 2..3, 3..4, 4..6, 6..7]);
        assert_eq!(plan(&items, 100), vec![0..4, 4..6, 6..7]);
        assert_eq!(
            plan(&items, 1),
            (0..7).map(|i| i..i + 1).collect::<Vec<_>>()
        );
        assert!(plan::<char>(&[], 5).is_empty());
    }

    #[test]
    fn the_cap_counts_f32_bytes() {
        assert_eq!(cap_elems(25.0), 25 * 1024 * 1024 / 4);
        assert_eq!(cap_elems(1e-9), 1);
    }
}
