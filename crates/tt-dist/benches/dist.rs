//! `cargo bench -p tt-dist --features c10d` (and `cargo xtask bench`): 2 Gloo ranks on
//! this machine, ours against Python's `torch.distributed` from the setup venv, in one
//! run: all-reduce of 64 MiB (ms per op) and a DDP training step of a small MLP
//! (steps per second). Every process gets `OMP_NUM_THREADS=1`, as torchrun gives.
//!
//! Prints `row|<what>|<ours>|<baseline name>|<baseline>|<unit>|<better>` lines.

use std::process::{Command, Stdio};
use std::time::Instant;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tt_dist::{Ddp, ProcessGroup, ReduceOp};

const ALLREDUCE_MIB: i64 = 64;
const ALLREDUCE_OPS: usize = 20;
const DDP_STEPS: usize = 100;
const BATCH: i64 = 64;

const PYTHON: &str = r#"
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
r = dist.get_rank()
t = torch.ones((64 << 20) // 4)
for _ in range(3): dist.all_reduce(t)
dist.barrier(); s = time.perf_counter()
for _ in range(20): dist.all_reduce(t)
ar = (time.perf_counter() - s) / 20 * 1e3
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256); y = torch.randn(64, 10)
def step():
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
for _ in range(5): step()
dist.barrier(); s = time.perf_counter()
for _ in range(100): step()
sps = 100 / (time.perf_counter() - s)
if r == 0: print(f"result {ar} {sps}")
dist.destroy_process_group()
"#;

fn rank_main() -> Result<(), String> {
    let pg = ProcessGroup::from_env().map_err(|e| e.to_string())?;
    let t = Tensor::ones([(ALLREDUCE_MIB << 20) / 4], (Kind::Float, Device::Cpu));
    for _ in 0..3 {
        pg.all_reduce(&t, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
    }
    pg.barrier().map_err(|e| e.to_string())?;
    let s = Instant::now();
    for _ in 0..ALLREDUCE_OPS {
        pg.all_reduce(&t, ReduceOp::Sum)
            .map_err(|e| e.to_string())?;
    }
    let ar = s.elapsed().as_secs_f64() / ALLREDUCE_OPS as f64 * 1e3;

    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let model = nn::seq()
        .add(nn::linear(&root / "l1", 256, 512, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "l2", 512, 512, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "l3", 512, 10, Default::default()));
    let ddp = Ddp::new(&pg, &vs).map_err(|e| e.to_string())?;
    let mut opt = nn::Sgd::default()
        .build(&vs, 0.01)
        .map_err(|e| e.to_string())?;
    let x = Tensor::randn([BATCH, 256], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([BATCH, 10], (Kind::Float, Device::Cpu));
    let mut step = || -> Result<(), String> {
        opt.zero_grad();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        ddp.backward(&loss).map_err(|e| e.to_string())?;
        opt.step();
        Ok(())
    };
    for _ in 0..5 {
        step()?;
    }
    pg.barrier().map_err(|e| e.to_string())?;
    let s = Instant::now();
    for _ in 0..DDP_STEPS {
        step()?;
    }
    let sps = DDP_STEPS as f64 / s.elapsed().as_secs_f64();
    if pg.is_main() {
        println!("result {ar} {sps}");
    }
    pg.barrier().map_err(|e| e.to_string())
}

/// Runs 2 ranks of `program args`; rank 0's "result <ms> <steps/s>".
fn two_ranks(program: &str, args: &[&str], role: bool) -> (f64, f64) {
    let port = tt_dist::free_port("127.0.0.1").expect("a free port");
    let children: Vec<_> = (0..2)
        .map(|r| {
            let mut c = Command::new(program);
            c.args(args)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("OMP_NUM_THREADS", "1")
                .env("TORCHTOOLS_DEVICE", "cpu")
                .stdout(Stdio::piped());
            if role {
                c.env("TT_BENCH_ROLE", "rank");
            }
            c.spawn().expect("spawn a rank")
        })
        .collect();
    let mut result = None;
    for c in children {
        let out = c.wait_with_output().expect("wait for a rank");
        assert!(
            out.status.success(),
            "{program} rank failed: {}",
            out.status
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if let Some(line) = text.lines().find(|l| l.starts_with("result ")) {
            let v: Vec<f64> = line
                .split_whitespace()
                .skip(1)
                .map(|x| x.parse().expect("a number"))
                .collect();
            result = Some((v[0], v[1]));
        }
    }
    result.expect("rank 0 printed its result")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if std::env::var_os("TT_BENCH_ROLE").is_some() {
        if let Err(e) = rank_main() {
            eprintln!("bench rank failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    let python = std::env::var("TORCHTOOLS_PYTHON").expect("TORCHTOOLS_PYTHON (cargo xtask setup)");
    let exe = std::env::current_exe().expect("own path");
    let exe = exe.to_str().expect("a UTF-8 path");
    // Alternate ours and Python's, 3 rounds, medians: the machine's noise hits both.
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        ours.push(two_ranks(exe, &[], true));
        theirs.push(two_ranks(&python, &["-c", PYTHON], false));
    }
    let o_ar = median(ours.iter().map(|r| r.0).collect());
    let p_ar = median(theirs.iter().map(|r| r.0).collect());
    let o_sps = median(ours.iter().map(|r| r.1).collect());
    let p_sps = median(theirs.iter().map(|r| r.1).collect());
    println!("row|tt-dist: Gloo all_reduce 64 MiB, 2 ranks|{o_ar:.2}|torch.distributed (Python)|{p_ar:.2}|ms/op|lower");
    println!("row|tt-dist: DDP step, MLP 256-512-512-10, 2x64|{o_sps:.1}|torch DDP (Python)|{p_sps:.1}|step/s|higher");
}
