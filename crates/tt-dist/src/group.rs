//! Process groups on libtorch's c10d, formed the way `torch.distributed.init_process_group`
//! forms them, so Rust and Python ranks can share one group.

use std::time::Duration;

use tch::{Kind, Tensor};
use tt_sys::c10d::{Backend, Store};
pub use tt_sys::c10d::{BackendKind, ReduceOp};

use crate::{DistEnv, Error, Result, Source};

use crate::env::DEFAULT_TIMEOUT;

/// How to form a [`ProcessGroup`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupOptions {
    /// The backend; `None`: NCCL when this process's device (tt-device's choice,
    /// per `LOCAL_RANK`) is CUDA and NCCL is built, Gloo otherwise.
    pub backend: Option<BackendKind>,
    /// Rendezvous and collective timeout.
    pub timeout: Duration,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            backend: None,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

impl GroupOptions {
    /// The defaults, overridden by `TORCHTOOLS_DIST_BACKEND` (`gloo` | `nccl`) and
    /// `TORCHTOOLS_DIST_TIMEOUT` (a duration above 0: `600`, `20s`, `10m`).
    pub fn from_env() -> Result<GroupOptions> {
        GroupOptions::from_lookup(|k| std::env::var(k).ok())
    }

    /// As [`GroupOptions::from_env`], from any lookup.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<GroupOptions> {
        let mut opts = GroupOptions::default();
        if let Some(v) = get("TORCHTOOLS_DIST_BACKEND").filter(|v| !v.is_empty()) {
            opts.backend = Some(match v.trim().to_ascii_lowercase().as_str() {
                "gloo" => BackendKind::Gloo,
                "nccl" => BackendKind::Nccl,
                _ => {
                    return Err(Error::Invalid {
                        name: "TORCHTOOLS_DIST_BACKEND",
                        value: v,
                        reason: "not a backend: use gloo or nccl, or unset it to pick by device"
                            .into(),
                    })
                }
            });
        }
        opts.timeout = crate::env::dist_timeout(&get)?;
        Ok(opts)
    }

    /// With this backend.
    pub fn backend(mut self, backend: BackendKind) -> Self {
        self.backend = Some(backend);
        self
    }

    /// With this timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// The engine's parts, dropped backend first (it uses the store).
struct Engine {
    backend: Backend,
    /// Where this rank's small tensors (scalars, flags) go: NCCL reduces only CUDA
    /// tensors, on the rank's own GPU.
    scalars: tch::Device,
    // The group's own PrefixStore (what Python's `_get_default_store()` would give).
    store: Store,
}

/// A group of processes that run collectives together: c10d's `ProcessGroupGloo` or
/// `ProcessGroupNCCL` on a `TCPStore` rendezvous, or, for a single process started
/// without any launcher variables, a group of one with no network, where every
/// collective leaves its tensors as they are.
///
/// Collectives block until done ([`ProcessGroup::timeout`] at most) or return an error
/// (a peer died, hung, or disagreed); `*_async` variants return a [`Work`].
pub struct ProcessGroup {
    env: DistEnv,
    timeout: Duration,
    engine: Option<Engine>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.env.rank)
            .field("world_size", &self.env.world_size)
            .field("backend", &self.backend())
            .finish()
    }
}

fn rendezvous_error(env: &DistEnv, message: String) -> Error {
    let hint = if message.contains("EADDRINUSE") || message.contains("address already in use") {
        format!(
            "; port {} is already in use on this host: choose another MASTER_PORT, or let \
             `torchtools launch` pick a free one (it does when --master-port is not given)",
            env.master_port
        )
    } else if message.contains("timed out") || message.contains("Timeout") {
        format!(
            "; check that all {} ranks started, that rank 0 runs on MASTER_ADDR={} and that \
             its port is reachable (or raise TORCHTOOLS_DIST_TIMEOUT)",
            env.world_size, env.master_addr
        )
    } else {
        String::new()
    };
    Error::Rendezvous {
        addr: env.master_addr.clone(),
        port: env.master_port,
        reason: format!("{message}{hint}"),
    }
}

impl ProcessGroup {
    /// The group this process belongs to, from its environment ([`DistEnv::from_env`],
    /// [`GroupOptions::from_env`]): every rank calls it, and it returns once all have.
    pub fn from_env() -> Result<ProcessGroup> {
        ProcessGroup::new(&DistEnv::from_env()?, &GroupOptions::from_env()?)
    }

    /// A group of one, no network.
    pub fn single() -> ProcessGroup {
        ProcessGroup {
            env: DistEnv::single(),
            timeout: DEFAULT_TIMEOUT,
            engine: None,
        }
    }

    /// Forms the group described by `env`: rank 0 serves the `TCPStore` at
    /// `master_addr:master_port` (under torchrun's agent, `TORCHELASTIC_USE_AGENT_STORE=True`,
    /// the agent serves it and every rank is a client), then the backend connects all
    /// ranks. Store keys are namespaced as torch.distributed's default group does
    /// (`default_pg` / `0/` / `cpu/` or `cuda/`), so Python ranks can join.
    pub fn new(env: &DistEnv, opts: &GroupOptions) -> Result<ProcessGroup> {
        if env.source == Source::Single {
            let mut pg = ProcessGroup::single();
            pg.timeout = opts.timeout;
            return Ok(pg);
        }
        let selected = tt_device::select().ok();
        let cuda = matches!(selected, Some(tch::Device::Cuda(_)));
        // Counted only where it matters, and through tt-sys: asking tch first, before
        // libtorch's CUDA library is loaded, would disable CUDA for the process.
        let gpus = if cuda || opts.backend == Some(BackendKind::Nccl) {
            tt_sys::ensure_cuda_loaded().map_or(0, |info| info.device_count)
        } else {
            0
        };
        let (kind, why) = pick_backend(
            opts.backend,
            cuda,
            tt_sys::c10d::nccl_built(),
            env.local_world_size,
            gpus,
        )?;
        if let Some(why) = why {
            tracing::warn!("{why}");
        }
        let agent = env.agent_store;
        let tcp = Store::tcp(
            &env.master_addr,
            env.master_port,
            Some(env.world_size),
            env.rank == 0 && !agent,
            opts.timeout,
            true,
        )
        .map_err(|e| rendezvous_error(env, e.to_string()))?;
        let device = match kind {
            BackendKind::Gloo => "cpu/",
            _ => "cuda/",
        };
        let store = tcp
            .prefixed("default_pg")
            .and_then(|s| s.prefixed("0/"))
            .map_err(|e| rendezvous_error(env, e.to_string()))?;
        let backend_store = store
            .prefixed(device)
            .map_err(|e| rendezvous_error(env, e.to_string()))?;
        let backend = match kind {
            BackendKind::Nccl => {
                // This rank's GPU (per LOCAL_RANK): NCCL is bound to it at once.
                let gpu = match selected {
                    Some(tch::Device::Cuda(i)) => i,
                    _ => env.local_rank,
                };
                Backend::nccl(&backend_store, env.rank, env.world_size, opts.timeout, gpu)
            }
            _ => {
                // Peers on other hosts must reach this rank: where the host's name
                // resolves to loopback, the interface that reaches the master (as the
                // launcher does for its ranks; GLOO_SOCKET_IFNAME, when set, wins).
                let iface = crate::socket_interface_for(&env.master_addr)
                    .map_err(|e| rendezvous_error(env, e.to_string()))?;
                if let Some(iface) = &iface {
                    tracing::info!(rank = env.rank, "Gloo on {iface}");
                }
                let name = iface.as_ref().map(|i| i.name.as_str());
                Backend::gloo_on(&backend_store, env.rank, env.world_size, opts.timeout, name)
            }
        }
        .map_err(|e| rendezvous_error(env, e.to_string()))?;
        tracing::debug!(rank = env.rank, world = env.world_size, backend = %kind, "process group formed");
        Ok(ProcessGroup {
            env: env.clone(),
            timeout: opts.timeout,
            engine: Some(Engine {
                backend,
                store,
                scalars: match (kind, selected) {
                    (BackendKind::Nccl, Some(d @ tch::Device::Cuda(_))) => d,
                    _ => tch::Device::Cpu,
                },
            }),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.env.rank
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.env.world_size
    }

    /// Rank on this node.
    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }

    /// Whether this is rank 0 (the one that logs and checkpoints).
    pub fn is_main(&self) -> bool {
        self.env.rank == 0
    }

    /// The environment the group was formed from.
    pub fn env(&self) -> &DistEnv {
        &self.env
    }

    /// The backend, `None` for the networkless group of one.
    pub fn backend(&self) -> Option<BackendKind> {
        self.engine.as_ref().map(|e| e.backend.kind())
    }

    /// Where small tensors of this rank's own (a loss to average, a flag) must be for
    /// this group's collectives: this rank's GPU under NCCL (which reduces only CUDA
    /// tensors), the CPU otherwise.
    pub fn scalar_device(&self) -> tch::Device {
        self.engine.as_ref().map_or(tch::Device::Cpu, |e| e.scalars)
    }

    /// The c10d backend, `None` for the networkless group of one.
    pub(crate) fn raw_backend(&self) -> Option<&Backend> {
        self.engine.as_ref().map(|e| &e.backend)
    }

    /// The error of a failed `op` on this rank.
    pub(crate) fn error_of(&self, op: &'static str, e: tt_sys::Error) -> Error {
        collective_error(op, self.env.rank, e)
    }

    /// The timeout of every blocking call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The group's key-value store (a `PrefixStore` over the `TCPStore`), for small
    /// agreements of one's own; `None` for the group of one.
    pub fn store(&self) -> Option<&Store> {
        self.engine.as_ref().map(|e| &e.store)
    }

    fn collective_error(&self, op: &'static str) -> impl Fn(tt_sys::Error) -> Error + '_ {
        move |e| collective_error(op, self.env.rank, e)
    }

    /// The op to hand the backend for `op` on `tensor`, and whether the result must be
    /// divided by the world size afterwards (Gloo has no average: sum, then divide).
    /// An average needs a floating-point tensor, on every backend.
    fn reduction(
        &self,
        op: ReduceOp,
        tensor: &Tensor,
        name: &'static str,
    ) -> Result<(ReduceOp, bool)> {
        if op == ReduceOp::Avg && !is_float(tensor.kind()) {
            return Err(Error::Collective {
                op: name,
                rank: self.env.rank,
                reason: format!(
                    "average of a {:?} tensor: use a floating-point tensor, or Sum and divide",
                    tensor.kind()
                ),
            });
        }
        let emulate = op == ReduceOp::Avg && self.backend() == Some(BackendKind::Gloo);
        Ok(if emulate {
            (ReduceOp::Sum, true)
        } else {
            (op, false)
        })
    }

    /// Reduces `tensor` in place over all ranks; returns when done everywhere.
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op)?.wait()
    }

    /// Starts an all-reduce; `tensor` must not be touched until [`Work::wait`].
    /// `Avg` on Gloo (which has no average) is a sum divided by the world size when
    /// waited on; it needs a floating-point tensor.
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let (raw_op, emulate_avg) = self.reduction(op, tensor, "allreduce")?;
        let Some(engine) = &self.engine else {
            return Ok(self.done("allreduce"));
        };
        let raw = engine
            .backend
            .all_reduce(tensor, raw_op)
            .map_err(self.collective_error("allreduce"))?;
        Ok(Work {
            raw: Some(raw),
            divide: emulate_avg.then(|| (tensor.shallow_clone(), self.env.world_size)),
            op: "allreduce",
            rank: self.env.rank,
        })
    }

    fn done(&self, op: &'static str) -> Work {
        Work {
            raw: None,
            divide: None,
            op,
            rank: self.env.rank,
        }
    }

    /// Copies rank `root`'s `tensor` into every rank's `tensor`.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.broadcast_async(tensor, root)?.wait()
    }

    /// Starts a broadcast.
    pub fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        self.check_root("broadcast", root)?;
        let Some(engine) = &self.engine else {
            return Ok(self.done("broadcast"));
        };
        let raw = engine
            .backend
            .broadcast(tensor, root)
            .map_err(self.collective_error("broadcast"))?;
        Ok(self.work("broadcast", raw))
    }

    fn work(&self, op: &'static str, raw: tt_sys::c10d::Work) -> Work {
        Work {
            raw: Some(raw),
            ..self.done(op)
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.env.world_size {
            return Err(Error::Collective {
                op,
                rank: self.env.rank,
                reason: format!(
                    "root rank {root} is not in this group of {}",
                    self.env.world_size
                ),
            });
        }
        Ok(())
    }

    /// Every rank's `tensor`, in rank order (the same shape and kind on every rank).
    pub fn all_gather(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let Some(engine) = &self.engine else {
            return Ok(vec![tensor.copy()]);
        };
        let outputs: Vec<Tensor> = (0..self.env.world_size)
            .map(|_| tensor.empty_like())
            .collect();
        engine
            .backend
            .all_gather(&outputs, tensor)
            .map_err(self.collective_error("allgather"))
            .map(|raw| self.work("allgather", raw))?
            .wait()?;
        Ok(outputs)
    }

    /// Reduces `inputs[r]` over the ranks into rank `r`'s `output` (`inputs` holds one
    /// tensor per rank, each shaped like `output`).
    pub fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<()> {
        if inputs.len() != self.env.world_size {
            return Err(Error::Collective {
                op: "reduce_scatter",
                rank: self.env.rank,
                reason: format!(
                    "{} input tensors for a group of {}: give one per rank",
                    inputs.len(),
                    self.env.world_size
                ),
            });
        }
        let (raw_op, emulate_avg) = self.reduction(op, output, "reduce_scatter")?;
        let Some(engine) = &self.engine else {
            return output
                .shallow_clone()
                .f_copy_(&inputs[0])
                .map_err(|e| Error::Tensor {
                    reason: e.to_string(),
                });
        };
        let raw = engine
            .backend
            .reduce_scatter(output, inputs, raw_op)
            .map_err(self.collective_error("reduce_scatter"))?;
        Work {
            divide: emulate_avg.then(|| (output.shallow_clone(), self.env.world_size)),
            ..self.work("reduce_scatter", raw)
        }
        .wait()
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        let Some(engine) = &self.engine else {
            return Ok(());
        };
        let raw = engine
            .backend
            .barrier()
            .map_err(self.collective_error("barrier"))?;
        self.work("barrier", raw).wait()
    }

    /// A number reduced over the ranks (for metrics: `Avg` of a loss, `Sum` of counts).
    pub fn all_reduce_f64(&self, value: f64, op: ReduceOp) -> Result<f64> {
        let t = Tensor::from_slice(&[value]).to_device(self.scalar_device());
        self.all_reduce(&t, op)?;
        t.f_double_value(&[0]).map_err(|e| Error::Tensor {
            reason: e.to_string(),
        })
    }

    /// The smallest of every rank's `value`: how ranks agree on one batch size when
    /// each found its own (tt-adaptive's batch agreement).
    pub fn min_over_ranks(&self, value: u64) -> Result<u64> {
        let v = i64::try_from(value).unwrap_or(i64::MAX);
        let t = Tensor::from_slice(&[v])
            .to_kind(Kind::Int64)
            .to_device(self.scalar_device());
        self.all_reduce(&t, ReduceOp::Min)?;
        let out = t.f_int64_value(&[0]).map_err(|e| Error::Tensor {
            reason: e.to_string(),
        })?;
        Ok(u64::try_from(out).unwrap_or(0))
    }
}

/// c10d's own message (tt-sys wraps it with the op, which `Collective` names itself).
fn collective_error(op: &'static str, rank: usize, e: tt_sys::Error) -> Error {
    Error::Collective {
        op,
        rank,
        reason: match e {
            tt_sys::Error::Torch {
                reason: message, ..
            } => message,
            other => other.to_string(),
        },
    }
}

fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Half
            | Kind::Float
            | Kind::Double
            | Kind::BFloat16
            | Kind::ComplexFloat
            | Kind::ComplexDouble
    )
}

/// The backend, and why when it is not the obvious one: what was asked for
/// (`TORCHTOOLS_DIST_BACKEND`), else NCCL when this process's device is CUDA, NCCL is
/// built and every local rank has a visible GPU of its own (NCCL refuses two ranks on
/// one GPU at the first collective), else Gloo.
fn pick_backend(
    asked: Option<BackendKind>,
    cuda: bool,
    nccl_built: bool,
    local_ranks: Option<usize>,
    gpus: usize,
) -> Result<(BackendKind, Option<String>)> {
    let shared = local_ranks.filter(|&n| n > gpus);
    match asked {
        Some(BackendKind::Nccl) if !nccl_built => Err(Error::BackendUnavailable {
            backend: "nccl",
            fix: "build tt-sys with its `nccl` feature, or use gloo \
                  (TORCHTOOLS_DIST_BACKEND=gloo)",
        }),
        Some(BackendKind::Nccl) if gpus == 0 => Err(Error::Invalid {
            name: "TORCHTOOLS_DIST_BACKEND",
            value: "nccl".into(),
            reason: "impossible here: no GPU is visible (NCCL runs on GPUs only); use gloo \
                     (TORCHTOOLS_DIST_BACKEND=gloo), or run where a GPU is"
                .into(),
        }),
        Some(BackendKind::Nccl) => match shared {
            Some(n) => Err(Error::Invalid {
                name: "TORCHTOOLS_DIST_BACKEND",
                value: "nccl".into(),
                reason: format!(
                    "impossible here: {n} ranks on this node share {gpus} visible GPU(s) and \
                     NCCL needs one GPU per rank; launch at most {gpus} rank(s) per node, or \
                     use gloo (TORCHTOOLS_DIST_BACKEND=gloo)"
                ),
            }),
            None => Ok((BackendKind::Nccl, None)),
        },
        Some(kind) => Ok((kind, None)),
        None if !cuda => Ok((BackendKind::Gloo, None)),
        None if !nccl_built => Ok((
            BackendKind::Gloo,
            Some("CUDA device but this build has no NCCL: using gloo (build tt-sys with `nccl` for NCCL)".into()),
        )),
        None => match shared {
            Some(n) => Ok((
                BackendKind::Gloo,
                Some(format!(
                    "{n} ranks on this node share {gpus} visible GPU(s): NCCL needs one GPU per \
                     rank, so gloo is used (launch at most {gpus} rank(s) per node for NCCL)"
                )),
            )),
            None => Ok((BackendKind::Nccl, None)),
        },
    }
}

/// A collective in flight ([`ProcessGroup`]'s `*_async` calls).
#[must_use = "a collective's result is only known once waited on"]
pub struct Work {
    raw: Option<tt_sys::c10d::Work>,
    // Gloo's emulated average: the tensor to divide by the world size once summed.
    divide: Option<(Tensor, usize)>,
    op: &'static str,
    rank: usize,
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("op", &self.op).finish()
    }
}

impl Work {
    /// Waits until the collective is done on this rank, or fails (a dead peer at once,
    /// a hung one when the group's timeout, which the backend enforces, passes).
    pub fn wait(self) -> Result<()> {
        if let Some(raw) = self.raw {
            // The backend enforces the group's timeout on every collective (Gloo's and
            // NCCL's options carry it), as torch.distributed's `work.wait()` relies on;
            // a second, timed wait on top only adds a clock to every call.
            raw.wait(None)
                .map_err(|e| collective_error(self.op, self.rank, e))?;
        }
        if let Some((mut t, n)) = self.divide {
            let _ = t.f_div_scalar_(n as f64).map_err(|e| Error::Tensor {
                reason: e.to_string(),
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{pick_backend, BackendKind};

    #[test]
    fn nccl_only_where_every_local_rank_has_a_gpu_of_its_own() {
        use BackendKind::{Gloo, Nccl};
        let pick = |asked, cuda, built, local, gpus| pick_backend(asked, cuda, built, local, gpus);
        // The plain cases.
        assert_eq!(pick(None, false, true, Some(2), 0).unwrap(), (Gloo, None));
        assert_eq!(pick(None, true, true, Some(2), 2).unwrap(), (Nccl, None));
        assert_eq!(pick(None, true, true, None, 1).unwrap(), (Nccl, None));
        assert_eq!(
            pick(Some(Gloo), true, true, Some(8), 1).unwrap(),
            (Gloo, None)
        );
        // No NCCL in this build: gloo, saying so; asked for: an error naming the fix.
        let (kind, why) = pick(None, true, false, Some(1), 1).unwrap();
        assert_eq!(kind, Gloo);
        assert!(why.unwrap().contains("no NCCL"));
        let e = pick(Some(Nccl), true, false, Some(1), 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("nccl") && e.contains("TORCHTOOLS_DIST_BACKEND=gloo"),
            "{e}"
        );
        // Two ranks on one visible GPU: NCCL would refuse them at the first collective.
        let (kind, why) = pick(None, true, true, Some(2), 1).unwrap();
        assert_eq!(kind, Gloo);
        let why = why.unwrap();
        assert!(
            why.contains("2 ranks on this node share 1 visible GPU(s)"),
            "{why}"
        );
        // No GPU at all: said so, not "launch at most 0 rank(s)".
        let e = pick(Some(Nccl), false, true, Some(1), 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no GPU is visible") && !e.contains("at most 0"),
            "{e}"
        );
        let e = pick(Some(Nccl), true, true, Some(2), 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("2 ranks on this node share 1 visible GPU(s)")
                && e.contains("at most 1 rank(s) per node"),
            "{e}"
        );
    }
}
