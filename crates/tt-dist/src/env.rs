use std::fmt;
use std::time::Duration;

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

/// The variables a launcher names rank, world size and local rank by: torchrun's, or
/// Slurm's (for a single process, torchrun's, which messages name).
fn rank_variables(source: Source) -> (&'static str, &'static str, &'static str) {
    match source {
        Source::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        Source::Torchrun | Source::Single => ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    }
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

/// This process's place in a distributed run: its rank, the world size and its rank on
/// the node. The one rule torchtools follows for "which rank am I" and "who is rank
/// 0": tt-ckpt (only rank 0 writes), tt-sampler (which shard is this rank's) and
/// tt-dist's [`DistEnv`] all read it, so a job started by torchrun, by `torchtools
/// launch` or by Slurm's `srun` is seen the same way everywhere. Needs no rendezvous
/// variables and no libtorch.
///
/// ```
/// use tt_dist::{Place, Source};
/// let slurm = |k: &str| match k {
///     "SLURM_PROCID" => Some("3".to_owned()),
///     "SLURM_NTASKS" => Some("8".to_owned()),
///     "SLURM_LOCALID" => Some("1".to_owned()),
///     _ => None,
/// };
/// let place = Place::from_lookup(slurm)?;
/// assert_eq!((place.rank, place.world_size, place.local_rank), (3, 8, 1));
/// assert_eq!(place.source, Source::Slurm);
/// assert!(!place.is_main());
/// // A typo is an error naming the variable, never a silent "rank 0" or "not rank 0".
/// assert!(Place::from_lookup(|k| (k == "RANK" || k == "WORLD_SIZE").then(|| "x".into())).is_err());
/// # Ok::<(), tt_dist::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Processes in all.
    pub world_size: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Where these came from.
    pub source: Source,
}

impl Place {
    /// One process (what nothing set means).
    pub fn single() -> Place {
        Place {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            source: Source::Single,
        }
    }

    /// From this process's environment (see [`Place::from_lookup`]).
    pub fn from_env() -> Result<Place> {
        Place::from_lookup(|k| std::env::var(k).ok())
    }

    /// torchrun's `RANK` and `WORLD_SIZE` (both, or neither) and `LOCAL_RANK` (the rank
    /// when unset); else Slurm's `SLURM_PROCID`, `SLURM_NTASKS` and `SLURM_LOCALID`; else
    /// a single process. Every value is checked: a non-number, a rank at or past the
    /// world size, or one variable of a pair without the other is an error naming them.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Place> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let source = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            Source::Torchrun
        } else if get("SLURM_PROCID").is_some() {
            Source::Slurm
        } else {
            return Ok(Place::single());
        };
        let (rank_var, world_var, local_var) = rank_variables(source);
        // srun always sets the local id; torchrun's LOCAL_RANK may be left out.
        match source {
            Source::Slurm => require(&get, "Slurm", &[rank_var, world_var, local_var])?,
            _ => require(&get, "torchrun", &[rank_var, world_var])?,
        }
        let rank = number(&get, rank_var)?;
        let place = Place {
            rank,
            world_size: number(&get, world_var)?,
            local_rank: match get(local_var) {
                Some(_) => number(&get, local_var)?,
                None => rank,
            },
            source,
        };
        if place.world_size == 0 {
            return Err(Error::Inconsistent {
                reason: format!("{world_var}=0: there must be at least one process"),
            });
        }
        if place.rank >= place.world_size {
            return Err(Error::Inconsistent {
                reason: format!(
                    "{rank_var}={} but {world_var}={}: ranks go from 0 to {}",
                    place.rank,
                    place.world_size,
                    place.world_size - 1
                ),
            });
        }
        Ok(place)
    }

    /// Whether this is rank 0 (which logs and writes checkpoints).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// Whether there are several processes.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

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
            require(&get, "torchrun", &torchrun)?;
            let place = Place::from_lookup(get)?;
            let env = DistEnv {
                rank: place.rank,
                world_size: place.world_size,
                local_rank: place.local_rank,
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
            let place = Place::from_lookup(get)?;
            let env = DistEnv {
                rank: place.rank,
                world_size: place.world_size,
                local_rank: place.local_rank,
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

    /// The local world size against the place ([`Place::from_lookup`] checked the rest).
    fn checked(self) -> Result<DistEnv> {
        let (_, world_var, local_var) = rank_variables(self.source);
        if let Some(lws) = self.local_world_size {
            if self.local_rank >= lws || lws > self.world_size {
                return Err(Error::Inconsistent {
                    reason: format!(
                        "{local_var}={} with {lws} process(es) per node and {world_var}={}",
                        self.local_rank, self.world_size
                    ),
                });
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

    /// Its rank, world size and local rank.
    pub fn place(&self) -> Place {
        Place {
            rank: self.rank,
            world_size: self.world_size,
            local_rank: self.local_rank,
            source: self.source,
        }
    }
}

/// [`Error::Missing`] naming those of `required` that `get` does not have.
fn require(
    get: &impl Fn(&str) -> Option<String>,
    source_name: &'static str,
    required: &[&str],
) -> Result<()> {
    let missing: Vec<&str> = required
        .iter()
        .copied()
        .filter(|k| get(k).is_none())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::Missing {
            source_name,
            missing: missing.join(", "),
        })
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

/// How long rendezvous and each collective may take, unless `TORCHTOOLS_DIST_TIMEOUT`
/// says otherwise: a process group's timeout, and how long `torchtools launch` waits
/// for every node of a job to join. (torch.distributed's default is 30 minutes for
/// Gloo; a dead peer is usually detected at once, the timeout is for hung ones.)
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// `TORCHTOOLS_DIST_TIMEOUT` read through `get` (a duration above 0: `600`, `20s`,
/// `10m`, `1.5h`), else [`DEFAULT_TIMEOUT`].
pub(crate) fn dist_timeout(get: impl Fn(&str) -> Option<String>) -> Result<Duration> {
    let Some(v) = get("TORCHTOOLS_DIST_TIMEOUT").filter(|v| !v.is_empty()) else {
        return Ok(DEFAULT_TIMEOUT);
    };
    // The CLI's form: 600, 20s, 10m, 1.5h.
    let timeout = tt_device::parse_duration(&v).map_err(|why| Error::Invalid {
        name: "TORCHTOOLS_DIST_TIMEOUT",
        value: v.clone(),
        reason: format!("not a duration ({why})"),
    })?;
    if timeout.is_zero() || timeout.as_secs() >= 1_000_000_000 {
        return Err(Error::Invalid {
            name: "TORCHTOOLS_DIST_TIMEOUT",
            value: v,
            reason: "out of range: give a duration above 0, e.g. 600 or 10m".into(),
        });
    }
    Ok(timeout)
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

    fn place(vars: &[(&str, &str)]) -> String {
        let lookup = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        match Place::from_lookup(lookup) {
            Ok(p) => format!(
                "{} {} {} {:?}",
                p.rank, p.world_size, p.local_rank, p.source
            ),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_place_from_torchrun_slurm_or_nothing_every_value_checked() {
        assert_eq!(place(&[]), "0 1 0 Single");
        assert_eq!(place(&[("WORLD_SIZE", ""), ("RANK", " ")]), "0 1 0 Single");
        assert_eq!(
            place(&[("WORLD_SIZE", "4"), ("RANK", "3")]),
            "3 4 3 Torchrun"
        );
        assert_eq!(
            place(&[("WORLD_SIZE", "8"), ("RANK", "5"), ("LOCAL_RANK", "1")]),
            "5 8 1 Torchrun"
        );
        let slurm = [
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
        ];
        assert_eq!(place(&slurm), "6 8 2 Slurm");
        // torchrun's variables win over Slurm's (torchrun inside an allocation).
        let both = [slurm.as_slice(), &[("RANK", "1"), ("WORLD_SIZE", "2")]].concat();
        assert_eq!(place(&both), "1 2 1 Torchrun");
        for (vars, says) in [
            (
                &[("WORLD_SIZE", "4")][..],
                "torchrun variables are incomplete: RANK missing",
            ),
            (&[("RANK", "1")][..], "WORLD_SIZE missing"),
            (
                &[("WORLD_SIZE", "four"), ("RANK", "0")][..],
                "WORLD_SIZE=\"four\" is not a non-negative integer",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "-1")][..],
                "RANK=\"-1\" is not a non-negative integer",
            ),
            (
                &[("WORLD_SIZE", "2"), ("RANK", "2")][..],
                "RANK=2 but WORLD_SIZE=2: ranks go from 0 to 1",
            ),
            (&[("WORLD_SIZE", "0"), ("RANK", "0")][..], "WORLD_SIZE=0"),
            (
                &[("SLURM_PROCID", "0")][..],
                "Slurm variables are incomplete: SLURM_NTASKS, SLURM_LOCALID missing",
            ),
            (
                &[
                    ("SLURM_PROCID", "x"),
                    ("SLURM_NTASKS", "2"),
                    ("SLURM_LOCALID", "0"),
                ][..],
                "SLURM_PROCID=\"x\"",
            ),
        ] {
            assert!(place(vars).contains(says), "{vars:?}: {}", place(vars));
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
