//! GPU tests, selected by `cargo xtask test-gpu` (they fail loudly without CUDA): NCCL
//! at world size 1 (a real TCPStore rendezvous and ProcessGroupNCCL), and DDP training
//! on one GPU matching plain training there.

use std::time::Duration;

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};
use tt_dist::{BackendKind, Ddp, DistEnv, GroupOptions, ProcessGroup, ReduceOp};

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
}

fn mlp(vs: &nn::VarStore) -> impl Module {
    let root = vs.root();
    nn::seq()
        .add(nn::linear(&root / "l1", 16, 64, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "l2", 64, 4, Default::default()))
}

fn train(vs: &nn::VarStore, model: &impl Module, ddp: Option<&Ddp<'_>>) {
    let mut opt = nn::Sgd::default().build(vs, 0.05).expect("SGD");
    let x = (Tensor::arange(32 * 16, (Kind::Float, Device::Cuda(0))) * 0.01)
        .sin()
        .view([32, 16]);
    let y = (Tensor::arange(32 * 4, (Kind::Float, Device::Cuda(0))) * 0.02)
        .cos()
        .view([32, 4]);
    for _ in 0..5 {
        opt.zero_grad();
        let loss = model.forward(&x).mse_loss(&y, tch::Reduction::Mean);
        match ddp {
            Some(d) => d.backward(&loss).expect("DDP backward"),
            None => loss.backward(),
        }
        opt.step();
    }
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
    let init: Vec<(String, Tensor)> = plain
        .variables()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    train(&plain, &plain_model, None);

    let got = vs.variables();
    for (name, want) in plain.variables() {
        let diff = (&got[&name] - &want).abs().max().double_value(&[]);
        assert!(diff < 1e-6, "{name} differs by {diff}");
    }
    let moved = init
        .iter()
        .map(|(n, t)| (&got[n] - t).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    assert!(moved > 1e-4, "training did not move the parameters");
}
