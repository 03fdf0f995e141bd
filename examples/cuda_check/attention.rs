//! Forward + backward of the packed causal attention at the GPT's shapes,
//! flash and materialised, in milliseconds (CUDA events) and the FLOP rate
//! of the causal products (`4 * b * heads * t^2 * d` forward, 2.5 times
//! that backward, halved by the mask). The attention's checks against the
//! CPU are tests (`tests/gpu/fused.rs`).

use crate::util::Rng;
use amp::nn::fused;
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};

/// Normal-ish values of `dims` as a `Var` on `dev`.
fn dev_var(rng: &mut Rng, dims: &[usize], dtype: DType, dev: &Device) -> Result<Var> {
    let n = dims.iter().product();
    let t = Tensor::from_vec(rng.normal(n), dims, &Device::Cpu)?.to_dtype(dtype)?;
    Ok(Var::from_tensor(&t.to_device(dev)?)?)
}

/// `y` and the gradient of `sum(y * r)` for `x`, of the packed attention
/// with flash on or off.
fn run_packed(x: &Var, r: &Tensor, heads: usize, flash: bool) -> Result<(Tensor, Tensor)> {
    fused::set_flash_attention(flash);
    let y = fused::causal_attention_qkv(x, heads);
    fused::set_flash_attention(true);
    let y = y?;
    let grads = (y.to_dtype(DType::F32)? * r.to_dtype(DType::F32)?)?
        .sum_all()?
        .backward()?;
    let dx = grads
        .get(x)
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no gradient"))?;
    Ok((y, dx))
}

pub fn bench(dev: &Device) -> Result<bool> {
    let mut rng = Rng(0xa77e_0002);
    let cuda = dev.as_cuda_device()?;
    println!("attention fwd+bwd (BF16, causal):");
    for (b, t, heads) in [(8usize, 1024usize, 12usize), (8, 1024, 16), (8, 2048, 16)] {
        let x = dev_var(&mut rng, &[b, t, 3 * heads * 64], DType::BF16, dev)?;
        let r = dev_var(&mut rng, &[b, t, heads * 64], DType::BF16, dev)?;
        // the causal half of 4 b h t^2 d (forward), 2.5 times that backward
        let fwd_flops = 4.0 * (b * heads * t * t * 64) as f64 / 2.0;
        let mut line = format!("  b {b} t {t} heads {heads}:");
        let xd = x.as_tensor().detach();
        for flash in [true, false] {
            let fwd = crate::bench::event_ms(cuda, || {
                fused::set_flash_attention(flash);
                let y = fused::causal_attention_qkv(&xd, heads);
                fused::set_flash_attention(true);
                y?;
                Ok(())
            })?;
            let both = crate::bench::event_ms(cuda, || {
                run_packed(&x, r.as_tensor(), heads, flash)?;
                Ok(())
            })?;
            let name = if flash { "flash" } else { "materialised" };
            line += &format!(
                " {name} fwd {fwd:.3} ms ({:.0} TFLOP/s), fwd+bwd {both:.3} ms ({:.0})",
                fwd_flops / fwd / 1e9,
                3.5 * fwd_flops / both / 1e9
            );
        }
        println!("{line}");
    }
    Ok(true)
}
