//! End-to-end: the GPT example's training function at every level on the
//! tiny size, its determinism, exact resume, export, the comparison
//! outputs, and the CLI's errors.

use crate::data;
use crate::gpt_common;
use crate::model;
use crate::report;
use crate::train;

use amp::levels::{Compute, Level};
use amp::{CurrentScaling, DelayedScaling};
use candle_core::{DType, Device};
use train::{train, TrainConfig};

/// Small enough for CI: tiny model, short sequences.
fn quick(level: Level, compute: Compute, steps: u64) -> TrainConfig {
    TrainConfig {
        level,
        compute,
        steps,
        batch: 8,
        seq: 32,
        warmup: 5,
        eval_every: 10,
        eval_batches: 2,
        ..Default::default()
    }
}

fn current() -> Compute {
    Compute::Fp8Current {
        recipe: CurrentScaling::default(),
    }
}

fn delayed() -> Compute {
    Compute::Fp8Delayed {
        recipe: DelayedScaling::default(),
    }
}

fn block() -> Compute {
    Compute::Fp8Block {
        recipe: Default::default(),
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("amp-gpt-{}-{name}", std::process::id()))
}

#[test]
fn every_level_learns_and_reports() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    // Every level, and each compute path at least once ("TE path only",
    // O0 + fp8-delayed, is the determinism test's run; the resume test
    // runs delayed scaling at O3).
    // O3 with both Adam moments in FP8 (`--fp8-moments`; O3's FP16 second
    // moments train in the distributed and recomputation tests).
    let runs = [
        (Level::O0, Compute::Native, false),
        (Level::O1, delayed(), false),
        (Level::O2, current(), false),
        (Level::O3, current(), true),
        (Level::O2, block(), false),
        (
            Level::O1,
            Compute::Fp8Rowwise {
                recipe: Default::default(),
            },
            false,
        ),
    ];
    for (level, compute, fp8_moments) in runs {
        let cfg = TrainConfig {
            fp8_moments,
            ..quick(level, compute.clone(), 30)
        };
        let s = train(&cfg, &corpus)?;
        let tag = format!(
            "{level} {} fp8 moments {fp8_moments}",
            train::compute_name(&compute)
        );
        assert_eq!(s.fp8_moments, fp8_moments, "{tag}");
        if fp8_moments {
            // one rank: 2 + 4 instead of 2 + 5
            assert_eq!(s.predicted_bytes_per_linear_param, 6.0, "{tag}");
        }
        // ln(256) = 5.55 at the start; bytes of English text sit near 2.5 nats
        // once the model knows the letters' frequencies.
        assert!(
            (5.0..6.5).contains(&s.first_loss),
            "{tag}: first loss {}",
            s.first_loss
        );
        assert!(
            s.final_loss < 0.6 * s.first_loss,
            "{tag}: {} -> {}",
            s.first_loss,
            s.final_loss
        );
        assert!(
            s.val_loss < 0.6 * s.first_loss,
            "{tag}: validation {}",
            s.val_loss
        );
        assert_eq!(s.skipped_steps, 0, "{tag}");
        assert_eq!(s.train_curve.len(), 30);
        assert_eq!(s.val_curve.len(), 3);

        let json: serde_json::Value = serde_json::from_str(&serde_json::to_string(&s)?)?;
        for key in [
            "level",
            "compute",
            "size",
            "steps",
            "first_loss",
            "final_loss",
            "val_loss",
            "tokens_per_s",
            "bytes_per_linear_param",
            "persistent_bytes",
            "skipped_steps",
            "steps_run",
            "device",
        ] {
            assert!(json.get(key).is_some(), "{tag}: no `{key}` in {json}");
        }
        assert_eq!(json["level"], level.to_string());
        assert_eq!(json["compute"], train::compute_name(&compute));
        assert_eq!(json["size"], "tiny");
        assert_eq!(json["steps"], 30);
        assert_eq!(json["device"], "cpu");
        assert!(
            json["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0),
            "{tag}"
        );
        // Measured bytes per Linear parameter are the level's prediction
        // plus the scaling metadata, nothing else.
        let p = &json["persistent_bytes"];
        let (measured, predicted) = (s.bytes_per_linear_param, s.predicted_bytes_per_linear_param);
        let excess = (measured - predicted) * s.linear_params as f64;
        let meta = p["scaling_metadata"].as_f64().unwrap_or(-1.0);
        assert!(
            excess > -0.5 && excess <= meta + 0.5,
            "{tag}: {measured} bytes per linear parameter, predicted {predicted}, metadata {meta}"
        );
        let parts: u64 = [
            "linear_weights",
            "master_weights",
            "weight_gradients",
            "first_moments",
            "second_moments",
            "other_params",
            "other_states",
            "scaling_metadata",
        ]
        .iter()
        .map(|k| p[*k].as_u64().unwrap_or(u64::MAX / 16))
        .sum();
        assert_eq!(p["total"].as_u64(), Some(parts), "{tag}: {p}");
        assert_eq!(
            p["master_weights"].as_u64() == Some(0),
            level != Level::O3,
            "{tag}"
        );
    }
    Ok(())
}

#[test]
fn bf16_activations_learn_like_f32_and_are_reported() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let cfg = quick(Level::O2, current(), 30);
    let f32_run = train(&cfg, &corpus)?;
    let bf16_activations = TrainConfig {
        activations: DType::BF16,
        ..cfg
    };
    let bf16_run = train(&bf16_activations, &corpus)?;
    assert_eq!(f32_run.activations, "F32");
    assert_eq!(bf16_run.activations, "BF16");
    // a different run (BF16 rounding), the same learning
    assert_ne!(f32_run.final_loss.to_bits(), bf16_run.final_loss.to_bits());
    assert!(bf16_run.final_loss < 0.8 * bf16_run.first_loss);
    let (a, b) = (f64::from(f32_run.val_loss), f64::from(bf16_run.val_loss));
    assert!((a - b).abs() <= 0.05 * a, "val {a} (F32) vs {b} (BF16)");
    // other activation dtypes are refused with a message
    let (gpt, _) = model::build(model::GptConfig::named("tiny", 256, 32)?, 0, &Device::Cpu)?;
    assert!(gpt
        .with_activations(DType::F16)
        .is_err_and(|e| e.to_string().contains("F32 or BF16")));
    Ok(())
}

#[test]
fn same_seed_same_losses() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let cfg = quick(Level::O0, delayed(), 6);
    let a = train(&cfg, &corpus)?;
    let b = train(&cfg, &corpus)?;
    let bits = |s: &train::Summary| -> Vec<u32> {
        s.train_curve
            .iter()
            .chain(&s.val_curve)
            .map(|p| p.1.to_bits())
            .collect()
    };
    assert_eq!(bits(&a), bits(&b));
    let c = train(&TrainConfig { seed: 1, ..cfg }, &corpus)?;
    assert_ne!(bits(&a), bits(&c), "another seed gave the same run");
    Ok(())
}

#[test]
fn resume_continues_exactly() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let ckpt = tmp("resume.safetensors");
    let cfg = TrainConfig {
        eval_every: 100,
        ..quick(Level::O3, delayed(), 10)
    };
    let (whole, rest) = gpt_common::whole_and_resumed(&cfg, &corpus, 4, &ckpt)?;
    std::fs::remove_file(&ckpt)?;
    assert_eq!(rest.train_curve.first().map(|p| p.0), Some(5));
    assert_eq!(rest.train_curve, whole.train_curve[4..]);
    assert_eq!(rest.val_loss.to_bits(), whole.val_loss.to_bits());
    Ok(())
}

#[test]
fn a_resumed_run_counts_skipped_steps_as_batches() -> anyhow::Result<()> {
    // A rate that blows the weights up at the first step: every later
    // step has a non-finite gradient and is skipped. Resumed after step 4
    // (1 applied, 3 skipped), the run goes on at batch 5, not at batch 2:
    // it repeats no batch and runs 6 steps, not 9.
    let corpus = data::Corpus::bundled();
    let ckpt = tmp("resume-skipped.safetensors");
    let cfg = TrainConfig {
        lr: 1e30,
        warmup: 1,
        max_grad_norm: None,
        eval_every: 100,
        ..quick(Level::O2, current(), 10)
    };
    let (whole, rest) = gpt_common::whole_and_resumed(&cfg, &corpus, 4, &ckpt)?;
    let _ = std::fs::remove_file(&ckpt);
    assert_eq!(whole.skipped_steps, 9, "the setting no longer skips");
    assert_eq!(rest.steps_run, 6);
    assert_eq!(rest.skipped_steps, 6);
    let steps: Vec<u64> = rest.train_curve.iter().map(|p| p.0).collect();
    assert_eq!(steps, (5..=10).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn parameter_count_and_names() -> anyhow::Result<()> {
    let cfg = model::GptConfig::named("tiny", 256, 32)?;
    let (_, varmap) = model::build(cfg, 0, &Device::Cpu)?;
    let n: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    assert_eq!(n, cfg.params());
    assert!(model::GptConfig::named("huge", 256, 32).is_err());
    // every parameter receives a gradient (no silent stop in the graph)
    let (gpt, varmap) = model::build(cfg, 0, &Device::Cpu)?;
    let corpus = data::Corpus::bundled();
    let (x, y) = corpus.batch(data::Split::Train, 0, 0, 2, 16, &Device::Cpu)?;
    let grads = gpt.loss(&x, &y)?.backward()?;
    for (name, var) in varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("poisoned"))?
        .iter()
    {
        let g = grads
            .get(var.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no gradient for {name}"))?;
        let norm = g.sqr()?.sum_all()?.to_scalar::<f32>()?;
        assert!(
            norm > 0.0 && norm.is_finite(),
            "{name}: gradient norm {norm}"
        );
    }
    Ok(())
}

#[test]
fn compare_outputs() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    let runs = [(Level::O0, Compute::Native), (Level::O2, current())]
        .into_iter()
        .map(|(l, c)| train(&quick(l, c, 3), &corpus))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let table = report::markdown(&runs);
    assert!(
        table.contains("| O0 | native |") && table.contains("| O2 | fp8-current |"),
        "{table}"
    );
    let dir = tmp("compare");
    std::fs::create_dir_all(&dir)?;
    report::loss_svg(&runs, &dir.join("loss.svg"))?;
    report::memory_svg(&runs, &dir.join("memory.svg"))?;
    for f in ["loss.svg", "memory.svg"] {
        let svg = std::fs::read_to_string(dir.join(f))?;
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{f}"
        );
        assert!(svg.contains("O2 fp8-current"), "{f} has no legend");
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Resumes `ckpt` (at `step`) with `args` for one more step; its JSON
/// summary. Fails, naming `what`, unless the run succeeds.
fn one_more_step(
    bin: &std::path::Path,
    args: &[&str],
    ckpt: &std::path::Path,
    step: u64,
    what: &str,
) -> anyhow::Result<serde_json::Value> {
    let out = std::process::Command::new(bin)
        .args(args)
        .args(["--steps", &(step + 1).to_string(), "--json"])
        .arg("--resume")
        .arg(ckpt)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{what} step {step}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_str(String::from_utf8(out.stdout)?.trim())?)
}

/// The example binary and a fresh, empty directory `name` for a test that
/// runs it as a child; `None` (skipped, said on stderr) without the binary.
fn bin_and_dir(name: &str) -> anyhow::Result<Option<(std::path::PathBuf, std::path::PathBuf)>> {
    let Some(bin) = example_bin() else {
        eprintln!("skipped: target/*/examples/gpt not built");
        return Ok(None);
    };
    let dir = tmp(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(Some((bin, dir)))
}

/// The example binary cargo built beside this test.
pub(crate) fn example_bin() -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let bin = exe.parent()?.parent()?.join("examples").join("gpt");
    bin.exists().then_some(bin)
}

#[test]
fn cli_bad_input_exits_2_and_json_line() -> anyhow::Result<()> {
    let Some(bin) = example_bin() else {
        // `cargo test` builds examples first; a bare test binary has none.
        eprintln!("skipped: target/*/examples/gpt not built");
        return Ok(());
    };
    for (args, says) in [
        (vec!["--level", "O9"], "O9"),
        (vec!["--steps", "0"], "steps"),
        (vec!["--size", "huge"], "huge"),
        (vec!["--device", "tpu"], "tpu"),
        (vec!["--lr=-1"], "lr"),
        (vec!["--lr", "nan"], "lr"),
        (vec!["--seq", "1000000"], "seq"),
        (
            vec!["--compute", "fp8-current", "--recipe", "r.toml"],
            "recipe",
        ),
        (vec!["--recipe", "/nonexistent/recipe.toml"], "recipe"),
        (
            vec!["--compute", "native", "--recipe", "r.toml"],
            "recipe goes with",
        ),
        (
            vec!["--compute", "fp8-block", "--recipe", "/nonexistent/b.toml"],
            "recipe",
        ),
        (vec!["--compare", "O0,O1", "--save", "x"], "compare"),
        (vec!["--level", "O1", "--fp8-moments"], "O2 or O3"),
        (vec!["--bogus"], "bogus"),
        // more threads than cores used to run ~150x slower without a word
        (vec!["--threads", "100000"], "cores"),
    ] {
        let out = std::process::Command::new(&bin).args(&args).output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // a current-scaling recipe with fp8-current (refused before: only the
    // delayed, block and rowwise recipes were read)
    let recipe = tmp("current-e4m3.toml");
    std::fs::write(&recipe, "fp8_format = \"E4M3\"\nmargin = 1\n")?;
    let recipe = recipe.to_string_lossy().to_string();
    let out = std::process::Command::new(&bin)
        .args([
            "--steps",
            "1",
            "--batch",
            "2",
            "--seq",
            "16",
            "--eval-batches",
            "1",
        ])
        .args([
            "--level",
            "O2",
            "--compute",
            "fp8-current",
            "--recipe",
            &recipe,
            "--json",
        ])
        .output()?;
    let line = String::from_utf8_lossy(&out.stdout);
    let run: serde_json::Value = serde_json::from_str(line.lines().last().unwrap_or(""))?;
    assert_eq!(run["compute"], "fp8-current", "{line}");
    // a size that cannot fit used to allocate for tens of seconds and
    // abort; run under a 4 GiB address-space limit, so that if the check
    // ever lets it through the child fails fast instead of filling the
    // machine
    #[cfg(unix)]
    for (args, says) in [
        (vec!["--batch", "10000000"], "--no-memory-check"),
        (
            vec!["--batch", "10000000", "--level", "O3", "--world-size", "2"],
            "free",
        ),
    ] {
        let out = std::process::Command::new("sh")
            .args(["-c", "ulimit -v 4194304 && exec \"$0\" \"$@\""])
            .arg(&bin)
            .args(&args)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // launched as a rank (WORLD_SIZE set) by a build without NCCL: a clear error
    let out = std::process::Command::new(&bin)
        .args(["--steps", "1"])
        .env("WORLD_SIZE", "2")
        .env("RANK", "0")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("nccl"), "{err}");
    let out = std::process::Command::new(&bin)
        .args([
            "--level", "O2", "--steps", "2", "--batch", "2", "--seq", "16", "--json",
        ])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout)?;
    let json: serde_json::Value = serde_json::from_str(stdout.trim())?;
    assert_eq!(json["level"], "O2");
    assert_eq!(json["compute"], "fp8-current");
    assert_eq!(json["steps"], 2);
    Ok(())
}

/// `--save-every` writes the checkpoint while the run goes on, and SIGTERM
/// finishes the step, saves and exits non-zero, naming the step; the
/// checkpoint resumes from there.
#[cfg(unix)]
#[test]
fn a_signal_saves_and_stops_and_save_every_saves_on_the_way() -> anyhow::Result<()> {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let Some((bin, dir)) = bin_and_dir("signal")? else {
        return Ok(());
    };
    let ckpt = dir.join("run.safetensors");
    let _ = std::fs::remove_file(&ckpt);
    let common = [
        "--level",
        "O2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--threads",
        "1",
    ];
    let mut child = Command::new(&bin)
        .args(common)
        .args([
            "--steps",
            "100000",
            "--eval-every",
            "1000000",
            "--save-every",
            "3",
        ])
        .arg("--save")
        .arg(&ckpt)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(300);
    while !ckpt.exists() {
        if Instant::now() > deadline || child.try_wait()?.is_some() {
            let _ = child.kill();
            anyhow::bail!("no checkpoint from --save-every 3 while the run went on");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // the shell's kill: no extra crate, no procps needed
    let sent = Command::new("sh")
        .args(["-c", &format!("kill -TERM {}", child.id())])
        .status()?;
    assert!(sent.success());
    let out = child.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    let said = err
        .split("stopped by a signal after step ")
        .nth(1)
        .unwrap_or_else(|| panic!("no stop message: {err}"));
    let step: u64 = said.split_whitespace().next().unwrap_or("").parse()?;
    assert!(step >= 3 && err.contains("saved to"), "{err}");
    // the checkpoint holds that step: one more step resumes from it
    let json = one_more_step(&bin, &common, &ckpt, step, "")?;
    assert_eq!(json["steps_run"], 1);
    // --save-every without --save is refused up front
    let out = Command::new(&bin).args(["--save-every", "2"]).output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--save"));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// A sharded O3 run (two ranks) saving every step, killed with SIGKILL at
/// 20 random moments (during a save, between its rank files and its
/// index, or while training): the checkpoint on disk always loads and
/// goes on from the step its index names.
#[cfg(unix)]
#[test]
fn a_sharded_save_killed_at_any_point_leaves_a_loadable_checkpoint() -> anyhow::Result<()> {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let Some((bin, dir)) = bin_and_dir("killed-saves")? else {
        return Ok(());
    };
    let ckpt = dir.join("run.safetensors");
    let common = [
        "--level",
        "O3",
        "--world-size",
        "2",
        "--batch",
        "4",
        "--seq",
        "16",
        "--threads",
        "1",
    ];
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    for round in 0..20 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mut child = Command::new(&bin)
            .args(common)
            .args([
                "--steps",
                "100000",
                "--eval-every",
                "1000000",
                "--save-every",
                "1",
            ])
            .arg(if round == 0 { "--save" } else { "--resume" })
            .arg(&ckpt)
            .args(if round == 0 {
                vec![]
            } else {
                vec!["--save".into(), ckpt.clone()]
            })
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        // the first save of a fresh run, then a random moment (0-63 ms:
        // a save of this model takes a few ms, a step about as long)
        let deadline = Instant::now() + Duration::from_secs(300);
        while !ckpt.exists() {
            anyhow::ensure!(Instant::now() < deadline, "no checkpoint in round {round}");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(seed % 64));
        child.kill()?;
        child.wait()?;
        // what is on disk loads: one more step from the index's step
        let meta = std::fs::read(&ckpt)?;
        let (_, header) = safetensors::SafeTensors::read_metadata(&meta)?;
        let step: u64 = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get("step"))
            .ok_or_else(|| anyhow::anyhow!("round {round}: no step in the index"))?
            .parse()?;
        one_more_step(&bin, &common, &ckpt, step, &format!("round {round}"))?;
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn cli_refuses_bad_output_paths_before_training() -> anyhow::Result<()> {
    let Some(bin) = example_bin() else {
        eprintln!("skipped: target/*/examples/gpt not built");
        return Ok(());
    };
    let dir = tmp("bad-outputs");
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("a-file");
    std::fs::write(&file, b"not a directory")?;
    let ckpt = dir.join("ckpt.safetensors");
    let same = dir.join(".").join("ckpt.safetensors");
    let s = |p: &std::path::Path| p.display().to_string();
    for (args, says) in [
        // the export would replace the checkpoint written or resumed
        (
            vec!["--save".into(), s(&ckpt), "--export".into(), s(&ckpt)],
            "--export",
        ),
        (
            vec!["--resume".into(), s(&ckpt), "--export".into(), s(&same)],
            "--resume",
        ),
        // missing directories, a file where a directory should be
        (
            vec!["--save".into(), s(&dir.join("missing/ckpt.safetensors"))],
            "missing",
        ),
        (
            vec!["--export".into(), s(&file.join("gpt.safetensors"))],
            "a-file",
        ),
        (
            vec![
                "--compare".into(),
                "O0,O1".into(),
                "--out".into(),
                s(&file.join("out")),
            ],
            "--out",
        ),
    ] {
        let start = std::time::Instant::now();
        // the default 300 steps train for over a minute: refused up front
        let out = std::process::Command::new(&bin).args(&args).output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?} trained");
        assert!(
            start.elapsed().as_secs() < 30,
            "{args:?}: refused only after {:?}",
            start.elapsed()
        );
    }
    assert!(
        !ckpt.exists() && std::fs::read_dir(&dir)?.count() == 1,
        "nothing written"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn cli_run_that_trained_nothing_is_an_error() -> anyhow::Result<()> {
    let Some(bin) = example_bin() else {
        eprintln!("skipped: target/*/examples/gpt not built");
        return Ok(());
    };
    // --lr 1e30: the first step's update makes every later loss non-finite;
    // this used to exit 0 with a null loss and nothing on stderr
    for level in ["O0", "O2"] {
        let out = std::process::Command::new(&bin)
            .args([
                "--level", level, "--lr", "1e30", "--steps", "4", "--batch", "2",
            ])
            .args(["--seq", "16", "--json"])
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{level}: exit 0: {err}");
        assert!(
            err.contains("diverged") && err.contains("lower --lr"),
            "{level}: {err}"
        );
        // the summary still comes first, for the record
        let stdout = String::from_utf8(out.stdout)?;
        let json: serde_json::Value = serde_json::from_str(stdout.trim())?;
        assert_eq!(json["steps_run"], 4, "{json}");
        assert!(
            json["skipped_steps"].as_u64().is_some_and(|n| n >= 3),
            "{json}"
        );
    }
    Ok(())
}

/// The README's first code block, `examples/quickstart.rs`, runs: its loss
/// falls (it exits non-zero otherwise) and it prints O2's memory report
/// beside O0's.
#[test]
fn the_quickstart_runs() -> anyhow::Result<()> {
    let Some(gpt) = example_bin() else {
        eprintln!("skipped: target/*/examples not built");
        return Ok(());
    };
    let bin = gpt.with_file_name("quickstart");
    if !bin.exists() {
        eprintln!("skipped: {} not built", bin.display());
        return Ok(());
    }
    let out = std::process::Command::new(&bin).output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("memory at O2") && stdout.contains("vs O0"),
        "{stdout}"
    );
    Ok(())
}

/// The head's loss over chunks of rows (`loss_chunk_rows`: 64 of the 256
/// rows a step, four chunks) trains the tiny GPT as the whole logits do at
/// O2 (FP16 weights) and O3 (FP8 weights, sharded masters): every step's
/// loss within 1%, the validation loss too.
#[test]
fn the_head_loss_over_chunks_trains_as_the_whole_logits() -> anyhow::Result<()> {
    let corpus = data::Corpus::bundled();
    for level in [Level::O2, Level::O3] {
        let run = |rows: usize| {
            train(
                &TrainConfig {
                    loss_chunk_rows: rows,
                    ..quick(level, current(), 8)
                },
                &corpus,
            )
        };
        let (chunked, whole) = (run(64)?, run(0)?);
        // the chunked head holds its gradients for the backward, not its
        // inputs' codes: what the layers keep differs, so the path ran
        assert_ne!(
            chunked.activations_saved_bytes, whole.activations_saved_bytes,
            "{level:?}: the same bytes kept with and without chunks"
        );
        for (a, b) in chunked.train_curve.iter().zip(&whole.train_curve) {
            assert!(
                ((a.1 - b.1) / b.1).abs() < 0.01,
                "{level:?} step {}: {} chunked, {} whole",
                a.0,
                a.1,
                b.1
            );
        }
        let (a, b) = (chunked.val_loss, whole.val_loss);
        assert!(((a - b) / b).abs() < 0.01, "{level:?} val {a} against {b}");
    }
    Ok(())
}
