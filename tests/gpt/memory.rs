//! The memory estimate (`examples/lm/budget.rs`) against the peak a run
//! measures: on the CPU the example counts its heap, and the second step's
//! high-water mark (`second_step_device_bytes`) must be within 10% of the
//! estimate it checked before starting (`estimated_peak_bytes`), for the
//! tiny and 125M shapes, with each recompute mode; and each mode must
//! keep less than the one before it.

use crate::example::example_bin;

/// `(measured peak, estimate)` of a two-step CPU run with `args`.
fn peak(bin: &std::path::Path, args: &[&str]) -> anyhow::Result<(f64, f64)> {
    let out = std::process::Command::new(bin)
        .args(args)
        .args(["--steps", "2", "--eval-every", "100", "--eval-batches", "1"])
        .args(["--json", "--no-memory-check"])
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
    let measured = s["second_step_device_bytes"][2]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("{args:?}: no second_step_device_bytes in {s}"))?;
    let estimate = s["estimated_peak_bytes"]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("{args:?}: no estimated_peak_bytes"))?;
    Ok((measured, estimate))
}

fn within_10_percent(what: &str, (measured, estimate): (f64, f64)) {
    let ratio = estimate / measured;
    assert!(
        (0.9..=1.1).contains(&ratio),
        "{what}: estimated {estimate:.0} bytes, measured {measured:.0} ({ratio:.3})"
    );
}

#[test]
fn the_estimate_is_within_10_percent_of_the_measured_peak() -> anyhow::Result<()> {
    let Some(bin) = example_bin() else {
        eprintln!("skipped: target/*/examples/gpt not built");
        return Ok(());
    };
    // tiny, long enough sequences that materialized attention's
    // probabilities count: every recompute mode at O2, and O0's candle
    // graph
    let tiny = ["--size", "tiny", "--batch", "8", "--seq", "256"];
    let mut kept = Vec::new();
    for mode in ["none", "selective", "full"] {
        let args = [&tiny[..], &["--level", "O2", "--recompute", mode]].concat();
        let m = peak(&bin, &args)?;
        within_10_percent(&format!("tiny O2 {mode}"), m);
        kept.push(m.0);
    }
    assert!(kept[0] > kept[1] && kept[1] > kept[2], "{kept:?}");
    // the MLP's activation input as E4M3 tiles: less than all of it kept
    let args = [&tiny[..], &["--level", "O2", "--fp8-activation-inputs"]].concat();
    let m = peak(&bin, &args)?;
    within_10_percent("tiny O2 --fp8-activation-inputs", m);
    assert!(m.0 < kept[0], "{} against {}", m.0, kept[0]);
    let args = [&tiny[..], &["--level", "O0"]].concat();
    within_10_percent("tiny O0", peak(&bin, &args)?);
    // 125M: the level's persistent bytes count most
    let args = [
        "--size", "125m", "--batch", "2", "--seq", "64", "--level", "O2",
    ];
    within_10_percent("125M O2", peak(&bin, &args)?);
    Ok(())
}
