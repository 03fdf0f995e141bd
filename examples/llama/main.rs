//! Train a small Llama-style decoder on the bundled corpus at any level,
//! or compare levels side by side, with the GPT example's flags: the
//! command line and the training loop are the ones the GPT example uses
//! (`examples/lm`); this example adds the Llama (`model.rs`: RMSNorm,
//! rotary positions, grouped-query attention, SwiGLU) and Hugging Face's
//! Llama layout (`hf.rs`).
//!
//! ```sh
//! cargo run --release --example llama                              # O0, tiny, CPU
//! cargo run --release --example llama -- --compare O0,O1,O2,O3     # out/compare.md, loss.svg, memory.svg
//! cargo run --release --example llama -- --device cuda --size 1b --vocab 128256 --batch 8 --seq 2048 --level O2
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
