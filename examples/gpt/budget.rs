//! The memory a run will need, estimated before it starts, against what
//! the device has free: a configuration that cannot fit is refused up
//! front with both numbers (it used to allocate for tens of seconds and
//! then abort), unless `--no-memory-check`.
//!
//! The estimate is deliberately on the high side, so that it never
//! refuses a run that fits: per rank, the level's persistent bytes (its
//! bytes per Linear parameter, 16 for every other parameter: F32 weight,
//! gradient and two moments), the activations the backward keeps (34
//! bytes per token, width and layer at 16-bit activations, twice that at
//! F32, as Korthikanti et al. count them; 66 with native products, whose
//! candle graph keeps more, as measured at O0; plus `5 a s^2` per layer and
//! sequence for the attention probabilities where flash attention does
//! not run), and the logits with their softmax and gradient in F32. At
//! 350M O2 (8 x 1024, BF16, flash) it says 14.7 GB where the pool's peak
//! was 10.8 GB. With `--recompute full` the backward keeps each block's
//! input (2 bytes per token and width at 16-bit activations) and one
//! block's activations at a time. The optimizer step is a phase of its
//! own: on a GPU it writes each Linear's new weights and moments beside the
//! old ones, kept until the step's outcome is read (a skipped step puts
//! them back), so while activations are gone it holds the level's state
//! bytes a second time (all but the gradient's: 5 a parameter at O2). The
//! peak is the persistent bytes plus the larger phase; with recomputation
//! the optimizer's phase is the larger from 1.3B up (measured on an H100:
//! 2.7B 28.9 GiB against 29.7 estimated, 6.7B 70.9 against 72.2).

use crate::model::{GptConfig, Recompute};
use amp::levels::Level;
use candle_core::Device;

/// Bytes a run needs, by part, for all the ranks this process holds.
#[derive(Debug, Clone, Copy)]
pub struct Estimate {
    /// Weights, gradients and optimizer state.
    pub persistent: f64,
    /// What the forward keeps for the backward.
    pub activations: f64,
    /// The logits, their softmax and their gradient (F32).
    pub logits: f64,
    /// The optimizer step's second copy of the states it replaces.
    pub optimizer: f64,
}

impl Estimate {
    /// The peak: the persistent bytes and the larger phase (forward and
    /// backward, or the optimizer step).
    pub fn total(&self) -> f64 {
        self.persistent + (self.activations + self.logits).max(self.optimizer)
    }
}

/// What a run of `g` at `level` needs: `batch` sequences of `seq` tokens
/// per rank, `ranks` ranks in this process (threads of `--world-size`),
/// ZeRO over `shards` ranks at O3, activations of `act_bytes` bytes,
/// attention through flash attention or materialized, blocks recomputed
/// as `recompute` says, the Linears native (`native`: candle's products,
/// which keep about twice what the FP8 ops keep) or FP8.
#[allow(clippy::too_many_arguments)]
pub fn estimate(
    g: &GptConfig,
    level: Level,
    batch: usize,
    seq: usize,
    ranks: usize,
    shards: usize,
    act_bytes: usize,
    flash: bool,
    recompute: Recompute,
    native: bool,
) -> Estimate {
    let (l, d, h) = (g.n_layer as f64, g.n_embd as f64, g.n_head as f64);
    let (b, s) = (batch as f64, seq as f64);
    let linear = l * 12.0 * d * d;
    let other = (g.params() as f64 - linear).max(0.0);
    let per_linear = level.predicted_bytes_per_linear_param(shards.max(1));
    let persistent = linear * per_linear + other * 16.0;
    // every state but the gradient (F32 at O0, FP8 above), written anew
    let grad_bytes = if level == Level::O0 { 4.0 } else { 1.0 };
    let optimizer = linear * (per_linear - grad_bytes).max(0.0);
    // measured on an H100 at 8 x 1024 with BF16 activations (per token,
    // width and layer): 33 bytes at O2 (1.3B, 2.7B), 65 with native
    // products at O0 (1.3B)
    let per_token = if native { 33.0 } else { 17.0 } * act_bytes as f64;
    let mut block = b * s * d * per_token;
    if !flash {
        block += 2.5 * act_bytes as f64 * h * s * s * b;
    }
    let activations = match recompute {
        Recompute::None => l * block,
        // each block's input, and the block being recomputed
        Recompute::Full => l * b * s * d * act_bytes as f64 + block,
    };
    let logits = b * s * g.vocab as f64 * 4.0 * 3.0;
    let n = ranks.max(1) as f64;
    Estimate {
        persistent: n * persistent,
        activations: n * activations,
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

    #[test]
    fn the_estimate_covers_a_measured_peak_without_doubling_it() {
        // 350M O2, 8 x 1024, BF16 activations, flash: the pool's peak on
        // an H200 was 10.8 GB (BENCHMARKS.md)
        let g = GptConfig::named("350m", 50304, 1024).unwrap();
        let none = Recompute::None;
        let e = estimate(&g, Level::O2, 8, 1024, 1, 1, 2, true, none, false);
        assert!(e.total() > 10.8e9 && e.total() < 2.0 * 10.8e9, "{e:?}");
        // ranks as threads multiply it; materialized attention adds to it
        let two = estimate(&g, Level::O2, 8, 1024, 2, 1, 2, true, none, false);
        assert!((two.total() - 2.0 * e.total()).abs() < 1.0);
        assert!(estimate(&g, Level::O2, 8, 1024, 1, 1, 2, false, none, false).total() > e.total());
        // recomputation keeps a block's input of each layer and one block
        let full = estimate(
            &g,
            Level::O2,
            8,
            1024,
            1,
            1,
            2,
            true,
            Recompute::Full,
            false,
        );
        let want = 24.0 * 8.0 * 1024.0 * 1024.0 * 2.0 + e.activations / 24.0;
        assert!((full.activations - want).abs() < 1.0, "{full:?}");
        assert_eq!(full.persistent, e.persistent);
        // the optimizer's phase: 5 bytes a Linear parameter at O2, the
        // larger phase with recomputation at 6.7B (measured 70.9 GiB on an
        // H100), not without
        let big = GptConfig::named("6.7b", 50304, 1024).unwrap();
        let full = estimate(
            &big,
            Level::O2,
            8,
            1024,
            1,
            1,
            2,
            true,
            Recompute::Full,
            false,
        );
        let linear = 32.0 * 12.0 * 4096.0 * 4096.0;
        assert!((full.optimizer - 5.0 * linear).abs() < 1.0, "{full:?}");
        assert!(full.optimizer > full.activations + full.logits);
        assert!(
            full.total() > 70.9 * (1u64 << 30) as f64 && full.total() < 78.0 * (1u64 << 30) as f64
        );
        let kept = estimate(&big, Level::O2, 8, 1024, 1, 1, 2, true, none, false);
        assert!(kept.activations + kept.logits > kept.optimizer);
        // O0 with native products: 1.3B measured 46.37 GiB at its peak
        // (H100), 2.7B ran out of memory on 78.6 GiB free
        let gib = (1u64 << 30) as f64;
        let o0 = |size: &str| {
            let g = GptConfig::named(size, 50304, 1024).unwrap();
            estimate(&g, Level::O0, 8, 1024, 1, 1, 2, true, none, true).total() / gib
        };
        assert!(
            o0("1.3b") > 46.37 && o0("1.3b") < 1.2 * 46.37,
            "{}",
            o0("1.3b")
        );
        assert!(o0("2.7b") > 78.6, "{}", o0("2.7b"));
    }
}
