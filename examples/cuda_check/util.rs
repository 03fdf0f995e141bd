//! The data of `cuda_check`'s benches and of the GPU tests (which include
//! this file): a small reproducible generator.

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
    /// Values over many decades with zeros, subnormals, infinities and NaNs
    /// (the GPU tests' inputs; the benches do not use them).
    #[allow(dead_code)]
    pub fn values(&mut self, n: usize, decades: f64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let r = self.next_u64();
                match r % 200 {
                    0 => f32::NAN,
                    1 => -f32::NAN,
                    2 => f32::INFINITY,
                    3 => f32::NEG_INFINITY,
                    4 => 0.0,
                    5 => -0.0,
                    6 => f32::from_bits((r >> 16) as u32 & 0x807F_FFFF),
                    _ => {
                        let sign = if r & (1 << 40) != 0 { -1.0 } else { 1.0 };
                        (sign * 10f64.powf((self.unit() - 0.5) * 2.0 * decades)) as f32
                    }
                }
            })
            .collect()
    }
    /// Normal-ish values (sum of uniforms), finite.
    pub fn normal(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| ((0..4).map(|_| self.unit()).sum::<f64>() - 2.0) as f32 * 1.7)
            .collect()
    }
}
