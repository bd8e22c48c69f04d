//! GPU tests, selected by `cargo xtask test-gpu` (they fail loudly without CUDA): NCCL
//! at world size 1 (a real TCPStore rendezvous and ProcessGroupNCCL, the group's scalars
//! on the GPU), DDP training on one GPU matching plain training there and proven to run
//! through the Reducer, two ranks sharing the one GPU (Gloo, chosen automatically)
//! training CUDA tensors like one process on the whole batch, and two NCCL ranks on two
//! GPUs doing the same.
//!
//! With one GPU, NCCL can only run a group of one, where every reduction is the
//! identity: there the Reducer's own effects are what is checked (gradients become
//! views of its bucket; an unused parameter fails the next step). The two-rank NCCL
//! test needs two GPUs; on a one-GPU machine it reports itself not run (`@@not-run`),
//! which the bundle's `run.sh` never counts as passed.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use std::time::Duration;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tt_dist::{BackendKind, Ddp, DdpOptions, DistEnv, GroupOptions, ProcessGroup, ReduceOp};

fn nccl_group_of_one() -> ProcessGroup {
    tt_sys::require_cuda();
    assert!(
        tt_sys::c10d::nccl_built(),
        "this build has no ProcessGroupNCCL: run `cargo xtask setup` (it installs CUDA's headers) and rebuild"
    );
    let port = tt_dist::free_port("127.0.0.1").expect("a free port");
    let env = DistEnv::from_lookup(|k| {
        Some(match k {
            "RANK" | "LOCAL_RANK" => "0".into(),
            "WORLD_SIZE" | "LOCAL_WORLD_SIZE" => "1".into(),
            "MASTER_ADDR" => "127.0.0.1".into(),
            "MASTER_PORT" => port.to_string(),
            _ => return None,
        })
    })
    .expect("a world of one");
    let opts = GroupOptions::default()
        .backend(BackendKind::Nccl)
        .timeout(Duration::from_secs(60));
    let pg = ProcessGroup::new(&env, &opts).expect("an NCCL group of one");
    assert_eq!(pg.backend(), Some(BackendKind::Nccl));
    pg
}

#[test]
fn nccl_collectives_at_world_size_1() {
    let pg = nccl_group_of_one();
    let base = Tensor::arange(1000, (Kind::Float, Device::Cuda(0)));
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max] {
        let t = base.copy();
        pg.all_reduce(&t, op).expect("NCCL all_reduce");
        assert!(t.equal(&base), "{op:?} of one rank changed the tensor");
    }
    let t = base.copy();
    pg.broadcast(&t, 0).expect("NCCL broadcast");
    assert!(t.equal(&base));
    let g = pg.all_gather(&base).expect("NCCL all_gather");
    assert_eq!(g.len(), 1);
    assert!(g[0].equal(&base));
    pg.barrier().expect("NCCL barrier");
    // The group's own scalars (the trainer's per-step flags, batch agreement) live on
    // the rank's GPU: NCCL refuses CPU tensors.
    assert_eq!(pg.scalar_device(), Device::Cuda(0));
    assert_eq!(pg.all_reduce_f64(2.5, ReduceOp::Sum).expect("f64 sum"), 2.5);
    assert_eq!(pg.min_over_ranks(7).expect("min over ranks"), 7);
}

fn mlp(vs: &nn::VarStore) -> impl Module {
    let root = vs.root();
    nn::seq()
        .add(nn::linear(&root / "l1", 16, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "l2", 64, 4, Default::default()))
}

/// Five steps of SGD with momentum on all 32 rows.
fn train(vs: &nn::VarStore, model: &impl Module, ddp: Option<&Ddp<'_>>) {
    let (x, y) = data_rows(Device::Cuda(0), 0, 32);
    train_rows(vs, model, ddp, &x, &y);
}

/// A copy of every parameter, by name.
fn snapshot(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    vs.variables()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect()
}

/// How far the parameters of `vs` moved from `init`.
fn largest_move(vs: &nn::VarStore, init: &[(String, Tensor)]) -> f64 {
    let now = vs.variables();
    init.iter()
        .map(|(n, t)| (&now[n] - t).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

#[test]
fn ddp_trains_on_one_gpu_like_plain_training() {
    let pg = nccl_group_of_one();
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cuda(0));
    let model = mlp(&vs);
    let ddp = Ddp::new(&pg, &vs).expect("DDP over a CUDA VarStore");
    train(&vs, &model, Some(&ddp));

    tch::manual_seed(3);
    let plain = nn::VarStore::new(Device::Cuda(0));
    let plain_model = mlp(&plain);
    let init = snapshot(&plain);
    train(&plain, &plain_model, None);

    let got = vs.variables();
    for (name, want) in plain.variables() {
        let diff = (&got[&name] - &want).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{name} differs by {diff}");
    }
    let moved = largest_move(&plain, &init);
    assert!(
        moved > 1e-4,
        "training did not move the parameters ({moved})"
    );
}

/// The Reducer at world size 1, where every reduction is the identity, seen through
/// what only it does: with `gradient_as_bucket_view`, every gradient is a view into
/// one flat bucket, back to back in bucket order (separate allocations by autograd
/// are at least 512 bytes apart, so the 16-byte bias gradient could not be followed
/// directly by the next one); and a parameter the loss does not use makes the next
/// step fail with the Reducer's explanation, unless `find_unused_parameters` is on.
#[test]
fn ddp_on_one_gpu_runs_through_the_reducer() {
    let pg = nccl_group_of_one();
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cuda(0));
    let model = mlp(&vs);
    let ddp = Ddp::with_options(
        &pg,
        &vs,
        &DdpOptions::default().gradient_as_bucket_view(true),
    )
    .expect("DDP with gradients as bucket views");
    assert_eq!(ddp.bucket_count(), 1, "{:?}", ddp.bucket_sizes());
    let (x, y) = data_rows(Device::Cuda(0), 0, 32);
    // Two steps: the buckets are rebuilt after the first, in the order gradients came.
    for _ in 0..2 {
        ddp.backward(&model.forward(&x).mse_loss(&y, tch::Reduction::Mean))
            .expect("DDP backward");
    }
    let mut spans: Vec<(i64, i64, String)> = vs
        .variables()
        .into_iter()
        .map(|(name, t)| {
            let g = t.grad();
            assert!(g.defined(), "{name} has no gradient");
            let start = g.data_ptr() as i64;
            (start, start + g.numel() as i64 * 4, name)
        })
        .collect();
    spans.sort();
    for pair in spans.windows(2) {
        assert_eq!(
            pair[0].1, pair[1].0,
            "{} and {} are not back to back in one bucket: {spans:?}",
            pair[0].2, pair[1].2
        );
    }

    // A layer the loss never uses: the Reducer waits for its gradient and says so.
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cuda(0));
    let model = mlp(&vs);
    let _unused = nn::linear(vs.root() / "unused", 16, 4, Default::default());
    let step = |ddp: &Ddp<'_>| ddp.backward(&model.forward(&x).mse_loss(&y, tch::Reduction::Mean));
    let ddp = Ddp::new(&pg, &vs).expect("DDP");
    step(&ddp).expect("the first step");
    let err = step(&ddp).expect_err("a second step with an unused parameter");
    assert!(err.to_string().contains("find_unused_parameters"), "{err}");
    drop(ddp);
    let vs2 = nn::VarStore::new(Device::Cuda(0));
    let model2 = mlp(&vs2);
    let _unused2 = nn::linear(vs2.root() / "unused", 16, 4, Default::default());
    let ddp = Ddp::with_options(
        &pg,
        &vs2,
        &DdpOptions::default().find_unused_parameters(true),
    )
    .expect("DDP finding unused parameters");
    for _ in 0..2 {
        ddp.backward(&model2.forward(&x).mse_loss(&y, tch::Reduction::Mean))
            .expect("with find_unused_parameters, every step");
    }
}

/// Rows `[start, start + rows)` of the shared data, on `dev`.
fn data_rows(dev: Device, start: i64, rows: i64) -> (Tensor, Tensor) {
    let x = (Tensor::arange(32 * 16, (Kind::Float, dev)) * 0.01)
        .sin()
        .view([32, 16]);
    let y = (Tensor::arange(32 * 4, (Kind::Float, dev)) * 0.02)
        .cos()
        .view([32, 4]);
    (x.narrow(0, start, rows), y.narrow(0, start, rows))
}

fn train_rows(
    vs: &nn::VarStore,
    model: &impl Module,
    ddp: Option<&Ddp<'_>>,
    x: &Tensor,
    y: &Tensor,
) {
    let mut opt = nn::Sgd {
        momentum: 0.9,
        ..Default::default()
    }
    .build(vs, 0.05)
    .expect("SGD");
    for _ in 0..5 {
        opt.zero_grad();
        let loss = model.forward(x).mse_loss(y, tch::Reduction::Mean);
        match ddp {
            Some(d) => d.backward(&loss).expect("DDP backward"),
            None => loss.backward(),
        }
        opt.step();
    }
}

/// One rank of the two-rank CUDA tests: Gloo on one shared GPU, or NCCL with a GPU per
/// rank (`TT_DIST_GPU_BACKEND`).
#[test]
#[ignore = "a rank of the two-rank CUDA tests, started by them"]
fn cuda_rank_child() {
    let Some(out) = std::env::var_os("TT_DIST_GPU_OUT") else {
        return;
    };
    tt_sys::require_cuda();
    let pg = ProcessGroup::from_env().expect("a group from the launcher's variables");
    let rank = pg.rank();
    // Two local ranks and one GPU: NCCL would refuse the shared GPU, so Gloo it is; with
    // a GPU each, NCCL, each rank on its own.
    let dev = match std::env::var("TT_DIST_GPU_BACKEND").as_deref() {
        Ok("nccl") => {
            assert_eq!(pg.backend(), Some(BackendKind::Nccl));
            assert_eq!(pg.scalar_device(), Device::Cuda(rank));
            Device::Cuda(rank)
        }
        _ => {
            assert_eq!(pg.backend(), Some(BackendKind::Gloo));
            Device::Cuda(0)
        }
    };
    // Each ReduceOp on a CUDA tensor: rank r holds r + 1.
    for (op, want) in [
        (ReduceOp::Sum, 3.0),
        (ReduceOp::Avg, 1.5),
        (ReduceOp::Min, 1.0),
        (ReduceOp::Max, 2.0),
        (ReduceOp::Product, 2.0),
    ] {
        let t = Tensor::full([4], rank as f64 + 1.0, (Kind::Float, dev));
        pg.all_reduce(&t, op).expect("all_reduce of a CUDA tensor");
        assert_eq!(t.device(), dev);
        let got = t.double_value(&[0]);
        assert!((got - want).abs() < 1e-6, "{op:?}: {got}, expected {want}");
    }
    // Different initial weights per rank: DDP's broadcast from rank 0 makes them agree.
    tch::manual_seed(100 + rank as i64);
    let vs = nn::VarStore::new(dev);
    let model = mlp(&vs);
    let ddp = Ddp::new(&pg, &vs).expect("DDP over a CUDA VarStore");
    let (x, y) = data_rows(dev, 16 * rank as i64, 16);
    train_rows(&vs, &model, Some(&ddp), &x, &y);
    let path = format!("{}.rank{rank}.safetensors", out.to_string_lossy());
    let vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    Tensor::write_safetensors(&vars, &path).expect("save the parameters");
    println!("@@rank {rank} saved");
}

/// Two ranks (`backend`: "gloo" on the one GPU, "nccl" on a GPU each) train like one
/// process on the whole batch.
fn two_ranks_train_like_one_process(backend: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("params");
    let port = tt_dist::free_port("127.0.0.1").expect("a free port");
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            tt_testkit::rerun("cuda_rank_child")
                .env("TT_DIST_GPU_OUT", &out)
                .env("TT_DIST_GPU_BACKEND", backend)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("TORCHTOOLS_DIST_BACKEND")
                .env_remove("CUDA_VISIBLE_DEVICES")
                .spawn()
                .unwrap()
        })
        .collect();
    for mut r in ranks {
        assert!(
            r.wait().unwrap().success(),
            "a {backend} rank failed (its output is above)"
        );
    }
    // The reference: one process, the whole batch of 32, starting from rank 0's weights.
    tch::manual_seed(100);
    let vs = nn::VarStore::new(Device::Cuda(0));
    let model = mlp(&vs);
    let init = snapshot(&vs);
    train(&vs, &model, None);
    let want = vs.variables();
    for rank in 0..2 {
        let got =
            Tensor::read_safetensors(format!("{}.rank{rank}.safetensors", out.display())).unwrap();
        assert_eq!(
            got.len(),
            want.len(),
            "rank {rank} saved {} tensors",
            got.len()
        );
        for (name, t) in got {
            let diff = (&t.to_device(Device::Cuda(0)) - &want[&name])
                .abs()
                .max()
                .double_value(&[]);
            assert!(
                diff < 1e-5,
                "{backend} rank {rank}: {name} differs by {diff}"
            );
        }
    }
    let moved = largest_move(&vs, &init);
    assert!(
        moved > 1e-3,
        "training did not move the parameters ({moved})"
    );
}

#[test]
fn two_ranks_on_one_gpu_train_like_one_process_on_the_whole_batch() {
    tt_sys::require_cuda();
    two_ranks_train_like_one_process("gloo");
}

#[test]
fn two_nccl_ranks_on_two_gpus_train_like_one_process_on_the_whole_batch() {
    let info = tt_sys::require_cuda();
    if info.device_count < 2 {
        tt_testkit::not_run(&format!(
            "two NCCL ranks need two GPUs (NCCL refuses two ranks on one GPU); this machine has {}",
            info.device_count
        ));
        return;
    }
    two_ranks_train_like_one_process("nccl");
}
