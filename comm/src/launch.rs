//! The launch environment of one process of a multi-process group, read
//! as `torchrun` sets it (docs/ARCHITECTURE.md, "Launch and rendezvous"): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`; and where the NCCL unique id is handed
//! out: `AMP_RENDEZVOUS_PORT` (default `MASTER_PORT + 1`, since torchrun's
//! own agent listens on `MASTER_PORT`) and `AMP_RENDEZVOUS_TIMEOUT_S`
//! (default 300).
//!
//! Both readers take a lookup function as well as the process environment
//! (`from_lookup`), so tests and launchers can pass variables without
//! touching the environment.

use crate::error::{Error, Result};
use std::time::Duration;

/// How long the rendezvous waits for the other ranks by default.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

const OP: &str = "LaunchEnv";

/// One process's place in the group, as `torchrun` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// `RANK`: this process, in `0..world_size`.
    pub rank: usize,
    /// `WORLD_SIZE`: the number of processes, at least 1.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process on its node; the NCCL backend runs on
    /// `cuda:LOCAL_RANK`.
    pub local_rank: usize,
    /// `MASTER_ADDR`: the host of rank 0.
    pub master_addr: String,
    /// `MASTER_PORT`: torchrun's own port on rank 0's host.
    pub master_port: u16,
}

fn read(
    op: &'static str,
    get: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<String> {
    match get(var) {
        Some(v) if !v.trim().is_empty() => Ok(v.trim().to_owned()),
        Some(_) => Err(Error::Env {
            op,
            var,
            what: "is empty".into(),
        }),
        None => Err(Error::Env {
            op,
            var,
            what: "is not set (launch with torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, \
                   MASTER_ADDR and MASTER_PORT)"
                .into(),
        }),
    }
}

fn parse<T: std::str::FromStr>(
    op: &'static str,
    var: &'static str,
    value: &str,
    what: &str,
) -> Result<T> {
    value.parse().map_err(|_| Error::Env {
        op,
        var,
        what: format!("{value:?} is not {what}"),
    })
}

fn port(op: &'static str, var: &'static str, value: &str) -> Result<u16> {
    let port: u16 = parse(op, var, value, "a port number (1 to 65535)")?;
    if port == 0 {
        return Err(Error::Env {
            op,
            var,
            what: "port 0 is not a port one can connect to".into(),
        });
    }
    Ok(port)
}

impl LaunchEnv {
    /// Reads the process environment.
    ///
    /// # Errors
    /// [`Error::Env`] naming the first variable that is missing or invalid,
    /// or `RANK` when it is not below `WORLD_SIZE`.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(env_lookup)
    }

    /// Reads the variables through `get` (`None` for an unset variable).
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let world_size: usize = parse(
            OP,
            "WORLD_SIZE",
            &read(OP, &get, "WORLD_SIZE")?,
            "a number of processes",
        )?;
        if world_size == 0 {
            return Err(Error::Env {
                op: OP,
                var: "WORLD_SIZE",
                what: "must be at least 1".into(),
            });
        }
        let rank: usize = parse(OP, "RANK", &read(OP, &get, "RANK")?, "a rank")?;
        if rank >= world_size {
            return Err(Error::Env {
                op: OP,
                var: "RANK",
                what: format!("{rank} is not below WORLD_SIZE {world_size}"),
            });
        }
        let local_rank = parse(
            OP,
            "LOCAL_RANK",
            &read(OP, &get, "LOCAL_RANK")?,
            "a GPU index",
        )?;
        let master_addr = read(OP, &get, "MASTER_ADDR")?;
        let master_port = port(OP, "MASTER_PORT", &read(OP, &get, "MASTER_PORT")?)?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }
}

/// Where and how long the NCCL unique id is exchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// Rank 0's host (`MASTER_ADDR`).
    pub addr: String,
    /// The port rank 0 serves the id on (`AMP_RENDEZVOUS_PORT`, default
    /// `MASTER_PORT + 1`).
    pub port: u16,
    /// How long every rank waits for the others (`AMP_RENDEZVOUS_TIMEOUT_S`,
    /// default [`DEFAULT_RENDEZVOUS_TIMEOUT`]).
    pub timeout: Duration,
}

impl RendezvousConfig {
    /// A config for `addr:port` with the default timeout.
    pub fn new(addr: impl Into<String>, port: u16) -> Self {
        Self {
            addr: addr.into(),
            port,
            timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
        }
    }

    /// Reads `AMP_RENDEZVOUS_PORT` and `AMP_RENDEZVOUS_TIMEOUT_S` from the
    /// process environment; the host is `launch.master_addr`.
    ///
    /// # Errors
    /// [`Error::Env`] naming the variable that is invalid, or
    /// `MASTER_PORT` when it is 65535 and no `AMP_RENDEZVOUS_PORT` is set.
    pub fn from_env(launch: &LaunchEnv) -> Result<Self> {
        Self::from_lookup(launch, env_lookup)
    }

    /// As [`from_env`](Self::from_env), reading through `get`.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_lookup(launch: &LaunchEnv, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        const OP: &str = "RendezvousConfig";
        let port = match get("AMP_RENDEZVOUS_PORT") {
            Some(v) => port(OP, "AMP_RENDEZVOUS_PORT", v.trim())?,
            None => launch.master_port.checked_add(1).ok_or(Error::Env {
                op: OP,
                var: "MASTER_PORT",
                what: "is 65535, so the rendezvous port MASTER_PORT + 1 does not exist: \
                       set AMP_RENDEZVOUS_PORT"
                    .into(),
            })?,
        };
        let timeout = match get("AMP_RENDEZVOUS_TIMEOUT_S") {
            Some(v) => {
                let var = "AMP_RENDEZVOUS_TIMEOUT_S";
                let secs: f64 = parse(OP, var, v.trim(), "a number of seconds")?;
                Duration::try_from_secs_f64(secs)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or(Error::Env {
                        op: OP,
                        var,
                        what: format!("{secs} is not a positive number of seconds"),
                    })?
            }
            None => DEFAULT_RENDEZVOUS_TIMEOUT,
        };
        Ok(Self {
            addr: launch.master_addr.clone(),
            port,
            timeout,
        })
    }
}

fn env_lookup(var: &str) -> Option<String> {
    std::env::var_os(var).map(|v| v.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    const TORCHRUN: [(&str, &str); 5] = [
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    fn without(var: &str) -> Vec<(&'static str, &'static str)> {
        TORCHRUN
            .iter()
            .copied()
            .filter(|(k, _)| *k != var)
            .collect()
    }

    fn with(var: &'static str, value: &'static str) -> Vec<(&'static str, &'static str)> {
        let mut v = without(var);
        v.push((var, value));
        v
    }

    fn env_var_of(err: Error) -> &'static str {
        match err {
            Error::Env { var, .. } => var,
            other => panic!("expected Error::Env, got {other:?}"),
        }
    }

    #[test]
    fn reads_torchrun_variables() {
        let env = LaunchEnv::from_lookup(vars(&TORCHRUN)).unwrap();
        assert_eq!(
            env,
            LaunchEnv {
                rank: 1,
                world_size: 2,
                local_rank: 1,
                master_addr: "127.0.0.1".into(),
                master_port: 29500
            }
        );
        let rdv = RendezvousConfig::from_lookup(&env, vars(&[])).unwrap();
        assert_eq!(rdv, RendezvousConfig::new("127.0.0.1", 29501));
    }

    #[test]
    fn missing_variables_are_named() {
        for var in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            let err = LaunchEnv::from_lookup(vars(&without(var))).unwrap_err();
            assert!(err.to_string().contains(var), "{err}");
            assert!(err.to_string().contains("not set"), "{err}");
            assert_eq!(env_var_of(err), var);
        }
    }

    #[test]
    fn invalid_variables_are_named() {
        for (var, value) in [
            ("RANK", "one"),
            ("RANK", "2"),
            ("RANK", "-1"),
            ("WORLD_SIZE", "0"),
            ("WORLD_SIZE", "two"),
            ("LOCAL_RANK", "x"),
            ("MASTER_ADDR", " "),
            ("MASTER_PORT", "70000"),
            ("MASTER_PORT", "0"),
            ("MASTER_PORT", "http"),
        ] {
            let err = LaunchEnv::from_lookup(vars(&with(var, value))).unwrap_err();
            assert_eq!(env_var_of(err), var, "{var}={value}");
        }
    }

    #[test]
    fn rendezvous_variables() {
        let env = LaunchEnv::from_lookup(vars(&TORCHRUN)).unwrap();
        let rdv = RendezvousConfig::from_lookup(
            &env,
            vars(&[
                ("AMP_RENDEZVOUS_PORT", "4000"),
                ("AMP_RENDEZVOUS_TIMEOUT_S", "2.5"),
            ]),
        )
        .unwrap();
        assert_eq!((rdv.port, rdv.timeout), (4000, Duration::from_millis(2500)));
        for (var, value) in [
            ("AMP_RENDEZVOUS_PORT", "0"),
            ("AMP_RENDEZVOUS_PORT", "65536"),
            ("AMP_RENDEZVOUS_TIMEOUT_S", "soon"),
            ("AMP_RENDEZVOUS_TIMEOUT_S", "0"),
            ("AMP_RENDEZVOUS_TIMEOUT_S", "-3"),
        ] {
            let err = RendezvousConfig::from_lookup(&env, vars(&[(var, value)])).unwrap_err();
            assert_eq!(env_var_of(err), var, "{var}={value}");
        }
        let top = LaunchEnv {
            master_port: 65535,
            ..env
        };
        let err = RendezvousConfig::from_lookup(&top, vars(&[])).unwrap_err();
        assert_eq!(env_var_of(err), "MASTER_PORT");
    }
}
