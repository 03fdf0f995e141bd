//! amp-comm through its public API: the collectives of the in-process
//! backend, its failures (a rank that errors, panics or never arrives),
//! the FP8 all-reduce and its ZeRO halves, and the TCP rendezvous.
//! One test binary for these modules (one link instead of one each).

mod collectives;
mod failures;
mod fp8_all_reduce;
mod rendezvous;
