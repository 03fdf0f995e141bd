//! `nn::causal_self_attention` and `nn::pre_norm_mlp`: the tensors handed
//! between LayerNorm, the Linears and the attention give the values of the
//! parts in sequence (output and every gradient: input, LayerNorm, both
//! Linears' weights (GradStore or sink) and biases) in every compute mode,
//! F32 and BF16, over delayed-scaling steps. Where the fused path adds the
//! residual in the FP8 GEMM's epilogue (BF16), its output is the parts'
//! within one rounding (see `within_one_rerounding`).

use crate::common;

use amp::nn::{self, fp8_autocast, ComputeMode, GradSink};
use candle_core::{DType, Tensor, Var};
use common::{modes, randt, residual_in_gemm, values, within_one_rerounding, DTYPE_SINK};

struct Block {
    ln: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    vars: Vec<Var>,
    sink: GradSink,
}

/// The form of a test block.
#[derive(Clone, Copy, PartialEq)]
enum Form {
    /// Attention: LayerNorm, `d -> 3d`, `d -> d`.
    Attention,
    /// GPT's MLP: LayerNorm, `d -> 3d`, GELU, `3d -> d`.
    Mlp,
    /// Llama's MLP: RMSNorm, `d -> 3d`, SwiGLU, `3d / 2 -> d`.
    Llama,
}

/// A block over fresh Vars (names from `tag`): the second Linear `d ->
/// 3d` (attention) or `3d -> d` (`mlp`).
fn block(tag: &str, d: usize, with_sink: bool, mlp: bool) -> Block {
    block_of(
        tag,
        d,
        with_sink,
        if mlp { Form::Mlp } else { Form::Attention },
    )
}

/// A block of `form` over fresh Vars (names from `tag`); an RMSNorm's
/// second Var (the shift) is unused.
fn block_of(tag: &str, d: usize, with_sink: bool, form: Form) -> Block {
    let var = |shape: &[usize], seed: u64, scale: f32| {
        Var::from_tensor(&randt(shape, seed, scale)).unwrap()
    };
    let vars = vec![
        Var::from_tensor(&randt(&[d], 1, 0.3).affine(1.0, 1.0).unwrap()).unwrap(),
        var(&[d], 2, 0.1),
        var(&[3 * d, d], 3, 0.3),
        var(&[3 * d], 4, 0.1),
        var(
            &[
                d,
                match form {
                    Form::Attention => d,
                    Form::Mlp => 3 * d,
                    Form::Llama => 3 * d / 2,
                },
            ],
            5,
            0.3,
        ),
        var(&[d], 6, 0.1),
    ];
    let t = |i: usize| vars[i].as_tensor().clone();
    let ln = match form {
        Form::Llama => nn::LayerNorm::new_rms(t(0), 1e-5).unwrap(),
        _ => nn::LayerNorm::new(t(0), t(1), 1e-5).unwrap(),
    };
    let qkv = nn::Linear::new(format!("{tag}.qkv.weight"), t(2), Some(t(3))).unwrap();
    let proj = nn::Linear::new(format!("{tag}.proj.weight"), t(4), Some(t(5))).unwrap();
    let sink = GradSink::new();
    if with_sink {
        qkv.set_grad_sink(Some(sink.clone())).unwrap();
        proj.set_grad_sink(Some(sink.clone())).unwrap();
    }
    Block {
        ln,
        qkv,
        proj,
        vars,
        sink,
    }
}

type Forward<'a> = dyn Fn(&Block, &Tensor) -> Tensor + 'a;

/// The gradients of two blocks' parameters (of `form`) in two stores are
/// equal, the FP8 weights' (in the sinks, with `fp8_weights`) and an
/// RMSNorm's unused shift left out.
fn same_grads(
    what: &str,
    (g1, g2): (
        &candle_core::backprop::GradStore,
        &candle_core::backprop::GradStore,
    ),
    (a, b): (&Block, &Block),
    form: Form,
    fp8_weights: bool,
) {
    for (i, (va, vb)) in a.vars.iter().zip(&b.vars).enumerate() {
        if (fp8_weights && (i == 2 || i == 4)) || (form == Form::Llama && i == 1) {
            continue;
        }
        let (ga, gb) = (g1.get(va.as_tensor()), g2.get(vb.as_tensor()));
        let (ga, gb) = (ga.expect("grad a"), gb.expect("grad b"));
        assert_eq!(values(ga), values(gb), "{what}: parameter {i}");
    }
}

/// `fused` against `parts` on two blocks with equal values; `residual`:
/// whether the block adds its input to its output.
fn check(name: &str, form: Form, residual: bool, fused: &Forward<'_>, parts: &Forward<'_>) {
    let modes = modes();
    let d = 16;
    for (m, mode) in modes.into_iter().enumerate() {
        for (c, (dtype, with_sink)) in DTYPE_SINK.into_iter().enumerate() {
            let (a, b) = (
                block_of(&format!("{name}{m}{c}a"), d, with_sink, form),
                block_of(&format!("{name}{m}{c}b"), d, with_sink, form),
            );
            for step in 0..3u64 {
                let what = format!("{name} {mode:?} {dtype:?} sink {with_sink} step {step}");
                let h =
                    Var::from_tensor(&randt(&[2, 5, d], 80 + step, 1.5).to_dtype(dtype).unwrap())
                        .unwrap();
                let r = randt(&[2, 5, d], 90 + step, 1.0).to_dtype(dtype).unwrap();
                let _s = fp8_autocast(true, mode.clone());
                let h_t = h.as_tensor();
                let (y1, y2) = (fused(&a, h_t), parts(&b, h_t));
                if residual && residual_in_gemm(&mode, dtype, with_sink) {
                    assert!(within_one_rerounding(&y1, &y2, h_t), "{what}: y");
                } else {
                    assert_eq!(values(&y1), values(&y2), "{what}: y");
                }
                let g1 = (&y1 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (&y2 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let dh = |g: &candle_core::backprop::GradStore| values(g.get(h_t).expect("dh"));
                assert_eq!(dh(&g1), dh(&g2), "{what}: dh");
                let fp8_weights = with_sink && !matches!(mode, ComputeMode::Native);
                same_grads(&what, (&g1, &g2), (&a, &b), form, fp8_weights);
                if fp8_weights {
                    let (sa, sb) = (a.sink.take().unwrap(), b.sink.take().unwrap());
                    for part in ["qkv", "proj"] {
                        let ka = format!("{name}{m}{c}a.{part}.weight");
                        let kb = format!("{name}{m}{c}b.{part}.weight");
                        assert_eq!(
                            values(&sa[&ka].dequantize(DType::F32).unwrap()),
                            values(&sb[&kb].dequantize(DType::F32).unwrap()),
                            "{what}: sink {part}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn handed_self_attention_equals_the_parts_in_sequence() {
    let heads = 2;
    check(
        "sa",
        Form::Attention,
        true,
        &move |b, h| nn::causal_self_attention(h, &b.ln, &b.qkv, &b.proj, heads).unwrap(),
        &move |b, h| {
            let qkv = b.qkv.try_forward(&b.ln.try_forward(h).unwrap()).unwrap();
            let att = nn::causal_attention_qkv(&qkv, heads).unwrap();
            (h + b.proj.try_forward(&att).unwrap()).unwrap()
        },
    );
}

/// `nn::pre_norm_block` (the stream between the halves handed too) gives
/// the values of its attention half then `nn::pre_norm_mlp_with`, the
/// output and every gradient (input, both norms, the four Linears'
/// weights in the GradStore or the sink, and biases), in every compute
/// mode, F32 and BF16, over delayed-scaling steps: the two differ only in
/// the zero-fill and add candle gives the stream's gradient. GPT's form
/// (causal attention, GELU) and Llama's (rotary attention, RMSNorm and
/// SwiGLU).
fn check_block(name: &str, attention: nn::BlockAttention<'_>, mlp: Form, act: nn::Activation) {
    let d = 16;
    for (m, mode) in modes().into_iter().enumerate() {
        for (c, (dtype, with_sink)) in DTYPE_SINK.into_iter().enumerate() {
            let tag = |x: &str| format!("{name}{m}{c}{x}");
            let (aa, am) = (
                block_of(&tag("aa"), d, with_sink, Form::Attention),
                block_of(&tag("am"), d, with_sink, mlp),
            );
            let (ba, bm) = (
                block_of(&tag("ba"), d, with_sink, Form::Attention),
                block_of(&tag("bm"), d, with_sink, mlp),
            );
            for step in 0..3u64 {
                let what = format!("{name} {mode:?} {dtype:?} sink {with_sink} step {step}");
                let h =
                    Var::from_tensor(&randt(&[2, 5, d], 70 + step, 1.5).to_dtype(dtype).unwrap())
                        .unwrap();
                let r = randt(&[2, 5, d], 60 + step, 1.0).to_dtype(dtype).unwrap();
                let _s = fp8_autocast(true, mode.clone());
                let h_t = h.as_tensor();
                let y1 = nn::pre_norm_block(
                    h_t,
                    (&aa.ln, &aa.qkv, &aa.proj, attention),
                    (&am.ln, &am.qkv, &am.proj, act),
                )
                .unwrap();
                let mid = match attention {
                    nn::BlockAttention::Causal { heads } => {
                        nn::causal_self_attention(h_t, &ba.ln, &ba.qkv, &ba.proj, heads)
                    }
                    nn::BlockAttention::Rope { heads, tables } => {
                        nn::rope_self_attention(h_t, &ba.ln, &ba.qkv, &ba.proj, heads, tables)
                    }
                }
                .unwrap();
                let y2 = nn::pre_norm_mlp_with(&mid, &bm.ln, &bm.qkv, &bm.proj, true, act).unwrap();
                assert_eq!(values(&y1), values(&y2), "{what}: y");
                let g1 = (&y1 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let g2 = (&y2 * &r).unwrap().sum_all().unwrap().backward().unwrap();
                assert_eq!(
                    values(g1.get(h_t).expect("dh 1")),
                    values(g2.get(h_t).expect("dh 2")),
                    "{what}: dh"
                );
                let fp8_weights = with_sink && !matches!(mode, ComputeMode::Native);
                for (half, (a, b), form) in [
                    ("attention", (&aa, &ba), Form::Attention),
                    ("mlp", (&am, &bm), mlp),
                ] {
                    let what = format!("{what}: {half}");
                    same_grads(&what, (&g1, &g2), (a, b), form, fp8_weights);
                }
                if fp8_weights {
                    for (half, (a, b), (ka, kb)) in [
                        ("attention", (&aa, &ba), ("aa", "ba")),
                        ("mlp", (&am, &bm), ("am", "bm")),
                    ] {
                        let (sa, sb) = (a.sink.take().unwrap(), b.sink.take().unwrap());
                        for part in ["qkv", "proj"] {
                            let grad =
                                |sink: &std::collections::HashMap<String, amp::ScalingTensor>,
                                 k: &str| {
                                    values(
                                        &sink[&format!("{}.{part}.weight", tag(k))]
                                            .dequantize(DType::F32)
                                            .unwrap(),
                                    )
                                };
                            assert_eq!(grad(&sa, ka), grad(&sb, kb), "{what}: {half} sink {part}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn handed_gpt_block_equals_its_two_halves() {
    let attention = nn::BlockAttention::Causal { heads: 2 };
    check_block("pb", attention, Form::Mlp, nn::Activation::Gelu);
}

#[test]
fn handed_llama_block_equals_its_two_halves() {
    // d = 16 as two heads of 8 with as many key/value heads: qkv is d -> 3d
    let (cos, sin) = nn::rope_tables(5, 8, 10_000.0, None, &candle_core::Device::Cpu).unwrap();
    let attention = nn::BlockAttention::Rope {
        heads: (2, 2),
        tables: (&cos, &sin),
    };
    check_block("lb", attention, Form::Llama, nn::Activation::SwiGlu);
}

#[test]
fn handed_mlp_equals_the_parts_in_sequence() {
    for residual in [true, false] {
        check(
            if residual { "mr" } else { "mn" },
            Form::Mlp,
            residual,
            &move |b, h| nn::pre_norm_mlp(h, &b.ln, &b.qkv, &b.proj, residual).unwrap(),
            &move |b, h| {
                let m = b.qkv.try_forward(&b.ln.try_forward(h).unwrap()).unwrap();
                let y = b.proj.try_forward(&nn::gelu(&m).unwrap()).unwrap();
                if residual {
                    (h + y).unwrap()
                } else {
                    y
                }
            },
        );
    }
}

#[test]
fn handed_rope_attention_equals_the_parts_in_sequence() {
    // d = 16 as two heads of 8 with as many key/value heads: qkv is d -> 3d
    let (cos, sin) = nn::rope_tables(5, 8, 10_000.0, None, &candle_core::Device::Cpu).unwrap();
    let tables = (&cos, &sin);
    check(
        "ra",
        Form::Attention,
        true,
        &move |b, h| nn::rope_self_attention(h, &b.ln, &b.qkv, &b.proj, (2, 2), tables).unwrap(),
        &move |b, h| {
            let qkv = b.qkv.try_forward(&b.ln.try_forward(h).unwrap()).unwrap();
            let att = nn::fused::rope_attention_qkv(&qkv, (2, 2), tables).unwrap();
            (h + b.proj.try_forward(&att).unwrap()).unwrap()
        },
    );
}

#[test]
fn handed_llama_mlp_equals_the_parts_in_sequence() {
    for residual in [true, false] {
        check(
            if residual { "lr" } else { "ln" },
            Form::Llama,
            residual,
            &move |b, h| {
                let act = nn::Activation::SwiGlu;
                nn::pre_norm_mlp_with(h, &b.ln, &b.qkv, &b.proj, residual, act).unwrap()
            },
            &move |b, h| {
                let m = b.qkv.try_forward(&b.ln.try_forward(h).unwrap()).unwrap();
                let y = b.proj.try_forward(&nn::swiglu(&m).unwrap()).unwrap();
                if residual {
                    (h + y).unwrap()
                } else {
                    y
                }
            },
        );
    }
}

/// One Linear in high precision: the half-block falls back to the parts
/// in sequence (same values); a projection whose output does not match
/// the residual is an error on both paths, never a panic.
#[test]
fn mixed_precision_falls_back_and_bad_residuals_are_errors() {
    let d = 16;
    let (a, b) = (block("mx_a", d, true, false), block("mx_b", d, true, false));
    a.proj.set_high_precision(true);
    b.proj.set_high_precision(true);
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    let h = Var::from_tensor(&randt(&[2, 5, d], 3, 1.0)).unwrap();
    let y1 = nn::causal_self_attention(h.as_tensor(), &a.ln, &a.qkv, &a.proj, 2).unwrap();
    let qkv = b
        .qkv
        .try_forward(&b.ln.try_forward(h.as_tensor()).unwrap())
        .unwrap();
    let att = nn::causal_attention_qkv(&qkv, 2).unwrap();
    let y2 = (h.as_tensor() + b.proj.try_forward(&att).unwrap()).unwrap();
    assert_eq!(values(&y1), values(&y2));
    // a d -> d + 1 projection: its output cannot take the residual
    let wide = nn::Linear::new(
        "mx_wide.weight",
        Var::from_tensor(&randt(&[d + 1, d], 4, 0.3))
            .unwrap()
            .as_tensor()
            .clone(),
        None,
    )
    .unwrap();
    wide.set_grad_sink(Some(GradSink::new())).unwrap();
    let e = nn::causal_self_attention(h.as_tensor(), &a.ln, &a.qkv, &wide, 2);
    assert!(e.is_err(), "a residual of another width accepted");
    let c = block("mx_c", d, true, true);
    let e = nn::pre_norm_mlp(h.as_tensor(), &c.ln, &c.qkv, &wide, true);
    assert!(e.is_err(), "an MLP output of another width accepted");
}

/// The heads' tests' targets: `[2, 5]` tokens of a 40-word vocabulary.
fn head_targets() -> Tensor {
    Tensor::from_vec(
        (0..10u32).map(|i| (i * 7) % 40).collect(),
        (2, 5),
        &candle_core::Device::Cpu,
    )
    .unwrap()
}

/// `linear_cross_entropy`: the handed logits give the loss and gradients
/// (input, LayerNorm, the head's weight in the GradStore or the sink) of
/// the parts in sequence, in every mode, F32 and BF16.
#[test]
fn handed_head_and_loss_equal_the_parts_in_sequence() {
    let modes = modes();
    let (d, vocab) = (16, 40);
    let targets = head_targets();
    for (m, mode) in modes.into_iter().enumerate() {
        for (c, (dtype, with_sink)) in DTYPE_SINK.into_iter().enumerate() {
            let heads = [0, 1].map(|i| {
                let b = block(&format!("ce{m}{c}{i}"), d, false, false);
                let w = Var::from_tensor(&randt(&[vocab, d], 11, 0.3)).unwrap();
                let head = nn::Linear::new(
                    format!("ce{m}{c}{i}.head.weight"),
                    w.as_tensor().clone(),
                    None,
                )
                .unwrap();
                let sink = GradSink::new();
                if with_sink {
                    head.set_grad_sink(Some(sink.clone())).unwrap();
                }
                (b, head, w, sink)
            });
            for step in 0..3u64 {
                let what = format!("{mode:?} {dtype:?} sink {with_sink} step {step}");
                let h =
                    Var::from_tensor(&randt(&[2, 5, d], 100 + step, 1.5).to_dtype(dtype).unwrap())
                        .unwrap();
                let _s = fp8_autocast(true, mode.clone());
                let (a, b) = (&heads[0], &heads[1]);
                let l1 =
                    nn::linear_cross_entropy(h.as_tensor(), Some(&a.0.ln), &a.1, &targets).unwrap();
                let logits =
                    b.1.try_forward(&b.0.ln.try_forward(h.as_tensor()).unwrap())
                        .unwrap();
                let l2 = nn::cross_entropy(&logits, &targets).unwrap();
                assert_eq!(values(&l1), values(&l2), "{what}: loss");
                let (g1, g2) = (l1.backward().unwrap(), l2.backward().unwrap());
                let fp8_weights = with_sink && !matches!(mode, ComputeMode::Native);
                let mut pairs = vec![
                    ("dh", h.as_tensor(), h.as_tensor()),
                    ("dln_w", a.0.vars[0].as_tensor(), b.0.vars[0].as_tensor()),
                    ("dln_b", a.0.vars[1].as_tensor(), b.0.vars[1].as_tensor()),
                ];
                if !fp8_weights {
                    pairs.push(("dw", a.2.as_tensor(), b.2.as_tensor()));
                }
                for (name, x, y) in pairs {
                    let (gx, gy) = (g1.get(x).expect(name), g2.get(y).expect(name));
                    assert_eq!(values(gx), values(gy), "{what}: {name}");
                }
                if fp8_weights {
                    let (sa, sb) = (a.3.take().unwrap(), b.3.take().unwrap());
                    assert_eq!(
                        values(
                            &sa[&format!("ce{m}{c}0.head.weight")]
                                .dequantize(DType::F32)
                                .unwrap()
                        ),
                        values(
                            &sb[&format!("ce{m}{c}1.head.weight")]
                                .dequantize(DType::F32)
                                .unwrap()
                        ),
                        "{what}: sink dw"
                    );
                }
            }
        }
    }
}

/// The handed head's loss lets its logits go in its backward (the op held
/// the only reference: they are the largest activation): a second
/// backward through the same loss is a clear error, not a silent reuse.
#[test]
fn handed_loss_frees_its_logits_in_backward() {
    let (d, vocab) = (16, 40);
    let targets = head_targets();
    let b = block("free0", d, false, false);
    let w = Var::from_tensor(&randt(&[vocab, d], 11, 0.3)).unwrap();
    let head = nn::Linear::new("free0.head.weight", w.as_tensor().clone(), None).unwrap();
    let h = Var::from_tensor(&randt(&[2, 5, d], 100, 1.5)).unwrap();
    let _s = fp8_autocast(true, ComputeMode::Fp8Current(Default::default()));
    let loss = nn::linear_cross_entropy(h.as_tensor(), Some(&b.ln), &head, &targets).unwrap();
    let grads = loss.backward().unwrap();
    assert!(
        grads.get(h.as_tensor()).is_some(),
        "the first backward reaches h"
    );
    let again = loss.backward();
    let err = again.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("second backward"), "{err}");
}

/// Two GPT blocks and the head chained on an `nn::Stream` (the residual
/// stream handed from block to block and into the head's norm) give the
/// loss and every gradient of `nn::pre_norm_block` twice and
/// `nn::linear_cross_entropy`, in every compute mode, F32 and BF16, with
/// and without sinks.
#[test]
fn a_handed_stream_through_blocks_and_head_equals_the_calls() {
    let (d, vocab) = (16, 40);
    let targets = head_targets();
    let attention = nn::BlockAttention::Causal { heads: 2 };
    for (m, mode) in modes().into_iter().enumerate() {
        for (c, (dtype, with_sink)) in DTYPE_SINK.into_iter().enumerate() {
            // two models of equal values: two blocks (attention and MLP
            // halves) and a head with its norm each
            let model = |side: &str| {
                let tag = |x: &str| format!("st{m}{c}{side}{x}");
                let blocks: Vec<(Block, Block)> = (0..2)
                    .map(|i| {
                        (
                            block_of(&tag(&format!("a{i}")), d, with_sink, Form::Attention),
                            block_of(&tag(&format!("m{i}")), d, with_sink, Form::Mlp),
                        )
                    })
                    .collect();
                let norm = block(&tag("n"), d, false, false);
                let w = Var::from_tensor(&randt(&[vocab, d], 11, 0.3)).unwrap();
                let head =
                    nn::Linear::new(tag("head.weight"), w.as_tensor().clone(), None).unwrap();
                if with_sink {
                    head.set_grad_sink(Some(GradSink::new())).unwrap();
                }
                (blocks, norm, head, w)
            };
            let (a, b) = (model("a"), model("b"));
            for step in 0..2u64 {
                let what = format!("stream {mode:?} {dtype:?} sink {with_sink} step {step}");
                let h =
                    Var::from_tensor(&randt(&[2, 5, d], 50 + step, 1.5).to_dtype(dtype).unwrap())
                        .unwrap();
                let _s = fp8_autocast(true, mode.clone());
                let mut s = nn::Stream::new(h.as_tensor().clone());
                for (at, ml) in &a.0 {
                    s = nn::pre_norm_block_stream(
                        s,
                        (&at.ln, &at.qkv, &at.proj, attention),
                        (&ml.ln, &ml.qkv, &ml.proj, nn::Activation::Gelu),
                    )
                    .unwrap();
                }
                let l1 = nn::linear_cross_entropy_stream(s, Some(&a.1.ln), &a.2, &targets).unwrap();
                let mut t = h.as_tensor().clone();
                for (at, ml) in &b.0 {
                    t = nn::pre_norm_block(
                        &t,
                        (&at.ln, &at.qkv, &at.proj, attention),
                        (&ml.ln, &ml.qkv, &ml.proj, nn::Activation::Gelu),
                    )
                    .unwrap();
                }
                let l2 = nn::linear_cross_entropy(&t, Some(&b.1.ln), &b.2, &targets).unwrap();
                assert_eq!(values(&l1), values(&l2), "{what}: loss");
                let (g1, g2) = (l1.backward().unwrap(), l2.backward().unwrap());
                assert_eq!(
                    values(g1.get(h.as_tensor()).expect("dh 1")),
                    values(g2.get(h.as_tensor()).expect("dh 2")),
                    "{what}: dh"
                );
                let fp8_weights = with_sink && !matches!(mode, ComputeMode::Native);
                let params = |x: &(Vec<(Block, Block)>, Block, nn::Linear, Var)| {
                    let mut v: Vec<Var> = Vec::new();
                    for (at, ml) in &x.0 {
                        for (i, var) in at.vars.iter().chain(&ml.vars).enumerate() {
                            if !(fp8_weights && (i % 6 == 2 || i % 6 == 4)) {
                                v.push(var.clone());
                            }
                        }
                    }
                    v.extend(x.1.vars[..2].iter().cloned());
                    if !fp8_weights {
                        v.push(x.3.clone());
                    }
                    v
                };
                for (i, (va, vb)) in params(&a).iter().zip(&params(&b)).enumerate() {
                    let (ga, gb) = (g1.get(va.as_tensor()), g2.get(vb.as_tensor()));
                    assert_eq!(
                        values(ga.expect("grad a")),
                        values(gb.expect("grad b")),
                        "{what}: parameter {i}"
                    );
                }
            }
        }
    }
}
