//! The TCP rendezvous that hands the NCCL unique id from rank 0 to the
//! other ranks (docs/ARCHITECTURE.md, "Launch and rendezvous"). Needs no CUDA: it moves 128 opaque bytes.
//!
//! Rank 0 listens on [`RendezvousConfig::addr`]`:`[`port`](RendezvousConfig::port)
//! and serves the id to each of the other `world - 1` ranks once; the
//! others connect (retrying until the deadline, since rank 0 may start
//! later) and read it. Every wait is bounded by
//! [`RendezvousConfig::timeout`]: rank 0 names the ranks that never came,
//! the others name rank 0 ([`Error::Timeout`]).
//!
//! Wire format (integers little-endian):
//! - peer to rank 0: `b"AMPR"`, version byte [`PROTOCOL_VERSION`], rank
//!   (`u32`), world size (`u32`);
//! - rank 0 to peer: `0` and the 128 id bytes, or `1`, a `u16` length and
//!   a UTF-8 message (a version or world size that differs from rank 0's,
//!   a rank out of range or already served: [`Error::Mismatch`] on both
//!   sides);
//! - peer to rank 0: one byte `0xAC`, the acknowledgement; rank 0 counts
//!   a rank as served only then.

use crate::error::{Error, Result};
use crate::launch::RendezvousConfig;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// The size of an NCCL unique id.
pub const UNIQUE_ID_BYTES: usize = 128;

/// The version byte of the wire format.
pub const PROTOCOL_VERSION: u8 = 1;

const MAGIC: &[u8; 4] = b"AMPR";
const ACK: u8 = 0xAC;
const OP: &str = "rendezvous";
const RETRY: Duration = Duration::from_millis(50);

/// Hands rank 0's id to every rank: rank 0 calls `make_id` once, serves
/// its bytes to the `world - 1` other ranks and returns them once all have
/// fetched them; the other ranks fetch and return them. With `world == 1`
/// no socket is opened.
///
/// # Errors
/// [`Error::Timeout`] when the other ranks (on rank 0) or rank 0 (on the
/// others) do not arrive within `cfg.timeout`; [`Error::Mismatch`] when a
/// peer's protocol version or world size differs from rank 0's, or two
/// peers claim one rank; [`Error::Rendezvous`] when the port cannot be
/// bound or a peer does not speak the protocol; [`Error::InvalidArgument`]
/// for a rank not below `world`; and `make_id`'s error.
pub fn rendezvous(
    cfg: &RendezvousConfig,
    rank: usize,
    world: usize,
    make_id: impl FnOnce() -> Result<[u8; UNIQUE_ID_BYTES]>,
) -> Result<[u8; UNIQUE_ID_BYTES]> {
    if rank >= world {
        return Err(Error::InvalidArgument {
            op: OP,
            what: format!("rank {rank} is not below the world size {world}"),
        });
    }
    if rank == 0 {
        let id = make_id()?;
        if world > 1 {
            serve(cfg, world, &id)?;
        }
        Ok(id)
    } else {
        fetch(cfg, rank, world)
    }
}

fn io_error(what: String, e: &std::io::Error) -> Error {
    Error::Rendezvous {
        op: OP,
        detail: format!("{what}: {e}"),
    }
}

fn resolve(cfg: &RendezvousConfig) -> std::io::Result<Vec<SocketAddr>> {
    Ok((cfg.addr.as_str(), cfg.port).to_socket_addrs()?.collect())
}

/// Binds `cfg.addr:cfg.port`, or every interface on that port when the
/// address is not one of this host's (MASTER_ADDR as the others see it).
fn bind(cfg: &RendezvousConfig) -> Result<TcpListener> {
    let name = format!("{}:{}", cfg.addr, cfg.port);
    let addrs = resolve(cfg).map_err(|e| io_error(format!("cannot resolve {name}"), &e))?;
    let mut last = None;
    for addr in &addrs {
        match TcpListener::bind(addr) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    match last {
        Some(e) if e.kind() != ErrorKind::AddrNotAvailable => Err(io_error(
            format!("rank 0 cannot listen on {name} (AMP_RENDEZVOUS_PORT)"),
            &e,
        )),
        _ => TcpListener::bind(("0.0.0.0", cfg.port)).map_err(|e| {
            io_error(
                format!(
                    "rank 0 cannot listen on port {} (AMP_RENDEZVOUS_PORT)",
                    cfg.port
                ),
                &e,
            )
        }),
    }
}

/// What became of one connection to rank 0.
enum Served {
    /// The rank fetched the id and acknowledged it.
    Rank(usize),
    /// Not a peer of ours, or one that went away: ignored.
    Ignored,
}

fn serve(cfg: &RendezvousConfig, world: usize, id: &[u8; UNIQUE_ID_BYTES]) -> Result<()> {
    let listener = bind(cfg)?;
    serve_on(&listener, cfg.timeout, world, id)
}

pub(crate) fn serve_on(
    listener: &TcpListener,
    timeout: Duration,
    world: usize,
    id: &[u8; UNIQUE_ID_BYTES],
) -> Result<()> {
    let start = Instant::now();
    let deadline = start + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| io_error("rank 0: listener".into(), &e))?;
    let mut served = vec![false; world];
    served[0] = true;
    while served.iter().any(|s| !s) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Served::Rank(r) = serve_one(stream, deadline, world, id, &served)? {
                    served[r] = true;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        op: OP,
                        rank: 0,
                        missing: (0..world).filter(|&r| !served[r]).collect(),
                        waited: start.elapsed(),
                    });
                }
                std::thread::sleep(RETRY.min(deadline.saturating_duration_since(Instant::now())));
            }
            Err(e) => return Err(io_error("rank 0: accept".into(), &e)),
        }
    }
    Ok(())
}

fn set_timeouts(stream: &TcpStream, deadline: Instant) -> std::io::Result<()> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(10));
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))
}

fn refuse(stream: &mut TcpStream, message: &str) {
    let bytes = message.as_bytes();
    let len = bytes.len().min(u16::MAX as usize);
    let mut reply = vec![1u8];
    reply.extend_from_slice(&(len as u16).to_le_bytes());
    reply.extend_from_slice(&bytes[..len]);
    // The peer may be gone already: the error is ours to report anyway.
    let _ = stream.write_all(&reply);
}

fn serve_one(
    mut stream: TcpStream,
    deadline: Instant,
    world: usize,
    id: &[u8; UNIQUE_ID_BYTES],
    served: &[bool],
) -> Result<Served> {
    if set_timeouts(&stream, deadline).is_err() {
        return Ok(Served::Ignored);
    }
    let mut hello = [0u8; 13];
    if stream.read_exact(&mut hello).is_err() || &hello[..4] != MAGIC {
        return Ok(Served::Ignored);
    }
    let version = hello[4];
    let word = |i: usize| u32::from_le_bytes([hello[i], hello[i + 1], hello[i + 2], hello[i + 3]]);
    let (rank, peer_world) = (word(5) as usize, word(9) as usize);
    let problem = if version != PROTOCOL_VERSION {
        Some(format!(
            "rank {rank} speaks rendezvous protocol version {version}, rank 0 version {PROTOCOL_VERSION}"
        ))
    } else if peer_world != world {
        Some(format!(
            "rank {rank} has WORLD_SIZE {peer_world}, rank 0 has WORLD_SIZE {world}"
        ))
    } else if rank == 0 || rank >= world {
        Some(format!(
            "a peer claims rank {rank}, which is not in 1..{world}"
        ))
    } else if served[rank] {
        Some(format!("two processes claim rank {rank}"))
    } else {
        None
    };
    if let Some(detail) = problem {
        refuse(&mut stream, &detail);
        return Err(Error::Mismatch { op: OP, detail });
    }
    let mut reply = [0u8; 1 + UNIQUE_ID_BYTES];
    reply[1..].copy_from_slice(id);
    let mut ack = [0u8; 1];
    if stream.write_all(&reply).is_err() || stream.read_exact(&mut ack).is_err() || ack[0] != ACK {
        // The peer went away before acknowledging: it reports its own error
        // and this rank counts it as missing until it comes back.
        return Ok(Served::Ignored);
    }
    Ok(Served::Rank(rank))
}

fn fetch(cfg: &RendezvousConfig, rank: usize, world: usize) -> Result<[u8; UNIQUE_ID_BYTES]> {
    let start = Instant::now();
    let deadline = start + cfg.timeout;
    let name = format!("{}:{}", cfg.addr, cfg.port);
    let timeout = || Error::Timeout {
        op: OP,
        rank,
        missing: vec![0],
        waited: start.elapsed(),
    };
    let mut stream = loop {
        // Resolved at every try: the name may appear late (a starting node).
        let attempt = resolve(cfg).and_then(|addrs| {
            let mut last = std::io::Error::new(ErrorKind::NotFound, "no address");
            for addr in addrs {
                let left = deadline.saturating_duration_since(Instant::now());
                match TcpStream::connect_timeout(
                    &addr,
                    left.clamp(Duration::from_millis(10), Duration::from_secs(1)),
                ) {
                    Ok(s) => return Ok(s),
                    Err(e) => last = e,
                }
            }
            Err(last)
        });
        match attempt {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(RETRY),
            Err(_) => return Err(timeout()),
        }
    };
    let fail = |e: &std::io::Error| {
        if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) {
            timeout()
        } else {
            io_error(
                format!("rank {rank}: reading the NCCL id from rank 0 at {name}"),
                e,
            )
        }
    };
    set_timeouts(&stream, deadline).map_err(|e| fail(&e))?;
    let mut hello = Vec::with_capacity(13);
    hello.extend_from_slice(MAGIC);
    hello.push(PROTOCOL_VERSION);
    hello.extend_from_slice(&u32::try_from(rank).unwrap_or(u32::MAX).to_le_bytes());
    hello.extend_from_slice(&u32::try_from(world).unwrap_or(u32::MAX).to_le_bytes());
    stream.write_all(&hello).map_err(|e| fail(&e))?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).map_err(|e| fail(&e))?;
    match status[0] {
        0 => {
            let mut id = [0u8; UNIQUE_ID_BYTES];
            stream.read_exact(&mut id).map_err(|e| fail(&e))?;
            stream.write_all(&[ACK]).map_err(|e| fail(&e))?;
            Ok(id)
        }
        1 => {
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).map_err(|e| fail(&e))?;
            let mut msg = vec![0u8; u16::from_le_bytes(len) as usize];
            stream.read_exact(&mut msg).map_err(|e| fail(&e))?;
            Err(Error::Mismatch {
                op: OP,
                detail: format!(
                    "rank 0 refused rank {rank}: {}",
                    String::from_utf8_lossy(&msg)
                ),
            })
        }
        other => Err(Error::Rendezvous {
            op: OP,
            detail: format!(
                "rank {rank}: {name} answered status byte {other}: not a candle-amp rendezvous \
                 (is AMP_RENDEZVOUS_PORT another service's port?)"
            ),
        }),
    }
}
