//! The TCP rendezvous of the NCCL backend, without CUDA: ranks as threads
//! on 127.0.0.1 exchanging a fake 128-byte id.

use amp_comm::{rendezvous, Error, RendezvousConfig, UNIQUE_ID_BYTES};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// A port nobody listens on right now.
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn config(port: u16, timeout_ms: u64) -> RendezvousConfig {
    RendezvousConfig {
        timeout: Duration::from_millis(timeout_ms),
        ..RendezvousConfig::new("127.0.0.1", port)
    }
}

fn fake_id() -> [u8; UNIQUE_ID_BYTES] {
    std::array::from_fn(|i| (i * 37 + 11) as u8)
}

/// Runs `ranks` of a world of `world` as threads; each rank's result.
fn run(
    cfg: &RendezvousConfig,
    world: usize,
    ranks: impl IntoIterator<Item = usize>,
) -> Vec<(usize, amp_comm::Result<[u8; UNIQUE_ID_BYTES]>)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|r| {
                let cfg = cfg.clone();
                // Rank 0 starts last, so the others must retry their connects.
                s.spawn(move || {
                    if r == 0 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    (r, rendezvous(&cfg, r, world, || Ok(fake_id())))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn every_rank_gets_rank_zeros_id() {
    for world in [1, 2, 3, 5] {
        let cfg = config(free_port(), 20_000);
        for (r, id) in run(&cfg, world, 0..world) {
            assert_eq!(id.unwrap(), fake_id(), "world {world} rank {r}");
        }
    }
}

#[test]
fn world_of_one_opens_no_socket() {
    // Port 1 cannot be bound without privileges; a world of one never tries.
    let id = rendezvous(&config(1, 100), 0, 1, || Ok(fake_id())).unwrap();
    assert_eq!(id, fake_id());
}

#[test]
fn only_rank_zero_makes_the_id() {
    let cfg = config(free_port(), 20_000);
    let out = std::thread::scope(|s| {
        let peer = s.spawn(|| {
            rendezvous(&cfg, 1, 2, || -> amp_comm::Result<_> {
                panic!("rank 1 must not make an id")
            })
        });
        let root = rendezvous(&cfg, 0, 2, || Ok(fake_id()));
        (root.unwrap(), peer.join().unwrap().unwrap())
    });
    assert_eq!(out, (fake_id(), fake_id()));
}

#[test]
fn a_missing_rank_is_named_by_rank_zero() {
    let cfg = config(free_port(), 1_000);
    let start = Instant::now();
    let out = run(&cfg, 4, [0, 1, 3]);
    assert!(start.elapsed() < Duration::from_secs(10));
    for (r, res) in out {
        if r == 0 {
            match res {
                Err(Error::Timeout {
                    rank: 0,
                    missing,
                    waited,
                    ..
                }) => {
                    assert_eq!(missing, vec![2]);
                    assert!(waited >= Duration::from_millis(1_000));
                }
                other => panic!("rank 0: expected a timeout naming rank 2, got {other:?}"),
            }
        } else {
            assert_eq!(
                res.unwrap(),
                fake_id(),
                "rank {r} fetched before the deadline"
            );
        }
    }
}

#[test]
fn a_missing_rank_zero_is_named_by_the_others() {
    let cfg = config(free_port(), 500);
    let err = rendezvous(&cfg, 2, 3, || Ok(fake_id())).unwrap_err();
    match &err {
        Error::Timeout {
            rank: 2, missing, ..
        } => assert_eq!(missing, &vec![0]),
        other => panic!("expected a timeout naming rank 0, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("rendezvous") && msg.contains("[0]"), "{msg}");
}

#[test]
fn mismatched_world_sizes_fail_on_both_sides() {
    let cfg = config(free_port(), 10_000);
    let (root, peer) = std::thread::scope(|s| {
        let peer = s.spawn(|| rendezvous(&cfg, 1, 3, || Ok(fake_id())));
        let root = rendezvous(&cfg, 0, 2, || Ok(fake_id()));
        (root, peer.join().unwrap())
    });
    for (who, res) in [("rank 0", root), ("rank 1", peer)] {
        match res {
            Err(Error::Mismatch { detail, .. }) => {
                assert!(
                    detail.contains("WORLD_SIZE 3") && detail.contains("WORLD_SIZE 2"),
                    "{detail}"
                )
            }
            other => panic!("{who}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_claimed_twice_is_an_error() {
    let cfg = config(free_port(), 10_000);
    let out = run(&cfg, 3, [0, 1, 1]);
    let mismatches = out
        .iter()
        .filter(|(_, res)| matches!(res, Err(Error::Mismatch { .. })))
        .count();
    // Rank 0 and the second claimant of rank 1 both report it.
    assert_eq!(mismatches, 2, "{out:?}");
}

#[test]
fn another_protocol_version_is_refused() {
    let port = free_port();
    let cfg = config(port, 10_000);
    std::thread::scope(|s| {
        let root = s.spawn(|| rendezvous(&cfg, 0, 2, || Ok(fake_id())));
        let mut stream = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        };
        let mut hello = b"AMPR".to_vec();
        hello.push(99);
        hello.extend_from_slice(&1u32.to_le_bytes());
        hello.extend_from_slice(&2u32.to_le_bytes());
        stream.write_all(&hello).unwrap();
        let mut status = [0u8; 1];
        stream.read_exact(&mut status).unwrap();
        assert_eq!(status[0], 1, "refused");
        match root.join().unwrap() {
            Err(Error::Mismatch { detail, .. }) => {
                assert!(detail.contains("version 99"), "{detail}")
            }
            other => panic!("expected a version mismatch, got {other:?}"),
        }
    });
}

#[test]
fn strangers_are_ignored() {
    let port = free_port();
    let cfg = config(port, 20_000);
    let out = std::thread::scope(|s| {
        let root = s.spawn(|| rendezvous(&cfg, 0, 2, || Ok(fake_id())));
        // Something that is not a rank: connects, writes junk, leaves.
        loop {
            if let Ok(mut junk) = TcpStream::connect(("127.0.0.1", port)) {
                let _ = junk.write_all(b"GET / HTTP/1.0\r\n\r\n");
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let peer = rendezvous(&cfg, 1, 2, || Ok(fake_id()));
        (root.join().unwrap().unwrap(), peer.unwrap())
    });
    assert_eq!(out, (fake_id(), fake_id()));
}

#[test]
fn a_port_in_use_is_a_clear_error() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let err = rendezvous(&config(port, 1_000), 0, 2, || Ok(fake_id())).unwrap_err();
    match &err {
        Error::Rendezvous { detail, .. } => {
            assert!(detail.contains(&port.to_string()), "{detail}");
            assert!(detail.contains("AMP_RENDEZVOUS_PORT"), "{detail}");
        }
        other => panic!("expected a rendezvous error, got {other:?}"),
    }
}

#[test]
fn a_rank_outside_the_world_is_refused_locally() {
    let err = rendezvous(&config(free_port(), 100), 3, 3, || Ok(fake_id())).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
}
