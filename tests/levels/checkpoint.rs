//! Checkpoints: exact resume at every level, clear errors for corrupt files
//! (with nothing changed), level mismatch.

use crate::ckpt_common;
use crate::common;

use amp::levels::Level;
use candle_core::{DType, Device, Tensor};
use ckpt_common::{build, contents, tmp, train, with_metadata, with_tensor_bytes};
use common::masters;
use safetensors::SafeTensors;

#[test]
fn resume_is_bit_exact_at_every_level() {
    for level in Level::ALL {
        let (straight, sctx, mut sopt) = build(8, level);
        train(&straight, &sctx, &mut sopt, 0..6);
        let (first, fctx, mut fopt) = build(8, level);
        train(&first, &fctx, &mut fopt, 0..3);
        let mid = tmp(&format!("mid-{level}.safetensors"));
        fctx.save(&mid, &fopt).unwrap();
        let (resumed, rctx, mut ropt) = build(8, level);
        rctx.load(&mid, &mut ropt).unwrap();
        train(&resumed, &rctx, &mut ropt, 3..6);
        let (a, b) = (
            tmp(&format!("straight-{level}.safetensors")),
            tmp(&format!("resumed-{level}.safetensors")),
        );
        sctx.save(&a, &sopt).unwrap();
        rctx.save(&b, &ropt).unwrap();
        let (ca, cb) = (contents(&a), contents(&b));
        assert!(ca.0.len() > 10, "{level}: {} tensors", ca.0.len());
        assert_eq!(ca.0.len(), cb.0.len(), "{level}: same tensors");
        for ((na, da), (nb, db)) in ca.0.iter().zip(&cb.0) {
            assert_eq!(na, nb, "{level}");
            assert!(da == db, "{level}: tensor {na} differs after resume");
        }
        assert_eq!(ca.1, cb.1, "{level}: metadata (step, scaler, layer metas)");
        if level != Level::O0 {
            assert!(
                ca.0.iter().any(|(n, _)| n.contains("__fp8_meta")),
                "{level}: layer metas saved"
            );
        }
    }
}

#[test]
fn corrupt_checkpoints_are_clear_errors_and_change_nothing() {
    let (model, ctx, mut opt) = build(8, Level::O2);
    train(&model, &ctx, &mut opt, 0..2);
    let good = tmp("good.safetensors");
    ctx.save(&good, &opt).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let before = tmp("before.safetensors");
    ctx.save(&before, &opt).unwrap();
    let mut cases: Vec<(String, Vec<u8>)> = vec![];
    for cut in [0, 4, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        cases.push((format!("truncated at {cut}"), bytes[..cut].to_vec()));
    }
    let mut flipped = bytes.clone();
    flipped[10] ^= 0x40;
    cases.push(("flipped header byte".into(), flipped));
    // a byte of the tensors' data: the header still parses, the values
    // would load wrong without the checksum
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for at in [8 + header_len + 1, bytes.len() - 1] {
        let mut flipped = bytes.clone();
        flipped[at] ^= 0x01;
        cases.push((format!("flipped data byte {at}"), flipped));
    }
    cases.push((
        "not safetensors".into(),
        b"this is a text file, not a checkpoint".to_vec(),
    ));
    // A checkpoint of a wider model: right names, wrong shapes.
    let (wide, wctx, mut wopt) = build(12, Level::O2);
    train(&wide, &wctx, &mut wopt, 0..1);
    let w = tmp("wide.safetensors");
    wctx.save(&w, &wopt).unwrap();
    cases.push(("wrong shapes".into(), std::fs::read(&w).unwrap()));
    for (what, data) in cases {
        let p = tmp("corrupt.safetensors");
        std::fs::write(&p, &data).unwrap();
        let e = ctx.load(&p, &mut opt).unwrap_err();
        assert!(e.to_string().contains("checkpoint"), "{what}: {e}");
        if what.starts_with("flipped data") {
            assert!(e.to_string().contains("CRC-32"), "{what}: {e}");
        }
        let after = tmp("after.safetensors");
        ctx.save(&after, &opt).unwrap();
        assert_eq!(
            contents(&before),
            contents(&after),
            "{what}: state changed by a failed load"
        );
    }
    // The good file still loads.
    ctx.load(&good, &mut opt).unwrap();
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
}

#[test]
fn a_checkpoint_loads_at_another_level_and_exports_as_plain_safetensors() {
    let (model, ctx, mut opt) = build(8, Level::O2);
    train(&model, &ctx, &mut opt, 0..3);
    let path = tmp("o2.safetensors");
    ctx.save(&path, &opt).unwrap();
    let saved = masters(&opt);
    for level in [Level::O0, Level::O1, Level::O3] {
        let (_, c, mut o) = build(8, level);
        c.load(&path, &mut o).unwrap();
        assert_eq!(o.inner().step_count(), 3, "{level}");
        // FP16 masters convert exactly to F32 and to FP16 again.
        assert_eq!(masters(&o), saved, "{level}");
    }
    // Export: plain tensors under the model's names, F32 exact, BF16 rounded.
    for (dtype, tol) in [
        (amp::levels::ExportDType::F32, 0.0f32),
        (amp::levels::ExportDType::BF16, 1.0 / 256.0),
    ] {
        let out = tmp("export.safetensors");
        ctx.export(&out, &opt, dtype).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = st.names();
        names.sort_unstable();
        assert_eq!(names.len(), saved.len());
        for (name, want) in &saved {
            let v = st.tensor(name).unwrap();
            let got: Vec<f32> = match v.dtype() {
                safetensors::Dtype::F32 => v
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                safetensors::Dtype::BF16 => v
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                    .collect(),
                other => panic!("{other:?}"),
            };
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() <= tol * b.abs(), "{name}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn bad_metadata_is_refused_before_anything_changes() {
    let (model, ctx, mut opt) = build(8, Level::O3);
    train(&model, &ctx, &mut opt, 0..2);
    let good = tmp("meta-good.safetensors");
    ctx.save(&good, &opt).unwrap();
    for (key, value, says) in [
        ("level", "O9", "level"),
        ("version", "99", "version"),
        ("step", "18446744073709551615", "step"),
        (
            "scaler",
            r#"{"config":{"static":{"scale":0.0}},"scale":0.0,"growth_tracker":0}"#,
            "scaler",
        ),
        ("param_steps", "{}", "no step"),
        ("format", "something-else", "not a candle-amp checkpoint"),
    ] {
        let p = with_metadata(&good, key, value);
        let before = contents(&good);
        let e = ctx.load(&p, &mut opt).unwrap_err().to_string();
        assert!(e.contains(says), "{key}={value}: {e}");
        let after = tmp("meta-after.safetensors");
        ctx.save(&after, &opt).unwrap();
        assert_eq!(contents(&after).0, before.0, "{key}: nothing changed");
    }
}

#[test]
fn a_save_removes_the_temporary_files_of_killed_saves() {
    let (_, ctx, opt) = build(8, Level::O2);
    let dir = tmp("stale-temps");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ckpt.safetensors");
    // what a save killed between its write and its rename leaves: dead
    // processes' (pids above Linux's pid_max), and one of a save still
    // running elsewhere (pid 1 always runs) that must stay
    let dead = [
        dir.join("ckpt.tmp.4194305.0"),
        dir.join("ckpt.tmp.4194399.7"),
    ];
    let live = dir.join("ckpt.tmp.1.0");
    let other = dir.join("other.tmp.4194305.0"); // another checkpoint's
    for f in dead.iter().chain([&live, &other]) {
        std::fs::write(f, b"partial").unwrap();
    }
    ctx.save(&path, &opt).unwrap();
    for f in &dead {
        if cfg!(target_os = "linux") {
            assert!(!f.exists(), "{} left behind", f.display());
        }
    }
    assert!(live.exists(), "a running save's temporary file was removed");
    assert!(
        other.exists(),
        "another checkpoint's temporary file was removed"
    );
    assert!(path.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn values_that_cannot_be_trained_from_are_refused() {
    // A file whose checksum matches (rewritten by another tool) with a NaN
    // in an FP16 weight (O2's master), a NaN code in an FP8 first moment, a
    // negative second moment: each a clear error, nothing loaded.
    let (model, ctx, mut opt) = build(8, Level::O2);
    train(&model, &ctx, &mut opt, 0..2);
    let good = tmp("values-good.safetensors");
    ctx.save(&good, &opt).unwrap();
    let st_bytes = std::fs::read(&good).unwrap();
    let st = SafeTensors::deserialize(&st_bytes).unwrap();
    let find = |suffix: &str, dtype: safetensors::Dtype| -> String {
        let mut names: Vec<String> = st
            .tensors()
            .into_iter()
            .filter(|(n, v)| n.ends_with(suffix) && v.dtype() == dtype)
            .map(|(n, _)| n)
            .collect();
        names.sort();
        names
            .first()
            .cloned()
            .unwrap_or_else(|| panic!("no {suffix} of {dtype:?}"))
    };
    let master = "proj.weight".to_string();
    let m = find(".__exp_avg", safetensors::Dtype::F8_E4M3);
    let v = find(".__exp_avg_sq", safetensors::Dtype::F16);
    let cases: Vec<(String, std::path::PathBuf, &str)> = vec![
        (
            "NaN FP16 weight".into(),
            with_tensor_bytes(&good, &master, |b| b[..2].copy_from_slice(&[0x00, 0x7e])),
            "NaN or inf",
        ),
        (
            "NaN first-moment code".into(),
            with_tensor_bytes(&good, &m, |b| b[0] = 0x7f),
            "NaN or inf",
        ),
        (
            "negative second moment".into(),
            with_tensor_bytes(&good, &v, |b| b[..2].copy_from_slice(&[0x00, 0xbc])),
            "negative second moment",
        ),
    ];
    let before = tmp("values-before.safetensors");
    ctx.save(&before, &opt).unwrap();
    for (what, path, want) in cases {
        let e = ctx.load(&path, &mut opt).unwrap_err().to_string();
        assert!(e.contains(want), "{what}: {e}");
        let after = tmp("values-after.safetensors");
        ctx.save(&after, &opt).unwrap();
        assert_eq!(contents(&before), contents(&after), "{what}: state changed");
        let _ = std::fs::remove_file(&path);
    }
    ctx.load(&good, &mut opt).unwrap();
}
