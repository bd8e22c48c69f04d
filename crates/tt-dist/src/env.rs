use std::fmt;

use crate::{Error, Result};

/// Where a [`DistEnv`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// torchrun's (or `torchtools launch`'s) variables.
    Torchrun,
    /// Slurm's (`srun`).
    Slurm,
    /// Nothing set: one process, no network.
    Single,
}

/// The distributed environment of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Processes in all.
    pub world_size: usize,
    /// Rank on this node (the GPU to use).
    pub local_rank: usize,
    /// Processes on this node, when known.
    pub local_world_size: Option<usize>,
    /// Rendezvous host (rank 0's).
    pub master_addr: String,
    /// Rendezvous port.
    pub master_port: u16,
    /// Where these came from.
    pub source: Source,
    /// Whether torchrun's agent serves the rendezvous store (it sets
    /// `TORCHELASTIC_USE_AGENT_STORE=True`): every rank is then a client.
    pub agent_store: bool,
}

/// Slurm's default rendezvous port (torchrun's too), unless `MASTER_PORT` is set.
pub const DEFAULT_PORT: u16 = 29500;

impl fmt::Display for DistEnv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source {
            Source::Single => write!(
                f,
                "single process (no RANK / WORLD_SIZE / SLURM_PROCID set)"
            ),
            s => write!(
                f,
                "rank {} of {} (local rank {}), rendezvous {}:{} ({})",
                self.rank,
                self.world_size,
                self.local_rank,
                self.master_addr,
                self.master_port,
                if s == Source::Torchrun {
                    "torchrun variables"
                } else {
                    "Slurm variables"
                }
            ),
        }
    }
}

/// torchrun's `TORCHELASTIC_USE_AGENT_STORE`: `True`, `False` or unset.
fn agent_store(get: &impl Fn(&str) -> Option<String>) -> Result<bool> {
    const NAME: &str = "TORCHELASTIC_USE_AGENT_STORE";
    match get(NAME).as_deref().map(str::trim) {
        None | Some("False") => Ok(false),
        Some("True") => Ok(true),
        Some(other) => Err(Error::Invalid {
            name: NAME,
            value: other.to_owned(),
            reason: "not True or False (torchrun sets it; unset it when starting ranks yourself)"
                .into(),
        }),
    }
}

impl DistEnv {
    /// One process, no network (what nothing set means).
    pub fn single() -> DistEnv {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: Some(1),
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_PORT,
            source: Source::Single,
            agent_store: false,
        }
    }

    /// From this process's environment.
    pub fn from_env() -> Result<DistEnv> {
        DistEnv::from_lookup(|k| std::env::var(k).ok())
    }

    /// From any lookup (tests, or a launcher building a child's environment):
    /// torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; else Slurm's `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the
    /// first host of `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`), port 29500 unless
    /// `MASTER_PORT` is set; else a single process. Missing or inconsistent variables are
    /// an error naming them.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let torchrun = [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        ];
        if torchrun[..2].iter().any(|k| get(k).is_some()) {
            let missing: Vec<&str> = torchrun
                .iter()
                .copied()
                .filter(|k| get(k).is_none())
                .collect();
            if !missing.is_empty() {
                return Err(Error::Missing {
                    source_name: "torchrun",
                    missing: missing.join(", "),
                });
            }
            let env = DistEnv {
                rank: number(&get, "RANK")?,
                world_size: number(&get, "WORLD_SIZE")?,
                local_rank: number(&get, "LOCAL_RANK")?,
                local_world_size: get("LOCAL_WORLD_SIZE")
                    .map(|_| number(&get, "LOCAL_WORLD_SIZE"))
                    .transpose()?,
                master_addr: get("MASTER_ADDR").unwrap_or_default(),
                master_port: port(&get)?.unwrap_or(DEFAULT_PORT),
                source: Source::Torchrun,
                agent_store: agent_store(&get)?,
            };
            return env.checked();
        }
        if get("SLURM_PROCID").is_some() {
            let missing: Vec<&str> = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"]
                .into_iter()
                .filter(|k| get(k).is_none())
                .collect();
            let nodelist = get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST"));
            if !missing.is_empty() || (nodelist.is_none() && get("MASTER_ADDR").is_none()) {
                let mut missing = missing.join(", ");
                if nodelist.is_none() && get("MASTER_ADDR").is_none() {
                    if !missing.is_empty() {
                        missing += ", ";
                    }
                    missing += "SLURM_JOB_NODELIST (or MASTER_ADDR)";
                }
                return Err(Error::Missing {
                    source_name: "Slurm",
                    missing,
                });
            }
            let master_addr = match get("MASTER_ADDR") {
                Some(a) => a,
                None => first_host(nodelist.as_deref().unwrap_or_default()).ok_or_else(|| {
                    Error::Invalid {
                        name: "SLURM_JOB_NODELIST",
                        value: nodelist.clone().unwrap_or_default(),
                        reason: "no host name in it".into(),
                    }
                })?,
            };
            let env = DistEnv {
                rank: number(&get, "SLURM_PROCID")?,
                world_size: number(&get, "SLURM_NTASKS")?,
                local_rank: number(&get, "SLURM_LOCALID")?,
                local_world_size: get("SLURM_NTASKS_PER_NODE")
                    .and_then(|v| v.split(['(', ',']).next()?.trim().parse().ok()),
                master_addr,
                master_port: port(&get)?.unwrap_or(DEFAULT_PORT),
                source: Source::Slurm,
                agent_store: false,
            };
            return env.checked();
        }
        Ok(DistEnv {
            master_port: port(&get)?.unwrap_or(DEFAULT_PORT),
            ..DistEnv::single()
        })
    }

    fn checked(self) -> Result<DistEnv> {
        let (rank_var, world_var, local_var) = match self.source {
            Source::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
            _ => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
        };
        if self.world_size == 0 {
            return Err(Error::Inconsistent(format!(
                "{world_var}=0: there must be at least one process"
            )));
        }
        if self.rank >= self.world_size {
            return Err(Error::Inconsistent(format!(
                "{rank_var}={} but {world_var}={}: ranks go from 0 to {}",
                self.rank,
                self.world_size,
                self.world_size - 1
            )));
        }
        if let Some(lws) = self.local_world_size {
            if self.local_rank >= lws || lws > self.world_size {
                return Err(Error::Inconsistent(format!(
                    "{local_var}={} with {lws} process(es) per node and {world_var}={}",
                    self.local_rank, self.world_size
                )));
            }
        }
        if self.local_rank > self.rank
            && self.source == Source::Torchrun
            && self.world_size > 1
            && self.local_world_size.is_none()
        {
            tracing::debug!("LOCAL_RANK above RANK: several nodes with uneven ranks");
        }
        Ok(self)
    }

    /// Whether there are several processes.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// Whether this is rank 0 (which logs and checkpoints).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }
}

fn number(get: &impl Fn(&str) -> Option<String>, name: &'static str) -> Result<usize> {
    let value = get(name).unwrap_or_default();
    value.trim().parse().map_err(|_| Error::Invalid {
        name,
        value,
        reason: "not a non-negative integer".into(),
    })
}

fn port(get: &impl Fn(&str) -> Option<String>) -> Result<Option<u16>> {
    match get("MASTER_PORT") {
        None => Ok(None),
        Some(v) => match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => Ok(Some(p)),
            _ => Err(Error::Invalid {
                name: "MASTER_PORT",
                value: v,
                reason: "not a port (1 to 65535)".into(),
            }),
        },
    }
}

/// The first host of a Slurm node list: `node[01-04,07],gpu5` -> `node01`.
pub fn first_host(nodelist: &str) -> Option<String> {
    let s = nodelist.trim();
    // The first entry ends at a comma outside brackets.
    let mut depth = 0;
    let end = s
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                ',' if depth == 0 => return true,
                _ => {}
            }
            false
        })
        .map_or(s.len(), |(i, _)| i);
    let first = &s[..end];
    match first.find('[') {
        None => (!first.is_empty()).then(|| first.to_owned()),
        Some(open) => {
            let prefix = &first[..open];
            let inner = first[open + 1..].trim_end_matches(']');
            let range = inner.split(',').next()?;
            let start = range.split('-').next()?;
            let rest = &first[first.find(']')? + 1..];
            Some(format!("{prefix}{start}{rest}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> Result<DistEnv> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        DistEnv::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (3, 4, 1, Some(2))
        );
        assert_eq!(
            (e.master_addr.as_str(), e.master_port, e.source),
            ("10.0.0.1", 1234, Source::Torchrun)
        );
        assert!(e.is_distributed() && !e.is_main());
        assert!(!e.agent_store);
    }

    #[test]
    fn torchruns_agent_store_is_read_with_the_other_variables() {
        let base = [
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ];
        let with = |v: &str| {
            let mut vars = base.to_vec();
            vars.push(("TORCHELASTIC_USE_AGENT_STORE", v));
            env(&vars)
        };
        assert!(with("True").unwrap().agent_store);
        assert!(!with("False").unwrap().agent_store);
        let e = with("yes").unwrap_err().to_string();
        assert!(
            e.contains("TORCHELASTIC_USE_AGENT_STORE=\"yes\"") && e.contains("True or False"),
            "{e}"
        );
    }

    #[test]
    fn slurm_variables() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,11],cpu1"),
        ])
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 8, 1, Some(4))
        );
        assert_eq!(
            (e.master_addr.as_str(), e.master_port),
            ("gpu07", DEFAULT_PORT)
        );
        let e = env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODELIST", "n1"),
            ("MASTER_PORT", "4000"),
        ])
        .unwrap();
        assert_eq!((e.master_addr.as_str(), e.master_port), ("n1", 4000));
    }

    #[test]
    fn nothing_set_is_one_process() {
        let e = env(&[]).unwrap();
        assert_eq!((e.rank, e.world_size, e.source), (0, 1, Source::Single));
        assert!(e.is_main() && !e.is_distributed());
    }

    #[test]
    fn missing_and_inconsistent_variables_are_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("RANK", "0")],
                "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "4"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ],
                "RANK=4 but WORLD_SIZE=4",
            ),
            (
                &[
                    ("RANK", "x"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ],
                "RANK=\\\"x\\\"",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "0"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "1"),
                ],
                "LOCAL_RANK=2",
            ),
            (
                &[("SLURM_PROCID", "0")],
                "SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST",
            ),
        ];
        for (vars, needle) in cases {
            let e = env(vars).unwrap_err().to_string();
            let e_dbg = format!("{e:?}");
            assert!(
                e.contains(needle) || e_dbg.contains(needle),
                "{vars:?}: {e}"
            );
        }
    }

    #[test]
    fn first_hosts() {
        assert_eq!(first_host("node[01-04,07],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("gpu5,node[1-2]").as_deref(), Some("gpu5"));
        assert_eq!(
            first_host("rack1-n[003-005]-ib").as_deref(),
            Some("rack1-n003-ib")
        );
        assert_eq!(first_host("").as_deref(), None);
    }
}
