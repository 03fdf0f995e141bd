//! amp-comm through its public API: the collectives of the in-process
//! backend, its failures (a rank that errors, panics or never arrives),
//! the FP8 all-reduce, its ZeRO halves and its bucketed form, and the TCP
//! rendezvous.
//! One test binary for these modules (one link instead of one each).

mod collectives;
mod failures;
mod fp8_all_reduce;
mod fp8_bucket;
mod fp8_zero_bucket;
mod rendezvous;
mod rng;
