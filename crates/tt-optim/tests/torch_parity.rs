//! Same parameters, same gradients, N steps: the result equals Python's
//! `torch.optim` (TORCHTOOLS_PYTHON, set up by `cargo xtask setup`) within float
//! tolerance, and so does the learning rate of each schedule.
#![cfg(feature = "tch")]
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use serde_json::{json, Value};
use tch::{nn, Device, Kind, Tensor};
use tt_optim::{AdamConfig, Algorithm, Optimizer, Schedule, SgdConfig};

const STEPS: i64 = 25;

const REFERENCE: &str = r#"
import json, math, sys, torch
cases = json.loads(sys.stdin.read())
out = []
def grads(k):
    return [(torch.arange(12, dtype=torch.float32) * 0.7 + k).sin().reshape(3, 4),
            (torch.arange(5, dtype=torch.float32) * 1.3 - k).cos() * 0.5]
for case in cases:
    a = torch.arange(12, dtype=torch.float32).sin().reshape(3, 4).requires_grad_()
    b = torch.arange(5, dtype=torch.float32).cos().requires_grad_()
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
        ga, gb = grads(k)
        a.grad, b.grad = ga, gb
        opt.step()
        if sched: sched.step()
    out.append({"a": a.detach().flatten().tolist(), "b": b.detach().tolist(), "lrs": lrs})
print(json.dumps(out))
"#;

fn cases() -> Vec<(Value, Algorithm, Schedule)> {
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

fn grads(k: i64) -> (Tensor, Tensor) {
    let f = (Kind::Float, Device::Cpu);
    (
        (Tensor::arange(12, f) * 0.7 + k as f64)
            .sin()
            .reshape([3, 4]),
        (Tensor::arange(5, f) * 1.3 - k as f64).cos() * 0.5,
    )
}

fn run_ours(alg: Algorithm, schedule: Schedule) -> (Vec<f32>, Vec<f32>, Vec<f64>) {
    let f = (Kind::Float, Device::Cpu);
    let vs = nn::VarStore::new(Device::Cpu);
    let a = vs
        .root()
        .var_copy("a", &Tensor::arange(12, f).sin().reshape([3, 4]));
    let b = vs.root().var_copy("b", &Tensor::arange(5, f).cos());
    let mut opt = Optimizer::new(&vs, alg, schedule).unwrap();
    let mut lrs = Vec::new();
    for k in 0..STEPS {
        lrs.push(opt.lr());
        let (ga, gb) = grads(k);
        let loss = (&a * ga).sum(Kind::Float) + (&b * gb).sum(Kind::Float); // gradients = ga, gb
        opt.backward_step(&loss).unwrap();
    }
    let flat = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap();
    (flat(&a), flat(&b), lrs)
}

#[test]
fn sgd_adam_adamw_and_schedules_match_torch_optim() {
    let cases = cases();
    let input: Vec<Value> = cases
        .iter()
        .map(|(j, _, _)| {
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
    for ((spec, alg, schedule), t) in cases.into_iter().zip(torch) {
        let (a, b, lrs) = run_ours(alg, schedule);
        assert_eq!(
            lrs.len(),
            t["lrs"].as_array().unwrap().len(),
            "{spec}: lr steps"
        );
        for (name, ours, theirs) in [("a", &a, &t["a"]), ("b", &b, &t["b"])] {
            let theirs = theirs.as_array().unwrap();
            assert!(!ours.is_empty(), "{spec}: {name} is empty");
            assert_eq!(ours.len(), theirs.len(), "{spec}: {name} lengths");
            for (i, (x, y)) in ours.iter().zip(theirs).enumerate() {
                let y = y.as_f64().unwrap() as f32;
                assert!(
                    (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "{spec}: {name}[{i}] = {x}, torch {y}"
                );
            }
        }
        for (k, (x, y)) in lrs.iter().zip(t["lrs"].as_array().unwrap()).enumerate() {
            let y = y.as_f64().unwrap();
            assert!(
                (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
                "{spec}: lr at step {k} = {x}, torch {y}"
            );
        }
    }
}
