//! A Linear tied to a weight of another name (an output head sharing the
//! token embedding, as GPT-2 and Llama-3.2-1B do): at every level the
//! shared weight keeps its F32 storage and gets the sum of both uses'
//! gradients; its product runs in the config's compute path unless kept in
//! high precision.

use crate::ckpt_common::{contents, tmp};
use crate::common::randn;

use amp::comm::{run_ranks_with, Communicator, InProcessConfig};
use amp::levels::{
    initialize, initialize_distributed, AmpConfig, AmpContext, AmpOptimizer, Compute, Level,
};
use amp::nn::{self, Linear};
use amp::optim::AdamWConfig;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::sync::Arc;

const VOCAB: usize = 24;
const WIDTH: usize = 16;

/// An embedding, an optional Linear between (a layer the levels convert)
/// and a head whose weight is the embedding.
struct Tied {
    wte: Tensor,
    fc: Option<Linear>,
    head: Linear,
}

fn model(with_fc: bool) -> (Tied, VarMap) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let wte = vb.get((VOCAB, WIDTH), "wte.weight").unwrap();
    let fc = with_fc.then(|| nn::linear_no_bias(WIDTH, WIDTH, vb.pp("fc")).unwrap());
    let head = Linear::new("head.weight", wte.clone(), None).unwrap();
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let s = name.bytes().map(u64::from).sum::<u64>();
        let v: Vec<f32> = randn(var.elem_count(), s).iter().map(|x| x * 0.3).collect();
        var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap())
            .unwrap();
    }
    (Tied { wte, fc, head }, varmap)
}

fn tokens(step: u64) -> (Tensor, Tensor) {
    let ids = |salt: u64| {
        let v: Vec<u32> = (0..32u64)
            .map(|i| ((i * 7 + step * 13 + salt) % VOCAB as u64) as u32)
            .collect();
        Tensor::from_vec(v, 32, &Device::Cpu).unwrap()
    };
    (ids(0), ids(5))
}

fn loss(m: &Tied, step: u64) -> amp::levels::Result<Tensor> {
    loss_on(m, tokens(step))
}

fn loss_on(m: &Tied, (x, y): (Tensor, Tensor)) -> amp::levels::Result<Tensor> {
    let mut h = nn::embedding(&x, &m.wte)?;
    if let Some(fc) = &m.fc {
        h = (&h + fc.forward(&h)?.tanh()?)?;
    }
    let logits = m.head.forward(&h)?;
    Ok(candle_nn::loss::cross_entropy(&logits, &y)?)
}

fn start(
    with_fc: bool,
    level: Level,
    compute: Compute,
    high: &[&str],
) -> (Tied, VarMap, AmpContext, AmpOptimizer) {
    start_in(with_fc, level, compute, high, None)
}

/// [`start`] as one rank of a data-parallel group, or alone.
fn start_in(
    with_fc: bool,
    level: Level,
    compute: Compute,
    high: &[&str],
    comm: Option<Arc<dyn Communicator>>,
) -> (Tied, VarMap, AmpContext, AmpOptimizer) {
    start_in_rows(with_fc, level, compute, high, comm, false)
}

/// [`start_in`], the table's gradient from its rows or not
/// (`AmpConfig::embedding_rows`).
fn start_in_rows(
    with_fc: bool,
    level: Level,
    compute: Compute,
    high: &[&str],
    comm: Option<Arc<dyn Communicator>>,
    embedding_rows: bool,
) -> (Tied, VarMap, AmpContext, AmpOptimizer) {
    let (m, varmap) = model(with_fc);
    let cfg = AmpConfig {
        level,
        compute,
        embedding_rows,
        high_precision: high.iter().map(|s| s.to_string()).collect(),
        // F32 moments for every parameter: O2 and O3 keep low-bit moments
        // for the other parameters too, which would round the comparison
        // with O0 below
        f32_moments: vec!["*".into()],
        ..Default::default()
    };
    let adam = AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    };
    let (ctx, opt) = match comm {
        Some(c) => initialize_distributed(&varmap, adam, cfg, c).unwrap(),
        None => initialize(&varmap, adam, cfg).unwrap(),
    };
    (m, varmap, ctx, opt)
}

/// The losses of `steps` and the embedding after them.
fn run(
    m: &Tied,
    ctx: &AmpContext,
    opt: &mut AmpOptimizer,
    steps: std::ops::Range<u64>,
) -> (Vec<f32>, Vec<f32>) {
    let losses = steps
        .map(|s| {
            let out = ctx.step(opt, || loss(m, s)).unwrap();
            out.loss.to_scalar::<f32>().unwrap()
        })
        .collect();
    let wte = m.wte.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (losses, wte)
}

fn current() -> Compute {
    Compute::Fp8Current {
        recipe: Default::default(),
    }
}

#[test]
fn a_tied_head_trains_as_the_same_weight_in_f32_at_every_level() {
    // Kept in high precision, a tied head at any level is O0's model to the
    // bit: the embedding's F32 weight, updated with the sum of the lookup's
    // and the head's gradients, as candle sums them.
    let (m, _v, ctx, mut opt) = start(false, Level::O0, Compute::Native, &[]);
    let want = run(&m, &ctx, &mut opt, 0..6);
    assert!(want.0[5] < want.0[0], "learns: {:?}", want.0);
    for level in [Level::O1, Level::O2, Level::O3] {
        let (m, varmap, ctx, mut opt) = start(false, level, current(), &["head.weight"]);
        assert!(varmap.data().lock().unwrap().contains_key("wte.weight"));
        assert!(ctx.linears().is_empty() && !ctx.is_linear("wte.weight"));
        assert_eq!(
            run(&m, &ctx, &mut opt, 0..6),
            want,
            "{level}, high precision"
        );
    }
    // In the FP8 path, a tied head is Transformer Engine's path with an F32
    // weight (O0 with fp8-current) at every level, to the bit.
    let (m, _v, ctx, mut opt) = start(false, Level::O0, current(), &[]);
    let te = run(&m, &ctx, &mut opt, 0..6);
    assert_ne!(te, want, "the FP8 product rounds");
    for level in [Level::O1, Level::O2, Level::O3] {
        let (m, _v, ctx, mut opt) = start(false, level, current(), &[]);
        assert_eq!(ctx.linears().len(), 1, "{level}: the head computes in FP8");
        assert_eq!(run(&m, &ctx, &mut opt, 0..6), te, "{level}, FP8 head");
    }
}

#[test]
fn a_tied_head_beside_converted_layers_learns_and_resumes_exactly() {
    let delayed = Compute::Fp8Delayed {
        recipe: Default::default(),
    };
    for level in [Level::O2, Level::O3] {
        let (m, varmap, ctx, mut opt) = start(true, level, delayed.clone(), &[]);
        {
            let data = varmap.data().lock().unwrap();
            assert!(
                data.contains_key("wte.weight"),
                "{level}: the tied weight stays F32"
            );
            assert!(!data.contains_key("fc.weight"), "{level}: fc is converted");
        }
        assert!(ctx.is_linear("fc.weight") && !ctx.is_linear("wte.weight"));
        assert_eq!(ctx.linears().len(), 2, "{level}: fc and the head");
        let tied = [("head.weight".to_string(), "wte.weight".to_string())];
        assert_eq!(ctx.tied(), tied);
        let report = ctx.memory_report(&opt).unwrap();
        assert_eq!(report.linear_params, WIDTH * WIDTH, "{level}: fc only");
        assert_eq!(
            report.other_params,
            VOCAB * WIDTH,
            "{level}: the table once"
        );
        assert!(
            report
                .to_string()
                .contains("tied: head.weight is wte.weight"),
            "{report}"
        );
        let (straight, _) = run(&m, &ctx, &mut opt, 0..8);
        assert!(straight[7] < straight[0] * 0.9, "{level}: {straight:?}");
        // halfway through, saved and resumed into a fresh model: the
        // head's delayed-scaling state travels with fc's
        let (m1, _v1, ctx1, mut opt1) = start(true, level, delayed.clone(), &[]);
        run(&m1, &ctx1, &mut opt1, 0..4);
        let path = tmp(&format!("tied-{level}.safetensors"));
        ctx1.save(&path, &opt1).unwrap();
        let (names, _) = contents(&path);
        assert!(
            names
                .iter()
                .any(|(n, _)| n.starts_with("head.weight.__fp8_meta")),
            "{level}: the head's scaling state is saved"
        );
        assert!(
            !names.iter().any(|(n, _)| n == "head.weight"),
            "{level}: saved once, as wte"
        );
        let (m2, _v2, ctx2, mut opt2) = start(true, level, delayed.clone(), &[]);
        ctx2.load(&path, &mut opt2).unwrap();
        let (resumed, _) = run(&m2, &ctx2, &mut opt2, 4..8);
        assert_eq!(resumed, straight[4..], "{level}: resume is exact");
    }
}

#[test]
fn a_tied_gradient_in_fp8_is_the_native_one_within_the_format() {
    // the table's gradient (lookup + head) through the FP8 head against
    // the native product, before any level: the same model, two scopes
    let (m, _varmap) = model(true);
    for fused in [false, true] {
        let grad = |mode: nn::ComputeMode| {
            let l = {
                let _s = nn::fp8_autocast(true, mode);
                if fused {
                    let (x, y) = tokens(0);
                    let h = nn::embedding(&x, &m.wte).unwrap();
                    nn::linear_cross_entropy(&h, None, &m.head, &y).unwrap()
                } else {
                    loss(&m, 0).unwrap()
                }
            };
            let g = l.backward().unwrap();
            g.get(&m.wte)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let native = grad(nn::ComputeMode::Native);
        let fp8 = grad(nn::ComputeMode::Fp8Current(Default::default()));
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in native.iter().zip(&fp8) {
            num += f64::from(a - b).powi(2);
            den += f64::from(*a).powi(2);
        }
        let rel = (num / den).sqrt();
        assert!(rel < 0.1, "fused {fused}: relative L2 difference {rel}");
    }
}

#[test]
fn a_tied_gradient_is_reduced_over_ranks_as_one_rank_sees_it() {
    // two ranks, each on half of every batch, against one rank on the
    // whole: the tied table's F32 gradient (lookup + head) averaged over
    // the ranks is the whole batch's; every rank holds the same table
    let halves = |step: u64, part: Option<usize>| {
        let (x, y) = tokens(step);
        match part {
            None => (x, y),
            Some(r) => (
                x.narrow(0, 16 * r, 16).unwrap(),
                y.narrow(0, 16 * r, 16).unwrap(),
            ),
        }
    };
    // (with the lookup's part from its rows too: the head's part is
    // all-reduced and the two means added)
    for (level, rows) in [
        (Level::O0, false),
        (Level::O2, false),
        (Level::O3, false),
        (Level::O0, true),
        (Level::O2, true),
    ] {
        let compute = if level == Level::O0 {
            Compute::Native
        } else {
            current()
        };
        let train = |comm: Option<Arc<dyn Communicator>>| {
            let rank = comm.as_ref().map(|c| c.rank());
            let (m, _v, ctx, mut opt) =
                start_in_rows(true, level, compute.clone(), &[], comm, rows);
            let losses: Vec<f32> = (0..6)
                .map(|s| {
                    let out = ctx.step(&mut opt, || loss_on(&m, halves(s, rank))).unwrap();
                    out.loss.to_scalar::<f32>().unwrap()
                })
                .collect();
            let wte = m.wte.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (losses, wte)
        };
        let (alone, want) = train(None);
        let ranks = run_ranks_with(2, &InProcessConfig::default(), |comm| {
            Ok::<_, amp::comm::Error>(train(Some(Arc::new(comm))))
        })
        .unwrap();
        assert_eq!(ranks[0].1, ranks[1].1, "{level}: the table is replicated");
        let max_diff = want
            .iter()
            .zip(&ranks[0].1)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // O0: the same sums in another order; O2 and O3: FP8 products of
        // half the tokens, and the converted fc's FP8 gradient reduction
        let tol = if level == Level::O0 { 1e-6 } else { 5e-3 };
        assert!(max_diff < tol, "{level}: the table differs by {max_diff}");
        assert!(
            ranks[0].0[5] < ranks[0].0[0],
            "{level}: learns {:?}",
            ranks[0].0
        );
        assert!(alone[5] < alone[0]);
    }
}
