//! `cargo bench -p tt-dist --features c10d` (and `cargo xtask bench`): 2 Gloo ranks on
//! this machine, ours against Python's `torch.distributed` from the setup venv, in one
//! run: all-reduce of 64 MiB (ms per op), a DDP training step of a small MLP and of a
//! large one where communication matters (steps per second), the large one also with
//! the all-reduce started only after the backward pass (no overlap), to show what the
//! Reducer's overlap is worth. Every process gets `OMP_NUM_THREADS=1`, as torchrun gives.
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
import os, sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
r = dist.get_rank()
large = sys.argv[1] == "large"
ar = 0.0
if not large:
    t = torch.ones((64 << 20) // 4)
    for _ in range(3): dist.all_reduce(t)
    dist.barrier(); s = time.perf_counter()
    for _ in range(20): dist.all_reduce(t)
    ar = (time.perf_counter() - s) / 20 * 1e3
torch.manual_seed(0)
L = torch.nn.Linear
if large:
    net = torch.nn.Sequential(L(784, 4096), torch.nn.ReLU(), L(4096, 4096), torch.nn.ReLU(), L(4096, 4096), torch.nn.ReLU(), L(4096, 10))
    batch, inp, warm, steps = 128, 784, 2, 6
else:
    net = torch.nn.Sequential(L(256, 512), torch.nn.ReLU(), L(512, 512), torch.nn.ReLU(), L(512, 10))
    batch, inp, warm, steps = 64, 256, 5, 100
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(batch, inp); y = torch.randn(batch, 10)
def step():
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
for _ in range(warm): step()
dist.barrier(); s = time.perf_counter()
for _ in range(steps): step()
sps = steps / (time.perf_counter() - s)
if r == 0: print(f"result {ar} {sps}")
dist.destroy_process_group()
"#;

/// The measured shape of a run: which MLP, and whether the gradients' all-reduce may
/// overlap the backward pass.
#[derive(Clone, Copy, PartialEq)]
enum Run {
    Small,
    Large,
    LargeNoOverlap,
}

impl Run {
    fn name(self) -> &'static str {
        match self {
            Run::Small => "small",
            Run::Large => "large",
            Run::LargeNoOverlap => "large-no-overlap",
        }
    }

    fn from_name(name: &str) -> Run {
        match name {
            "large" => Run::Large,
            "large-no-overlap" => Run::LargeNoOverlap,
            _ => Run::Small,
        }
    }
}

/// The gradients averaged after the whole backward pass: 25 MiB buckets of flattened
/// gradients all-reduced concurrently (what tt-dist did before the Reducer).
fn all_reduce_after_backward(pg: &ProcessGroup, vs: &nn::VarStore) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = vs.trainable_variables().iter().map(Tensor::grad).collect();
    let mut buckets: Vec<Vec<&Tensor>> = vec![Vec::new()];
    let mut bytes = 0;
    for g in &grads {
        let size = g.numel() * 4;
        if bytes > 0 && bytes + size > 25 << 20 {
            buckets.push(Vec::new());
            bytes = 0;
        }
        buckets.last_mut().expect("one bucket").push(g);
        bytes += size;
    }
    let flats: Vec<Tensor> = buckets
        .iter()
        .map(|b| Tensor::cat(&b.iter().map(|g| g.view([-1])).collect::<Vec<_>>(), 0))
        .collect();
    let works = flats
        .iter()
        .map(|f| pg.all_reduce_async(f, ReduceOp::Avg))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    for ((bucket, flat), work) in buckets.iter().zip(&flats).zip(works) {
        work.wait().map_err(|e| e.to_string())?;
        let mut offset = 0;
        for g in bucket {
            let n = g.numel() as i64;
            g.shallow_clone()
                .copy_(&flat.narrow(0, offset, n).view_as(g));
            offset += n;
        }
    }
    Ok(())
}

fn rank_main() -> Result<(), String> {
    let run = Run::from_name(&std::env::var("TT_BENCH_RUN").unwrap_or_default());
    let pg = ProcessGroup::from_env().map_err(|e| e.to_string())?;
    let mut ar = 0.0;
    if run == Run::Small {
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
        ar = s.elapsed().as_secs_f64() / ALLREDUCE_OPS as f64 * 1e3;
    }

    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let (widths, batch, warm, steps): (&[i64], i64, usize, usize) = match run {
        Run::Small => (&[256, 512, 512, 10], BATCH, 5, DDP_STEPS),
        Run::Large | Run::LargeNoOverlap => (&[784, 4096, 4096, 4096, 10], 128, 2, 6),
    };
    let mut model = nn::seq();
    for (i, w) in widths.windows(2).enumerate() {
        if i > 0 {
            model = model.add_fn(|x| x.relu());
        }
        model = model.add(nn::linear(
            &root / format!("l{i}"),
            w[0],
            w[1],
            Default::default(),
        ));
    }
    let ddp = Ddp::new(&pg, &vs).map_err(|e| e.to_string())?;
    let mut opt = nn::Sgd::default()
        .build(&vs, 0.01)
        .map_err(|e| e.to_string())?;
    let x = Tensor::randn([batch, widths[0]], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([batch, 10], (Kind::Float, Device::Cpu));
    let mut step = || -> Result<(), String> {
        opt.zero_grad();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        if run == Run::LargeNoOverlap {
            ddp.no_sync(|| ddp.backward(&loss))
                .map_err(|e| e.to_string())?;
            all_reduce_after_backward(&pg, &vs)?;
        } else {
            ddp.backward(&loss).map_err(|e| e.to_string())?;
        }
        opt.step();
        Ok(())
    };
    for _ in 0..warm {
        step()?;
    }
    pg.barrier().map_err(|e| e.to_string())?;
    let s = Instant::now();
    for _ in 0..steps {
        step()?;
    }
    let sps = steps as f64 / s.elapsed().as_secs_f64();
    if pg.is_main() {
        println!("result {ar} {sps}");
    }
    pg.barrier().map_err(|e| e.to_string())
}

/// Runs 2 ranks of `program args`; rank 0's "result <ms> <steps/s>".
fn two_ranks(program: &str, args: &[&str], role: Option<Run>) -> (f64, f64) {
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
            if let Some(run) = role {
                c.env("TT_BENCH_ROLE", "rank")
                    .env("TT_BENCH_RUN", run.name());
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

use tt_testkit::bench::median;

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
    let (mut large, mut large_py, mut large_serial) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        ours.push(two_ranks(exe, &[], Some(Run::Small)));
        theirs.push(two_ranks(&python, &["-c", PYTHON, "small"], None));
        large.push(two_ranks(exe, &[], Some(Run::Large)).1);
        large_py.push(two_ranks(&python, &["-c", PYTHON, "large"], None).1);
        large_serial.push(two_ranks(exe, &[], Some(Run::LargeNoOverlap)).1);
    }
    let o_ar = median(ours.iter().map(|r| r.0).collect());
    let p_ar = median(theirs.iter().map(|r| r.0).collect());
    let o_sps = median(ours.iter().map(|r| r.1).collect());
    let p_sps = median(theirs.iter().map(|r| r.1).collect());
    let (l, lp, ls) = (median(large), median(large_py), median(large_serial));
    println!("row|tt-dist: Gloo all_reduce 64 MiB, 2 ranks|{o_ar:.2}|torch.distributed (Python)|{p_ar:.2}|ms/op|lower");
    println!("row|tt-dist: DDP step, MLP 256-512-512-10, 2x64|{o_sps:.1}|torch DDP (Python)|{p_sps:.1}|step/s|higher");
    println!("row|tt-dist: DDP step, MLP 784-4096x3-10, 2x128|{l:.3}|torch DDP (Python)|{lp:.3}|step/s|higher");
    println!("row|tt-dist: DDP step, MLP 784-4096x3-10, 2x128, overlap|{l:.3}|all-reduce after backward (ours)|{ls:.3}|step/s|higher");
}
