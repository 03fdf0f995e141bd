//! The agreement of a group's ranks on a checkpoint operation: each rank
//! reports its outcome, and every rank fails when any did, so that none is
//! left waiting in a later collective.

use super::err;
use crate::error::Result;
use amp_comm::Communicator;
use candle_core::{Device, Tensor};
use std::path::Path;

/// Every rank's `bytes` (all of one length), in rank order.
pub(crate) fn exchange(comm: &dyn Communicator, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let t = Tensor::from_slice(bytes, bytes.len(), comm.device())?;
    Ok(comm.all_gather(&t)?.to_device(&Device::Cpu)?.to_vec2()?)
}

/// How much of a failed rank's error message the others receive.
const MESSAGE_BYTES: usize = 512;

/// `local`, this rank's outcome of a checkpoint operation on `path`, once
/// every rank of the group has reported its own: this rank's error, or the
/// first failed rank's (its message, up to 512 bytes, after `failed(rank)`
/// saying what it could not do), or `local`'s value when all succeeded.
/// Every rank calls it, so that none is left waiting in a later collective.
///
/// # Errors
/// As described; the communicator's when the group is broken.
pub(crate) fn agree<T>(
    comm: &dyn Communicator,
    path: &Path,
    local: Result<T>,
    failed: impl Fn(usize) -> String,
) -> Result<T> {
    // [ok, message bytes (zero-padded)]
    let mut mine = vec![0u8; 1 + MESSAGE_BYTES];
    match &local {
        Ok(_) => mine[0] = 1,
        Err(e) => {
            let msg = e.to_string();
            let mut end = msg.len().min(MESSAGE_BYTES);
            while !msg.is_char_boundary(end) {
                end -= 1;
            }
            mine[1..=end].copy_from_slice(&msg.as_bytes()[..end]);
        }
    }
    let all = exchange(comm, &mine);
    let value = local?;
    let all = all?;
    match all.iter().position(|m| m.first() != Some(&1)) {
        Some(r) => {
            let msg = all[r].get(1..).unwrap_or_default();
            let msg = String::from_utf8_lossy(msg);
            Err(err(
                path,
                format!("{}: {}", failed(r), msg.trim_end_matches('\0')),
            ))
        }
        None => Ok(value),
    }
}
