//! Bits of tensors, a small random generator, relative errors, and the
//! gradient helpers of the training-op tests.

use amp::ScalingTensor;
use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

/// Every element's bit pattern, widened to u64 (U8, F16, BF16, F32, F64, I64).
pub fn bits(t: &Tensor) -> Result<Vec<u64>> {
    let t = t.flatten_all()?.to_device(&Device::Cpu)?;
    Ok(match t.dtype() {
        DType::U8 => t.to_vec1::<u8>()?.into_iter().map(u64::from).collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()?
            .into_iter()
            .map(|v| u64::from(v.to_bits()))
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .into_iter()
            .map(|v| u64::from(v.to_bits()))
            .collect(),
        DType::F32 => t
            .to_vec1::<f32>()?
            .into_iter()
            .map(|v| u64::from(v.to_bits()))
            .collect(),
        DType::F64 => t.to_vec1::<f64>()?.into_iter().map(f64::to_bits).collect(),
        DType::I64 => t.to_vec1::<i64>()?.into_iter().map(|v| v as u64).collect(),
        d => anyhow::bail!("bits: dtype {d:?}"),
    })
}

/// Compares two tensors bit for bit; prints the first differences.
pub fn same(what: &str, on_dev: &Tensor, cpu: &Tensor) -> Result<bool> {
    let (g, c) = (bits(on_dev)?, bits(cpu)?);
    if g.len() != c.len() {
        println!(
            "  {what}: lengths differ, device {} cpu {}",
            g.len(),
            c.len()
        );
        return Ok(false);
    }
    let diff: Vec<usize> = (0..g.len()).filter(|&i| g[i] != c[i]).collect();
    for &i in diff.iter().take(4) {
        println!("  {what}: [{i}] device {:#x} cpu {:#x}", g[i], c[i]);
    }
    if !diff.is_empty() {
        println!("  {what}: {} of {} differ", diff.len(), g.len());
    }
    Ok(diff.is_empty())
}

/// Data, scale, scale_inv, amax history and last-cast counts of two scaled
/// tensors, bit for bit.
pub fn same_scaled(what: &str, on_dev: &ScalingTensor, cpu: &ScalingTensor) -> Result<bool> {
    let m = |t: &ScalingTensor| -> Result<Vec<Tensor>> {
        let mut v = vec![
            t.data().clone(),
            t.meta().scale().clone(),
            t.meta().scale_inv().clone(),
            t.meta().amax_history().clone(),
        ];
        if let Some(s) = t.meta().last_cast_stats()? {
            v.push(Tensor::new(
                &[s.saturated as i64, s.flushed as i64],
                &Device::Cpu,
            )?);
        }
        Ok(v)
    };
    let (g, c) = (m(on_dev)?, m(cpu)?);
    let names = ["data", "scale", "scale_inv", "amax", "counts"];
    let mut ok = g.len() == c.len();
    for (i, (g, c)) in g.iter().zip(&c).enumerate() {
        ok &= same(&format!("{what} {}", names[i]), g, c)?;
    }
    Ok(ok)
}

// The generator the benches of `cuda_check` use, the same file: one
// definition of the data both run on.
#[path = "../../examples/cuda_check/util.rs"]
mod data;
pub use data::Rng;

/// ‖a − b‖ / ‖b‖ in float64.
pub fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let b = b.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let num = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    let den = b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(num / den)
}

/// A scaled tensor (codes and metadata) on `dev`.
pub fn to_dev(t: &ScalingTensor, dev: &Device) -> Result<ScalingTensor> {
    let m = t.meta();
    let meta = amp::ScalingMeta::from_parts(
        m.qtype(),
        m.scale().to_device(dev)?,
        m.scale_inv().to_device(dev)?,
        m.amax_history().to_device(dev)?,
    )?;
    Ok(ScalingTensor::from_parts(t.data().to_device(dev)?, meta)?)
}

/// `f` over `xs` cut into `threads` parts, each on a thread of its own;
/// the parts' results in order (the CPU side of the 2^32 sweeps).
pub fn on_threads<T: Send>(
    xs: &[f32],
    threads: usize,
    f: impl Fn(&[f32]) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let part = xs.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let hs: Vec<_> = xs.chunks(part).map(|c| s.spawn(|| f(c))).collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("CPU thread panicked")))
            })
            .collect()
    })
}

/// The CPU threads of a 2^32 sweep's CPU side.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(16, |n| n.get())
}

/// The same normal-ish values as a `Var` on the CPU and one on `dev`.
pub fn var(rng: &mut Rng, dims: &[usize], dtype: DType, dev: &Device) -> Result<(Var, Var)> {
    let n = dims.iter().product();
    let t = Tensor::from_vec(rng.normal(n), dims, &Device::Cpu)?.to_dtype(dtype)?;
    Ok((Var::from_tensor(&t)?, Var::from_tensor(&t.to_device(dev)?)?))
}

/// Sets every variable of `varmap` (in name order, the `i`th from
/// `Rng(seed + i)`) to normal values times `scale`; returns the sorted
/// names.
pub fn seed_vars(
    varmap: &candle_nn::VarMap,
    seed: u64,
    scale: f64,
    dev: &Device,
) -> Result<Vec<String>> {
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    for (i, name) in names.iter().enumerate() {
        let v = varmap.data().lock().unwrap()[name].clone();
        let host = Rng(seed + i as u64).normal(v.elem_count());
        v.set(&(Tensor::from_vec(host, v.shape(), dev)? * scale)?)?;
    }
    Ok(names)
}

/// `v`'s gradient in `s`.
pub fn g(s: &GradStore, v: &Var) -> Result<Tensor> {
    s.get(v)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no gradient"))
}

/// The gradients of `sum(y * r)` (a loss whose dy is `r` on any device).
pub fn backward(y: &Tensor, r: &Tensor) -> Result<GradStore> {
    Ok((y.to_dtype(DType::F32)? * r.to_dtype(DType::F32)?)?
        .sum_all()?
        .backward()?)
}

/// Prints the named errors of one case; whether all are within `tol`.
pub fn report(what: &str, errs: &[(&str, f64)], tol: f64) -> bool {
    let ok = errs.iter().all(|(_, e)| *e <= tol);
    let list: Vec<String> = errs.iter().map(|(n, e)| format!("{n} {e:.2e}")).collect();
    println!(
        "  {what}: {} (tolerance {tol:.0e}) {}",
        list.join(", "),
        if ok { "ok" } else { "FAIL" }
    );
    ok
}
