//! What a rank brings to one round of the in-process group: the collective
//! it called and its tensors.

use crate::communicator::ReduceOp;
use candle_core::Tensor;

/// What a rank asks for in one round; every rank of a round must ask the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    ReduceScatter(ReduceOp),
    AllGather,
    AllGatherShards { len: usize },
    Broadcast { root: usize },
    AllToAll,
    Barrier,
}

/// One rank's part of a round.
#[derive(Debug)]
pub(crate) struct Deposit {
    pub op: &'static str,
    pub call: Call,
    pub tensors: Vec<Tensor>,
}
