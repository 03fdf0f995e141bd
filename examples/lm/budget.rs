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
//!   (O0) what candle's graph keeps, as measured (65 bytes per token, width
//!   and layer at BF16);
//! - one block's backward at work (its gradients, 16 activations' widths
//!   per token, and where attention is materialized the probabilities'
//!   gradients) and the logits with their softmax and gradient in F32;
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

use crate::model::{GptConfig, Recompute};
use amp::levels::Level;
use candle_core::Device;

/// Bytes a run needs, by part, for all the ranks this process holds.
#[derive(Debug, Clone, Copy)]
pub struct Estimate {
    /// Weights, gradients and optimizer state.
    pub persistent: f64,
    /// What the forward keeps for the backward, and one block's backward
    /// at work.
    pub activations: f64,
    /// The logits, their softmax and their gradient (F32).
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
    /// The Linears' products are candle's (native compute, O0).
    pub native: bool,
    /// On a GPU (the optimizer's second copy of the states).
    pub gpu: bool,
    /// The optimizer's lean step (`--lean-step`): one parameter's new
    /// states at a time beside the old, not all of them.
    pub lean: bool,
}

/// What a run of `g` at `level` needs (see the module's documentation).
pub fn estimate(g: &GptConfig, level: Level, r: &Run) -> Estimate {
    let (l, d, h) = (g.n_layer as f64, g.n_embd as f64, g.n_head as f64);
    let (b, s) = (r.batch as f64, r.seq as f64);
    let linear = l * 12.0 * d * d;
    let other = (g.params() as f64 - linear).max(0.0);
    let per_linear = level.predicted_bytes_per_linear_param(r.shards.max(1));
    let persistent = linear * per_linear + other * 16.0;
    // every state but the gradient (F32 at O0, FP8 above), written anew
    let grad_bytes = if level == Level::O0 { 4.0 } else { 1.0 };
    let copies = (per_linear - grad_bytes).max(0.0);
    let optimizer = match (r.gpu, r.lean) {
        (false, _) => 0.0,
        // the largest Linear's (fc1, fc2: 4 d^2) new states
        (true, true) => 4.0 * g.n_embd as f64 * g.n_embd as f64 * copies,
        (true, false) => linear * copies,
    };
    let a = r.act_bytes as f64;
    let selective = r.recompute == Recompute::Selective;
    // what one block keeps for backward, per token
    let per_token = if r.native {
        // candle's graph: measured on an H100 at 8 x 1024, BF16
        // activations, 65 bytes per token, width and layer at O0 (1.3B)
        33.0 * a * d
    } else {
        // the block's input and the residual after attention (the
        // LayerNorms' inputs), fc1's output (GELU's input): 6 d at the
        // activations' width
        let kept = 6.0 * d * a;
        // flash attention keeps q, k, v and its output in BF16; the
        // materialized one q, k, v at the activations' width
        let attention = if r.flash { 8.0 * d } else { 3.0 * d * a };
        // the FP8 codes of the GEMMs' inputs (ln_1's and ln_2's outputs,
        // the attention's output, GELU's output): cast again under
        // `selective`, except a materialized attention's output
        let codes = match (selective, r.flash) {
            (false, _) => 7.0 * d,
            (true, false) => d,
            (true, true) => 0.0,
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
    let weight_copies = if r.native || selective || level == Level::O3 {
        0.0
    } else {
        12.0 * d * d
    };
    let kept = match r.recompute {
        Recompute::None | Recompute::Selective => l * (block + weight_copies),
        // each block's input, and the block being recomputed
        Recompute::Full => l * b * s * d * a + block + weight_copies,
    };
    // one block's backward at work: its activations' gradients, and the
    // probabilities' (and under `selective` the probabilities again)
    let working = 16.0 * b * s * d * a + if selective { 3.0 } else { 2.0 } * probs;
    let logits = b * s * g.vocab as f64 * 4.0 * 3.0;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU run of 8 x 1024 per rank, BF16 activations, flash attention.
    fn gpu(recompute: Recompute, native: bool) -> Run {
        Run {
            batch: 8,
            seq: 1024,
            ranks: 1,
            shards: 1,
            act_bytes: 2,
            flash: true,
            recompute,
            native,
            gpu: true,
            lean: false,
        }
    }

    #[test]
    fn the_estimate_covers_measured_gpu_peaks_without_doubling_them() {
        let gib = (1u64 << 30) as f64;
        // 350M O2: the pool's peak on an H200 was 10.8 GB (BENCHMARKS.md)
        let g = GptConfig::named("350m", 50304, 1024).unwrap();
        let none = gpu(Recompute::None, false);
        let e = estimate(&g, Level::O2, &none);
        assert!(e.total() > 10.8e9 && e.total() < 1.5 * 10.8e9, "{e:?}");
        // ranks as threads multiply it; materialized attention adds to it;
        // selective and full recomputation take from it
        let two = estimate(&g, Level::O2, &Run { ranks: 2, ..none });
        assert!((two.total() - 2.0 * e.total()).abs() < 1.0);
        let materialized = Run {
            flash: false,
            ..none
        };
        assert!(estimate(&g, Level::O2, &materialized).total() > e.total());
        let sel = estimate(&g, Level::O2, &gpu(Recompute::Selective, false));
        let full = estimate(&g, Level::O2, &gpu(Recompute::Full, false));
        assert!(full.activations < sel.activations && sel.activations < e.activations);
        assert_eq!(full.persistent, e.persistent);
        // the optimizer's phase: 5 bytes a Linear parameter at O2, the
        // larger phase with recomputation at 6.7B (measured 70.9 GiB on an
        // H100), not without
        let big = GptConfig::named("6.7b", 50304, 1024).unwrap();
        let full = estimate(&big, Level::O2, &gpu(Recompute::Full, false));
        let linear = 32.0 * 12.0 * 4096.0 * 4096.0;
        assert!((full.optimizer - 5.0 * linear).abs() < 1.0, "{full:?}");
        assert!(full.optimizer > full.activations + full.logits);
        assert!(full.total() > 70.9 * gib && full.total() < 78.0 * gib);
        let kept = estimate(&big, Level::O2, &none);
        assert!(kept.activations + kept.logits > kept.optimizer);
        // on the CPU the optimizer works a tensor at a time; the lean step
        // holds one parameter's new states (fc1's: 5 bytes x 4 d^2)
        let cpu = estimate(&big, Level::O2, &Run { gpu: false, ..none });
        assert_eq!(cpu.optimizer, 0.0);
        let lean = Run {
            lean: true,
            ..gpu(Recompute::Full, false)
        };
        let lean = estimate(&big, Level::O2, &lean);
        assert!((lean.optimizer - 5.0 * 4.0 * 4096.0 * 4096.0).abs() < 1.0);
        assert!(lean.total() < full.total() - 20.0 * gib, "{lean:?}");
        // O0 with native products: 1.3B measured 46.37 GiB at its peak
        // (H100), 2.7B ran out of memory on 78.6 GiB free
        let o0 = |size: &str| {
            let g = GptConfig::named(size, 50304, 1024).unwrap();
            estimate(&g, Level::O0, &gpu(Recompute::None, true)).total() / gib
        };
        assert!(
            o0("1.3b") > 46.37 && o0("1.3b") < 1.2 * 46.37,
            "{}",
            o0("1.3b")
        );
        assert!(o0("2.7b") > 78.6, "{}", o0("2.7b"));
    }
}
