//! Switches of the Linear layers' behaviour that a run sets once: the
//! MLP's activation input kept in FP8 and the head's loss over chunks of
//! rows (per thread), O0's products
//! through the layers' op on CUDA (process-wide, on by default) and the
//! casts' amaxes taken from their tensors' producers (process-wide, on by
//! default) and the weights' casts made ahead by the levels (process-wide,
//! on by default).

thread_local! {
    static FP8_ACTIVATION_INPUTS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static LOSS_CHUNK_ROWS: std::cell::Cell<usize> = const { std::cell::Cell::new(DEFAULT_LOSS_CHUNK_ROWS) };
}

/// [`loss_chunk_rows`] until [`set_loss_chunk_rows`] says otherwise.
pub const DEFAULT_LOSS_CHUNK_ROWS: usize = 4096;

/// `linear_cross_entropy` of at least `rows` rows (tokens), with a head
/// that runs per-tensor FP8 in all three GEMMs (current or delayed
/// scaling, no bias), makes its logits, their loss and both of the head's
/// gradients in the forward, over chunks of about `rows` rows (the fewest
/// chunks of at most `rows`, of equal size rounded up to a multiple of
/// 16): the whole logits, their gradient and its FP8 casts never exist
/// at once, and nothing of them waits for the backward
/// (`nn/linear/head_loss.rs`). `0` turns it off (the head and the loss
/// as separate ops, the whole logits alive from the forward to the
/// backward). The weight gradient is summed over the chunks in F32 by the
/// GEMM, which reads and writes the sum once a chunk: below about 4096
/// rows a chunk that costs more than its product at a large vocabulary
/// (Llama-3's: 2.1 GB a chunk). Default [`DEFAULT_LOSS_CHUNK_ROWS`]
/// (4096: two chunks at 8 x 1024 tokens). Per thread, as
/// [`set_fp8_activation_inputs`].
pub fn set_loss_chunk_rows(rows: usize) {
    LOSS_CHUNK_ROWS.with(|c| c.set(rows));
}

/// The rows [`set_loss_chunk_rows`] set in this thread (`0`: off).
pub fn loss_chunk_rows() -> usize {
    LOSS_CHUNK_ROWS
        .try_with(std::cell::Cell::get)
        .unwrap_or(DEFAULT_LOSS_CHUNK_ROWS)
}

/// In the FP8 modes, an activation's input that a Linear's op keeps for
/// the activation's backward (GELU's or SwiGLU's, between the MLP's two
/// Linears) is kept as E4M3 codes with one power-of-two scale per 1 x 128
/// tile instead of at the activations' width (COAT's FP8 activations):
/// a byte an element instead of 2 (BF16) or 4, the activation's gradient
/// from the decoded input. Off by default. Per thread, as
/// [`set_telemetry`](crate::nn::set_telemetry): the forward decides, on
/// the thread that runs it (ranks run as threads decide each for its own
/// model). The forward's values do not change; the backward's round the
/// kept input once more. Under `nn::selective` the input is kept as it is
/// (its casts read it).
pub fn set_fp8_activation_inputs(on: bool) {
    FP8_ACTIVATION_INPUTS.with(|c| c.set(on));
}

/// Whether [`set_fp8_activation_inputs`] turned it on in this thread.
pub fn fp8_activation_inputs() -> bool {
    FP8_ACTIVATION_INPUTS
        .try_with(std::cell::Cell::get)
        .unwrap_or(false)
}

static NATIVE_OP_ON_CUDA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// On CUDA, native products of F32 weights (O0, high-precision layers) on
/// BF16 or F16 inputs through the layers' op, as on the CPU (on by
/// default), or with `false` through candle's matmul and graph: the same
/// validation loss at 350M on an H100, 1.72x the tokens/s and 22% less
/// peak memory with the op (BENCHMARKS.md, "O0 through the layers' op").
/// Process-wide, as [`set_flash_attention`](crate::nn::set_flash_attention).
pub fn set_native_op_on_cuda(on: bool) {
    NATIVE_OP_ON_CUDA.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether native products of 16-bit inputs take the layers' op on CUDA
/// ([`set_native_op_on_cuda`]).
pub fn native_op_on_cuda() -> bool {
    NATIVE_OP_ON_CUDA.load(std::sync::atomic::Ordering::Relaxed)
}

static PRODUCER_AMAX: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Under current scaling, a Linear takes the amax an FP8 cast needs from
/// the pass that produced (or already read) the tensor, instead of a pass
/// of its own: its output gradient's from the bias gradient's column sums
/// (a Linear with a bias), its input's from the GELU it applies to it (the
/// MLP's second Linear). One read of the tensor less per cast, the same
/// values bit for bit (the amaxes and outputs are those of the separate
/// kernels). On by default: 2.3% faster at 350M O2 on an H100 and the
/// same validation loss (BENCHMARKS.md, "the casts' amax from their
/// producers"); `false` gives the separate passes. Process-wide, as
/// [`set_native_op_on_cuda`].
pub fn set_producer_amax(on: bool) {
    PRODUCER_AMAX.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_producer_amax`] is on.
pub fn producer_amax() -> bool {
    PRODUCER_AMAX.load(std::sync::atomic::Ordering::Relaxed)
}

static WEIGHT_CASTS_AHEAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// After each applied step the levels cast the FP16 weights to the FP8
/// operands of the next forward all at once
/// ([`cast_weights_ahead`](crate::nn::cast_weights_ahead): two launches
/// for all of them instead of two a layer), and each forward takes its
/// own: the same values bit for bit. On by default; `false` leaves the
/// casts to each forward. Process-wide, as [`set_producer_amax`].
pub fn set_weight_casts_ahead(on: bool) {
    WEIGHT_CASTS_AHEAD.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_weight_casts_ahead`] is on.
pub fn weight_casts_ahead() -> bool {
    WEIGHT_CASTS_AHEAD.load(std::sync::atomic::Ordering::Relaxed)
}
