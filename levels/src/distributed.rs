//! Data parallelism: every rank holds the whole model, trains on its share
//! of the batch, and the gradients are averaged across ranks before the
//! step, the Linear weight gradients in FP8 (DESIGN.md 4).
//!
//! - FP8 weight gradients (O1-O3): [`amp_comm::fp8_all_reduce`]: one scale
//!   agreed by all ranks, FP8 codes on the wire (a quarter of F32's
//!   bytes), F32 accumulation, the mean re-quantized with a fresh agreed
//!   scale.
//! - F32 gradients (every other parameter, and Linear weights at O0): one
//!   packed F32 all-reduce of all of them, divided by the world size.
//!
//! Every rank then takes the same step on the same gradients, so the
//! replicas stay bitwise identical; a non-finite gradient on any rank is
//! non-finite on every rank after the reduction, and every rank skips.

use crate::config::AmpConfig;
use crate::context::{initialize_sharded, AmpContext, AmpOptimizer, INITIALIZED_MARK};
use crate::error::Result;
use crate::zero::{reduce_scatter, Shard};
use amp_comm::{fp8_all_reduce, Communicator, Fp8ReduceConfig};
use amp_optim::{AdamWConfig, Grad, Grads};
use candle_core::Tensor;
use std::sync::Arc;

/// A shared communicator, as the optimizer keeps it.
#[derive(Clone)]
pub(crate) struct Comm(pub(crate) Arc<dyn Communicator>);

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.0.rank(), self.0.world_size())
    }
}

/// [`initialize`](crate::initialize) for one rank of a data-parallel
/// group: every parameter is first broadcast from rank 0 (candle's CPU
/// generator cannot be seeded, so replicas built apart start apart), then
/// converted as the level says (at O3 with ZeRO: this rank's slice of each
/// Linear weight's master and moments, [`crate::zero`]);
/// [`AmpOptimizer::backward_step`] averages the gradients over the ranks
/// before it steps. Each rank calls this with its own model, built by the
/// same code.
///
/// # Errors
/// As [`initialize`]; the communicator's ([`crate::Error::Comm`]), e.g. a
/// rank that fails or never arrives.
pub fn initialize_distributed(
    varmap: &candle_nn::VarMap,
    adam: AdamWConfig,
    config: AmpConfig,
    comm: Arc<dyn Communicator>,
) -> Result<(AmpContext, AmpOptimizer)> {
    broadcast_vars(varmap, comm.as_ref())?;
    let (ctx, mut opt) =
        initialize_sharded(varmap, adam, config, (comm.rank(), comm.world_size()))?;
    opt.comm = Some(Comm(comm));
    Ok((ctx, opt))
}

/// Rank 0's value of every variable, in name order, on every rank.
fn broadcast_vars(varmap: &candle_nn::VarMap, comm: &dyn Communicator) -> Result<()> {
    let mut vars: Vec<(String, candle_core::Var)> = varmap
        .data()
        .lock()
        .map_err(|_| amp_core::Error::Poisoned { op: "initialize" })?
        .iter()
        .filter(|(n, _)| n.as_str() != INITIALIZED_MARK)
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, var) in vars {
        let value = comm.broadcast(var.as_tensor(), 0)?;
        if comm.rank() != 0 {
            var.set(&value.reshape(var.shape())?)?;
        }
    }
    Ok(())
}

/// The mean of every rank's gradients, with FP8 ones reduced in FP8; of a
/// sharded weight, only this rank's slice.
pub(crate) fn average(comm: &dyn Communicator, grads: Grads, shards: &[Shard]) -> Result<Grads> {
    let n = comm.world_size();
    let mut names: Vec<String> = grads.0.keys().cloned().collect();
    names.sort();
    let mut grads = grads.0;
    let mut out = Grads::new();
    let mut dense: Vec<(String, Tensor)> = Vec::new();
    for name in names {
        let shard = shards.iter().find(|s| s.name == name);
        match (grads.remove(&name), shard) {
            (Some(Grad::Scaled(t)), Some(shard)) => {
                out.insert(name, reduce_scatter(comm, &t, shard)?);
            }
            (Some(Grad::Scaled(t)), None) => {
                let cfg = Fp8ReduceConfig {
                    qtype: t.qtype(),
                    ..Default::default()
                };
                out.insert(name, Grad::Scaled(fp8_all_reduce(comm, &t, &cfg)?.grad));
            }
            (Some(Grad::F32(_)), Some(_)) => {
                return Err(crate::Error::Config {
                    field: name,
                    reason: "a sharded weight needs its FP8 gradient from the layer's sink".into(),
                })
            }
            (Some(Grad::F32(t)), None) => dense.push((name, t)),
            (None, _) => {}
        }
    }
    if !dense.is_empty() {
        // one all-reduce for all of them: fewer, larger messages
        let flat: Vec<Tensor> = dense
            .iter()
            .map(|(_, t)| t.flatten_all())
            .collect::<candle_core::Result<_>>()?;
        let summed = comm.all_reduce_sum(&Tensor::cat(&flat, 0)?)?;
        let mean = (summed / n as f64)?;
        let mut offset = 0;
        for (name, t) in dense {
            let len = t.elem_count();
            out.insert(
                name,
                Grad::F32(mean.narrow(0, offset, len)?.reshape(t.shape())?),
            );
            offset += len;
        }
    }
    Ok(out)
}
