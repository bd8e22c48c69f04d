//! Process groups on c10d with real processes over loopback (Gloo, CPU).
//!
//! A custom harness (`harness = false`): run without `TT_DIST_ROLE`, this binary is the
//! test runner; each test launches ranks by re-executing this binary with
//! `TT_DIST_ROLE=<role>` and torchrun's variables (through `tt_dist::launch`, or by
//! hand where a test needs to watch each rank), and Python ranks from the setup venv.
//! A rank checks its own results and exits non-zero with the mismatch on stderr.

use std::ffi::OsString;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Kind, Tensor};
use tt_dist::{launch, DistEnv, GroupOptions, LaunchConfig, ProcessGroup, ReduceOp};

type TestResult = Result<(), String>;

fn main() {
    if let Ok(role) = std::env::var("TT_DIST_ROLE") {
        let code = match rank_main(&role) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("rank failed: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    let tests: &[(&str, tt_testkit::TestFn)] = &[
        ("collectives_on_2_ranks", || collectives(2)),
        ("collectives_on_4_ranks", || collectives(4)),
        ("world_size_1_group_and_single_process_group", world_of_one),
        (
            "ddp_on_2_ranks_matches_one_process_on_the_whole_batch",
            || ddp(2, 1, 1 << 20),
        ),
        (
            "ddp_small_buckets_and_no_sync_accumulation_match_too",
            || ddp(2, 2, 200),
        ),
        ("ddp_on_4_ranks_matches_one_process", || ddp(4, 1, 1 << 20)),
        (
            "ddp_with_an_unused_parameter_needs_find_unused_parameters",
            ddp_unused,
        ),
        ("rust_and_python_ddp_ranks_train_one_model", python_ddp),
        ("rust_and_python_ranks_form_one_gloo_group", python_interop),
        ("our_binary_runs_under_torchrun_no_python", under_torchrun),
        (
            "rust_ranks_on_two_hosts_find_the_interface_to_the_master",
            two_hosts,
        ),
        (
            "a_killed_rank_is_an_error_on_the_others_not_a_hang",
            killed_rank,
        ),
        ("a_hung_rank_is_an_error_after_the_timeout", hung_rank),
        ("a_busy_port_is_a_clear_error", busy_port),
        ("bad_environment_is_a_clear_error", bad_env),
    ];
    tt_testkit::run_tests(tests);
}

// ---------------------------------------------------------------- ranks

fn rank_main(role: &str) -> TestResult {
    let timeout = Duration::from_secs_f64(
        std::env::var("TT_TIMEOUT_S")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60.0),
    );
    let opts = GroupOptions::default().timeout(timeout);
    let env = DistEnv::from_env().map_err(|e| e.to_string())?;
    let pg = ProcessGroup::new(&env, &opts).map_err(|e| e.to_string())?;
    match role {
        "collectives" => check_default_backend(&pg).and_then(|()| check_collectives(&pg)),
        "interop" => {
            // Python rank 1 runs the same steps (see PY_INTEROP).
            let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]) * (pg.rank() as f64 + 1.0);
            pg.all_reduce(&t, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            expect_eq(
                &t,
                &(Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]) * 3.0),
                "interop sum",
            )?;
            let b = Tensor::from_slice(&[pg.rank() as i64 * 7 + 1; 3]);
            pg.broadcast(&b, 1).map_err(|e| e.to_string())?;
            expect_eq(&b, &Tensor::from_slice(&[8i64; 3]), "interop broadcast")?;
            let g = pg
                .all_gather(&Tensor::from_slice(&[pg.rank() as f64 + 0.5]))
                .map_err(|e| e.to_string())?;
            expect_eq(&g[1], &Tensor::from_slice(&[1.5f64]), "interop gather")?;
            pg.barrier().map_err(|e| e.to_string())
        }
        "die" => {
            let t = Tensor::ones([1024], (Kind::Float, tch::Device::Cpu));
            pg.all_reduce(&t, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if pg.rank() == 1 {
                // Gone without a word, as a crashed or OOM-killed rank would be.
                std::process::exit(3);
            }
            let start = Instant::now();
            for _ in 0..1000 {
                if let Err(e) = pg.all_reduce(&t, ReduceOp::Sum) {
                    println!("\n@@error@@ {:.3} {e}", start.elapsed().as_secs_f64());
                    return Ok(());
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err("the collectives kept succeeding after rank 1 died".into())
        }
        "ddp" => {
            let accum: i64 = std::env::var("TT_DDP_ACCUM")
                .map_err(|e| e.to_string())?
                .parse()
                .map_err(|e| format!("TT_DDP_ACCUM: {e}"))?;
            let bucket: usize = std::env::var("TT_DDP_BUCKET")
                .map_err(|e| e.to_string())?
                .parse()
                .map_err(|e| format!("TT_DDP_BUCKET: {e}"))?;
            // Different seeds per rank: DDP's broadcast must make them agree.
            tch::manual_seed(1000 + pg.rank() as i64);
            let (vs, model) = mlp();
            let ddp =
                tt_dist::Ddp::with_bucket_bytes(&pg, &vs, bucket).map_err(|e| e.to_string())?;
            // PyTorch's DDP: one bucket until the first backward shows the order in which
            // gradients become ready, then buckets of the size asked for.
            if ddp.bucket_count() != 1 {
                return Err(format!(
                    "{} buckets before the first step",
                    ddp.bucket_count()
                ));
            }
            let mut opt = sgd(&vs);
            let (x, y) = data();
            let w = pg.world_size() as i64;
            let rows = x.size()[0] / (w * accum);
            for _ in 0..STEPS {
                opt.zero_grad();
                for m in 0..accum {
                    // Rank r's micro-batch m: rows of chunk m * w + r.
                    let start = (m * w + pg.rank() as i64) * rows;
                    let loss = model
                        .forward(&x.narrow(0, start, rows))
                        .mse_loss(&y.narrow(0, start, rows), tch::Reduction::Mean);
                    if m + 1 < accum {
                        ddp.no_sync(|| ddp.backward(&loss))
                            .map_err(|e| e.to_string())?;
                    } else {
                        ddp.backward(&loss).map_err(|e| e.to_string())?;
                    }
                }
                opt.step();
            }
            if bucket < 256 && ddp.bucket_count() < 2 {
                return Err(format!("{bucket} B buckets gave {}", ddp.bucket_count()));
            }
            let out = std::env::var("TT_DDP_OUT").map_err(|e| e.to_string())?;
            vs.save(format!("{out}.rank{}.safetensors", pg.rank()))
                .map_err(|e| e.to_string())
        }
        "ddp_unused" => {
            // l3 is defined but never used by the forward pass.
            let find = std::env::var("TT_DDP_FIND_UNUSED").as_deref() == Ok("1");
            tch::manual_seed(1000 + pg.rank() as i64);
            let (vs, model) = mlp();
            let unused = nn::linear(vs.root() / "l3", 4, 4, Default::default());
            let opts = tt_dist::DdpOptions::default().find_unused_parameters(find);
            let ddp = tt_dist::Ddp::with_options(&pg, &vs, &opts).map_err(|e| e.to_string())?;
            let mut opt = sgd(&vs);
            for step in 0..STEPS {
                opt.zero_grad();
                if let Err(e) = ddp.backward(&rank_loss(&model, &pg)) {
                    let e = e.to_string();
                    if !find && step == 1 && e.contains("find_unused_parameters(true)") {
                        println!("@@refused@@");
                        return Ok(());
                    }
                    return Err(format!("step {step}: {e}"));
                }
                opt.step();
            }
            if !find {
                return Err(
                    "an unused parameter without find_unused_parameters went unnoticed".into(),
                );
            }
            if unused.ws.grad().defined() {
                return Err("the unused parameter got a gradient".into());
            }
            save_rank(&vs, &pg)
        }
        "ddp_py" => {
            // Rank 0 (Rust or Python) sets PY_DDP's known start; DDP's broadcast gives it
            // to the others.
            tch::manual_seed(77 + pg.rank() as i64);
            let (vs, model) = mlp();
            if pg.rank() == 0 {
                known_start(&vs);
            }
            let ddp = tt_dist::Ddp::new(&pg, &vs).map_err(|e| e.to_string())?;
            let mut opt = sgd(&vs);
            for _ in 0..STEPS {
                opt.zero_grad();
                ddp.backward(&rank_loss(&model, &pg))
                    .map_err(|e| e.to_string())?;
                opt.step();
            }
            save_rank(&vs, &pg)
        }
        "hang" => {
            let t = Tensor::ones([1024], (Kind::Float, tch::Device::Cpu));
            pg.all_reduce(&t, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            if pg.rank() == 1 {
                // Alive but stuck (a deadlock, a stopped process): its sockets stay open.
                std::thread::sleep(Duration::from_secs(30));
                return Ok(());
            }
            let start = Instant::now();
            match pg.all_reduce(&t, ReduceOp::Sum) {
                Err(e) => {
                    println!("\n@@error@@ {:.3} {e}", start.elapsed().as_secs_f64());
                    std::process::exit(0);
                }
                Ok(()) => Err("the all-reduce with a stuck peer succeeded".into()),
            }
        }
        other => Err(format!("unknown role {other}")),
    }
}

const STEPS: usize = 5;

fn mlp() -> (nn::VarStore, impl Module) {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let root = vs.root();
    let model = nn::seq()
        .add(nn::linear(&root / "l1", 8, 32, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 32, 4, Default::default()));
    (vs, model)
}

fn sgd(vs: &nn::VarStore) -> nn::Optimizer {
    nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, 0.05)
    .expect("SGD over a VarStore")
}

/// 16 rows, the same in every process.
fn data() -> (Tensor, Tensor) {
    let x = (Tensor::arange(16 * 8, (Kind::Float, tch::Device::Cpu)) * 0.37)
        .sin()
        .view([16, 8]);
    let y = (Tensor::arange(16 * 4, (Kind::Float, tch::Device::Cpu)) * 0.11)
        .cos()
        .view([16, 4]);
    (x, y)
}

/// This rank's loss: the mean squared error on its share of `data()`'s rows.
fn rank_loss(model: &impl Module, pg: &ProcessGroup) -> Tensor {
    let (x, y) = data();
    let rows = x.size()[0] / pg.world_size() as i64;
    let start = pg.rank() as i64 * rows;
    model
        .forward(&x.narrow(0, start, rows))
        .mse_loss(&y.narrow(0, start, rows), tch::Reduction::Mean)
}

/// Saves this rank's parameters as `$TT_DDP_OUT.rank<r>.safetensors`.
fn save_rank(vs: &nn::VarStore, pg: &ProcessGroup) -> TestResult {
    let out = std::env::var("TT_DDP_OUT").map_err(|e| e.to_string())?;
    vs.save(format!("{out}.rank{}.safetensors", pg.rank()))
        .map_err(|e| e.to_string())
}

/// The parameters PY_DDP's `known_start` sets: parameter k (definition order) is
/// `sin(0.37 * i + k) * 0.3`.
fn known_start(vs: &nn::VarStore) {
    let _guard = tch::no_grad_guard();
    let vars = vs.variables();
    let in_pytorch_order = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"];
    for (k, mut t) in in_pytorch_order
        .iter()
        .map(|n| vars[*n].shallow_clone())
        .enumerate()
    {
        let n = t.numel() as i64;
        let v = ((Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 0.37 + k as f64).sin()
            * 0.3)
            .view(t.size().as_slice());
        t.copy_(&v);
    }
}

/// Trains the reference: one process, the whole batch, `STEPS` steps of `sgd`.
fn train_whole_batch(vs: &nn::VarStore, model: &impl Module) {
    let mut opt = sgd(vs);
    let (x, y) = data();
    for _ in 0..STEPS {
        opt.zero_grad();
        model
            .forward(&x)
            .mse_loss(&y, tch::Reduction::Mean)
            .backward();
        opt.step();
    }
}

/// Every `{out}.rank{r}.safetensors` of `ranks` equals `want` (1e-5).
fn saved_ranks_equal(
    out: &std::path::Path,
    ranks: std::ops::Range<usize>,
    want: &nn::VarStore,
) -> TestResult {
    let want = want.variables();
    for rank in ranks {
        let got = Tensor::read_safetensors(format!("{}.rank{rank}.safetensors", out.display()))
            .map_err(|e| e.to_string())?;
        if got.len() != want.len() {
            return Err(format!("rank {rank} saved {} tensors", got.len()));
        }
        for (name, t) in got {
            let diff = (&t - &want[&name]).abs().max().double_value(&[]);
            if diff > 1e-5 {
                return Err(format!("rank {rank} {name} differs by {diff}"));
            }
        }
    }
    Ok(())
}

fn expect_eq(got: &Tensor, want: &Tensor, what: &str) -> TestResult {
    let ok = if got.kind() == Kind::Int64 {
        got.equal(want)
    } else {
        got.allclose(want, 1e-6, 1e-6, false)
    };
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?} want {want:?}"))
    }
}

/// A launched rank's group: no backend asked for, so NCCL for a CUDA device when NCCL
/// is built, else Gloo.
fn check_default_backend(pg: &ProcessGroup) -> TestResult {
    let cuda = matches!(tt_device::select(), Ok(tch::Device::Cuda(_)));
    let expected = if cuda && tt_sys::c10d::nccl_built() {
        tt_dist::BackendKind::Nccl
    } else {
        tt_dist::BackendKind::Gloo
    };
    if pg.backend() != Some(expected) {
        return Err(format!(
            "the default backend is {:?}, expected {expected:?} (CUDA: {cuda})",
            pg.backend()
        ));
    }
    Ok(())
}

fn check_collectives(pg: &ProcessGroup) -> TestResult {
    let w = pg.world_size() as i64;
    let r = pg.rank() as i64;
    let err = |e: tt_dist::Error| e.to_string();
    // Gloo and the group of one reduce scalars on the CPU (NCCL: the rank's GPU).
    if pg.scalar_device() != tch::Device::Cpu {
        return Err(format!("scalars on {:?} for {pg:?}", pg.scalar_device()));
    }
    for kind in [Kind::Float, Kind::Double, Kind::Int64] {
        for n in [1i64, 1000, (1 << 18) + 3] {
            let opts = (kind, tch::Device::Cpu);
            let base = Tensor::arange(n, opts);
            let what = |op: &str| format!("{op} {kind:?} n={n} rank {r}/{w}");

            let t = &base * (r + 1);
            pg.all_reduce(&t, ReduceOp::Sum).map_err(err)?;
            expect_eq(&t, &(&base * (w * (w + 1) / 2)), &what("sum"))?;

            let t = &base + r;
            pg.all_reduce(&t, ReduceOp::Min).map_err(err)?;
            expect_eq(&t, &base, &what("min"))?;

            let t = &base + r;
            pg.all_reduce(&t, ReduceOp::Max).map_err(err)?;
            expect_eq(&t, &(&base + (w - 1)), &what("max"))?;

            if kind != Kind::Int64 {
                let t = &base * (r + 1);
                pg.all_reduce(&t, ReduceOp::Avg).map_err(err)?;
                let mean = (w + 1) as f64 / 2.0;
                expect_eq(&t, &(&base * mean), &what("avg"))?;
            } else {
                let t = base.copy();
                if pg.all_reduce(&t, ReduceOp::Avg).is_ok() {
                    return Err(what("avg of int64 should be refused"));
                }
                let parts: Vec<Tensor> = (0..w).map(|_| base.copy()).collect();
                if pg.reduce_scatter(&t, &parts, ReduceOp::Avg).is_ok() {
                    return Err(what("reduce_scatter avg of int64 should be refused"));
                }
            }

            let t = &base + r * 100;
            let root = (w - 1) as usize;
            pg.broadcast(&t, root).map_err(err)?;
            expect_eq(&t, &(&base + (w - 1) * 100), &what("broadcast"))?;

            let gathered = pg.all_gather(&(&base + r)).map_err(err)?;
            if gathered.len() != w as usize {
                return Err(what("all_gather length"));
            }
            for (i, g) in gathered.iter().enumerate() {
                expect_eq(g, &(&base + i as i64), &what("all_gather"))?;
            }

            // inputs[j] = base + 10*rank + j; rank j receives sum over ranks.
            let inputs: Vec<Tensor> = (0..w).map(|j| &base + (10 * r + j)).collect();
            let out = base.empty_like();
            pg.reduce_scatter(&out, &inputs, ReduceOp::Sum)
                .map_err(err)?;
            let want = &base * w + (10 * w * (w - 1) / 2 + w * r);
            expect_eq(&out, &want, &what("reduce_scatter"))?;
        }
    }
    // Numbers for metrics and batch agreement.
    let loss = pg.all_reduce_f64(r as f64, ReduceOp::Avg).map_err(err)?;
    if (loss - (w - 1) as f64 / 2.0).abs() > 1e-12 {
        return Err(format!("all_reduce_f64 avg gave {loss}"));
    }
    let agreed = pg.min_over_ranks(64 - r as u64).map_err(err)?;
    if agreed != 64 - (w as u64 - 1) {
        return Err(format!("min_over_ranks gave {agreed}"));
    }
    pg.barrier().map_err(err)
}

// ---------------------------------------------------------------- tests

fn exe() -> OsString {
    std::env::current_exe()
        .expect("the test binary's own path")
        .into_os_string()
}

/// Runs `role` on `n` ranks through the real launcher; Ok when all exit 0.
fn launch_role(n: usize, role: &str) -> TestResult {
    std::env::set_var("TT_DIST_ROLE", role);
    let outcome = launch(&LaunchConfig::local(n, exe(), Vec::new()));
    std::env::remove_var("TT_DIST_ROLE");
    let outcome = outcome.map_err(|e| e.to_string())?;
    if outcome.code != 0 {
        return Err(format!("launch of {n} ranks: {outcome:?}"));
    }
    Ok(())
}

fn collectives(n: usize) -> TestResult {
    launch_role(n, "collectives")
}

fn ddp(ranks: usize, accum: i64, bucket: usize) -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = dir.path().join("params");
    std::env::set_var("TT_DDP_ACCUM", accum.to_string());
    std::env::set_var("TT_DDP_BUCKET", bucket.to_string());
    std::env::set_var("TT_DDP_OUT", &out);
    launch_role(ranks, "ddp")?;
    // The reference: one process, the whole batch (accumulated the same way).
    tch::manual_seed(1000);
    let (vs, model) = mlp();
    let mut opt = sgd(&vs);
    let (x, y) = data();
    let rows = x.size()[0] / accum;
    for _ in 0..STEPS {
        opt.zero_grad();
        for m in 0..accum {
            let loss = model
                .forward(&x.narrow(0, m * rows, rows))
                .mse_loss(&y.narrow(0, m * rows, rows), tch::Reduction::Mean);
            loss.backward();
        }
        opt.step();
    }
    let want = vs.variables();
    let start = tch::Tensor::cat(
        &[want["l1.weight"].view([-1]), want["l2.bias"].view([-1])],
        0,
    );
    saved_ranks_equal(&out, 0..ranks, &vs)?;
    // Training moved the parameters (the comparison is not of initial values).
    tch::manual_seed(1000);
    let (fresh, _) = mlp();
    let init = fresh.variables();
    let before = tch::Tensor::cat(
        &[init["l1.weight"].view([-1]), init["l2.bias"].view([-1])],
        0,
    );
    if (&start - &before).abs().max().double_value(&[]) < 1e-3 {
        return Err("the parameters did not move".into());
    }
    Ok(())
}

fn ddp_unused() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = dir.path().join("params");
    std::env::set_var("TT_DDP_OUT", &out);
    // Without the option, the Reducer stops the second step and says what to do.
    std::env::set_var("TT_DDP_FIND_UNUSED", "0");
    launch_role(2, "ddp_unused")?;
    std::env::set_var("TT_DDP_FIND_UNUSED", "1");
    launch_role(2, "ddp_unused")?;
    std::env::remove_var("TT_DDP_FIND_UNUSED");
    tch::manual_seed(1000);
    let (vs, model) = mlp();
    let _unused = nn::linear(vs.root() / "l3", 4, 4, Default::default());
    train_whole_batch(&vs, &model);
    saved_ranks_equal(&out, 0..2, &vs)
}

const PY_DDP: &str = r#"
import json, os, sys, torch, torch.distributed as dist
from datetime import timedelta
from torch import nn
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
r, w = dist.get_rank(), dist.get_world_size()
torch.manual_seed(500 + r)
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 32)
        self.l2 = nn.Linear(32, 4)
    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))
m = M()
if r == 0:
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            p.copy_(((torch.arange(p.numel(), dtype=torch.float32) * 0.37 + k).sin() * 0.3).view(p.shape))
ddp = nn.parallel.DistributedDataParallel(m)
opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
x = (torch.arange(16 * 8, dtype=torch.float32) * 0.37).sin().view(16, 8)
y = (torch.arange(16 * 4, dtype=torch.float32) * 0.11).cos().view(16, 4)
rows = 16 // w
for _ in range(int(os.environ["TT_STEPS"])):
    opt.zero_grad()
    out = ddp(x[r * rows:(r + 1) * rows])
    nn.functional.mse_loss(out, y[r * rows:(r + 1) * rows]).backward()
    opt.step()
for name, p in m.named_parameters():
    print("@@param@@", name, json.dumps(p.detach().flatten().tolist()))
dist.destroy_process_group()
"#;

fn python_ddp() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let out = dir.path().join("params");
    // The reference: one process on the whole batch from the known start.
    let (want, model) = mlp();
    known_start(&want);
    train_whole_batch(&want, &model);
    let named = want.variables();
    // Both orders: Rust's parameters broadcast to Python, then Python's to Rust.
    for rust_rank in [0usize, 1] {
        let port = free_port();
        let mut rust = rank_command("ddp_py", rust_rank, 2, port);
        rust.env("TT_DDP_OUT", &out);
        let mut py = python_rank(PY_DDP, 1 - rust_rank, port);
        py.env("TT_STEPS", STEPS.to_string());
        let py_out = run_pair(rust, py, rust_rank)?;
        saved_ranks_equal(&out, rust_rank..rust_rank + 1, &want)?;
        let said = String::from_utf8_lossy(&py_out.stdout);
        let mut seen = 0;
        for line in said.lines().filter_map(|l| l.strip_prefix("@@param@@ ")) {
            let (name, values) = line.split_once(' ').ok_or(format!("python said {line}"))?;
            let values: Vec<f32> =
                serde_json::from_str(values).map_err(|e| format!("{e}: {line}"))?;
            let w = named
                .get(name)
                .ok_or(format!("python has {name}, Rust does not"))?;
            let got = Tensor::from_slice(&values).view(w.size().as_slice());
            let diff = (&got - w).abs().max().double_value(&[]);
            if diff > 1e-5 {
                return Err(format!(
                    "python rank {}: {name} differs by {diff}",
                    1 - rust_rank
                ));
            }
            seen += 1;
        }
        if seen != named.len() {
            return Err(format!("python printed {seen} parameters: {said}"));
        }
    }
    Ok(())
}

fn world_of_one() -> TestResult {
    // torchrun with one process: a real Gloo group of one.
    launch_role(1, "collectives")?;
    // No launcher at all: the networkless group, same answers.
    let pg = ProcessGroup::single();
    if pg.backend().is_some() || pg.world_size() != 1 || !pg.is_main() {
        return Err(format!("single group: {pg:?}"));
    }
    check_collectives(&pg)
}

fn free_port() -> u16 {
    tt_dist::free_port("127.0.0.1").expect("a free port")
}

fn rank_command(role: &str, rank: usize, world: usize, port: u16) -> Command {
    let mut cmd = Command::new(exe());
    cmd.env("TT_DIST_ROLE", role)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

const PY_INTEROP: &str = r#"
import os, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
r = dist.get_rank()
t = torch.tensor([1.0, 2.0, 3.0, 4.0]) * (r + 1)
dist.all_reduce(t)
assert torch.equal(t, torch.tensor([1.0, 2.0, 3.0, 4.0]) * 3), t
b = torch.full((3,), r * 7 + 1, dtype=torch.int64)
dist.broadcast(b, src=1)
assert torch.equal(b, torch.full((3,), 8, dtype=torch.int64)), b
outs = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
dist.all_gather(outs, torch.tensor([r + 0.5], dtype=torch.float64))
assert outs[0].item() == 0.5 and outs[1].item() == 1.5, outs
dist.barrier()
dist.destroy_process_group()
print("python rank", r, "ok")
"#;

fn python() -> String {
    tt_testkit::python_path()
}

/// Rank `rank` of a group of 2 as a Python process running `script`.
fn python_rank(script: &str, rank: usize, port: u16) -> Command {
    let mut py = Command::new(python());
    py.args(["-c", script])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    py
}

/// Runs a Rust rank and a Python rank together; the Python rank's output when both
/// succeed, else an error with both ranks' stderr.
fn run_pair(
    mut rust: Command,
    mut py: Command,
    rust_rank: usize,
) -> Result<std::process::Output, String> {
    let rust = rust.spawn().map_err(|e| e.to_string())?;
    let py = py.spawn().map_err(|e| e.to_string())?;
    let rust_out = rust.wait_with_output().map_err(|e| e.to_string())?;
    let py_out = py.wait_with_output().map_err(|e| e.to_string())?;
    if !rust_out.status.success() || !py_out.status.success() {
        return Err(format!(
            "rust rank {rust_rank}: {} {}\npython: {} {}",
            rust_out.status,
            String::from_utf8_lossy(&rust_out.stderr),
            py_out.status,
            String::from_utf8_lossy(&py_out.stderr),
        ));
    }
    Ok(py_out)
}

fn python_interop() -> TestResult {
    // Both orders: Rust serves the store (rank 0), then Python does.
    for rust_rank in [0usize, 1] {
        let port = free_port();
        let rust = rank_command("interop", rust_rank, 2, port);
        let py_out = run_pair(
            rust,
            python_rank(PY_INTEROP, 1 - rust_rank, port),
            rust_rank,
        )?;
        let said = String::from_utf8_lossy(&py_out.stdout);
        if !said.contains("ok") {
            return Err(format!("python said {said}"));
        }
    }
    Ok(())
}

fn under_torchrun() -> TestResult {
    // torchrun's agent serves the store (TORCHELASTIC_USE_AGENT_STORE=True): every rank
    // must connect as a client, or rank 0 would fail to listen on the agent's port.
    // `python -m torch.distributed.run` is the `torchrun` script's own entry point (the
    // script's shebang can be stale when a venv was moved).
    let torchrun = python();
    let port = free_port();
    let out = Command::new(&torchrun)
        .args(["-m", "torch.distributed.run"])
        .args(["--no-python", "--nproc-per-node", "2", "--master-port"])
        .arg(port.to_string())
        .arg(exe())
        .env("TT_DIST_ROLE", "collectives")
        .output()
        .map_err(|e| format!("{torchrun}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "torchrun: {}
{}
{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// Two Rust ranks on two "hosts" (network namespaces) whose names resolve to
/// 127.0.0.1, started without a launcher and without GLOO_SOCKET_IFNAME (as srun would):
/// the group finds the interface that reaches the master and the collectives run.
fn two_hosts() -> TestResult {
    let Some(hosts) = tt_testkit::netns::TwoHosts::new("rs") else {
        return Ok(());
    };
    let exe = exe();
    let exe = exe.to_str().ok_or("the test binary's path is not UTF-8")?;
    let ranks: Vec<std::process::Child> = (0..2)
        .map(|rank| {
            let mut cmd = hosts.exec(rank, exe);
            cmd.env("TT_DIST_ROLE", "collectives")
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", "0")
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "1")
                .env("MASTER_ADDR", hosts.addr(0))
                .env("MASTER_PORT", "29533")
                .env("TT_TIMEOUT_S", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd.spawn().map_err(|e| e.to_string())
        })
        .collect::<Result<_, _>>()?;
    for (rank, child) in ranks.into_iter().enumerate() {
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "rank {rank} on host {rank}: {}\n{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    Ok(())
}

fn killed_rank() -> TestResult {
    let port = free_port();
    let survivor = rank_command("die", 0, 2, port)
        .spawn()
        .map_err(|e| e.to_string())?;
    let victim = rank_command("die", 1, 2, port)
        .spawn()
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let v = victim.wait_with_output().map_err(|e| e.to_string())?;
    let s = survivor.wait_with_output().map_err(|e| e.to_string())?;
    let elapsed = start.elapsed();
    let out = String::from_utf8_lossy(&s.stdout);
    if v.status.code() != Some(3) {
        return Err(format!("victim: {}", v.status));
    }
    let Some(line) = out.lines().find(|l| l.starts_with("@@error@@")) else {
        return Err(format!(
            "survivor saw no error: {} {out} {}",
            s.status,
            String::from_utf8_lossy(&s.stderr)
        ));
    };
    // The group's timeout is 60 s; a dead peer's closed socket is noticed long before.
    if elapsed > Duration::from_secs(50) {
        return Err(format!("the error took {elapsed:?}: {line}"));
    }
    eprintln!("  survivor: {line}");
    if !line.contains("rank 0") {
        return Err(format!("the error does not name the rank: {line}"));
    }
    Ok(())
}

fn hung_rank() -> TestResult {
    let port = free_port();
    let mut survivor = rank_command("hang", 0, 2, port);
    survivor.env("TT_TIMEOUT_S", "3");
    let mut stuck = rank_command("hang", 1, 2, port);
    stuck.env("TT_TIMEOUT_S", "3");
    let survivor = survivor.spawn().map_err(|e| e.to_string())?;
    let mut stuck = stuck.spawn().map_err(|e| e.to_string())?;
    let s = survivor.wait_with_output().map_err(|e| e.to_string())?;
    let _ = stuck.kill();
    let _ = stuck.wait();
    let out = String::from_utf8_lossy(&s.stdout);
    let Some(line) = out.lines().find(|l| l.starts_with("@@error@@")) else {
        return Err(format!(
            "survivor saw no error: {} {out} {}",
            s.status,
            String::from_utf8_lossy(&s.stderr)
        ));
    };
    eprintln!("  survivor: {line}");
    let secs: f64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("no time in {line}"))?;
    // The 3 s timeout, not the 30 s the stuck rank sleeps, nor a hang.
    if !(2.5..20.0).contains(&secs) {
        return Err(format!("the error came after {secs} s: {line}"));
    }
    Ok(())
}

fn busy_port() -> TestResult {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let port = listener.local_addr().map_err(|e| e.to_string())?.port();
    let env = DistEnv::from_lookup(|k| {
        Some(match k {
            "RANK" | "LOCAL_RANK" => "0".into(),
            "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => "2".into(),
            "MASTER_ADDR" => "127.0.0.1".into(),
            "MASTER_PORT" => port.to_string(),
            _ => return None,
        })
    })
    .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let opts = GroupOptions::default().timeout(Duration::from_secs(30));
    match ProcessGroup::new(&env, &opts) {
        Ok(_) => Err("a group formed on a busy port".into()),
        Err(e) => {
            let msg = e.to_string();
            eprintln!("  {msg}");
            if !msg.contains(&port.to_string()) || !msg.contains("MASTER_PORT") {
                return Err(format!("unclear error: {msg}"));
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(format!("took {:?}: {msg}", start.elapsed()));
            }
            Ok(())
        }
    }
}

fn bad_env() -> TestResult {
    for (var, value) in [
        ("TORCHTOOLS_DIST_TIMEOUT", "soon"),
        ("TORCHTOOLS_DIST_TIMEOUT", "-1"),
        ("TORCHTOOLS_DIST_TIMEOUT", "0s"),
        ("TORCHTOOLS_DIST_BACKEND", "mpi"),
    ] {
        match GroupOptions::from_lookup(|k| (k == var).then(|| value.to_string())) {
            Ok(o) => return Err(format!("{var}={value} accepted: {o:?}")),
            Err(e) if e.to_string().contains(var) => {}
            Err(e) => return Err(format!("{var}={value}: error does not name it: {e}")),
        }
    }
    let ok = GroupOptions::from_lookup(|k| match k {
        "TORCHTOOLS_DIST_TIMEOUT" => Some("2.5".into()),
        "TORCHTOOLS_DIST_BACKEND" => Some("GLOO".into()),
        _ => None,
    })
    .map_err(|e| e.to_string())?;
    if ok.timeout != Duration::from_millis(2500) || ok.backend != Some(tt_dist::BackendKind::Gloo) {
        return Err(format!("parsed {ok:?}"));
    }
    // The CLI's durations: 20s, 10m.
    for (value, want) in [("20s", 20), ("10m", 600)] {
        let o =
            GroupOptions::from_lookup(|k| (k == "TORCHTOOLS_DIST_TIMEOUT").then(|| value.into()))
                .map_err(|e| format!("TORCHTOOLS_DIST_TIMEOUT={value}: {e}"))?;
        if o.timeout != Duration::from_secs(want) {
            return Err(format!("TORCHTOOLS_DIST_TIMEOUT={value}: {:?}", o.timeout));
        }
    }
    Ok(())
}
