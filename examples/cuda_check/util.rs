//! The benches' data: a small reproducible generator.

/// xorshift64*: reproducible data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Normal-ish values (sum of uniforms), finite.
    pub fn normal(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| ((0..4).map(|_| self.unit()).sum::<f64>() - 2.0) as f32 * 1.7)
            .collect()
    }
}
