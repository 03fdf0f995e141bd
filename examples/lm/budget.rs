//! The memory a run will need, estimated before it starts, against what
//! the device has free: a configuration that cannot fit is refused up
//! front with both numbers (it used to allocate for tens of seconds and
//! then abort), unless `--no-memory-check`.
//!
//! The estimate counts, per rank, what a step holds at its peak:
//! - the level's persistent bytes (its bytes per Linear parameter, 16 for
//!   every other parameter: F32 weight, gradient and two moments);
//! - what the forward keeps for the backward, tensor by tensor (see
//!   [`estimate`]: each block's input and the residual between its halves,
//!   fc1's output, the attention's q, k, v and output or its probabilities,
//!   the FP8 codes of the GEMMs' inputs and of the weights), as
//!   `--recompute` leaves it: `selective` casts the codes again and
//!   recomputes materialized attention's probabilities in backward, `full`
//!   keeps each block's input and one block at a time; with native products
//!   the same with each GEMM's input kept at the activations' width instead
//!   of its codes and the weights' copies in the activations' dtype (none
//!   where that is F32 at O0: the weight itself), except for candle's graph
//!   (O0 on CUDA): what it keeps, as measured (65 bytes per token, width
//!   and layer at BF16);
//! - one block's backward at work (its gradients, 16 activations' widths
//!   per token, and where attention is materialized the probabilities'
//!   gradients) and the logits with their gradient and the loss's
//!   working copy, at the activations' width;
//! - on a GPU, the optimizer step as a phase of its own: it writes each
//!   Linear's new weights and moments beside the old ones, kept until the
//!   step's outcome is read (a skipped step puts them back), so while the
//!   activations are gone it holds the level's state bytes a second time
//!   (all but the gradient's: 5 a parameter at O2); with `--lean-step`
//!   the optimizer reads the outcome first and holds one parameter's new
//!   states at a time. The CPU's optimizer works a tensor at a time.
//!
//! The peak is the persistent bytes plus the larger phase. Checked against
//! measured peaks: on the CPU (the heap the example counts) within 10% for
//! the tiny and 125M shapes at every recompute mode (`tests/gpt`); on an
//! H100, 2.7B with recomputation 28.9 GiB against 29.7 estimated, 6.7B
//! 70.9 against 72.2 (the optimizer's phase the larger).

use crate::recompute::Recompute;
use amp::levels::Level;
use candle_core::Device;

/// What the estimate needs of a model, in the architecture's terms
/// (`crate::model::Config::shape`): its sizes, and per token and layer what
/// its fused block keeps for backward.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Blocks.
    pub layers: usize,
    /// Width.
    pub width: usize,
    /// Attention heads (the materialized probabilities' count).
    pub heads: usize,
    /// Vocabulary (the logits' width).
    pub vocab: usize,
    /// Parameters in all.
    pub params: usize,
    /// Parameters of the blocks' Linears (the level's bytes apply to them).
    pub linear: usize,
    /// Parameters of the largest Linear (the lean step's phase).
    pub largest_linear: usize,
    /// Activations a block keeps per token at the activations' width
    /// (elements), FP8 levels: GPT's block input, the residual between its
    /// halves and fc1's output, 6 d.
    pub kept: usize,
    /// Of [`kept`](Self::kept), the MLP's activation input (GPT fc1's
    /// output, 4 d; Llama's gate and up, 2 f): E4M3 tiles with
    /// `--fp8-activation-inputs`.
    pub act_input: usize,
    /// What flash attention keeps per token (bytes: q, k, v and its output
    /// in BF16; GPT 8 d).
    pub flash_kept: usize,
    /// What materialized attention keeps per token at the activations'
    /// width (elements: q, k, v; GPT 3 d).
    pub materialized_kept: usize,
    /// The FP8 codes of the GEMMs' inputs per token (bytes; GPT 7 d), and
    /// of them those a materialized attention's output keeps under
    /// `selective` (GPT d).
    pub codes: (usize, usize),
    /// The block's Linear weights' FP8 copies (bytes; GPT 12 d²).
    pub weight_codes: usize,
    /// What a block keeps per token with native products through candle's
    /// graph (O0 on CUDA), elements at the activations' width (GPT 33 d,
    /// measured).
    pub native_kept: usize,
}

/// Bytes a run needs, by part, for all the ranks this process holds.
#[derive(Debug, Clone, Copy)]
pub struct Estimate {
    /// Weights, gradients and optimizer state.
    pub persistent: f64,
    /// What the forward keeps for the backward, and one block's backward
    /// at work.
    pub activations: f64,
    /// The logits, their gradient and the loss's working copy (at the
    /// activations' width).
    pub logits: f64,
    /// The optimizer step's second copy of the states it replaces (GPU).
    pub optimizer: f64,
}

impl Estimate {
    /// The peak: the persistent bytes and the larger phase (forward and
    /// backward, or the optimizer step).
    pub fn total(&self) -> f64 {
        self.persistent + (self.activations + self.logits).max(self.optimizer)
    }
}

/// How a run uses memory, besides the model and the level.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    /// Sequences per rank.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Ranks in this process (threads of `--world-size`).
    pub ranks: usize,
    /// Ranks ZeRO shards over at O3.
    pub shards: usize,
    /// Bytes of an activation (2 for BF16, 4 for F32).
    pub act_bytes: usize,
    /// Attention through flash attention (else materialized).
    pub flash: bool,
    /// What the blocks recompute in backward.
    pub recompute: Recompute,
    /// Native products (no FP8 casts).
    pub native: bool,
    /// Native products through candle's graph (O0 on CUDA) rather than
    /// the layers' op.
    pub native_graph: bool,
    /// On a GPU (the optimizer's second copy of the states).
    pub gpu: bool,
    /// The optimizer's lean step (`--lean-step`): one parameter's new
    /// states at a time beside the old, not all of them.
    pub lean: bool,
    /// Both Adam moments in FP8 (`--fp8-moments`, O2 and O3).
    pub fp8_moments: bool,
    /// The MLP's activation input kept as E4M3 tiles
    /// (`--fp8-activation-inputs`).
    pub fp8_act_inputs: bool,
    /// The head's loss over chunks of about this many rows where a rank has
    /// at least as many (`--loss-chunk-rows`; 0: the whole logits at once).
    pub loss_chunk_rows: usize,
}

/// What a run of a model of shape `g` at `level` needs (see the module's
/// documentation).
pub fn estimate(g: &Shape, level: Level, r: &Run) -> Estimate {
    let (l, d, h) = (g.layers as f64, g.width as f64, g.heads as f64);
    let (b, s) = (r.batch as f64, r.seq as f64);
    let linear = g.linear as f64;
    let other = (g.params as f64 - linear).max(0.0);
    let policy = if r.fp8_moments {
        level.policy().with_fp8_moments()
    } else {
        level.policy()
    };
    let per_linear = policy.predicted_bytes_per_linear_param(r.shards.max(1));
    let persistent = linear * per_linear + other * 16.0;
    // every state but the gradient (F32 at O0, FP8 above), written anew
    let grad_bytes = if level == Level::O0 { 4.0 } else { 1.0 };
    let copies = (per_linear - grad_bytes).max(0.0);
    let optimizer = match (r.gpu, r.lean) {
        (false, _) => 0.0,
        // the largest Linear's new states
        (true, true) => g.largest_linear as f64 * copies,
        (true, false) => linear * copies,
    };
    let a = r.act_bytes as f64;
    let selective = r.recompute == Recompute::Selective;
    // what one block keeps for backward, per token
    let per_token = if r.native_graph {
        // candle's graph, as measured (GPT: on an H100 at 8 x 1024, BF16
        // activations, 65 bytes per token, width and layer at O0, 1.3B)
        g.native_kept as f64 * a
    } else {
        // the block's inputs and what its activations keep (GPT: the
        // block's input and the residual after attention, the LayerNorms'
        // inputs, and fc1's output, GELU's input)
        // (the activation's input as E4M3 tiles: a byte and a 4-byte
        // scale per 128 elements)
        let kept = if r.fp8_act_inputs && !r.native && !selective {
            (g.kept - g.act_input) as f64 * a + g.act_input as f64 * (1.0 + 4.0 / 128.0)
        } else {
            g.kept as f64 * a
        };
        // flash attention keeps q, k, v and its output in BF16; the
        // materialized one q, k, v at the activations' width
        let attention = if r.flash {
            g.flash_kept as f64
        } else {
            g.materialized_kept as f64 * a
        };
        // the FP8 codes of the GEMMs' inputs: cast again under
        // `selective`, except a materialized attention's output; native
        // products keep the inputs themselves
        let codes = match (r.native, selective, r.flash) {
            (true, _, _) => g.codes.0 as f64 * a,
            (false, false, _) => g.codes.0 as f64,
            (false, true, false) => g.codes.1 as f64,
            (false, true, true) => 0.0,
        };
        kept + attention + codes
    };
    // materialized attention's probabilities, per layer
    let probs = if r.flash { 0.0 } else { a * h * s * s * b };
    let mut block = b * s * per_token;
    if !selective {
        block += probs;
    }
    // the weights' FP8 copies, kept from each Linear's forward to its
    // backward (cast again under `selective`; O3 keeps its FP8 weights)
    let weight_copies = if r.native_graph || (r.native && level == Level::O0 && r.act_bytes == 4) {
        // candle's graph; an F32 weight that is its own native copy
        0.0
    } else if r.native {
        // the weights in the activations' dtype
        g.weight_codes as f64 * a
    } else if selective || level == Level::O3 {
        0.0
    } else {
        g.weight_codes as f64
    };
    let kept = match r.recompute {
        Recompute::None | Recompute::Selective => l * (block + weight_copies),
        // each block's input, and the block being recomputed
        Recompute::Full => l * b * s * d * a + block + weight_copies,
    };
    // one block's backward at work: its activations' gradients, and the
    // probabilities' (and under `selective` the probabilities again)
    let working = 16.0 * b * s * d * a + if selective { 3.0 } else { 2.0 } * probs;
    // the logits and their gradient have the activations' dtype (BF16
    // logits come out of the head's GEMM as BF16; the loss sums in F32 a
    // row at a time)
    // (over chunks of rows at the FP8 levels where a rank has a chunk's
    // rows: a chunk's logits, their gradient and its casts, and the head's
    // weight gradient summed in F32 with the GEMM's next sum beside it)
    let chunk = r.loss_chunk_rows as f64;
    let logits = if !r.native && chunk > 0.0 && b * s >= chunk {
        // (as `chunk_rows` makes them: equal, a multiple of 16, at most `chunk`)
        let even = ((b * s / (b * s / chunk).ceil()) / 16.0).ceil() * 16.0;
        let rows = if even > chunk { even - 16.0 } else { even }.max(16.0);
        3.0 * rows * g.vocab as f64 * a + 2.0 * 4.0 * g.vocab as f64 * d
    } else {
        3.0 * b * s * g.vocab as f64 * a
    };
    let n = r.ranks.max(1) as f64;
    Estimate {
        persistent: n * persistent,
        activations: n * (kept + working),
        logits: n * logits,
        optimizer: n * optimizer,
    }
}

/// Free bytes where the run will allocate: the CUDA device's free memory,
/// or on the CPU the memory Linux reports available; `None` where that
/// cannot be told.
pub fn available(device: &Device) -> Option<f64> {
    match device {
        Device::Cuda(_) => amp::cuda::device_memory(device)
            .ok()
            .map(|(free, _)| free as f64),
        Device::Cpu => {
            let info = std::fs::read_to_string("/proc/meminfo").ok()?;
            let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024.0)
        }
        _ => None,
    }
}

/// Bytes as GiB, for messages.
pub fn gib(bytes: f64) -> String {
    format!("{:.1} GiB", bytes / (1u64 << 30) as f64)
}
