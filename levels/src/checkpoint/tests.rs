//! A save interrupted after the temporary file is written (before the
//! rename) leaves the previous checkpoint loadable and unchanged.

use super::save::save_whole;
use crate::config::AmpConfig;
use crate::initialize::initialize;
use crate::level::Level;
use crate::optimizer::AmpOptimizer;
use amp_core::nn;
use amp_optim::AdamWConfig;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};

#[test]
fn an_interrupted_save_leaves_the_old_checkpoint_intact() {
    let varmap = VarMap::new();
    let layer = nn::linear(
        4,
        3,
        VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu).pp("l"),
    )
    .unwrap();
    let (amp, mut opt) =
        initialize(&varmap, AdamWConfig::default(), AmpConfig::level(Level::O3)).unwrap();
    let step = |opt: &mut AmpOptimizer| {
        let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
        amp.step(opt, || -> crate::error::Result<Tensor> {
            Ok(layer.forward(&x)?.sqr()?.sum_all()?)
        })
        .unwrap();
    };
    step(&mut opt);
    let dir = std::env::temp_dir().join(format!("amp-interrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ckpt.safetensors");
    amp.save(&path, &opt).unwrap();
    let old = std::fs::read(&path).unwrap();
    step(&mut opt);
    let e = save_whole(&amp, &path, &opt, true).unwrap_err();
    assert!(e.to_string().contains("interrupted"), "{e}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        old,
        "the old checkpoint is untouched"
    );
    amp.load(&path, &mut opt).unwrap();
    assert_eq!(opt.inner().step_count(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}
