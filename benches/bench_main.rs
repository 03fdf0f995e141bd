//! Benchmarks: `cargo bench --bench bench_main` (criterion).
mod benchmarks;

criterion::criterion_main!(benchmarks::cast::benches);
