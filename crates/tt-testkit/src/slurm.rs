//! A real Slurm cluster for tests: Debian's `munged`, `slurmctld` and `slurmd` (Slurm
//! 22.05), started as root without systemd in a directory of the test's own, with
//! ports of their own (tests may run side by side), one node with fake GPUs, stopped
//! on drop. The GPUs are character devices made with `mknod` (Slurm refuses plain
//! files), so `srun --gres=gpu:2` sets `SLURM_STEP_GPUS` and `CUDA_VISIBLE_DEVICES` as
//! on a GPU node; `proctrack/linuxproc` and `task/none`: no cgroup is needed.
//!
//! Not a mock: `sbatch`, `srun`, `scancel`, `scontrol` and `squeue` are Slurm's own,
//! pointed at the cluster by `SLURM_CONF` ([`Cluster::command`]).
//!
//! [`Cluster::two_nodes`] is a cluster of two nodes, each `slurmd` in a network
//! namespace of its own ([`crate::netns::TwoHosts`]), the controller on the first: a
//! job step across both nodes talks between them as between two machines.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// A cluster of one node, or of two ([`Cluster::two_nodes`]).
pub struct Cluster {
    dir: tempfile::TempDir,
    /// The first node's name (this machine's short host name on a one-node cluster).
    pub node: String,
    /// The nodes' names and, on two hosts, addresses.
    nodes: Vec<(String, Option<&'static str>)>,
    /// Two nodes' network namespaces (deleted after the daemons stop: fields drop
    /// after [`Drop::drop`]).
    hosts: Option<crate::netns::TwoHosts>,
}

/// The programs a cluster needs, with the Debian package of each.
const PROGRAMS: [(&str, &str); 5] = [
    ("munged", "munge"),
    ("slurmctld", "slurmctld"),
    ("slurmd", "slurmd"),
    ("sbatch", "slurm-client"),
    ("srun", "slurm-client"),
];

impl Cluster {
    /// Starts a cluster of one node with `gpus` GPUs and waits until the node is idle.
    /// `None`, after a printed "SKIPPED" line, where it needs root and
    /// `TORCHTOOLS_TEST_NO_MOUNT` says why it cannot run; a failure otherwise (Slurm
    /// not installed: `cargo xtask setup` installs it).
    pub fn one_node(gpus: u32) -> Option<Cluster> {
        let dir = Cluster::installed()?;
        let node = host_name();
        let cluster = Cluster {
            dir,
            nodes: vec![(node.clone(), None)],
            node,
            hosts: None,
        };
        cluster.start(gpus);
        Some(cluster)
    }

    /// Starts a cluster of two nodes with `gpus` GPUs each, on two hosts (network
    /// namespaces, `tag`: a few letters unique to the test): node `{tag}n0` at
    /// 10.231.0.1 with the controller, `{tag}n1` at 10.231.0.2; the names resolve on
    /// both (an `/etc/hosts` of the cluster's, mounted over the machine's for what runs
    /// there). Slurm's commands ([`Cluster::command`]) run on the first host. `None` as
    /// [`Cluster::one_node`].
    pub fn two_nodes(tag: &str, gpus: u32) -> Option<Cluster> {
        let dir = Cluster::installed()?;
        let hosts = crate::netns::TwoHosts::new(tag)?;
        let nodes: Vec<(String, Option<&'static str>)> = (0..2)
            .map(|i| (format!("{tag}n{i}"), Some(hosts.addr(i))))
            .collect();
        let names: String = nodes
            .iter()
            .map(|(n, a)| format!("{} {n}\n", a.unwrap_or_default()))
            .collect();
        std::fs::write(
            dir.path().join("hosts"),
            format!("127.0.0.1 localhost\n{names}"),
        )
        .unwrap();
        let cluster = Cluster {
            dir,
            node: nodes[0].0.clone(),
            nodes,
            hosts: Some(hosts),
        };
        cluster.start(gpus);
        Some(cluster)
    }

    /// The nodes' names.
    pub fn nodes(&self) -> Vec<&str> {
        self.nodes.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// `program` on node `i`'s host, outside Slurm (on a one-node cluster, here). On
    /// two hosts: in the host's network namespace (`nsenter`, not `ip netns exec`,
    /// which mounts a `/sys` without the cgroups slurmd reads) and a mount namespace of
    /// its own with the cluster's `/etc/hosts`, no interface variable set.
    pub fn on_node(&self, i: usize, program: &str) -> Command {
        let Some(hosts) = &self.hosts else {
            return Command::new(program);
        };
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", hosts.name(i)))
            .args(["unshare", "--mount", "sh", "-c"])
            .arg("mount --bind \"$0\" /etc/hosts && exec \"$@\"")
            .arg(self.dir().join("hosts"))
            .arg(program)
            .env_remove("GLOO_SOCKET_IFNAME")
            .env_remove("NCCL_SOCKET_IFNAME");
        c
    }

    /// The directory of a new cluster, once Slurm is installed and this is root.
    fn installed() -> Option<tempfile::TempDir> {
        if !crate::is_root() {
            crate::skip_knowingly(
                "a Slurm cluster (its daemons run as root)",
                "a Slurm cluster needs root (slurmd runs jobs as their users)",
            );
            return None;
        }
        for (program, package) in PROGRAMS {
            let found = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
                .any(|d| d.join(program).exists());
            assert!(
                found,
                "{program} is not installed: `cargo xtask setup` installs Debian's {package} \
                 (or `apt-get install -y munge slurmctld slurmd slurm-client`)"
            );
        }
        Some(tempfile::tempdir().expect("a directory for the cluster"))
    }

    /// The cluster's directory (its configuration, state and logs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// `program` (`srun`, `sbatch`, `squeue`, ...) talking to this cluster.
    pub fn command(&self, program: &str) -> Command {
        let mut c = self.on_node(0, program);
        c.env("SLURM_CONF", self.dir().join("slurm.conf"));
        c
    }

    /// The cluster's logs, for a failure's message.
    pub fn logs(&self) -> String {
        std::iter::once("slurmctld.log".to_owned())
            .chain(self.nodes.iter().map(|(n, _)| format!("slurmd-{n}.log")))
            .map(|name| {
                let text = std::fs::read_to_string(self.dir().join(&name)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- {name}:\n{}", tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn start(&self, gpus: u32) {
        use std::os::unix::fs::PermissionsExt;
        let d = self.dir();
        // Job users (the test users) read the configuration and reach munge's socket.
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(d.join("state")).unwrap();
        let mut gres = String::new();
        for (node, _) in &self.nodes {
            std::fs::create_dir_all(d.join("spool").join(node)).unwrap();
            std::fs::create_dir_all(d.join("dev").join(node)).unwrap();
            for i in 0..gpus {
                let dev = d.join(format!("dev/{node}/nvidia{i}"));
                run(Command::new("mknod")
                    .arg(&dev)
                    .args(["c", "195", &i.to_string()]));
            }
            let files = if gpus > 1 {
                format!("{}/dev/{node}/nvidia[0-{}]", d.display(), gpus - 1)
            } else {
                format!("{}/dev/{node}/nvidia0", d.display())
            };
            gres += &format!("NodeName={node} Name=gpu File={files}\n");
        }
        let mut key = [0u8; 128];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key)
            .unwrap();
        std::fs::write(d.join("munge.key"), key).unwrap();
        std::fs::set_permissions(d.join("munge.key"), std::fs::Permissions::from_mode(0o400))
            .unwrap();
        let socket = d.join("munge.sock");
        run(Command::new("munged")
            .arg("--force")
            .arg(format!("--socket={}", socket.display()))
            .arg(format!("--key-file={}", d.join("munge.key").display()))
            .arg(format!("--pid-file={}", d.join("munged.pid").display()))
            .arg(format!("--log-file={}", d.join("munged.log").display()))
            .arg(format!("--seed-file={}", d.join("munge.seed").display())));
        let conf = slurm_conf(d, &self.nodes, &socket, gpus);
        std::fs::write(d.join("slurm.conf"), conf).unwrap();
        std::fs::write(d.join("gres.conf"), gres).unwrap();
        let conf = d.join("slurm.conf");
        run(self.on_node(0, "slurmctld").arg("-f").arg(&conf));
        for (i, (node, _)) in self.nodes.iter().enumerate() {
            run(self
                .on_node(i, "slurmd")
                .arg("-f")
                .arg(&conf)
                .args(["-N", node]));
        }
        let start = Instant::now();
        loop {
            let out = self
                .command("sinfo")
                .args(["-h", "-N", "-o", "%T"])
                .output()
                .expect("sinfo");
            let states = String::from_utf8_lossy(&out.stdout);
            if states.lines().filter(|l| l.trim() == "idle").count() == self.nodes.len() {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "the Slurm node is not idle after 120 s: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The jobs first (their processes are slurmstepd's), then the daemons.
        let _ = self
            .command("scancel")
            .args(["--partition", "main"])
            .output();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(30) {
            let out = self.command("squeue").args(["-h", "-o", "%i"]).output();
            if out.is_ok_and(|o| o.stdout.is_empty()) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let pid_files = self
            .nodes
            .iter()
            .map(|(n, _)| format!("slurmd-{n}.pid"))
            .chain(["slurmctld.pid".to_owned(), "munged.pid".to_owned()]);
        for pid_file in pid_files {
            let Some(pid) = std::fs::read_to_string(self.dir().join(&pid_file))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            else {
                continue;
            };
            // SAFETY: kill(2) of a daemon this cluster started (its pid file's).
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let start = Instant::now();
            while Path::new(&format!("/proc/{pid}")).exists()
                && start.elapsed() < Duration::from_secs(10)
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            // SAFETY: as above; a daemon that ignored SIGTERM.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// The cluster's `slurm.conf`: its files under `d` (each node's named after it), ports
/// of its own, its nodes (their addresses, where given), the controller on the first.
/// A requeued job waits `cred_expire` before it starts again (120 s by default): 5 s
/// here.
fn slurm_conf(
    d: &Path,
    nodes: &[(String, Option<&'static str>)],
    socket: &Path,
    gpus: u32,
) -> String {
    let [ctld_port, node_port] = [crate::free_port(), crate::free_port()];
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let p = |name: &str| d.join(name).display().to_string();
    let controller = match nodes[0].1 {
        // The controller's host name is this machine's; its address the first host's.
        Some(addr) => format!("{}({addr})", host_name()),
        None => nodes[0].0.clone(),
    };
    let mut node_lines = String::new();
    for (name, addr) in nodes {
        let addr = addr.map(|a| format!(" NodeAddr={a}")).unwrap_or_default();
        node_lines += &format!(
            "NodeName={name}{addr} CPUs={cpus} RealMemory=1000 Gres=gpu:{gpus} State=UNKNOWN\n"
        );
    }
    let names: Vec<&str> = nodes.iter().map(|(n, _)| n.as_str()).collect();
    let conf = format!(
        "ClusterName=tt\n\
         SlurmctldHost={controller}\n\
         SlurmctldPort={ctld_port}\n\
         SlurmdPort={node_port}\n\
         AuthType=auth/munge\n\
         AuthInfo=socket={socket},cred_expire=5\n\
         CredType=cred/munge\n\
         SlurmUser=root\n\
         SlurmdUser=root\n\
         StateSaveLocation={state}\n\
         SlurmdSpoolDir={spool}\n\
         SlurmctldPidFile={ctld_pid}\n\
         SlurmdPidFile={d_pid}\n\
         SlurmctldLogFile={ctld_log}\n\
         SlurmdLogFile={d_log}\n\
         ProctrackType=proctrack/linuxproc\n\
         TaskPlugin=task/none\n\
         SelectType=select/cons_tres\n\
         SelectTypeParameters=CR_Core\n\
         GresTypes=gpu\n\
         ReturnToService=2\n\
         MpiDefault=none\n\
         SchedulerType=sched/backfill\n\
         SchedulerParameters=sched_interval=1\n\
         AccountingStorageType=accounting_storage/none\n\
         JobAcctGatherType=jobacct_gather/none\n\
         JobCompType=jobcomp/none\n\
         KillWait=5\n\
         {node_lines}\
         PartitionName=main Nodes={names} Default=YES MaxTime=INFINITE State=UP\n",
        names = names.join(","),
        socket = socket.display(),
        state = p("state"),
        spool = p("spool/%n"),
        ctld_pid = p("slurmctld.pid"),
        d_pid = p("slurmd-%n.pid"),
        ctld_log = p("slurmctld.log"),
        d_log = p("slurmd-%n.log"),
    );
    conf
}

fn run(command: &mut Command) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn host_name() -> String {
    let out = Command::new("hostname")
        .arg("-s")
        .output()
        .expect("hostname");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}
