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

#[path = "../lm/budget.rs"]
mod budget;
#[path = "../lm/cli.rs"]
mod cli;
#[path = "../lm/data/mod.rs"]
mod data;
#[path = "../lm/heap.rs"]
mod heap;
#[path = "../lm/init.rs"]
mod init;
#[path = "../lm/launch.rs"]
mod launch;
#[path = "../lm/recompute.rs"]
mod recompute;
#[path = "../lm/report.rs"]
mod report;
#[path = "../lm/sample.rs"]
mod sample;
#[path = "../lm/summary.rs"]
mod summary;
#[path = "../lm/telemetry.rs"]
mod telemetry;
#[path = "../lm/train.rs"]
mod train;

/// The heap counted, so that a CPU run reports its memory (`heap.rs`).
#[global_allocator]
static HEAP: heap::Counting = heap::Counting;

fn main() -> anyhow::Result<()> {
    cli::main()
}
