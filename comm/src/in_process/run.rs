//! Running `N` ranks as scoped threads.

use super::{InProcessComm, InProcessConfig};
use crate::error::Error;
use std::any::Any;

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".into()
    }
}

/// Runs `f` on `world` ranks, each on its own thread with its own
/// communicator, and returns every rank's result in rank order.
///
/// Uses the default [`InProcessConfig`] (60 s timeout). `E` is the
/// closure's error type (any type an [`Error`] converts into); write
/// `Ok::<_, amp_comm::Error>(..)` where the compiler cannot infer it.
///
/// # Errors
/// When a rank fails, the error of the rank that failed first (the cause,
/// not the other ranks' [`Error::PeerFailed`]); a panic becomes
/// [`Error::Panicked`].
pub fn run_ranks<T, E, F>(world: usize, f: F) -> Result<Vec<T>, E>
where
    T: Send,
    E: From<Error> + Send,
    F: Fn(InProcessComm) -> Result<T, E> + Sync,
{
    run_ranks_with(world, &InProcessConfig::default(), f)
}

/// [`run_ranks`] with `config`.
///
/// # Errors
/// As [`run_ranks`].
pub fn run_ranks_with<T, E, F>(world: usize, config: &InProcessConfig, f: F) -> Result<Vec<T>, E>
where
    T: Send,
    E: From<Error> + Send,
    F: Fn(InProcessComm) -> Result<T, E> + Sync,
{
    let (results, cause) = run_all(world, config, f)?;
    let mut values = Vec::with_capacity(world);
    let (mut first_err, mut cause_err) = (None, None);
    for (rank, res) in results.into_iter().enumerate() {
        match res {
            Ok(v) => values.push(v),
            Err(e) if Some(rank) == cause => cause_err = Some(e),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match cause_err.or(first_err) {
        Some(e) => Err(e),
        None => Ok(values),
    }
}

/// As [`run_ranks_with`], but returns every rank's own result (the tests
/// of failure handling look at each).
///
/// # Errors
/// [`Error::InvalidArgument`] when `world` is 0.
pub fn run_ranks_each<T, E, F>(
    world: usize,
    config: &InProcessConfig,
    f: F,
) -> Result<Vec<Result<T, E>>, Error>
where
    T: Send,
    E: From<Error> + Send,
    F: Fn(InProcessComm) -> Result<T, E> + Sync,
{
    Ok(run_all(world, config, f)?.0)
}

type Outcome<T, E> = (Vec<Result<T, E>>, Option<usize>);

fn run_all<T, E, F>(world: usize, config: &InProcessConfig, f: F) -> Result<Outcome<T, E>, Error>
where
    T: Send,
    E: From<Error> + Send,
    F: Fn(InProcessComm) -> Result<T, E> + Sync,
{
    let comms = InProcessComm::group_with(world, config)?;
    let group = comms.first().map(InProcessComm::shared);
    let f = &f;
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::Builder::new()
                    .name(format!("amp-rank-{rank}"))
                    .spawn_scoped(scope, move || f(comm))
                    .map_err(|e| (rank, e))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => match h.join() {
                    Ok(res) => res,
                    Err(payload) => Err(E::from(Error::Panicked {
                        rank,
                        message: panic_message(payload.as_ref()),
                    })),
                },
                Err((rank, e)) => Err(E::from(Error::InvalidArgument {
                    op: "run_ranks",
                    what: format!("could not start the thread of rank {rank}: {e}"),
                })),
            })
            .collect::<Vec<_>>()
    });
    let cause = group.and_then(|g| g.first_failure());
    Ok((results, cause))
}
