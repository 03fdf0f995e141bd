//! `--telemetry N` on the tiny GPT: the records of every Linear and role
//! (its casts and its weight's Adam moments) at the steps it names, as
//! JSON lines and a plot.

use crate::data;
use crate::train;

use amp::levels::{Compute, Level};
use amp::DelayedScaling;
use train::{train, TrainConfig};

#[test]
fn telemetry_records_every_linear_and_role_at_its_steps() -> anyhow::Result<()> {
    // the whole logits, and the head's loss over chunks of 16 rows (four)
    for rows in [0, 16] {
        records_every_linear_and_role(rows)?;
    }
    Ok(())
}

fn records_every_linear_and_role(loss_chunk_rows: usize) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!(
        "amp-gpt-telemetry-{}-{loss_chunk_rows}",
        std::process::id()
    ));
    let cfg = TrainConfig {
        loss_chunk_rows,
        level: Level::O2,
        compute: Compute::Fp8Delayed {
            recipe: DelayedScaling::default(),
        },
        steps: 6,
        batch: 4,
        seq: 16,
        warmup: 2,
        eval_every: 100,
        eval_batches: 1,
        telemetry: Some((3, dir.clone())),
        fp8_moments: true,
        ..Default::default()
    };
    train(&cfg, &data::Corpus::bundled())?;
    let jsonl = std::fs::read_to_string(dir.join("telemetry-O2-fp8-delayed.jsonl"))?;
    let svg = std::fs::read_to_string(dir.join("telemetry-O2-fp8-delayed.svg"))?;
    std::fs::remove_dir_all(&dir)?;
    assert!(svg.starts_with("<svg") && svg.contains("relative error"));
    let rows: Vec<serde_json::Value> = jsonl
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    // steps 1 (the first), 3 and 6 (the last); 4 blocks x 4 Linears and the
    // head; input, weight, output gradient and weight gradient each, and
    // the weight's two moments
    let mut steps: Vec<u64> = rows.iter().filter_map(|r| r["step"].as_u64()).collect();
    steps.dedup();
    assert_eq!(steps, [1, 3, 6]);
    assert_eq!(rows.len(), 3 * 17 * 6, "{jsonl}");
    for role in ["exp_avg", "exp_avg_sq"] {
        assert_eq!(
            rows.iter().filter(|r| r["role"] == role).count(),
            3 * 17,
            "{role}"
        );
    }
    // the head's output gradient: a chunk's rows (the first chunk's cast)
    // or all 64
    let head = |role: &str| {
        rows.iter()
            .find(|r| r["layer"] == "lm_head" && r["role"] == role)
            .and_then(|r| r["total"].as_u64())
            .unwrap_or(0)
    };
    let width = head("input") / 64;
    let vocab = head("weight") / width.max(1);
    let chunk = if loss_chunk_rows == 0 {
        64
    } else {
        loss_chunk_rows as u64
    };
    assert_eq!(head("grad_output"), chunk * vocab, "{jsonl}");
    for r in &rows {
        let (role, layer) = (
            r["role"].as_str().unwrap_or(""),
            r["layer"].as_str().unwrap_or(""),
        );
        let rel = r["rel_err"].as_f64().unwrap_or(f64::NAN);
        assert!(rel.is_finite(), "{r}");
        // the default recipe scales a tensor's first cast by its own amax
        // (`calibrate_first_step`): the first step's output gradients no
        // longer fall mostly below E4M3's smallest subnormal (2^-9) as at
        // TE's initial scale of 1, so every cast's error is small, the
        // first step's too
        assert!(rel < 0.25, "{r}");
        if (role == "weight" || role.starts_with("exp_avg")) && layer == "h.0.mlp.c_fc" {
            assert_eq!(r["total"], 128 * 512);
        }
        assert!(r["amax"].as_f64().is_some_and(|a| a > 0.0), "{r}");
    }
    Ok(())
}
