//! The GPT example end to end, single-process and data-parallel.
//! One test binary for these modules (one link instead of one each).
// `AmpOptimizer::backward_step(_owned)` are deprecated for `AmpContext::step`
// but kept, and these tests still check them.
#![allow(deprecated)]

// The example's own modules, compiled into this test: the code under test
// is the code users run. Parts only the CLI uses are dead here.
#[allow(dead_code)]
#[path = "../../examples/lm/block.rs"]
mod block;
#[allow(dead_code)]
#[path = "../../examples/lm/budget.rs"]
mod budget;
#[allow(dead_code)]
#[path = "../../examples/lm/config.rs"]
mod config;
#[allow(dead_code)]
#[path = "../../examples/lm/data/mod.rs"]
mod data;
#[path = "../gpt_common/mod.rs"]
mod gpt_common;
#[allow(dead_code)]
#[path = "../../examples/lm/heap.rs"]
mod heap;
#[allow(dead_code)]
#[path = "../../examples/gpt/hf.rs"]
mod hf;
#[allow(dead_code)]
#[path = "../../examples/lm/hf_io.rs"]
mod hf_io;
#[allow(dead_code)]
#[path = "../../examples/lm/init.rs"]
mod init;
#[allow(dead_code)]
#[path = "../../examples/gpt/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../../examples/lm/recompute.rs"]
mod recompute;
#[allow(dead_code)]
#[path = "../../examples/lm/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../../examples/lm/sample.rs"]
mod sample;
#[allow(dead_code)]
#[path = "../../examples/lm/summary.rs"]
mod summary;
#[allow(dead_code)]
#[path = "../../examples/lm/telemetry.rs"]
mod telemetry;
#[allow(dead_code)]
#[path = "../../examples/lm/train.rs"]
mod train;

mod distributed;
mod example;
mod hf_checkpoints;
mod hf_reference;
mod llama;
mod llama_reference;
mod memory;
mod recomputation;
mod shards;
mod telemetry_run;
mod tokenizer;
