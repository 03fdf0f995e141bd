// The shared modules of the GPT and Llama examples, declared at each
// example's root by `include!("../lm/modules.rs")` (their paths are
// relative to the example's folder); the example declares its own `model`
// and `hf` beside them.

#[path = "../lm/block.rs"]
mod block;
#[path = "../lm/budget.rs"]
mod budget;
#[path = "../lm/config.rs"]
mod config;
#[path = "../lm/cli.rs"]
mod cli;
#[path = "../lm/data/mod.rs"]
mod data;
#[path = "../lm/heap.rs"]
mod heap;
#[path = "../lm/hf_io.rs"]
mod hf_io;
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
