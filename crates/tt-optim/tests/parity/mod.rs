//! The comparison with Python's `torch.optim` shared by the CPU and GPU tests: the same
//! parameters and gradients, `STEPS` steps, each case run by torch on the device the
//! case names.

use serde_json::{json, Value};
use tch::{nn, Device, Kind, Tensor};
use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule, SgdConfig};

pub(crate) const STEPS: i64 = 25;

pub(crate) const REFERENCE: &str = r#"
import json, math, sys, torch
cases = json.loads(sys.stdin.read())
out = []
def grads(k, dev):
    return [(torch.arange(12, dtype=torch.float32, device=dev) * 0.7 + k).sin().reshape(3, 4),
            (torch.arange(5, dtype=torch.float32, device=dev) * 1.3 - k).cos() * 0.5]
for case in cases:
    dev = case.get("device", "cpu")
    a = torch.arange(12, dtype=torch.float32, device=dev).sin().reshape(3, 4).requires_grad_()
    b = torch.arange(5, dtype=torch.float32, device=dev).cos().requires_grad_()
    alg, cfg = case["optim"], case["config"]
    if alg == "sgd":
        opt = torch.optim.SGD([a, b], **cfg)
    elif alg == "adam":
        opt = torch.optim.Adam([a, b], **cfg)
    else:
        opt = torch.optim.AdamW([a, b], **cfg)
    s = case["schedule"]
    if s == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    elif s == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20, eta_min=1e-4)
    elif s == "warmup_cosine":
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=15, eta_min=0.0)], milestones=[5])
    else:
        sched = None
    lrs = []
    for k in range(case["steps"]):
        lrs.append(opt.param_groups[0]["lr"])
        ga, gb = grads(k, dev)
        a.grad, b.grad = ga, gb
        opt.step()
        if sched: sched.step()
    out.append({"a": a.detach().cpu().flatten().tolist(), "b": b.detach().cpu().tolist(), "lrs": lrs})
print(json.dumps(out))
"#;

pub(crate) fn cases() -> Vec<(Value, Algorithm, Schedule)> {
    let sgd = |c: SgdConfig| Algorithm::Sgd(c);
    let none = Schedule::Constant;
    vec![
        (
            json!({"optim": "sgd", "config": {"lr": 0.1}, "schedule": "none"}),
            sgd(SgdConfig {
                lr: 0.1,
                ..Default::default()
            }),
            none,
        ),
        (
            json!({"optim": "sgd", "config": {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}, "schedule": "step"}),
            sgd(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                dampening: 0.1,
                weight_decay: 0.01,
                ..Default::default()
            }),
            Schedule::Step {
                step_size: 7,
                gamma: 0.5,
            },
        ),
        (
            json!({"optim": "sgd", "config": {"lr": 0.05, "momentum": 0.9, "nesterov": true, "weight_decay": 0.001}, "schedule": "none"}),
            sgd(SgdConfig {
                lr: 0.05,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.001,
                ..Default::default()
            }),
            none,
        ),
        (
            json!({"optim": "sgd", "config": {"lr": 0.02, "momentum": 0.5, "maximize": true}, "schedule": "none"}),
            sgd(SgdConfig {
                lr: 0.02,
                momentum: 0.5,
                maximize: true,
                ..Default::default()
            }),
            none,
        ),
        (
            json!({"optim": "adam", "config": {}, "schedule": "none"}),
            Algorithm::Adam(AdamConfig::adam()),
            none,
        ),
        (
            json!({"optim": "adam", "config": {"lr": 0.01, "weight_decay": 0.1, "amsgrad": true}, "schedule": "cosine"}),
            Algorithm::Adam(AdamConfig {
                lr: 0.01,
                weight_decay: 0.1,
                amsgrad: true,
                ..AdamConfig::adam()
            }),
            Schedule::Cosine {
                t_max: 20,
                eta_min: 1e-4,
            },
        ),
        (
            json!({"optim": "adamw", "config": {}, "schedule": "none"}),
            Algorithm::AdamW(AdamConfig::adamw()),
            none,
        ),
        (
            json!({"optim": "adamw", "config": {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "amsgrad": true, "maximize": true}, "schedule": "warmup_cosine"}),
            Algorithm::AdamW(AdamConfig {
                lr: 0.01,
                betas: (0.8, 0.99),
                eps: 1e-6,
                amsgrad: true,
                maximize: true,
                ..AdamConfig::adamw()
            }),
            Schedule::WarmupCosine {
                warmup: 5,
                start_factor: 0.1,
                t_max: 15,
                eta_min: 0.0,
            },
        ),
    ]
}

pub(crate) fn grads(k: i64, dev: Device) -> (Tensor, Tensor) {
    let f = (Kind::Float, dev);
    (
        (Tensor::arange(12, f) * 0.7 + k as f64)
            .sin()
            .reshape([3, 4]),
        (Tensor::arange(5, f) * 1.3 - k as f64).cos() * 0.5,
    )
}

/// Our optimizer over the parameters `a` and `b` on `dev`, `STEPS` steps: `a`, `b` and
/// the learning rate of each step.
pub(crate) fn run_ours(
    alg: Algorithm,
    schedule: Schedule,
    dev: Device,
) -> (Vec<f32>, Vec<f32>, Vec<f64>) {
    let f = (Kind::Float, dev);
    let vs = nn::VarStore::new(dev);
    let a = vs
        .root()
        .var_copy("a", &Tensor::arange(12, f).sin().reshape([3, 4]));
    let b = vs.root().var_copy("b", &Tensor::arange(5, f).cos());
    let mut opt = Optimizer::new(&vs, alg, schedule).unwrap();
    let mut lrs = Vec::new();
    for k in 0..STEPS {
        lrs.push(opt.lr());
        let (ga, gb) = grads(k, dev);
        let loss = (&a * ga).sum(Kind::Float) + (&b * gb).sum(Kind::Float); // gradients = ga, gb
        opt.backward_step(&loss).unwrap();
    }
    let flat = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1).to_device(Device::Cpu)).unwrap();
    (flat(&a), flat(&b), lrs)
}

/// torch.optim's answers for `cases` (JSON specs, each with its `device`), in order.
pub(crate) fn torch(cases: &[Value]) -> Vec<Value> {
    let input: Vec<Value> = cases
        .iter()
        .map(|j| {
            let mut j = j.clone();
            j["steps"] = json!(STEPS);
            j
        })
        .collect();
    let mut child = tt_testkit::python()
        .args(["-W", "ignore", "-c", REFERENCE])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&input).unwrap().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let torch: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    // zip stops at the shorter side: equal lengths first, or a short answer would pass.
    assert_eq!(
        torch.len(),
        cases.len(),
        "torch answered another number of cases"
    );
    torch
}

/// Asserts `ours` (`a` or `b`, named `name`) within `tol * (1 + |torch|)` of torch's;
/// returns how many elements are bit for bit equal.
pub(crate) fn assert_close(
    spec: &Value,
    name: &str,
    ours: &[f32],
    theirs: &Value,
    tol: f32,
) -> usize {
    let theirs = theirs.as_array().unwrap();
    assert!(!ours.is_empty(), "{spec}: {name} is empty");
    assert_eq!(ours.len(), theirs.len(), "{spec}: {name} lengths");
    let mut exact = 0;
    for (i, (x, y)) in ours.iter().zip(theirs).enumerate() {
        let y = y.as_f64().unwrap() as f32;
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "{spec}: {name}[{i}] = {x}, torch {y}"
        );
        exact += usize::from(x.to_bits() == y.to_bits());
    }
    exact
}
