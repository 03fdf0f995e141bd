//! The memory report: persistent bytes by category, each summed from the
//! tensors that exist, beside the level's prediction
//! ([`AmpContext::memory_report`], [`MemoryReport::measure`]). It reads the
//! context and the optimizer, and the data-parallel group's shards, and
//! changes nothing.

use crate::context::AmpContext;
use crate::distributed;
use crate::error::{Error, Result};
use crate::level::Level;
use crate::optimizer::AmpOptimizer;
use amp_core::{ScalingTensor, Weight};
use amp_optim::State;
use serde::Serialize;

/// Bytes by category.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Categories {
    /// Linear weights as the GEMMs read them (F32, FP16 at O1/O2, FP8 at O3).
    pub linear_weights: usize,
    /// Separate master copies of Linear weights (FP16 at O3).
    pub master_weights: usize,
    /// Linear weight gradients of the last step.
    pub weight_gradients: usize,
    /// Adam first moments of Linear weights.
    pub first_moments: usize,
    /// Adam second moments of Linear weights.
    pub second_moments: usize,
    /// Every other parameter (embeddings, norms, biases).
    pub other_params: usize,
    /// Their Adam moments and their (F32) gradients of the last step.
    pub other_states: usize,
    /// Scales, scale inverses and amax histories (tensors' and layers').
    pub scaling_metadata: usize,
    /// Saved for backward by the Linear layers in their last forward.
    pub activations_saved: usize,
}

/// Persistent memory of a model at a level.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryReport {
    /// The level.
    pub level: Level,
    /// Parameters in Linear weights handled by the level.
    pub linear_params: usize,
    /// Other parameters.
    pub other_params: usize,
    /// Bytes by category.
    pub bytes: Categories,
    /// (weights + masters + gradients + moments + their metadata) of Linear
    /// weights, per Linear parameter.
    pub measured_bytes_per_linear_param: f64,
    /// What the level's table predicts (one rank, no metadata).
    pub predicted_bytes_per_linear_param: f64,
    /// Persistent total relative to the same model at O0, once a baseline
    /// is given ([`with_baseline`](Self::with_baseline)).
    pub ratio_to_o0: Option<f64>,
    /// Linear layers tied to a weight of another name, kept F32 and counted
    /// among the other parameters: (layer, weight) names
    /// ([`AmpContext::tied`]).
    pub tied: Vec<(String, String)>,
}

fn split(t: &ScalingTensor) -> (usize, usize) {
    let meta = t.meta().nbytes();
    (t.nbytes() - meta, meta)
}

/// Data and metadata bytes of a scaled storage.
fn split_weight(w: &Weight) -> Result<(usize, usize)> {
    match w {
        Weight::F16(t) | Weight::Fp8Gathered(t) => Ok(split(t)),
        other => Err(Error::Config {
            field: "weight".into(),
            reason: format!("a sharded weight stored as {}", other.kind()),
        }),
    }
}

fn state(s: &State) -> (usize, usize) {
    match s {
        State::F32(t) => (t.elem_count() * 4, 0),
        State::Scaled(t) | State::Sqrt(t) => split(t),
    }
}

impl AmpContext {
    /// The memory report of this model and optimizer now.
    ///
    /// # Errors
    /// As [`MemoryReport::measure`].
    pub fn memory_report(&self, opt: &AmpOptimizer) -> Result<MemoryReport> {
        MemoryReport::measure(self, opt)
    }
}

impl MemoryReport {
    /// Measures `ctx` and `opt` now.
    ///
    /// # Errors
    /// A poisoned slot or layer.
    pub fn measure(ctx: &AmpContext, opt: &AmpOptimizer) -> Result<Self> {
        let mut b = Categories::default();
        let (mut linear_params, mut other_params, mut linear_meta) = (0, 0, 0);
        let shards = distributed::shards(opt);
        for p in opt.inner().params() {
            let w = p.slot.read()?;
            let (m, mm) = state(&p.exp_avg);
            let (v, vm) = state(&p.exp_avg_sq);
            if let Some(shard) = shards.iter().find(|s| s.name == p.name) {
                // ZeRO: the whole FP8 copy (the layer's) and this rank's slice
                // of the master (the optimizer's parameter)
                linear_params += shard.shape.elem_count();
                let (d, meta) = split_weight(&*shard.layer.read()?)?;
                let (dm, metam) = split_weight(&w)?;
                b.linear_weights += d;
                b.master_weights += dm;
                linear_meta += meta + metam;
                b.first_moments += m;
                b.second_moments += v;
                linear_meta += mm + vm;
            } else if ctx.is_linear(&p.name) {
                linear_params += w.shape().elem_count();
                match &*w {
                    Weight::F32(var) => b.linear_weights += var.elem_count() * 4,
                    Weight::F16(t) => {
                        let (d, meta) = split(t);
                        b.linear_weights += d;
                        linear_meta += meta;
                    }
                    Weight::Fp8 { weight, master } => {
                        let (d, meta) = split(weight);
                        let (dm, metam) = split(master);
                        b.linear_weights += d;
                        b.master_weights += dm;
                        linear_meta += meta + metam;
                    }
                    Weight::Fp8Gathered(t) => {
                        let (d, meta) = split(t);
                        b.linear_weights += d;
                        linear_meta += meta;
                    }
                }
                b.first_moments += m;
                b.second_moments += v;
                linear_meta += mm + vm;
            } else {
                other_params += w.shape().elem_count();
                b.other_params += w.nbytes();
                b.other_states += m + v;
                b.scaling_metadata += mm + vm;
            }
        }
        for layer in ctx.linears() {
            if let Some(s) = layer.scaling_state()? {
                let meta = s.input.nbytes() + s.weight.nbytes() + s.grad_output.nbytes();
                if ctx.tied.iter().any(|(l, _)| l == layer.name()) {
                    // a tied layer's weight counts among the other parameters
                    b.scaling_metadata += meta;
                } else {
                    linear_meta += meta;
                }
            }
            b.activations_saved += layer.saved_bytes()?;
        }
        let [grad_data, grad_meta, other_grads] = opt.last_grad_bytes;
        linear_meta += grad_meta;
        b.scaling_metadata += linear_meta;
        b.weight_gradients = grad_data;
        b.other_states += other_grads;
        let per_linear = b.linear_weights
            + b.master_weights
            + b.weight_gradients
            + b.first_moments
            + b.second_moments
            + linear_meta;
        Ok(Self {
            level: ctx.level(),
            linear_params,
            other_params,
            bytes: b,
            measured_bytes_per_linear_param: per_linear as f64 / linear_params.max(1) as f64,
            predicted_bytes_per_linear_param: ctx
                .config()
                .policy()
                .predicted_bytes_per_linear_param(if shards.is_empty() { 1 } else { ctx.world }),
            ratio_to_o0: None,
            tied: ctx.tied().to_vec(),
        })
    }

    /// Persistent bytes: every category but the activations.
    pub fn persistent_total(&self) -> usize {
        let b = &self.bytes;
        b.linear_weights
            + b.master_weights
            + b.weight_gradients
            + b.first_moments
            + b.second_moments
            + b.other_params
            + b.other_states
            + b.scaling_metadata
    }

    /// The same report with its ratio to the same model's O0 report.
    pub fn with_baseline(mut self, o0: &MemoryReport) -> Self {
        self.ratio_to_o0 = Some(self.ratio_to(o0));
        self
    }

    /// Persistent bytes relative to a baseline (the same model at O0).
    pub fn ratio_to(&self, baseline: &MemoryReport) -> f64 {
        self.persistent_total() as f64 / baseline.persistent_total().max(1) as f64
    }

    /// The report as one JSON object.
    ///
    /// # Errors
    /// Not for this type.
    pub fn to_json(&self) -> Result<String> {
        serde_json::to_string(self).map_err(|e| {
            amp_core::Error::Config {
                field: "(report)".into(),
                reason: e.to_string(),
            }
            .into()
        })
    }
}

impl std::fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let b = &self.bytes;
        writeln!(
            f,
            "memory at {} ({} linear, {} other parameters)",
            self.level, self.linear_params, self.other_params
        )?;
        for (layer, weight) in &self.tied {
            writeln!(
                f,
                "  tied: {layer} is {weight} (F32, among the other parameters)"
            )?;
        }
        for (name, v) in [
            ("linear weights", b.linear_weights),
            ("master weights", b.master_weights),
            ("weight gradients", b.weight_gradients),
            ("first moments", b.first_moments),
            ("second moments", b.second_moments),
            ("other parameters", b.other_params),
            ("other states", b.other_states),
            ("scaling metadata", b.scaling_metadata),
            ("persistent total", self.persistent_total()),
            ("activations saved", b.activations_saved),
        ] {
            writeln!(f, "  {name:<18} {v:>14}")?;
        }
        write!(
            f,
            "  bytes per linear parameter: {:.3} measured, {:.1} predicted",
            self.measured_bytes_per_linear_param, self.predicted_bytes_per_linear_param
        )?;
        match self.ratio_to_o0 {
            Some(r) => write!(f, "\n  persistent total vs O0: {r:.3}"),
            None => Ok(()),
        }
    }
}
