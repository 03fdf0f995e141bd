//! The rendezvous of the in-process backend: rounds of deposits under one
//! mutex, a timeout on every wait, and a group-wide failure that wakes
//! everyone.
//!
//! A collective is one round. Each rank deposits its call and tensors in
//! its slot; the last to arrive checks that the calls agree and publishes
//! the deposits. Every rank then computes its own result from them (outside
//! the lock) and waits until all ranks have finished reading, so that a
//! rank's inputs are never read after its call has returned. The first
//! failure (an error, a dropped communicator, a panic, a timeout, a
//! mismatch) is recorded once and turns every pending and later wait of
//! every rank into an error.

use super::agree::check_agree;
use super::deposit::Deposit;
use crate::error::{Error, Result};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How the group failed.
#[derive(Debug, Clone)]
pub(crate) enum FailureKind {
    /// A collective of that rank returned this error.
    Error(String),
    /// Its communicator was dropped (the rank left).
    Dropped,
    /// Its thread panicked.
    Panicked,
    /// It waited in vain for these ranks.
    Timeout { missing: Vec<usize> },
    /// The calls of one round disagreed (found by that rank, the last to arrive).
    Mismatch(String),
}

#[derive(Debug, Clone)]
struct Failure {
    rank: usize,
    round: u64,
    kind: FailureKind,
}

impl Failure {
    fn reason(&self) -> String {
        match &self.kind {
            FailureKind::Error(e) => format!("a collective returned an error: {e}"),
            FailureKind::Dropped => "its communicator was dropped (the rank left)".into(),
            FailureKind::Panicked => "its thread panicked".into(),
            FailureKind::Timeout { missing } => {
                format!("it timed out waiting for rank(s) {missing:?}")
            }
            FailureKind::Mismatch(d) => format!("ranks disagreed: {d}"),
        }
    }
}

struct State {
    /// The open round.
    round: u64,
    slots: Vec<Option<Deposit>>,
    /// The last completed round's deposits, in rank order.
    published: Option<Arc<[Deposit]>>,
    /// Ranks still reading `published`.
    reading: Vec<bool>,
    failure: Option<Failure>,
}

/// The state the ranks of one group share.
pub(crate) struct Group {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    cv: Condvar,
}

impl Group {
    pub(crate) fn new(world: usize, timeout: Duration) -> Self {
        Self {
            world,
            timeout,
            state: Mutex::new(State {
                round: 0,
                slots: (0..world).map(|_| None).collect(),
                published: None,
                reading: vec![false; world],
                failure: None,
            }),
            cv: Condvar::new(),
        }
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    /// The rank of the group's first failure, if any.
    pub(crate) fn first_failure(&self) -> Option<usize> {
        self.lock().failure.as_ref().map(|f| f.rank)
    }

    // ok: no code panics while holding the lock, so a poisoned state is
    // still consistent; the failure itself is recorded by the dropping rank.
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits on the condvar until `deadline`; returns false on timeout.
    fn wait<'a>(
        &self,
        guard: MutexGuard<'a, State>,
        deadline: Instant,
    ) -> (MutexGuard<'a, State>, bool) {
        let now = Instant::now();
        if now >= deadline {
            return (guard, false);
        }
        let (guard, _) = self
            .cv
            .wait_timeout(guard, deadline - now)
            .unwrap_or_else(PoisonError::into_inner);
        (guard, true)
    }

    /// Records the group's first failure and wakes every waiting rank.
    pub(crate) fn fail(&self, rank: usize, kind: FailureKind) {
        let mut st = self.lock();
        if st.failure.is_none() {
            let round = st.round;
            st.failure = Some(Failure { rank, round, kind });
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Fails the group with `err` (raised on `rank`) and returns it.
    pub(crate) fn fail_with(&self, rank: usize, err: Error) -> Error {
        if !matches!(err, Error::PeerFailed { .. } | Error::Timeout { .. }) {
            self.fail(rank, FailureKind::Error(err.to_string()));
        }
        err
    }

    /// The error a rank waiting in `round` reports for the group's failure.
    fn failure_error(
        &self,
        f: &Failure,
        op: &'static str,
        rank: usize,
        round: u64,
        since: Instant,
    ) -> Error {
        match &f.kind {
            FailureKind::Timeout { missing } if f.round == round && f.rank != rank => {
                Error::Timeout {
                    op,
                    rank,
                    missing: missing.clone(),
                    waited: since.elapsed(),
                }
            }
            FailureKind::Mismatch(detail) if f.round == round => Error::Mismatch {
                op,
                detail: detail.clone(),
            },
            _ => Error::PeerFailed {
                op,
                rank: f.rank,
                reason: f.reason(),
            },
        }
    }

    /// One collective: deposits `deposit` for `rank`, waits for all ranks,
    /// runs `read` on the deposits (in rank order) and waits until every
    /// rank has read them.
    pub(crate) fn round<R>(
        &self,
        rank: usize,
        deposit: Deposit,
        read: impl FnOnce(&[Deposit]) -> Result<R>,
    ) -> Result<R> {
        let op = deposit.op;
        let since = Instant::now();
        let deadline = since + self.timeout;
        let mut st = self.lock();
        if let Some(f) = &st.failure {
            let f = f.clone();
            return Err(self.failure_error(&f, op, rank, u64::MAX, since));
        }
        let my_round = st.round;
        let Some(slot) = st.slots.get_mut(rank) else {
            return Err(Error::InvalidArgument {
                op,
                what: format!("rank {rank} out of range"),
            });
        };
        if slot.is_some() {
            drop(st);
            let err = Error::InvalidArgument {
                op,
                what: format!(
                    "rank {rank} is already in a collective (one call at a time per rank)"
                ),
            };
            return Err(self.fail_with(rank, err));
        }
        *slot = Some(deposit);
        if st.slots.iter().all(Option::is_some) {
            let deposits: Vec<Deposit> = st.slots.iter_mut().filter_map(Option::take).collect();
            if let Err(detail) = check_agree(&deposits) {
                st.failure = Some(Failure {
                    rank,
                    round: my_round,
                    kind: FailureKind::Mismatch(detail.clone()),
                });
                drop(st);
                self.cv.notify_all();
                return Err(Error::Mismatch { op, detail });
            }
            st.published = Some(deposits.into());
            st.reading = vec![true; self.world];
            st.round += 1;
            self.cv.notify_all();
        } else {
            loop {
                if st.round > my_round {
                    break;
                }
                if let Some(f) = &st.failure {
                    let f = f.clone();
                    return Err(self.failure_error(&f, op, rank, my_round, since));
                }
                let (g, in_time) = self.wait(st, deadline);
                st = g;
                if !in_time && st.round == my_round && st.failure.is_none() {
                    let missing: Vec<usize> =
                        (0..self.world).filter(|&r| st.slots[r].is_none()).collect();
                    st.slots[rank] = None;
                    st.failure = Some(Failure {
                        rank,
                        round: my_round,
                        kind: FailureKind::Timeout {
                            missing: missing.clone(),
                        },
                    });
                    drop(st);
                    self.cv.notify_all();
                    return Err(Error::Timeout {
                        op,
                        rank,
                        missing,
                        waited: since.elapsed(),
                    });
                }
            }
        }
        let Some(published) = st.published.clone() else {
            // Unreachable by construction (the round was published); fail, do not panic.
            drop(st);
            let err = Error::InvalidArgument {
                op,
                what: "internal: completed round without deposits".into(),
            };
            return Err(self.fail_with(rank, err));
        };
        drop(st);
        let result = read(&published).map_err(|e| self.fail_with(rank, e));
        drop(published);
        self.finish_reading(rank, op)?;
        result
    }

    /// Marks `rank` done with the published round and waits for the others:
    /// their reads of this rank's inputs must end before it returns.
    fn finish_reading(&self, rank: usize, op: &'static str) -> Result<()> {
        let since = Instant::now();
        let deadline = since + self.timeout;
        let mut st = self.lock();
        st.reading[rank] = false;
        self.cv.notify_all();
        loop {
            // A failure after the round completed leaves this rank's result
            // valid: the next collective reports it.
            if st.failure.is_some() || st.reading.iter().all(|r| !r) {
                return Ok(());
            }
            let (g, in_time) = self.wait(st, deadline);
            st = g;
            if !in_time && st.failure.is_none() && st.reading.iter().any(|r| *r) {
                let missing: Vec<usize> = (0..self.world).filter(|&r| st.reading[r]).collect();
                let round = st.round;
                st.failure = Some(Failure {
                    rank,
                    round,
                    kind: FailureKind::Timeout {
                        missing: missing.clone(),
                    },
                });
                drop(st);
                self.cv.notify_all();
                return Err(Error::Timeout {
                    op,
                    rank,
                    missing,
                    waited: since.elapsed(),
                });
            }
        }
    }
}
