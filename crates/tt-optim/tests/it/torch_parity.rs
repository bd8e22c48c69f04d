//! Same parameters, same gradients, N steps: the result equals Python's
//! `torch.optim` (TORCHTOOLS_PYTHON, set up by `cargo xtask setup`) within float
//! tolerance, and so does the learning rate of each schedule. The multi-tensor Adam
//! step (`tt_sys::foreach_adam`, what tt-optim runs on CUDA) is compared on the CPU with
//! torch.optim's `foreach=True`.

use crate::parity;

use parity::{assert_close, cases, grads, run_ours, torch, STEPS};
use serde_json::json;
use tch::{Device, Kind, Tensor};
use tt_optim::{Algorithm, Schedule};

#[test]
fn sgd_adam_adamw_and_schedules_match_torch_optim() {
    let cases = cases();
    let specs: Vec<_> = cases.iter().map(|(j, _, _)| j.clone()).collect();
    let torch = torch(&specs);
    for ((spec, alg, schedule), t) in cases.into_iter().zip(torch) {
        let (a, b, lrs) = run_ours(alg, schedule, Device::Cpu);
        assert_eq!(
            lrs.len(),
            t["lrs"].as_array().unwrap().len(),
            "{spec}: lr steps"
        );
        assert_close(&spec, "a", &a, &t["a"], 1e-5);
        assert_close(&spec, "b", &b, &t["b"], 1e-5);
        for (k, (x, y)) in lrs.iter().zip(t["lrs"].as_array().unwrap()).enumerate() {
            let y = y.as_f64().unwrap();
            assert!(
                (x - y).abs() <= 1e-12 * (1.0 + y.abs()),
                "{spec}: lr at step {k} = {x}, torch {y}"
            );
        }
    }
}

/// `tt_sys::foreach_adam` over `a` and `b` on the CPU, `STEPS` steps of `alg` (Adam or
/// AdamW without AMSGrad, constant learning rate).
fn run_foreach(alg: Algorithm) -> (Vec<f32>, Vec<f32>) {
    let (c, decoupled) = match alg {
        Algorithm::Adam(c) => (c, false),
        Algorithm::AdamW(c) => (c, true),
        Algorithm::Sgd(_) => unreachable!("Adam cases only"),
    };
    let f = (Kind::Float, Device::Cpu);
    let a = Tensor::arange(12, f).sin().reshape([3, 4]);
    let b = Tensor::arange(5, f).cos();
    let (ma, va, mb, vb) = (
        a.zeros_like(),
        a.zeros_like(),
        b.zeros_like(),
        b.zeros_like(),
    );
    let h = tt_sys::AdamStep {
        lr: c.lr,
        betas: c.betas,
        eps: c.eps,
        weight_decay: c.weight_decay,
        decoupled,
        maximize: c.maximize,
    };
    for k in 0..STEPS {
        let (ga, gb) = grads(k, Device::Cpu);
        let step = k as u64 + 1;
        tt_sys::foreach_adam(
            &[a.shallow_clone(), b.shallow_clone()],
            &[ga, gb],
            &[ma.shallow_clone(), mb.shallow_clone()],
            &[va.shallow_clone(), vb.shallow_clone()],
            &[step, step],
            &h,
        )
        .unwrap();
    }
    let flat = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap();
    (flat(&a), flat(&b))
}

#[test]
fn the_multi_tensor_adam_step_matches_torch_optims_foreach() {
    let cases: Vec<_> = cases()
        .into_iter()
        .filter(|(spec, alg, schedule)| {
            matches!(alg, Algorithm::Adam(c) | Algorithm::AdamW(c) if !c.amsgrad)
                && *schedule == Schedule::Constant
                && spec["optim"] != "sgd"
        })
        .chain([(
            json!({"optim": "adam", "config": {"lr": 0.01, "weight_decay": 0.1, "maximize": true}, "schedule": "none"}),
            Algorithm::Adam(tt_optim::AdamConfig {
                lr: 0.01,
                weight_decay: 0.1,
                maximize: true,
                ..tt_optim::AdamConfig::adam()
            }),
            Schedule::Constant,
        )])
        .map(|(mut spec, alg, s)| {
            spec["config"]["foreach"] = json!(true);
            (spec, alg, s)
        })
        .collect();
    assert_eq!(
        cases.len(),
        3,
        "Adam, AdamW, Adam with L2 decay and maximize"
    );
    let specs: Vec<_> = cases.iter().map(|(j, _, _)| j.clone()).collect();
    for ((spec, alg, _), t) in cases.into_iter().zip(torch(&specs)) {
        let (a, b) = run_foreach(alg);
        assert_close(&spec, "a", &a, &t["a"], 1e-6);
        assert_close(&spec, "b", &b, &t["b"], 1e-6);
    }
}

/// torch.optim's `zero_grad()` sets gradients to `None`: a parameter the loss does not
/// reach at a step has no gradient and Adam leaves it alone (its moments and step count
/// too). Ours, with `b` used on even steps only, against torch's same loop.
#[test]
fn a_parameter_without_a_gradient_is_left_alone_as_torch_does() {
    const PY: &str = r#"
import json, torch
a = torch.arange(12, dtype=torch.float32).sin().reshape(3, 4).requires_grad_()
b = torch.arange(5, dtype=torch.float32).cos().requires_grad_()
opt = torch.optim.Adam([a, b], lr=0.01)
for k in range(25):
    ga = (torch.arange(12, dtype=torch.float32) * 0.7 + k).sin().reshape(3, 4)
    gb = (torch.arange(5, dtype=torch.float32) * 1.3 - k).cos() * 0.5
    opt.zero_grad()
    loss = (a * ga).sum() + ((b * gb).sum() if k % 2 == 0 else 0)
    loss.backward()
    opt.step()
print(json.dumps({"a": a.detach().flatten().tolist(), "b": b.detach().tolist()}))
"#;
    let t: serde_json::Value = serde_json::from_str(&tt_testkit::run_python(PY, &[])).unwrap();
    let f = (Kind::Float, Device::Cpu);
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let a = vs
        .root()
        .var_copy("a", &Tensor::arange(12, f).sin().reshape([3, 4]));
    let b = vs.root().var_copy("b", &Tensor::arange(5, f).cos());
    let mut opt = tt_optim::Optimizer::adam(
        &vs,
        tt_optim::AdamConfig {
            lr: 0.01,
            ..tt_optim::AdamConfig::adam()
        },
    )
    .unwrap();
    for k in 0..25 {
        let (ga, gb) = grads(k, Device::Cpu);
        let mut loss = (&a * ga).sum(Kind::Float);
        if k % 2 == 0 {
            loss += (&b * gb).sum(Kind::Float);
        }
        opt.backward_step(&loss).unwrap();
        if k % 2 == 1 {
            assert!(
                !b.grad().defined(),
                "step {k}: b has a gradient it never got"
            );
        }
    }
    let flat = |t: &Tensor| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap();
    let spec = json!("Adam, b used on even steps only");
    assert_close(&spec, "a", &flat(&a), &t["a"], 1e-5);
    assert_close(&spec, "b", &flat(&b), &t["b"], 1e-5);
}
