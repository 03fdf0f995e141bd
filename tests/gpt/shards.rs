//! Token shards (`--data`): llm.c's and nanoGPT's layouts written here and
//! read back, splits, deterministic batches within one shard, the text
//! corpus's batches unchanged, damaged files as errors naming the file,
//! and the example training on shards.

use crate::data::shards::{self, Format};
use crate::data::{self, Corpus, Split};
use anyhow::Result;
use candle_core::Device;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};

fn dir(name: &str) -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("amp-shards-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// `n` tokens below `vocab`: token `i` is `(i * 7919) % vocab`, so a window
/// shows where it came from.
fn tokens(n: usize, vocab: u32, shift: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919) + shift) % vocab)
        .collect()
}

fn err_of(path: &Path) -> String {
    match Corpus::from_path(path) {
        Ok(_) => String::from("(no error)"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn every_layout_reads_back_and_batches_stay_in_one_shard() -> Result<()> {
    let d = dir("layouts")?;
    for (format, name, vocab) in [
        (Format::LlmcU16, "a.bin", 50257u32),
        (Format::LlmcU32, "b.bin", 128_256),
        (Format::NanoGpt, "c.bin", 50257),
    ] {
        let want = tokens(10_000, vocab, 3);
        let path = d.join(name);
        shards::write(&path, format, &want)?;
        let shard = shards::Shard::open(&path)?;
        assert_eq!(shard.format(), format, "{name}");
        assert_eq!(shard.len(), want.len());
        assert_eq!(shard.max_token(), *want.iter().max().unwrap());
        let mut got = Vec::new();
        shard.extend(0, want.len(), &mut got);
        assert_eq!(got, want, "{name}");
        // one file: the last tenth validates
        let c = Corpus::from_path(&path)?;
        assert_eq!(c.len(Split::Train), 9_000);
        assert_eq!(c.len(Split::Val), 1_000);
        assert!(!c.is_text());
        let (x, y) = c.batch(Split::Val, 4, 11, 3, 64, &Device::Cpu)?;
        let (x2, _) = c.batch(Split::Val, 4, 11, 3, 64, &Device::Cpu)?;
        assert_eq!(x.to_vec2::<u32>()?, x2.to_vec2::<u32>()?);
        for (row, next) in x.to_vec2::<u32>()?.iter().zip(y.to_vec2::<u32>()?) {
            // a window of the validation tenth, the targets shifted by one
            let at = want[9_000..]
                .windows(64)
                .position(|w| w == row.as_slice())
                .expect("a window of the validation split");
            assert_eq!(next, want[9_000 + at + 1..9_000 + at + 65]);
        }
    }
    Ok(())
}

#[test]
fn val_shards_validate_and_windows_never_cross_shards() -> Result<()> {
    let d = dir("splits")?;
    // three short train shards with disjoint token ranges, one val shard
    for (k, name) in ["t_000.bin", "t_001.bin", "t_002.bin"].iter().enumerate() {
        let t: Vec<u32> = (0..40).map(|i| 1000 * k as u32 + i).collect();
        shards::write(&d.join(name), Format::LlmcU16, &t)?;
    }
    shards::write(
        &d.join("t_val_000.bin"),
        Format::LlmcU16,
        &tokens(500, 900, 0),
    )?;
    let c = Corpus::from_path(&d.join("t_*.bin"))?;
    assert_eq!(c.len(Split::Train), 120);
    assert_eq!(c.len(Split::Val), 500);
    assert_eq!(c.max_token(), 2039);
    for i in 0..50 {
        let (x, _) = c.batch(Split::Train, i, 5, 4, 30, &Device::Cpu)?;
        for row in x.to_vec2::<u32>()? {
            assert_eq!(
                row[0] / 1000,
                row[29] / 1000,
                "a window crossed shards: {row:?}"
            );
        }
    }
    // a sequence longer than every shard is an error, not a crossing
    let e = c
        .batch(Split::Train, 0, 0, 1, 40, &Device::Cpu)
        .unwrap_err();
    assert!(format!("{e:#}").contains("too few"), "{e:#}");
    // only validation shards: nothing to train on
    let e = err_of(&d.join("t_val_*.bin"));
    assert!(e.contains("only validation"), "{e}");
    Ok(())
}

#[test]
fn the_text_corpus_batches_as_before() -> Result<()> {
    // the sampling the text corpus always used, written out again
    let c = Corpus::bundled();
    let all = data::encode(data::BUNDLED);
    let cut = ((all.len() as f64) * (1.0 - data::VAL_FRACTION)) as usize;
    let train = &all[..cut];
    let (seed, index, batch, seq) = (7u64, 3u64, 4usize, 32usize);
    let mut rng = rand::rngs::StdRng::seed_from_u64(
        seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x7472_6169_6e00_0000u64 ^ index,
    );
    let (x, y) = c.batch(Split::Train, index, seed, batch, seq, &Device::Cpu)?;
    for (row, next) in x.to_vec2::<u32>()?.iter().zip(y.to_vec2::<u32>()?) {
        let o = rng.random_range(0..train.len() - seq - 1);
        assert_eq!(row.as_slice(), &train[o..o + seq]);
        assert_eq!(next.as_slice(), &train[o + 1..o + seq + 1]);
    }
    assert!(c.is_text());
    assert_eq!(c.max_token(), *all.iter().max().unwrap());
    Ok(())
}

#[test]
fn damaged_shards_are_errors_that_name_the_file() -> Result<()> {
    let d = dir("damaged")?;
    let good = d.join("good.bin");
    shards::write(&good, Format::LlmcU16, &tokens(1000, 50257, 1))?;
    let bytes = std::fs::read(&good)?;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        // cut mid-way: the header's count disagrees
        (
            "truncated.bin",
            bytes[..1024 + 900].to_vec(),
            "header says 1000 tokens",
        ),
        // half a token
        ("odd.bin", bytes[..1024 + 901].to_vec(), "whole number"),
        // a damaged magic in an llm.c header
        (
            "magic.bin",
            {
                let mut b = bytes.clone();
                b[0] ^= 1;
                b
            },
            "magic",
        ),
        // llm.c's magic with an unknown version
        (
            "version.bin",
            {
                let mut b = bytes.clone();
                b[4] = 9;
                b
            },
            "version 9",
        ),
        // the header alone
        ("short.bin", bytes[..600].to_vec(), "header"),
        ("empty.bin", Vec::new(), "no tokens"),
    ];
    for (name, content, says) in cases {
        let path = d.join(name);
        std::fs::write(&path, content)?;
        let e = err_of(&path);
        assert!(e.contains(name) && e.contains(says), "{name}: {e}");
    }
    let e = err_of(&d.join("nothing_*.bin"));
    assert!(e.contains("no file matches"), "{e}");
    std::fs::write(d.join("notes.txt"), "words, not tokens")?;
    let e = err_of(&d.join("*"));
    assert!(
        e.contains("notes.txt") && e.contains("not a token shard"),
        "{e}"
    );
    let e = err_of(&d.join("missing.bin"));
    assert!(e.contains("missing.bin"), "{e}");
    Ok(())
}

#[test]
fn the_example_trains_on_shards_and_refuses_a_small_vocabulary() -> Result<()> {
    let Some(bin) = crate::example::example_bin() else {
        eprintln!("skipped: target/*/examples/gpt not built");
        return Ok(());
    };
    let d = dir("train")?;
    // the bundled text as GPT-2-like token ids (bytes shifted past 256)
    let text: Vec<u32> = data::encode(data::BUNDLED)
        .iter()
        .map(|&b| b + 300)
        .collect();
    let cut = text.len() * 9 / 10;
    shards::write(&d.join("kjv_train_000.bin"), Format::LlmcU16, &text[..cut])?;
    shards::write(&d.join("kjv_val_000.bin"), Format::LlmcU16, &text[cut..])?;
    let glob = d.join("kjv_*.bin");
    let run = |extra: &[&str]| -> Result<std::process::Output> {
        Ok(std::process::Command::new(&bin)
            .arg("--data")
            .arg(&glob)
            .args([
                "--steps", "40", "--batch", "8", "--seq", "32", "--lr", "3e-3", "--warmup", "5",
                "--json",
            ])
            .args(extra)
            .output()?)
    };
    let out = run(&["--vocab", "600"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
    let (first, last) = (
        json["first_loss"].as_f64().unwrap_or(f64::NAN),
        json["final_loss"].as_f64().unwrap_or(f64::NAN),
    );
    assert!(last < first - 1.0, "{first} -> {last}");
    // the default vocabulary (256) is below the data's tokens: a clear error
    let out = run(&[])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let top = text.iter().max().copied().unwrap_or(0);
    assert!(
        err.contains("--vocab") && err.contains(&format!("token {top}")),
        "{err}"
    );
    Ok(())
}
