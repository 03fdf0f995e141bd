//! `LowBitAdamW`'s step: the gradients' checks and sums of squares, the
//! global norm, clipping and the skip decision (on the host, or on the GPU
//! by `ClipCoef` so that the host does not wait for the sums), and every
//! parameter's fused update.

use crate::adamw::AdamStep;
use crate::clip::{clip_math, ClipCoef};
use crate::error::{kernel_error, Error, Result};
use crate::fused::{SumSq, SumSqMany, META_LEN, Q};
use crate::grad::{Grad, Grads};
use crate::loss_scaler::LossScaling;
use crate::lowbit::{LowBitAdamW, ParamState, PendingStep, StepOutcome};
use crate::multi::{
    buffer_index, meta_at, storage_dtype, LowBitMulti, MomentPlaces, SumSqMulti, MULTI_MAX,
};
use crate::restore::Replaced;
use crate::state::State;
use crate::telemetry;
use crate::update::{
    f32_stream, gathered, root_salt, scaled_stream, state_stream, to_state, update_param,
    updates_in_place, Ones,
};
use amp_core::kernel::launch;
use amp_core::Weight;
use candle_core::{DType, Tensor};

/// Sums this rank's part of the squared norm (one F32 on the device) over
/// the data-parallel ranks ([`LowBitAdamW::step_partitioned`]).
pub type ReduceNorm<'a> = dyn FnMut(&Tensor) -> Result<Tensor> + 'a;

impl LowBitAdamW {
    /// One step. Gradients are taken as scaled by the loss scaler's current
    /// scale. If any holds inf or NaN, nothing changes (weights, moments,
    /// step counter) and the scaler backs off. Otherwise gradients are
    /// unscaled, clipped to `max_grad_norm` over all parameters, and every
    /// parameter with a gradient is updated.
    ///
    /// # Errors
    /// [`Error::GradShape`] or [`Error::UnknownParam`], checked for every
    /// gradient before anything changes.
    pub fn step(&mut self, grads: &Grads) -> Result<StepOutcome> {
        self.step_partitioned(grads.clone(), &|_| false, &mut |s| Ok(s.clone()))
    }

    /// [`step`](Self::step) that takes the gradients and drops them as soon
    /// as the updates that read them are enqueued: on a GPU their memory
    /// goes back to the pool before the host waits for the step's outcome,
    /// not after (their frees then cost the host no time of an idle
    /// device).
    ///
    /// # Errors
    /// As [`step`](Self::step).
    pub fn step_owned(&mut self, grads: Grads) -> Result<StepOutcome> {
        self.step_partitioned(grads, &|_| false, &mut |s| Ok(s.clone()))
    }

    /// [`step`](Self::step) where some parameters are partitioned across
    /// data-parallel ranks (ZeRO: each rank holds and updates its slice):
    /// the squared gradient norm of the parameters for which
    /// `partitioned(name)` holds is summed over the ranks by `reduce` (it
    /// takes this rank's part as one F32 on the parameters' device and
    /// returns the sum over the ranks, likewise), which every rank calls
    /// exactly once per step where any parameter is partitioned (never
    /// otherwise; ranks must agree on `partitioned`), so that all ranks
    /// clip by the same global norm and skip the same steps. On a GPU the
    /// part never leaves the device: the host does not wait for the
    /// backward before it enqueues the updates.
    ///
    /// # Errors
    /// As [`step`](Self::step); `reduce`'s.
    pub fn step_partitioned(
        &mut self,
        grads: Grads,
        partitioned: &dyn Fn(&str) -> bool,
        reduce: &mut ReduceNorm<'_>,
    ) -> Result<StepOutcome> {
        // the last step's outcome first: this step's counters build on it
        self.resolve()?;
        // Pass 1: shapes, finiteness and the global norm, decoding each
        // gradient on the fly.
        if let Some(name) = grads
            .0
            .keys()
            .find(|n| !self.params.iter().any(|p| &p.name == *n))
        {
            return Err(Error::UnknownParam(name.clone()));
        }
        // On a GPU the outcome is read after the updates are enqueued, where
        // a skipped step can be undone: every F32 weight written in place.
        let mut on_device = !self.params.is_empty();
        for p in &self.params {
            let w = p.slot.read()?;
            on_device &=
                w.device().is_cuda() && (updates_in_place(&w) || !matches!(*w, Weight::F32(_)));
        }
        let any_partitioned = self.params.iter().any(|p| partitioned(&p.name));
        // Per parameter: its sum of squares and, for a scaled gradient, the
        // amax of its source, left on the device; on the GPU path a kernel
        // reads them (`step_on_device`), otherwise one host read of all
        // (a read per parameter would stall the device once per parameter).
        // On the GPU path the small ones are summed in one launch.
        let mut sums: Vec<(bool, Tensor)> = Vec::with_capacity(self.params.len());
        let mut ones = Ones::default();
        let mut amaxes: Vec<(bool, Tensor)> = Vec::new();
        let (mut batch, mut batch_at) = (Vec::new(), Vec::new());
        // the other gradients by kind: their pairs, their places in `sums`
        let mut many: Vec<(Q, Vec<Tensor>, Vec<usize>)> = Vec::new();
        let plan = self.batch_plan(&grads)?;
        for (p, &batched) in self.params.iter().zip(&plan) {
            let Some(g) = grads.get(&p.name) else {
                continue;
            };
            let expected = p.slot.read()?.shape().clone();
            if g.shape() != &expected {
                return Err(Error::GradShape {
                    op: "LowBitAdamW::step",
                    name: p.name.clone(),
                    expected,
                    got: g.shape().clone(),
                });
            }
            if let Weight::Fp8Gathered(_) = &*p.slot.read()? {
                return Err(gathered(&p.name));
            }
            let part = partitioned(&p.name);
            if let Grad::Scaled(t) = g {
                amaxes.push((part, t.meta().amax()?.flatten_all()?));
            }
            let (data, scale_inv, q) = match g {
                Grad::F32(t) => f32_stream(t, &mut ones)?,
                Grad::Scaled(t) => scaled_stream(t),
            };
            if batched {
                batch.extend([data, scale_inv.clone()]);
                batch_at.push(sums.len());
                sums.push((part, scale_inv));
                continue;
            }
            if data.elem_count() > 0 {
                // with the others of its kind: two launches for all
                let at = match many.iter().position(|(k, _, _)| *k == q) {
                    Some(at) => at,
                    None => {
                        many.push((q, Vec::new(), Vec::new()));
                        many.len() - 1
                    }
                };
                many[at].1.extend([data, scale_inv.clone()]);
                many[at].2.push(sums.len());
                sums.push((part, scale_inv));
                continue;
            }
            let [total] = <[Tensor; 1]>::try_from(launch(&SumSq { g: q }, &[&data, &scale_inv])?)
                .map_err(|_| kernel_error("sum of squares"))?;
            sums.push((part, total));
        }
        for (q, inputs, at) in &many {
            let inputs: Vec<&Tensor> = inputs.iter().collect();
            let [totals] = <[Tensor; 1]>::try_from(launch(&SumSqMany { g: *q }, &inputs)?)
                .map_err(|_| kernel_error("sums of squares"))?;
            for (j, &i) in at.iter().enumerate() {
                sums[i].1 = totals.narrow(0, j, 1)?;
            }
        }
        if !batch.is_empty() {
            let inputs: Vec<&Tensor> = batch.iter().collect();
            let [totals] = <[Tensor; 1]>::try_from(launch(&SumSqMulti, &inputs)?)
                .map_err(|_| kernel_error("sums of squares"))?;
            for (j, &i) in batch_at.iter().enumerate() {
                sums[i].1 = totals.narrow(0, j, 1)?;
            }
        }
        // (without a gradient there is nothing to wait for: the host path)
        if on_device && !sums.is_empty() {
            let reduce = any_partitioned.then_some(reduce);
            return self.step_on_device(grads, &plan, &sums, &amaxes, ones, reduce);
        }
        let device = self.device()?;
        let (mut sum_sq, mut part_sq) = (0f64, 0f64);
        let values = read_all(&sums, &amaxes)?;
        let (totals, amax) = values.split_at(sums.len());
        // in parameter order, as the sums were taken
        for ((part, _), v) in sums.iter().zip(totals) {
            *if *part { &mut part_sq } else { &mut sum_sq } += v;
        }
        for ((part, _), a) in amaxes.iter().zip(amax) {
            if !a.is_finite() {
                *if *part { &mut part_sq } else { &mut sum_sq } = f64::INFINITY;
            }
        }
        if any_partitioned {
            let part = Tensor::new(&[part_sq as f32], &device)?;
            let total = reduce(&part)?.flatten_all()?.to_vec1::<f32>()?;
            sum_sq += *total
                .first()
                .ok_or_else(|| kernel_error("partitioned norm"))? as f64;
        }
        if !sum_sq.is_finite() {
            self.scaler.update(true);
            self.skipped += 1;
            return Ok(StepOutcome::Skipped);
        }
        let (grad_norm, grad_mul) =
            clip_math(sum_sq, 1.0 / self.scaler.scale, self.config.max_grad_norm);
        let grad_mul = Tensor::new(&[grad_mul], &device)?;
        self.update_all(&grads, &plan, &grad_mul, &mut ones)?;
        self.scaler.update(false);
        Ok(StepOutcome::Applied { grad_norm })
    }

    /// The rest of a step on a GPU: the norm, skip decision and multiplier
    /// by a kernel (`ClipCoef`), the outcome's copy to the host and the
    /// updates enqueued behind it, the gradients dropped, and then one
    /// wait for the outcome alone, so the host neither waits for the sums
    /// before it enqueues the updates nor for the updates before it frees
    /// what they replace. A skipped step's kernels return at
    /// once; the states they would have replaced are kept until the read
    /// and put back (an F32 weight, updated in place, was never written).
    /// With `defer_outcome` there is no wait: one more launch puts the
    /// replaced states' bytes back on a skipped step, and the host reads
    /// the outcome at the next step ([`resolve`](Self::resolve)).
    /// With partitioned parameters (`reduce`), their part of the norm is
    /// summed over the ranks on the device and added last, as the host
    /// path adds it.
    fn step_on_device(
        &mut self,
        grads: Grads,
        plan: &[bool],
        sums: &[(bool, Tensor)],
        amaxes: &[(bool, Tensor)],
        mut ones: Ones,
        reduce: Option<&mut ReduceNorm<'_>>,
    ) -> Result<StepOutcome> {
        let mut own_sums: Vec<&Tensor> = sums.iter().filter(|(p, _)| !p).map(|(_, t)| t).collect();
        let own_amaxes = amaxes.iter().filter(|(p, _)| !p).map(|(_, t)| t);
        let part_total;
        if let Some(reduce) = reduce {
            let part = self.partitioned_sum(sums, amaxes)?;
            part_total = reduce(&part)?.flatten_all()?.to_dtype(DType::F64)?;
            own_sums.push(&part_total);
        }
        let n_sums = own_sums.len();
        let all: Vec<&Tensor> = own_sums.into_iter().chain(own_amaxes).collect();
        let vals = amp_core::gather_scalars(&all)?;
        let clip = ClipCoef {
            n_sums,
            inv_scale: 1.0 / self.scaler.scale,
            max_norm: self.config.max_grad_norm,
        };
        let [outcome, grad_mul] = <[Tensor; 2]>::try_from(launch(&clip, &[&vals])?)
            .map_err(|_| kernel_error("clipping coefficient"))?;
        // the outcome's copy queued before the updates: the host learns it
        // as soon as the device has the norm, while the updates still run
        self.outcome_read.queue(&outcome)?;
        drop(outcome);
        if self.config.lean_step {
            return self.step_lean(&grads, plan, &grad_mul, &mut ones);
        }
        let before: Vec<(Weight, State, State, u64)> = self
            .params
            .iter()
            .map(|p| {
                Ok((
                    p.slot.read()?.clone(),
                    p.exp_avg.clone(),
                    p.exp_avg_sq.clone(),
                    p.step,
                ))
            })
            .collect::<Result<_>>()?;
        let step_before = self.step;
        let records_before = self.moment_records.len();
        let updated = self.update_all(&grads, plan, &grad_mul, &mut ones);
        let defer =
            self.config.defer_outcome && !matches!(self.scaler.config, LossScaling::Dynamic { .. });
        if defer && updated.is_ok() {
            // the replaced states put back on the device on a skip; where
            // that cannot be enqueued, the outcome is read below instead
            if let Ok(stepped) = self.put_back_on_skip(&grads, &before, &grad_mul) {
                self.pending = Some(PendingStep {
                    updated: stepped,
                    records_before,
                });
                return Ok(StepOutcome::Pending);
            }
        }
        // freed behind the updates that read them, before the wait
        drop(grads);
        let [sum_sq, grad_norm] = <[f64; 2]>::try_from(self.outcome_read.wait()?)
            .map_err(|_| kernel_error("clipping outcome"))?;
        if sum_sq.is_finite() {
            // an error part way leaves the parameters before it updated
            // (each with its moments), as the host path does
            updated?;
            self.scaler.update(false);
            return Ok(StepOutcome::Applied { grad_norm });
        }
        self.step = step_before;
        self.moment_records.truncate(records_before);
        for (p, (w, m, v, step)) in self.params.iter_mut().zip(before) {
            if !matches!(w, Weight::F32(_)) {
                p.slot.replace(w)?;
            }
            (p.exp_avg, p.exp_avg_sq, p.step) = (m, v, step);
        }
        updated?;
        self.scaler.update(true);
        self.skipped += 1;
        Ok(StepOutcome::Skipped)
    }

    /// For a deferred step (`defer_outcome`): one launch behind the
    /// updates that copies every state they replaced back where the step
    /// is skipped ([`Replaced`]); the parameters stepped (their `step`
    /// advanced), for [`resolve`](Self::resolve) to take back.
    fn put_back_on_skip(
        &self,
        grads: &Grads,
        before: &[(Weight, State, State, u64)],
        grad_mul: &Tensor,
    ) -> Result<Vec<usize>> {
        let mut replaced = Replaced::default();
        let mut stepped = Vec::new();
        for (i, (p, (w, m, v, _))) in self.params.iter().zip(before).enumerate() {
            if grads.get(&p.name).is_some() {
                stepped.push(i);
            }
            match (&*p.slot.read()?, w) {
                (Weight::F32(new), Weight::F32(old)) => {
                    replaced.tensor(new.as_tensor(), old.as_tensor())
                }
                (Weight::F16(new), Weight::F16(old)) => replaced.scaled(new, old)?,
                (
                    Weight::Fp8 { weight, master },
                    Weight::Fp8 {
                        weight: old_weight,
                        master: old_master,
                    },
                ) => {
                    replaced.scaled(weight, old_weight)?;
                    replaced.scaled(master, old_master)?;
                }
                _ => return Err(kernel_error("a weight's storage changed in a step")),
            }
            for (new, old) in [(&p.exp_avg, m), (&p.exp_avg_sq, v)] {
                match (new, old) {
                    (State::F32(new), State::F32(old)) => replaced.tensor(new, old),
                    (State::Scaled(new), State::Scaled(old))
                    | (State::Sqrt(new), State::Sqrt(old)) => replaced.scaled(new, old)?,
                    _ => return Err(kernel_error("a moment's storage changed in a step")),
                }
            }
        }
        replaced.enqueue(grad_mul)?;
        Ok(stepped)
    }

    /// The end of [`step_on_device`](Self::step_on_device) with
    /// `lean_step`: the outcome read first, then the updates enqueued (or
    /// none, for a skipped step), each parameter's old states dropped as
    /// its new ones are made.
    fn step_lean(
        &mut self,
        grads: &Grads,
        plan: &[bool],
        grad_mul: &Tensor,
        ones: &mut Ones,
    ) -> Result<StepOutcome> {
        let [sum_sq, grad_norm] = <[f64; 2]>::try_from(self.outcome_read.wait()?)
            .map_err(|_| kernel_error("clipping outcome"))?;
        if !sum_sq.is_finite() {
            // as a skipped step of the other path leaves them: the
            // schedule's batch counted, the states and Adam's `t` as they were
            self.scaler.update(true);
            self.skipped += 1;
            return Ok(StepOutcome::Skipped);
        }
        self.update_all(grads, plan, grad_mul, ones)?;
        self.scaler.update(false);
        Ok(StepOutcome::Applied { grad_norm })
    }

    /// The parameters' device (the CPU without parameters).
    fn device(&self) -> Result<candle_core::Device> {
        Ok(match self.params.first() {
            Some(p) => p.slot.read()?.device().clone(),
            None => candle_core::Device::Cpu,
        })
    }

    /// This rank's part of the squared norm of the partitioned parameters
    /// (`true` in `sums` and `amaxes`) as one F32 on their device, inf
    /// where an amax of theirs is not finite: the sums added in parameter
    /// order in F64, as the host path adds them, by the clipping kernel.
    fn partitioned_sum(
        &self,
        sums: &[(bool, Tensor)],
        amaxes: &[(bool, Tensor)],
    ) -> Result<Tensor> {
        let part = |v: &[(bool, Tensor)]| -> Vec<Tensor> {
            v.iter()
                .filter(|(p, _)| *p)
                .map(|(_, t)| t.clone())
                .collect()
        };
        let (part_sums, part_amaxes) = (part(sums), part(amaxes));
        if part_sums.is_empty() && part_amaxes.is_empty() {
            return Ok(Tensor::zeros(1, DType::F32, &self.device()?)?);
        }
        let all: Vec<&Tensor> = part_sums.iter().chain(&part_amaxes).collect();
        let vals = amp_core::gather_scalars(&all)?;
        let clip = ClipCoef {
            n_sums: part_sums.len(),
            inv_scale: 1.0,
            max_norm: None,
        };
        let [outcome, _] = <[Tensor; 2]>::try_from(launch(&clip, &[&vals])?)
            .map_err(|_| kernel_error("partitioned norm"))?;
        Ok(outcome.narrow(0, 0, 1)?.to_dtype(DType::F32)?)
    }

    /// Which parameters take the launches over many tensors (`batched`),
    /// in parameter order: none where one weight is two of them (tied: its
    /// updates must run one after the other).
    fn batch_plan(&self, grads: &Grads) -> Result<Vec<bool>> {
        let mut plan = Vec::with_capacity(self.params.len());
        let mut seen = std::collections::HashSet::new();
        let mut tied = false;
        for p in &self.params {
            let b = match grads.get(&p.name) {
                Some(g) => batched(p, g)?,
                None => false,
            };
            if b {
                if let Weight::F32(var) = &*p.slot.read()? {
                    tied |= !seen.insert(var.as_tensor().id());
                }
            }
            plan.push(b);
        }
        if tied {
            plan.fill(false);
        }
        Ok(plan)
    }

    /// Every parameter with a gradient updated (the step counters advanced)
    /// with the multiplier `grad_mul` (one F32 on the parameters' device);
    /// those `plan` marks in one launch ([`LowBitMulti`]).
    fn update_all(
        &mut self,
        grads: &Grads,
        plan: &[bool],
        grad_mul: &Tensor,
        ones: &mut Ones,
    ) -> Result<()> {
        self.step += 1;
        // the schedule counts batches (applied and skipped steps, as a
        // PyTorch scheduler stepped every iteration); Adam's `t` (each
        // parameter's `step`) counts applied steps only
        let lr = self.schedule.lr(self.step + self.skipped);
        let mut batch = Vec::new();
        for (i, (p, &batched)) in self.params.iter_mut().zip(plan).enumerate() {
            let Some(g) = grads.get(&p.name) else {
                continue;
            };
            p.step += 1;
            let k = self.config.adam.at_step(lr, p.step);
            if batched {
                batch.push((i, k));
                continue;
            }
            let before = telemetry::before([&p.exp_avg, &p.exp_avg_sq], g, grad_mul)?;
            update_param(p, g, k, grad_mul, &self.scratch, ones)?;
            if let Some(b) = before {
                let moments = [&p.exp_avg, &p.exp_avg_sq];
                let record = telemetry::after(&p.name, moments, b, &self.config.adam, p.step)?;
                self.moment_records.push(record);
            }
        }
        if !batch.is_empty() {
            self.update_batch(grads, &batch, grad_mul, ones)?;
        }
        Ok(())
    }

    /// The small parameters' steps in one launch; their new moments are
    /// views of the launch's buffers.
    fn update_batch(
        &mut self,
        grads: &Grads,
        batch: &[(usize, AdamStep)],
        grad_mul: &Tensor,
        ones: &mut Ones,
    ) -> Result<()> {
        let mut streams = Vec::with_capacity(8 * batch.len());
        let mut steps = Vec::with_capacity(batch.len());
        let mut shapes = Vec::with_capacity(batch.len());
        for &(i, k) in batch {
            let p = &self.params[i];
            let (Weight::F32(var), Some(Grad::F32(g))) = (&*p.slot.read()?, grads.get(&p.name))
            else {
                return Err(kernel_error("a batched parameter"));
            };
            let m = state_stream(&p.exp_avg, ones)?;
            let v = state_stream(&p.exp_avg_sq, ones)?;
            let w = f32_stream(var.as_tensor(), ones)?;
            let g = f32_stream(g, ones)?;
            steps.push((k, [g.2, m.2, v.2], root_salt(p)));
            shapes.push(var.shape().clone());
            streams.extend([w.0, w.1, g.0, g.1, m.0, m.1, v.0, v.1]);
        }
        let mut inputs: Vec<&Tensor> = streams.iter().collect();
        inputs.push(grad_mul);
        let kernel = LowBitMulti { steps };
        let outs = launch(&kernel, &inputs)?;
        let [u8s, f16s, f32s, meta] = outs.as_slice() else {
            return Err(kernel_error("the batch's outputs"));
        };
        let buffers = [u8s, f16s, f32s];
        let dtypes: Vec<[DType; 2]> = kernel
            .steps
            .iter()
            .map(|(_, [_, m, v], _)| [storage_dtype(*m), storage_dtype(*v)])
            .collect();
        let ns: Vec<usize> = shapes.iter().map(|s| s.elem_count()).collect();
        let places = MomentPlaces::new(&dtypes, &ns);
        for (j, (&(i, _), (_, [_, mq, vq], roots))) in batch.iter().zip(&kernel.steps).enumerate() {
            let p = &mut self.params[i];
            let shape = &shapes[j];
            let meta = meta.narrow(0, meta_at(j), META_LEN)?;
            let [(md, mo), (vd, vo)] = places.places[j];
            let m = buffers[buffer_index(md)]
                .narrow(0, mo, ns[j])?
                .reshape(shape)?;
            let v = buffers[buffer_index(vd)]
                .narrow(0, vo, ns[j])?
                .reshape(shape)?;
            p.exp_avg = to_state(*mq, false, &m, &meta, 1)?;
            p.exp_avg_sq = to_state(*vq, roots.is_some(), &v, &meta, 2)?;
        }
        Ok(())
    }
}

/// Whether a parameter's sum of squares and step can go into the launches
/// over many tensors (on a GPU): an F32 weight updated in place, an F32
/// gradient, at most [`MULTI_MAX`] elements.
fn batched(p: &ParamState, g: &Grad) -> Result<bool> {
    let Grad::F32(t) = g else {
        return Ok(false);
    };
    let n = t.elem_count();
    Ok(t.dtype() == DType::F32
        && t.is_contiguous()
        && (1..=MULTI_MAX).contains(&n)
        && updates_in_place(&*p.slot.read()?))
}

/// The one-element sums, then the amaxes (as F64, exactly), read to the
/// host in one copy (`amp_core::read_scalars`: one gather launch per 256
/// values, where a concatenation launched a copy per value).
fn read_all(sums: &[(bool, Tensor)], amaxes: &[(bool, Tensor)]) -> Result<Vec<f64>> {
    let all: Vec<&Tensor> = sums.iter().chain(amaxes).map(|(_, t)| t).collect();
    Ok(amp_core::read_scalars(&all)?)
}
