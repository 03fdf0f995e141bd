//! What a run reports: the `--json` line and the curves of the plots.

use amp::levels::{Compute, MemoryReport};
use candle_core::Device;
use serde::Serialize;

/// The median (the upper one of an even count) and the maximum of `xs`
/// (NaN for none).
pub fn median_max(xs: &[f64]) -> (f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let median = v.get(v.len() / 2).copied().unwrap_or(f64::NAN);
    (median, v.last().copied().unwrap_or(f64::NAN))
}

/// The name of a compute path on the command line.
pub fn compute_name(c: &Compute) -> &'static str {
    match c {
        Compute::Native => "native",
        Compute::Fp8Current { .. } => "fp8-current",
        Compute::Fp8Delayed { .. } => "fp8-delayed",
        Compute::Fp8Block { .. } => "fp8-block",
        Compute::Fp8Rowwise { .. } => "fp8-rowwise",
    }
}

/// An H100 SXM's dense BF16 peak, FLOP/s: the denominator of
/// [`Summary::mfu`], whatever the GPU (the figure is for comparisons).
pub const H100_BF16_PEAK: f64 = 989e12;

/// What a run did: the `--json` line, and the curves for the plots.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub level: String,
    pub compute: String,
    pub size: String,
    pub params: usize,
    pub linear_params: usize,
    /// The head is the embedding (`--tie-embeddings`).
    pub tied_embeddings: bool,
    /// The model's vocabulary (the embedding's rows).
    pub vocab: usize,
    pub steps: u64,
    pub batch: usize,
    pub seq: usize,
    pub seed: u64,
    /// Loss of this run's first step.
    pub first_loss: f32,
    /// Loss of its last step.
    pub final_loss: f32,
    /// Mean validation loss after the last step.
    pub val_loss: f32,
    /// Training tokens per second (evaluation and the first
    /// `timing_skip` steps excluded).
    pub tokens_per_s: f64,
    /// Median wall time of a timed step, ms (as torch_gpt.py reports).
    pub step_ms_median: f64,
    /// `batch * seq` over the median step: torch_gpt.py's `tokens_per_s`
    /// (`tokens_per_s` above is over the mean step, outliers included).
    pub tokens_per_s_median: f64,
    /// Model FLOPs utilisation on CUDA (`None` on the CPU): training FLOPs
    /// per token, `6 N + 12 layers width seq` (nanoGPT's `estimate_mfu`,
    /// PaLM's appendix B; `N` every parameter but the position
    /// embeddings; a recomputed forward is not counted), times
    /// `tokens_per_s_median`, over an H100 SXM's dense BF16 peak
    /// ([`H100_BF16_PEAK`]) times the GPUs (the ranks of an NCCL group).
    pub mfu: Option<f64>,
    /// Slowest timed step, ms.
    pub step_ms_max: f64,
    /// Every timed step's wall time in order, ms (to 0.01 ms).
    pub step_ms: Vec<f64>,
    /// Median time of the forward pass within a timed step, ms: from the
    /// step's start to the device's end of the forward (CUDA: timing events
    /// on the stream, so the step runs on without waiting there; CPU: wall
    /// time); the rest of the step is backward, optimizer, loss read.
    pub forward_ms_median: f64,
    /// Steps timed (after `timing_skip`).
    pub timed_steps: u64,
    /// CUDA only: the pool's used high-water mark from the model's build
    /// to the end of the first step's forward pass (the F32 model before
    /// `amp::initialize` converted it included; see
    /// `second_step_device_bytes` for a steady step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes_after_forward: Option<u64>,
    /// CUDA only: the high-water mark when the first step's backward pass
    /// ended (before its optimizer step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes_after_backward: Option<u64>,
    /// The second step (the first runs once: kernels load, the optimizer
    /// state is allocated): bytes in use at its start, the high-water mark
    /// from there to the end of its forward, and to the end of the step
    /// (backward and optimizer). What a steady step holds and adds, without
    /// the model's F32 initialisation in it. On CUDA the memory pool's; on
    /// the CPU (one rank in the process) the heap's, counted by the
    /// example's allocator, above what it held before the model was built.
    /// The reads synchronize the device twice in that step (leave it out of
    /// the timing with `--timing-skip 2` or more, as the scripts do).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub second_step_device_bytes: Option<[u64; 3]>,
    /// The memory estimate the example checks before it starts (bytes, all
    /// ranks of this process): persistent state and the larger of the
    /// backward's activations and the optimizer step's copies.
    pub estimated_peak_bytes: f64,
    /// High-water mark of bytes in use: on CUDA in the device's default
    /// memory pool from the second step on (every candle tensor; not
    /// cuBLAS workspaces or the context), from `CU_MEMPOOL_ATTR_USED_MEM_HIGH`;
    /// on the CPU (one rank in the process) the counted heap's over the
    /// whole run, above what it held before the model was built.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes: Option<u64>,
    /// CUDA only: the pool's reserved high-water mark
    /// (`CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_device_reserved_bytes: Option<u64>,
    pub bytes_per_linear_param: f64,
    pub predicted_bytes_per_linear_param: f64,
    /// Persistent bytes by category (weights, masters, gradients, moments,
    /// other parameters and their states, scaling metadata) and `total`.
    pub persistent_bytes: serde_json::Value,
    pub activations_saved_bytes: usize,
    pub skipped_steps: u64,
    /// Optimizer steps this run took (from the resumed step to the last).
    pub steps_run: u64,
    pub device: String,
    /// Data-parallel ranks; memory figures are per rank.
    pub world_size: usize,
    /// Dtype of the activations between layers ("F32", "BF16").
    pub activations: String,
    /// Whether attention ran as flash attention (CUDA, head dimension 64,
    /// 80, 96 or 128).
    pub flash_attention: bool,
    /// Which activations the blocks recomputed in backward (`--recompute`).
    pub recompute: crate::recompute::Recompute,
    /// The optimizer read each step's outcome before it updated, keeping
    /// no second copy of the states (`--lean-step`, or chosen to fit).
    pub lean_step: bool,
    /// The host read each step's outcome at the next step (the default on a
    /// GPU; off with `--sync-outcome` or `--lean-step`; at O3 with ZeRO the
    /// step reads it itself, its weight gathers depend on it).
    pub defer_outcome: bool,
    /// Both Adam moments in FP8 (`--fp8-moments`).
    pub fp8_moments: bool,
    /// Bytes this rank sent to other ranks per step (gradient averaging,
    /// and at O3 the weight gathers).
    pub wire_bytes_per_step: f64,
    /// With data parallelism: the median over timed steps of the time the
    /// step waited for communication after the backward (CUDA: timing
    /// events on the device's stream; CPU: wall time), ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_exposed_ms: Option<f64>,
    /// Of `comm_exposed_ms`, at O3 with more than one rank: the median
    /// time of the FP8 weight gathers after the step, ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub comm_gather_ms: Option<f64>,
    /// With data parallelism: the median number of buckets a timed step
    /// reduced (and at O3 gathered).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub buckets_per_step: Option<f64>,
    /// Of those, the median number reduced while the backward still ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlapped_buckets_per_step: Option<f64>,
    pub wall_s: f64,
    /// (step, training loss) of every step of this run.
    #[serde(skip)]
    pub train_curve: Vec<(u64, f32)>,
    /// (step, validation loss) of every evaluation (in the JSON line: a
    /// few points, for plots of several runs).
    pub val_curve: Vec<(u64, f32)>,
    #[serde(skip)]
    pub memory: Option<MemoryReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample: Option<String>,
}

pub fn persistent_json(r: &MemoryReport) -> serde_json::Value {
    let b = &r.bytes;
    serde_json::json!({
        "linear_weights": b.linear_weights,
        "master_weights": b.master_weights,
        "weight_gradients": b.weight_gradients,
        "first_moments": b.first_moments,
        "second_moments": b.second_moments,
        "other_params": b.other_params,
        "other_states": b.other_states,
        "scaling_metadata": b.scaling_metadata,
        "total": r.persistent_total(),
    })
}

/// `cpu` or `cuda:N`.
pub fn device_name(dev: &Device) -> String {
    match dev.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}
