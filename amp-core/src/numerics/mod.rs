//! The numerics, amp-core's lowest layer: the FP8 formats with exact OCP
//! semantics and their bulk codecs, what a scaled tensor stores
//! ([`QType`](qtype::QType)), the scale rules of Transformer Engine and
//! MS-AMP, the recipes and the config parsing behind them, the kernel
//! mechanism every op of the project plugs into, and the kernels on raw
//! storages: scaled casts (per tensor and per tile), the cast-transpose, requantize, the transpose,
//! scalar gathers, a device-to-host read that waits only when read.
//! `cuda` holds the CUDA bodies of those kernels (and of
//! the scaling layer's) and the device plumbing the other layers'
//! launchers share. Imports nothing of the layers above.

pub(crate) mod block;
pub(crate) mod bucket;
pub(crate) mod bulk;
pub(crate) mod capability;
pub(crate) mod cast;
pub(crate) mod cast_t;
pub(crate) mod clock;
pub mod config;
pub(crate) mod counts;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub(crate) mod cuda;
pub(crate) mod decode_sum;
pub(crate) mod format;
pub mod kernel;
pub(crate) mod qtype;
pub(crate) mod readback;
pub(crate) mod recipe;
pub(crate) mod requantize;
pub(crate) mod scalars;
pub(crate) mod scale;
pub(crate) mod stream;
pub(crate) mod transpose;
