//! `--tokenizer`: a Hugging Face `tokenizer.json` for raw text and for the
//! sample (issue 24): the codec against the file's own vocabulary, the
//! example training on a text file through it, and bad files refused with
//! the file named.

use crate::data::codec::Codec;
use crate::data::{self, Corpus, Split};
use anyhow::Result;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn dir(name: &str) -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("amp-tokenizer-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// A word-level `tokenizer.json` (whitespace and punctuation split) whose
/// vocabulary is `[UNK]` then the distinct words of `text`, sorted: a file
/// in Hugging Face's format written without the `tokenizers` crate.
fn word_tokenizer(text: &str, path: &Path) -> Result<Vec<String>> {
    let words: BTreeSet<&str> = text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let mut vocab = vec!["[UNK]".to_string()];
    vocab.extend(words.iter().map(|w| w.to_string()));
    let ids: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| (w.clone(), serde_json::json!(i)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": { "type": "Whitespace" },
        "post_processor": null,
        "decoder": null,
        "model": { "type": "WordLevel", "vocab": ids, "unk_token": "[UNK]" }
    });
    std::fs::write(path, serde_json::to_vec(&json)?)?;
    Ok(vocab)
}

/// The first `n` bytes of the bundled text, cut at a line.
fn text(n: usize) -> String {
    let s = String::from_utf8_lossy(&data::BUNDLED[..n]).into_owned();
    match s.rfind('\n') {
        Some(i) => s[..=i].to_string(),
        None => s,
    }
}

#[test]
fn a_tokenizer_json_encodes_and_decodes_by_its_vocabulary() -> Result<()> {
    let d = dir("codec")?;
    let t = text(20_000);
    let vocab = word_tokenizer(&t, &d.join("tokenizer.json"))?;
    let codec = Codec::from_file(&d.join("tokenizer.json"))?;
    assert_eq!(codec.vocab_size(), vocab.len());
    let ids = codec.encode(b"In the beginning God created")?;
    let words: Vec<&str> = ids.iter().map(|&i| vocab[i as usize].as_str()).collect();
    assert_eq!(words, ["In", "the", "beginning", "God", "created"]);
    // an unknown word is [UNK] (id 0); ids past the vocabulary (a model's
    // padded rows) are left out of the text
    assert_eq!(codec.encode(b"zzzqx")?, [0]);
    let mut padded = ids.clone();
    padded.push(vocab.len() as u32 + 7);
    assert_eq!(
        codec.decode(&padded)?,
        codec.decode(&ids)?,
        "a padded id decodes to nothing"
    );
    assert_eq!(codec.decode(&ids)?, "In the beginning God created");
    // the corpus of a text file, tokenized by it
    std::fs::write(d.join("text.txt"), &t)?;
    let c = Corpus::from_path_with(&d.join("text.txt"), &codec)?;
    let all = codec.encode(t.as_bytes())?;
    assert_eq!(c.len(Split::Train) + c.len(Split::Val), all.len());
    assert_eq!(c.max_token(), all.iter().copied().max().unwrap_or(0));
    Ok(())
}

#[test]
fn bad_tokenizer_files_are_errors_that_name_the_file() -> Result<()> {
    let d = dir("bad")?;
    let missing = d.join("missing.json");
    let e = format!("{:#}", Codec::from_file(&missing).unwrap_err());
    assert!(e.contains("missing.json"), "{e}");
    let junk = d.join("junk.json");
    std::fs::write(&junk, b"{\"model\": 3}")?;
    let e = format!("{:#}", Codec::from_file(&junk).unwrap_err());
    assert!(e.contains("junk.json") && e.contains("tokenizer"), "{e}");
    // text that is not UTF-8 cannot go through a tokenizer
    let t = text(5_000);
    word_tokenizer(&t, &d.join("tokenizer.json"))?;
    let codec = Codec::from_file(&d.join("tokenizer.json"))?;
    let e = format!("{:#}", codec.encode(&[b'a', 0xff, b'b']).unwrap_err());
    assert!(e.contains("UTF-8") && e.contains("tokenizer.json"), "{e}");
    Ok(())
}

#[test]
fn the_example_trains_on_text_through_a_tokenizer_and_samples_with_it() -> Result<()> {
    let Some(bin) = crate::example::example_bin() else {
        eprintln!("skipped: target/*/examples/gpt not built");
        return Ok(());
    };
    let d = dir("train")?;
    let t = text(60_000);
    let vocab = word_tokenizer(&t, &d.join("tokenizer.json"))?;
    std::fs::write(d.join("text.txt"), &t)?;
    let run = |extra: &[&str]| -> Result<std::process::Output> {
        Ok(std::process::Command::new(&bin)
            .arg("--data")
            .arg(d.join("text.txt"))
            .arg("--tokenizer")
            .arg(d.join("tokenizer.json"))
            .args([
                "--steps", "40", "--batch", "8", "--seq", "32", "--lr", "3e-3", "--warmup", "5",
                "--json",
            ])
            .args(extra)
            .output()?)
    };
    let out = run(&["--sample", "12", "--prompt", "And God said"])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let json: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
    let (first, last) = (
        json["first_loss"].as_f64().unwrap_or(f64::NAN),
        json["final_loss"].as_f64().unwrap_or(f64::NAN),
    );
    assert!(last < first - 1.0, "{first} -> {last}");
    // the vocabulary padded to a multiple of 64 by default
    let padded = vocab.len().div_ceil(64) * 64;
    assert_eq!(json["vocab"].as_u64(), Some(padded as u64), "{json}");
    // the sample is words of the vocabulary, after the prompt
    let sample = json["sample"].as_str().unwrap_or_default();
    assert!(sample.starts_with("And God said"), "{sample:?}");
    let words: BTreeSet<&str> = vocab.iter().map(String::as_str).collect();
    assert!(
        sample.split_whitespace().all(|w| words.contains(w)),
        "{sample:?}"
    );
    // (a sampled id of the padding decodes to nothing)
    assert!(sample.split_whitespace().count() > 3, "{sample:?}");
    // a --vocab below the tokenizer's is refused up front
    let out = run(&["--vocab", "256"])?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--vocab 256") && err.contains(&vocab.len().to_string()),
        "{err}"
    );
    Ok(())
}
