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

include!("../lm/modules.rs");

fn main() -> anyhow::Result<()> {
    cli::main()
}
