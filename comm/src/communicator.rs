//! The [`Communicator`] trait: collectives over candle tensors.

use crate::error::Result;
use amp_core::SideStream;
use candle_core::{Device, Tensor};

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum, added in rank order (0, 1, .., N-1), so that every
    /// rank receives the bitwise same result.
    Sum,
    /// Elementwise maximum; NaN wins (a NaN on any rank gives NaN).
    Max,
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Sum => "sum",
            Self::Max => "max",
        })
    }
}

/// A group of `world_size()` ranks that run collectives together.
///
/// Every rank must call the same collectives in the same order with
/// tensors that fit together (as NCCL requires); a rank that calls another
/// collective, or passes another shape or dtype, gets
/// [`Error::Mismatch`](crate::Error::Mismatch). All tensors must live on
/// [`device`](Self::device). Reductions take F32 tensors; the data-moving
/// collectives (gathers, broadcast, all-to-all) take any dtype, FP8 codes
/// travel as `U8`.
///
/// Uneven sizes follow one rule, [`shard_range`](crate::shard_range): a
/// flat tensor of `len` elements is cut into contiguous chunks in rank
/// order, the first `len % N` ranks one element longer.
///
/// # Errors and failures
/// A backend must never hang: a rank that does not arrive within the
/// backend's timeout gives [`Error::Timeout`](crate::Error::Timeout) naming
/// it, and once any rank fails (an error in a collective, a dropped
/// communicator, a panic) every pending and later collective of the group
/// returns an error ([`Error::PeerFailed`](crate::Error::PeerFailed)).
///
/// # Bytes on the wire
/// [`bytes_sent`](Self::bytes_sent) counts what this rank sends to other
/// ranks (a byte is counted once, by its sender; nothing a rank keeps for
/// itself), with `L` elements of `b` bytes, `s_r = shard_len(L, r, N)`:
///
/// | collective | bytes sent by rank r |
/// |---|---|
/// | `reduce_scatter` | `(L - s_r) * b` (every chunk but its own, to its owner) |
/// | `all_gather_shards` | `(N - 1) * s_r * b` (its shard, to every other rank) |
/// | `all_reduce` | reduce-scatter + all-gather: `(L - s_r + (N - 1) * s_r) * b` |
/// | `all_gather` | `(N - 1) * L * b` |
/// | `broadcast` | root: `(N - 1) * L * b`; the others 0 |
/// | `all_to_all` | the chunks it sends to the other ranks |
/// | `barrier` | 0 |
///
/// Summed over ranks, `reduce_scatter` and `all_gather_shards` each move
/// `(N - 1) * L * b`, as NCCL's ring algorithms do; where `N` divides `L`
/// each rank's count is the ring's `(N - 1) / N * L * b`, so `all_reduce`
/// sends `2 (N - 1) / N * L * b` per rank.
pub trait Communicator {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world_size(&self) -> usize;

    /// The device every tensor of a collective must live on.
    fn device(&self) -> &Device;

    /// The elementwise reduction of `x` over all ranks, on every rank.
    /// `x` is F32 of the same shape on every rank; so is the result.
    ///
    /// # Errors
    /// As described on the trait.
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// [`all_reduce`](Self::all_reduce) with [`ReduceOp::Sum`].
    ///
    /// # Errors
    /// As `all_reduce`.
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        self.all_reduce(x, ReduceOp::Sum)
    }

    /// [`all_reduce`](Self::all_reduce) with [`ReduceOp::Max`].
    ///
    /// # Errors
    /// As `all_reduce`.
    fn all_reduce_max(&self, x: &Tensor) -> Result<Tensor> {
        self.all_reduce(x, ReduceOp::Max)
    }

    /// [`all_reduce_max`](Self::all_reduce_max) of values the caller
    /// guarantees hold no NaN (amaxes with NaN already counted as inf): the
    /// same result and bytes, without the NaN handling a backend may need
    /// otherwise (NCCL's max drops NaN; the NCCL backend then reduces the
    /// values alone, one collective and no extra kernels). A NaN passed
    /// anyway may be lost.
    ///
    /// # Errors
    /// As `all_reduce`.
    fn all_reduce_max_no_nan(&self, x: &Tensor) -> Result<Tensor> {
        self.all_reduce_max(x)
    }

    /// This rank's chunk of the reduction of `x` over all ranks: `x`, F32 of
    /// the same shape on every rank, is read flat (`L` elements); the result
    /// is 1-D, elements `shard_range(L, rank, N)` of the reduction.
    ///
    /// # Errors
    /// As described on the trait.
    fn reduce_scatter(&self, x: &Tensor, op: ReduceOp) -> Result<Tensor>;

    /// Every rank's `x` stacked in rank order: shape `[N, ..x.shape()]`.
    /// `x` has the same shape and dtype on every rank.
    ///
    /// # Errors
    /// As described on the trait.
    fn all_gather(&self, x: &Tensor) -> Result<Tensor>;

    /// The inverse of [`reduce_scatter`](Self::reduce_scatter): rank r
    /// passes its chunk (read flat, `shard_len(len, r, N)` elements) and
    /// every rank gets the `len` elements concatenated in rank order (1-D).
    /// Any dtype, the same on every rank.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when the
    /// shard has the wrong length; otherwise as described on the trait.
    fn all_gather_shards(&self, shard: &Tensor, len: usize) -> Result<Tensor>;

    /// `root`'s `x` on every rank. The other ranks pass a tensor of the same
    /// shape and dtype (its values are not read).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when `root`
    /// is out of range; otherwise as described on the trait.
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<Tensor>;

    /// Personalized exchange: `chunks[j]` goes to rank `j`; the result's
    /// element `i` is the chunk rank `i` sent to this rank. The chunks a
    /// rank receives have the shape and dtype of the chunk it keeps for
    /// itself (`chunks[rank]`), so that a backend can allocate them
    /// beforehand (NCCL grouped send/recv): the reduce-scatter pattern of
    /// FP8 all-reduce, where rank `r` gets chunk `r` of every rank.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) unless
    /// there are `N` chunks; otherwise as described on the trait.
    fn all_to_all(&self, chunks: &[Tensor]) -> Result<Vec<Tensor>>;

    /// [`all_to_all`](Self::all_to_all) of `chunks` and
    /// [`all_gather`](Self::all_gather) of `extra` in one exchange: the
    /// same results and bytes as the two calls, which a backend may send
    /// together (the NCCL backend: one group; the FP8 reductions send each
    /// rank's scales with its codes). `extra` has the same shape and dtype
    /// on every rank.
    ///
    /// # Errors
    /// As the two calls.
    fn all_to_all_gather(
        &self,
        chunks: &[Tensor],
        extra: &Tensor,
    ) -> Result<(Vec<Tensor>, Tensor)> {
        Ok((self.all_to_all(chunks)?, self.all_gather(extra)?))
    }

    /// Returns once every rank has called it.
    ///
    /// # Errors
    /// As described on the trait.
    fn barrier(&self) -> Result<()>;

    /// Bytes this rank has sent since creation or the last
    /// [`reset_bytes_sent`](Self::reset_bytes_sent), counted as the table
    /// on the trait says.
    fn bytes_sent(&self) -> u64;

    /// Sets the [`bytes_sent`](Self::bytes_sent) counter to zero.
    fn reset_bytes_sent(&self);

    /// The stream this backend's collectives run on, when it is not
    /// candle's ([`SideStream`]; the NCCL backend's). Each collective
    /// called on its own is fenced on both sides, so its result can be used
    /// at once; the bucketed FP8 reductions run their kernels and
    /// collectives inside [`SideStream::run`], which inside
    /// [`amp_core::defer_side_work`] leaves candle's stream free to go on
    /// (see [`SideStream`] for what the caller then owes). `None` (the
    /// default): everything runs where candle's ops run.
    fn side_stream(&self) -> Option<&SideStream> {
        None
    }
}
