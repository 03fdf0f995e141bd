//! Bulk FP8 casts on one core, as bytes read plus written per second, beside
//! a plain copy of the same number of bytes in the same run.
//!
//! encode: reads 4 bytes (f32), writes 1 (code) per element;
//! decode: reads 1, writes 4; copy: `copy_from_slice` of 2.5 bytes per
//! element, so 5 bytes moved per element for all three.

use amp::Fp8Format;
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

fn inputs(n: usize) -> Vec<f32> {
    // Values across the whole E4M3 range, subnormals and saturation included.
    (0..n)
        .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 2f32.powi((i % 24) as i32 - 12) * 900.0)
        .collect()
}

fn cast(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_cast");
    for &n in &[1usize << 16, 1 << 22] {
        let bytes = 5 * n as u64;
        group.throughput(Throughput::Bytes(bytes));
        let src = inputs(n);
        let mut codes = vec![0u8; n];
        let mut out = vec![0f32; n];
        let copy_src = vec![7u8; 5 * n / 2];
        let mut copy_dst = vec![0u8; 5 * n / 2];
        group.bench_with_input(BenchmarkId::new("copy", n), &n, |b, _| {
            b.iter(|| copy_dst.copy_from_slice(black_box(&copy_src)))
        });
        group.bench_with_input(BenchmarkId::new("encode_e4m3", n), &n, |b, _| {
            b.iter(|| Fp8Format::E4M3.encode_slice(black_box(&src), &mut codes))
        });
        group.bench_with_input(BenchmarkId::new("decode_e4m3", n), &n, |b, _| {
            b.iter(|| Fp8Format::E4M3.decode_slice(black_box(&codes), &mut out))
        });
        group.bench_with_input(BenchmarkId::new("encode_scaled_e5m2", n), &n, |b, _| {
            b.iter(|| Fp8Format::E5M2.encode_scaled_slice(black_box(&src), 0.37, &mut codes))
        });
    }
    group.finish();
}

criterion_group!(benches, cast);
