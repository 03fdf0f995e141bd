//! The checkpoint loader on arbitrary bytes: an error, never a panic.
#![no_main]

use amp::levels::{initialize, AmpConfig, Level};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let Ok(_layer) = amp::nn::linear(4, 3, vb.pp("l")) else { return };
    let Ok((ctx, mut opt)) = initialize(&varmap, Default::default(), AmpConfig::level(Level::O3)) else { return };
    let path = std::env::temp_dir().join(format!("amp-fuzz-{}.safetensors", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        let _ = ctx.load(&path, &mut opt);
    }
});
