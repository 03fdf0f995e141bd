//! The GPT example end to end, single-process and data-parallel.
//! One test binary for these modules (one link instead of one each).
// `AmpOptimizer::backward_step(_owned)` are deprecated for `AmpContext::step`
// but kept, and these tests still check them.
#![allow(deprecated)]

// The example's own modules, compiled into this test: the code under test
// is the code users run. Parts only the CLI uses are dead here.
#[allow(dead_code)]
#[path = "../../examples/gpt/budget.rs"]
mod budget;
#[allow(dead_code)]
#[path = "../../examples/gpt/data/mod.rs"]
mod data;
#[path = "../gpt_common/mod.rs"]
mod gpt_common;
#[allow(dead_code)]
#[path = "../../examples/gpt/heap.rs"]
mod heap;
#[allow(dead_code)]
#[path = "../../examples/gpt/hf.rs"]
mod hf;
#[allow(dead_code)]
#[path = "../../examples/gpt/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../../examples/gpt/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../../examples/gpt/sample.rs"]
mod sample;
#[allow(dead_code)]
#[path = "../../examples/gpt/summary.rs"]
mod summary;
#[allow(dead_code)]
#[path = "../../examples/gpt/telemetry.rs"]
mod telemetry;
#[allow(dead_code)]
#[path = "../../examples/gpt/train.rs"]
mod train;

mod distributed;
mod example;
mod hf_checkpoints;
mod hf_reference;
mod memory;
mod recompute;
mod shards;
mod telemetry_run;
mod tokenizer;
