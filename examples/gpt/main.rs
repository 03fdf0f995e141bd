//! Train a small GPT on the bundled corpus at any level, or compare levels
//! side by side: the README's main job. The command line and the training
//! loop are the ones the Llama example shares (`examples/lm`); this
//! example adds the GPT (`model.rs`) and GPT-2's Hugging Face layout
//! (`hf.rs`).
//!
//! ```sh
//! cargo run --release --example gpt                              # O0, tiny, CPU
//! cargo run --release --example gpt -- --level O2 --sample 200
//! cargo run --release --example gpt -- --compare O0,O1,O2,O3     # out/compare.md, loss.svg, memory.svg
//! cargo run --release --example gpt -- --level O3 --world-size 4  # 4 ranks as threads, ZeRO
//! torchrun --no-python --nproc-per-node 2 target/release/examples/gpt --device cuda --level O2
//! ```

mod hf;
mod model;

include!("../lm/modules.rs");

fn main() -> anyhow::Result<()> {
    cli::main()
}
