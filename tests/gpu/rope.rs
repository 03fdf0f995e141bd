//! RoPE (`amp::nn::rope`) on the device against its CPU body, bit for bit:
//! both compute the same f32 expression in the same order (no fused
//! multiply-add in the kernel) and round it to the dtype the same way
//! (round to nearest even), so F32 and BF16 outputs and `x`'s gradients
//! are equal bits. Shapes of a GPT's q (head dimension 64 and 128) and odd
//! ones; tables with Llama 3's scaling.

use crate::util::{backward, g, same, var, Rng};
use amp::nn::{rope, rope_tables, RopeScaling};
use anyhow::{ensure, Result};
use candle_core::{DType, Device};

test_device!(rope_fwd_bwd, rope_fwd_bwd_cpu, rope_fwd_bwd_cuda);

fn rope_fwd_bwd(dev: &Device) -> Result<()> {
    let mut rng = Rng(0x0123_4e11);
    let llama3 = RopeScaling {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let mut ok = true;
    for dtype in [DType::F32, DType::BF16] {
        for (b, s, h, d, scaling) in [
            (4usize, 1024usize, 12usize, 64usize, None),
            (2, 512, 8, 128, Some(&llama3)),
            (2, 5, 3, 6, None),
            (3, 7, 1, 2, Some(&llama3)),
        ] {
            let what = format!("rope {dtype:?} [{b}, {s}, {h}, {d}]");
            let (cc, sc) = rope_tables(s, d, 500_000.0, scaling, &Device::Cpu)?;
            let (cg, sg) = (cc.to_device(dev)?, sc.to_device(dev)?);
            let (xc, xg) = var(&mut rng, &[b, s, h, d], dtype, dev)?;
            let (rc, rg) = var(&mut rng, &[b, s, h, d], dtype, dev)?;
            let (yc, yg) = (rope(&xc, &cc, &sc)?, rope(&xg, &cg, &sg)?);
            ok &= same(&format!("{what} y"), &yg, &yc)?;
            let (gc, gg) = (backward(&yc, &rc)?, backward(&yg, &rg)?);
            ok &= same(&format!("{what} dx"), &g(&gg, &xg)?, &g(&gc, &xc)?)?;
            println!("  {what}: checked");
        }
    }
    ensure!(
        ok,
        "RoPE differs between the device and the CPU (see the lines above)"
    );
    Ok(())
}
