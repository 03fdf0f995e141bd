//! Activation recomputation ("checkpointing"): a block's forward keeps
//! nothing for backward but its input, and runs again from that input when
//! backward reaches it (PyTorch's `checkpoint`, Megatron's full
//! recompute). Memory for activations falls from every block's to one
//! block's plus each block's input; the price is a second forward.
//!
//! In candle's graph the block's output is the output of one op,
//! [`RecomputeOp`], whose inputs are the block's input and a one-element
//! token tied ([`TieOp`]) to the block's parameters that candle's
//! `GradStore` collects (F32 `Var`s: LayerNorm parameters, biases, Linear
//! weights kept in F32). Its backward re-enters the forward's FP8 scope
//! (its mode and its step), runs the block on a tracked copy of the input
//! and backpropagates the output's gradient through it; the input's
//! gradient is the op's, the parameters' gradients wait in the op's shared
//! state for the tie ops, which candle runs next and which hand each
//! parameter its own. FP8 weight gradients leave through the Linear
//! layers' sinks, as without recomputation.
//!
//! **The FP8 state does not advance twice.** The recomputed casts run at
//! the step of the first forward: delayed scaling takes the same scale
//! (a history rolls only at a role's first cast in a new step) and records
//! the same amax into the same slot (a max: the second record changes
//! nothing); current scaling computes the same scales from the same
//! tensors. With deterministic kernels (ours are: no atomics) the
//! recomputed values, and so every gradient and every amax history, are
//! bitwise those of the run without recomputation.

use super::fused::{token_fwd, Handoff};
use super::mode::{current_mode, current_step, in_scope_at, ComputeMode};
use super::precomputed::{precomputed_fwd, Precomputed};
use crate::error::{Error, Result};
use candle_core::{CustomOp1, CustomOp2, CustomOp3, DType, Tensor, TensorId, Var};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A block's forward, as [`recompute`] keeps it until backward.
type BlockFn = dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync;

/// `f(x)`, with `f`'s activations recomputed in backward instead of kept
/// (see the module's documentation). `params` are the tensors `f` reads
/// whose gradients candle's `GradStore` must receive: the block's F32
/// parameters (`Linear::vars`, `LayerNorm::vars`); FP8 weights reach
/// their sinks without being named. A variable that `f` reads and `params`
/// does not name is an error in backward where it gets a gradient (which
/// would be lost). `f` must
/// compute the same values when run again (ours do: no atomics).
///
/// Where neither `x` nor any of `params` is tracked there is nothing to
/// recompute for, and this is `f(x)`.
///
/// ```
/// use amp_core::nn::{self, recompute};
/// use candle_core::{DType, Device, Module, Tensor, Var};
/// use candle_nn::{VarBuilder, VarMap};
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let fc = nn::linear(4, 4, vb.pp("fc"))?;
/// let x = Var::from_tensor(&Tensor::ones((2, 4), DType::F32, &Device::Cpu)?)?;
/// let kept = fc.forward(&x)?.relu()?.sum_all()?.backward()?;
/// let block = fc.clone();
/// let y = recompute(&x, &fc.vars()?, move |x| Ok(block.forward(x)?.relu()?))?;
/// let again = y.sum_all()?.backward()?;
/// for t in [x.as_tensor(), fc.bias().unwrap()] {
///     let flat = |g: &candle_core::backprop::GradStore| g.get(t).unwrap().flatten_all()?.to_vec1::<f32>();
///     assert_eq!(flat(&kept)?, flat(&again)?);
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// `f`'s, and candle's.
pub fn recompute<F>(x: &Tensor, params: &[Tensor], f: F) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
{
    let tracked: Vec<Tensor> = params.iter().filter(|p| p.track_op()).cloned().collect();
    if !x.track_op() && tracked.is_empty() {
        return f(x);
    }
    let (mode, step) = (current_mode(), current_step());
    // The first forward, on a tracked copy of the input (the ops choose
    // their path by what is tracked: the residual added in a GEMM's
    // epilogue, for one) cut from `x`'s graph: its graph is dropped with
    // `y_full` below.
    let y_full = f(Var::from_tensor(&x.detach())?.as_tensor())?;
    let y = y_full.detach();
    drop(y_full);
    let shared = Arc::new(Shared {
        f: Arc::new(f),
        mode,
        step,
        params: tracked,
        grads: Mutex::new(HashMap::new()),
    });
    let token = tie(&shared, x.device())?;
    let op = RecomputeOp {
        y: Precomputed::new(OP, y),
        shared,
    };
    Ok(x.apply_op2(&token, op)?)
}

/// The variables `y`'s graph reads that are neither `x` nor among
/// `params`: if the backward gives one a gradient, it would be lost.
fn unnamed_variables(y: &Tensor, x: &Tensor, params: &[Tensor]) -> Vec<(TensorId, Vec<usize>)> {
    let mut named: std::collections::HashSet<TensorId> = params.iter().map(Tensor::id).collect();
    named.insert(x.id());
    y.sorted_nodes()
        .into_iter()
        .filter(|n| n.is_variable() && !named.contains(&n.id()))
        .map(|n| (n.id(), n.dims().to_vec()))
        .collect()
}

const OP: &str = "recompute";

fn wrap(e: Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// What the block's ops share: the forward to run again, the scope it ran
/// in, the tracked parameters, and their gradients once recomputed.
struct Shared {
    f: Arc<BlockFn>,
    mode: ComputeMode,
    step: u64,
    params: Vec<Tensor>,
    grads: Mutex<HashMap<TensorId, Tensor>>,
}

impl Shared {
    /// The block again on a tracked copy of `x`, backpropagated from `dy`:
    /// `x`'s gradient; the parameters' wait in `grads`.
    fn backward(&self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let xv = Var::from_tensor(&x.detach())?;
        let y = in_scope_at(self.mode.clone(), self.step, || (self.f)(xv.as_tensor()))?;
        if y.shape() != dy.shape() {
            return Err(Error::Shape {
                op: OP,
                lhs: y.shape().clone(),
                rhs: dy.shape().clone(),
            });
        }
        let unnamed = unnamed_variables(&y, xv.as_tensor(), &self.params);
        let seed = y.apply_op1(Seed { dy: dy.clone() })?;
        drop(y);
        let mut grads = seed.backward()?;
        // (the Linear's one-element placeholders are variables that never
        // get a gradient)
        if let Some((_, dims)) = unnamed.iter().find(|(id, _)| grads.get_id(*id).is_some()) {
            return Err(Error::Unsupported {
                op: OP,
                what: format!(
                    "a block that reads a variable of shape {dims:?} not among its parameters \
                     (pass it in `params`: its gradient would be lost)"
                ),
            });
        }
        let dx = match grads.remove(xv.as_tensor()) {
            Some(g) => g,
            None => x.zeros_like()?,
        };
        let mut held = self.grads.lock().map_err(|_| Error::Poisoned { op: OP })?;
        for p in &self.params {
            if let Some(g) = grads.remove(p) {
                held.insert(p.id(), g);
            }
        }
        Ok(dx)
    }

    /// Parameter `p`'s recomputed gradient (taken: each is handed once).
    fn take(&self, p: &Tensor) -> Result<Option<Tensor>> {
        Ok(self
            .grads
            .lock()
            .map_err(|_| Error::Poisoned { op: OP })?
            .remove(&p.id()))
    }
}

/// A one-element token on `dev` tied to every tracked parameter (through
/// [`TieOp`]s, two parameters each), or an untracked one without any.
fn tie(shared: &Arc<Shared>, dev: &candle_core::Device) -> Result<Tensor> {
    let placeholder = Tensor::zeros(1, DType::F32, dev)?;
    let mut token = placeholder.clone();
    for pair in shared.params.chunks(2) {
        let second = pair.get(1).unwrap_or(&placeholder);
        token = token.apply_op3(
            &pair[0],
            second,
            TieOp {
                shared: shared.clone(),
                pair: pair.len(),
            },
        )?;
    }
    Ok(token)
}

/// The block's output (computed before the op was applied); backward
/// recomputes the block.
struct RecomputeOp {
    y: Precomputed,
    shared: Arc<Shared>,
}

impl CustomOp2 for RecomputeOp {
    fn name(&self) -> &'static str {
        OP
    }

    precomputed_fwd!(2);

    fn bwd(
        &self,
        x: &Tensor,
        token: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = self.shared.backward(x, dy).map_err(wrap)?;
        let dtoken = if token.track_op() {
            Some(Handoff::token_grad(token).map_err(wrap)?)
        } else {
            None
        };
        Ok((x.track_op().then_some(dx), dtoken))
    }
}

/// Ties the token to one or two parameters: a one-element output whose
/// backward hands each parameter the gradient the recomputation left.
struct TieOp {
    shared: Arc<Shared>,
    /// Parameters tied (1 or 2; with 1 the third argument is a placeholder).
    pair: usize,
}

impl CustomOp3 for TieOp {
    fn name(&self) -> &'static str {
        "recompute_tie"
    }

    token_fwd!(3);

    fn bwd(
        &self,
        prev: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        _dtoken: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let da = self.shared.take(a).map_err(wrap)?;
        let db = if self.pair == 2 {
            self.shared.take(b).map_err(wrap)?
        } else {
            None
        };
        let dprev = if prev.track_op() {
            Some(Handoff::token_grad(prev).map_err(wrap)?)
        } else {
            None
        };
        Ok((dprev, da, db))
    }
}

/// The recomputed output's seed: a one-element token whose backward
/// hands the output the gradient the outer backward brought (candle seeds
/// a backward with ones; this replaces them with `dy`, no op on the
/// output's values).
struct Seed {
    dy: Tensor,
}

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "recompute_seed"
    }

    token_fwd!(1);

    fn bwd(
        &self,
        _y: &Tensor,
        _res: &Tensor,
        _dseed: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.dy.clone()))
    }
}
