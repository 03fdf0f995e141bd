//! Data parallelism averages a large embedding table's gradient from every
//! rank's looked-up rows instead of all-reducing the table: on the
//! in-process backend, N ranks on 1/N of a batch each give the table of
//! one rank on the whole batch (to the bit where N is a power of two: each
//! rank's row gradients are N times the whole batch's, scaled back
//! exactly, and summed in the same token order), and send the rows, not
//! the table.

use crate::common::randn;

use amp::comm::{run_ranks, Communicator};
use amp::levels::{initialize, initialize_distributed, AmpConfig, Compute, Level};
use amp::nn::{self, Linear};
use amp::optim::AdamWConfig;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use std::sync::Arc;

/// Rows of the table: more than twice the ids of every test's ranks, so
/// the rows are gathered ([`worth_it`] in `levels/src/distributed/rows.rs`).
const ROWS: usize = 64;
const WIDTH: usize = 8;
/// Ids a rank looks up each step.
const IDS: usize = 8;

struct Model {
    wte: Tensor,
    head: Linear,
}

fn model() -> (Model, VarMap) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let wte = vb.get((ROWS, WIDTH), "wte.weight").unwrap();
    let head = nn::linear_no_bias(WIDTH, ROWS, vb.pp("head")).unwrap();
    // the table starts at zero, so that after one step it holds the
    // update itself, every bit of it (a table of 0.3s would round the
    // update to its own precision and hide the gradient's last bits)
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let s = name.bytes().map(u64::from).sum::<u64>();
        let scale = if name == "wte.weight" { 0.0 } else { 0.3 };
        let v: Vec<f32> = randn(var.elem_count(), s)
            .iter()
            .map(|x| x * scale)
            .collect();
        var.set(&Tensor::from_vec(v, var.dims(), &Device::Cpu).unwrap())
            .unwrap();
    }
    (Model { wte, head }, varmap)
}

/// Ids and targets of `ranks * IDS` tokens, rank `r`'s the `r`-th run of
/// `IDS`; a few rows recur across the ranks.
fn batch(ranks: usize, micro: u64) -> (Vec<u32>, Vec<u32>) {
    let n = ranks * IDS;
    let ids = (0..n as u64).map(|i| ((i * i * 5 + micro * 3) % 11) as u32);
    let targets = (0..n as u64).map(|i| ((i * 7 + micro) % ROWS as u64) as u32);
    (ids.collect(), targets.collect())
}

fn loss(m: &Model, ids: &[u32], targets: &[u32]) -> amp::levels::Result<Tensor> {
    let x = Tensor::new(ids, &Device::Cpu)?;
    let y = Tensor::new(targets, &Device::Cpu)?;
    let h = nn::embedding(&x, &m.wte)?.tanh()?;
    Ok(candle_nn::loss::cross_entropy(&m.head.forward(&h)?, &y)?)
}

/// An AdamW whose first update is `g / (|g| + eps)`, about `g / eps`: the
/// table after one step (from zero) shows the gradient's bits.
fn adam() -> AdamWConfig {
    AdamWConfig {
        lr: 1.0,
        eps: 1e3,
        weight_decay: 0.0,
        ..Default::default()
    }
}

fn config() -> AmpConfig {
    AmpConfig {
        level: Level::O0,
        compute: Compute::Native,
        embedding_rows: true,
        ..Default::default()
    }
}

/// The table after one step of `micro` micro-batches, on one rank with
/// every rank's tokens (`comm` None, `ranks` the tokens' ranks) or as one
/// rank of a group; and the bytes this rank sent.
fn one_step(comm: Option<Arc<dyn Communicator>>, ranks: usize, micro: u64) -> (Vec<f32>, u64) {
    one_step_with(comm, ranks, micro, config())
}

fn one_step_with(
    comm: Option<Arc<dyn Communicator>>,
    ranks: usize,
    micro: u64,
    cfg: AmpConfig,
) -> (Vec<f32>, u64) {
    let (m, varmap) = model();
    let (ctx, mut opt) = match &comm {
        Some(c) => initialize_distributed(&varmap, adam(), cfg, c.clone()).unwrap(),
        None => initialize(&varmap, adam(), cfg).unwrap(),
    };
    let part = |v: &[u32]| match &comm {
        Some(c) => v[c.rank() * IDS..(c.rank() + 1) * IDS].to_vec(),
        None => v.to_vec(),
    };
    for k in 0..micro {
        let (ids, targets) = batch(ranks, k);
        let l = (loss(&m, &part(&ids), &part(&targets)).unwrap() / micro as f64).unwrap();
        if k + 1 < micro {
            opt.backward_accumulate(l).unwrap();
        } else {
            opt.backward_step_owned(l).unwrap();
        }
    }
    let _ = ctx;
    let bytes = opt.last_comm().map_or(0, |s| s.wire_bytes);
    let wte = m.wte.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (wte, bytes)
}

fn on_ranks(world: usize, micro: u64) -> Vec<(Vec<f32>, u64)> {
    run_ranks(world, |comm| {
        Ok::<_, amp::comm::Error>(one_step(Some(Arc::new(comm)), world, micro))
    })
    .unwrap()
}

#[test]
fn a_table_averaged_from_its_rows_is_the_whole_batchs_to_the_bit() {
    for world in [2, 4] {
        let (alone, _) = one_step(None, world, 1);
        let ranks = on_ranks(world, 1);
        let (start, _) = model();
        let moved = start.wte.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_ne!(alone, moved, "the step moves the table");
        for (r, (wte, _)) in ranks.iter().enumerate() {
            assert_eq!(wte, &alone, "{world} ranks, rank {r}");
        }
    }
}

#[test]
fn the_rows_go_on_the_wire_and_not_the_table() {
    // rank r of 2 sends its ids and row gradients once each (IDS x (1 +
    // WIDTH) F32-sized values), and the head's gradient in the F32
    // all-reduce (ROWS x WIDTH: half sent in the reduce-scatter, half in
    // the gather); the table's ROWS x WIDTH all-reduce is gone
    let want = (IDS * (1 + WIDTH) + ROWS * WIDTH) as u64 * 4;
    for (r, (_, bytes)) in on_ranks(2, 1).iter().enumerate() {
        assert_eq!(*bytes, want, "rank {r}");
    }
    // off (AmpConfig's default): the table all-reduced with the head
    let dense = run_ranks(2, |comm| {
        let cfg = AmpConfig {
            embedding_rows: false,
            ..config()
        };
        Ok::<_, amp::comm::Error>(one_step_with(Some(Arc::new(comm)), 2, 1, cfg))
    })
    .unwrap();
    for (r, (_, bytes)) in dense.iter().enumerate() {
        assert_eq!(*bytes, (2 * ROWS * WIDTH) as u64 * 4, "rank {r}, off");
    }
    assert!(!AmpConfig::default().embedding_rows);
}

#[test]
fn three_ranks_and_accumulated_micro_batches_average_alike() {
    // 3 ranks: the scale 1/3 rounds, so the table is the whole batch's to
    // within a rounding; with two micro-batches the first one's table
    // gradient stays in the store (accumulated, all-reduced after the
    // backward) and the last one's comes from its rows: their sum
    for (world, micro) in [(3, 1), (2, 2), (3, 2)] {
        let (alone, _) = one_step(None, world, micro);
        let ranks = on_ranks(world, micro);
        for (r, (wte, _)) in ranks.iter().enumerate() {
            assert_eq!(
                wte, &ranks[0].0,
                "{world} ranks: rank {r} differs from rank 0"
            );
            let max = |v: &mut dyn Iterator<Item = f32>| v.fold(0f32, f32::max);
            let diff = max(&mut wte.iter().zip(&alone).map(|(a, b)| (a - b).abs()));
            let rel = diff / max(&mut alone.iter().map(|a| a.abs()));
            assert!(rel < 1e-5, "{world} ranks, {micro} micro-batches: {rel}");
        }
    }
}
