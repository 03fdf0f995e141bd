//! No device-to-host copy in a training-step slice: the delayed-scaling
//! update, quantize with amax and counts, amax recording, the FP8 GEMM,
//! requantize and dequantize are captured into a CUDA graph. A capture
//! fails on any host copy or synchronization (candle refuses the copy
//! outright with its graph cache on; the driver would invalidate the
//! capture otherwise), so a capture that completes proves there is none.
//! The graph is then replayed and its results compared with the same slice
//! run eagerly. CUDA only (a graph capture has no CPU counterpart).

use anyhow::Result;
use candle_core::Device;

test_device!(no_device_to_host_copy, no_device_to_host_copy_cuda);

#[cfg(feature = "cuda")]
fn no_device_to_host_copy(dev: &Device) -> Result<()> {
    cuda::check(dev)
}

/// Never called: without the `cuda` feature the test is skipped first.
#[cfg(not(feature = "cuda"))]
fn no_device_to_host_copy(_: &Device) -> Result<()> {
    anyhow::bail!("built without the `cuda` feature")
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::util::{same, Rng};
    use amp::{fp8_gemm_with, CurrentScaling, DelayedScaling, QType, ScalingMeta, ScalingTensor};
    use anyhow::{bail, ensure, Result};
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::{DType, Device, Tensor};

    struct Step {
        y: Tensor,
        d: Tensor,
    }

    fn step(x: &Tensor, w: &Tensor, mx: &mut ScalingMeta, mw: &mut ScalingMeta) -> Result<Step> {
        let recipe = DelayedScaling::default();
        mx.update_delayed(&recipe)?;
        mw.update_delayed(&recipe)?;
        let (xq, _) = ScalingTensor::quantize_with(x, mx)?;
        mx.record_cast(xq.meta())?;
        let (wq, _) = ScalingTensor::quantize_with(w, mw)?;
        mw.record_cast(wq.meta())?;
        let y = fp8_gemm_with(&xq, &wq, DType::BF16, true)?;
        let (g, _) = xq.requantize(QType::E5M2, &CurrentScaling::default())?;
        let d = g.dequantize(DType::BF16)?;
        Ok(Step { y, d })
    }

    pub fn check(dev: &Device) -> Result<()> {
        let Device::Cuda(cuda) = dev else {
            bail!("not a CUDA device")
        };
        let stream = cuda.cuda_stream();
        let _cache = cuda.enable_cuda_graph_htod_cache();
        let mut rng = Rng(3);
        let (m, k, n) = (256, 1024, 512);
        let x = Tensor::from_vec(rng.normal(m * k), (m, k), dev)?;
        let w = Tensor::from_vec(rng.normal(n * k), (n, k), dev)?;
        let mut mx = ScalingMeta::new(QType::E4M3, 16, dev)?;
        let mut mw = ScalingMeta::new(QType::E4M3, 16, dev)?;
        // Warm-up: loads the module, builds the cuBLASLt plan, fills candle's caches.
        step(&x, &w, &mut mx, &mut mw)?;
        dev.synchronize()?;
        // Eager run from the same state.
        let (mut ex, mut ew) = (mx.clone(), mw.clone());
        let eager = step(&x, &w, &mut ex, &mut ew)?;
        // The same, captured. `keep` holds the state's tensors so that none
        // allocated outside the graph is freed inside it.
        let keep = (mx.clone(), mw.clone());
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)?;
        let captured = step(&x, &w, &mut mx, &mut mw);
        let graph = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        let captured = match captured {
            Ok(c) => c,
            Err(e) => bail!("capture failed (a host copy or sync inside the step?): {e:#}"),
        };
        let Some(graph) = graph? else {
            bail!("empty graph")
        };
        graph.launch()?;
        dev.synchronize()?;
        drop(keep);
        let mut ok = same("captured y", &captured.y, &eager.y)?;
        ok &= same("captured requantize/dequantize", &captured.d, &eager.d)?;
        ok &= same("captured scale", mx.scale(), ex.scale())?;
        ok &= same(
            "captured amax history",
            mx.amax_history(),
            ex.amax_history(),
        )?;
        ok &= same("captured weight scale_inv", mw.scale_inv(), ew.scale_inv())?;
        ensure!(
            ok,
            "the replayed graph differs from the eager run (see the lines above)"
        );
        // Negative control: a host read inside a capture is refused.
        stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)?;
        let read = mx.scale().to_vec1::<f32>();
        let _ = stream.end_capture(
            sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
        );
        ensure!(
            read.is_err(),
            "a scale read to the host inside a capture was not refused: the check proves nothing"
        );
        Ok(())
    }
}
