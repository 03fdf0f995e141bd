//! A rank that fails (returns an error, panics, never arrives) is reported
//! by every other rank as an error within the timeout: never a hang.

use amp_comm::{
    run_ranks_each, run_ranks_with, Communicator, Error, InProcessComm, InProcessConfig,
};
use candle_core::{DType, Device, Tensor};
use std::thread;
use std::time::{Duration, Instant};

/// The tests' timeout: short, and well above the time a failure takes to
/// reach the other ranks (no sleeping until the timeout).
const TIMEOUT: Duration = Duration::from_secs(2);

fn config(timeout: Duration) -> InProcessConfig {
    InProcessConfig { timeout }
}

fn grad() -> Tensor {
    Tensor::ones(7, DType::F32, &Device::Cpu).unwrap()
}

/// One step: two all-reduces; rank `bad` leaves with an error before the second.
fn step_with_failing_rank(comm: InProcessComm, bad: usize) -> Result<Duration, Error> {
    comm.all_reduce_sum(&grad())?;
    if comm.rank() == bad {
        // Let the others enter the second collective first: they are pending.
        thread::sleep(Duration::from_millis(100));
        return Err(Error::InvalidArgument {
            op: "test",
            what: "rank gave up".into(),
        });
    }
    let start = Instant::now();
    comm.all_reduce_sum(&grad())?;
    Ok(start.elapsed())
}

#[test]
fn a_rank_that_returns_an_error_fails_every_pending_collective() {
    let start = Instant::now();
    let out = run_ranks_each(4, &config(TIMEOUT), |comm| step_with_failing_rank(comm, 2)).unwrap();
    assert!(start.elapsed() < TIMEOUT, "took {:?}", start.elapsed());
    assert!(matches!(
        out[2],
        Err(Error::InvalidArgument { op: "test", .. })
    ));
    for r in [0, 1, 3] {
        match &out[r] {
            Err(Error::PeerFailed { op, rank, reason }) => {
                assert_eq!((*op, *rank), ("all_reduce", 2), "rank {r}");
                assert!(reason.contains("dropped"), "rank {r}: {reason}");
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn run_ranks_returns_the_failing_ranks_own_error() {
    let err =
        run_ranks_with(3, &config(TIMEOUT), |comm| step_with_failing_rank(comm, 1)).unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { op: "test", .. }),
        "{err}"
    );
}

#[test]
fn a_rank_that_panics_fails_every_other_rank() {
    let start = Instant::now();
    let out = run_ranks_each(3, &config(TIMEOUT), |comm| {
        comm.all_reduce_sum(&grad())?;
        if comm.rank() == 0 {
            thread::sleep(Duration::from_millis(100));
            panic!("rank 0 blew up mid-step");
        }
        comm.all_reduce_sum(&grad())?;
        comm.barrier()
    })
    .unwrap();
    assert!(start.elapsed() < TIMEOUT, "took {:?}", start.elapsed());
    match &out[0] {
        Err(Error::Panicked { rank: 0, message }) => assert!(message.contains("blew up")),
        other => panic!("rank 0: {other:?}"),
    }
    for r in [1, 2] {
        match &out[r] {
            Err(Error::PeerFailed {
                rank: 0, reason, ..
            }) => {
                assert!(reason.contains("panicked"), "rank {r}: {reason}")
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_never_arrives_is_named_by_the_timeout() {
    let timeout = Duration::from_millis(300);
    let out = run_ranks_each(3, &config(timeout), |comm| {
        let start = Instant::now();
        if comm.rank() == 1 {
            // Arrives long after the others gave up.
            thread::sleep(timeout * 3);
        }
        let err = comm.barrier().err();
        Ok::<_, Error>((err, start.elapsed()))
    })
    .unwrap();
    for r in [0, 2] {
        let (err, waited) = out[r].as_ref().unwrap();
        match err {
            Some(
                e @ Error::Timeout {
                    op: "barrier",
                    rank,
                    missing,
                    ..
                },
            ) => {
                assert_eq!((*rank, missing.as_slice()), (r, &[1][..]), "{e}");
                assert!(e.to_string().contains("[1]"), "{e}");
            }
            other => panic!("rank {r}: {other:?}"),
        }
        assert!(*waited < TIMEOUT, "rank {r}: {waited:?}");
    }
    // The first rank whose timeout expires breaks the group; it waited the
    // full timeout, the other waiting rank (which arrived later) a little less.
    let longest = [0, 2].map(|r| out[r].as_ref().unwrap().1).into_iter().max();
    assert!(longest >= Some(timeout), "{longest:?}");
    // The late rank learns that the group broke without it.
    match &out[1].as_ref().unwrap().0 {
        Some(Error::PeerFailed { reason, .. }) => assert!(reason.contains("[1]"), "{reason}"),
        other => panic!("rank 1: {other:?}"),
    }
}

#[test]
fn after_a_failure_every_later_collective_fails_at_once() {
    let out = run_ranks_each(2, &config(TIMEOUT), |comm| {
        if comm.rank() == 1 {
            comm.abort("test abort");
            return Ok(Vec::new());
        }
        thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        let errs = vec![
            comm.barrier().err(),
            comm.all_reduce_sum(&grad()).err(),
            comm.all_gather(&grad()).err(),
        ];
        assert!(start.elapsed() < Duration::from_millis(500));
        Ok::<_, Error>(errs)
    })
    .unwrap();
    for e in out[0].as_ref().unwrap() {
        match e {
            Some(Error::PeerFailed {
                rank: 1, reason, ..
            }) => {
                assert!(reason.contains("test abort"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn ranks_that_finish_together_do_not_fail() {
    // Dropping communicators after the last collective is the normal end.
    for _ in 0..20 {
        let out = run_ranks_each(4, &config(TIMEOUT), |comm| {
            comm.barrier()?;
            comm.all_reduce_sum(&grad())
        })
        .unwrap();
        assert!(out.iter().all(Result::is_ok));
    }
}
