//! Forward, and forward + backward (an upstream gradient of ones), of the
//! packed causal attention at the GPT's shapes
//! (head dimensions 64, 80, 96, 128), flash and materialised, in
//! milliseconds (CUDA events) and the FLOP rate
//! of the causal products (`4 * b * heads * t^2 * d` forward, 2.5 times
//! that backward, halved by the mask). The attention's checks against the
//! CPU are tests (`tests/gpu/fused.rs`); `scripts/gpu/torch_attention.py`
//! times PyTorch's causal `scaled_dot_product_attention` at the same
//! shapes.

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

/// `y` and the gradient for `x` of `sum(y)` (an upstream gradient of
/// ones, what candle seeds a backward with: no op of its own besides the
/// fill), of the packed attention with flash on or off.
fn run_packed(x: &Var, heads: usize, flash: bool) -> Result<(Tensor, Tensor)> {
    fused::set_flash_attention(flash);
    let y = fused::causal_attention_qkv(x, heads);
    fused::set_flash_attention(true);
    let y = y?;
    let grads = y.backward()?;
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
    // 125M, 350M, 350M at 2048, 760M, 2.7B, 6.7B
    for (b, t, heads, hd) in [
        (8usize, 1024usize, 12usize, 64usize),
        (8, 1024, 16, 64),
        (8, 2048, 16, 64),
        (8, 1024, 16, 96),
        (8, 1024, 32, 80),
        (8, 1024, 32, 128),
    ] {
        let x = dev_var(&mut rng, &[b, t, 3 * heads * hd], DType::BF16, dev)?;
        // the causal half of 4 b h t^2 d (forward), 2.5 times that backward
        let fwd_flops = 4.0 * (b * heads * t * t * hd) as f64 / 2.0;
        let mut line = format!("  b {b} t {t} heads {heads} hd {hd}:");
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
                run_packed(&x, heads, flash)?;
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
