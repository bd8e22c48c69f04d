//! GPU test (`cargo xtask test-gpu`): every optimizer on CUDA against torch.optim on
//! CUDA (its default there: the multi-tensor `foreach` step), same parameters and
//! gradients, within float tolerance. Adam and AdamW without AMSGrad run tt-optim's
//! multi-tensor step on CUDA.
#![allow(clippy::unwrap_used)] // a panic is how a test reports

mod parity;

use parity::{assert_close, cases, run_ours, torch};
use serde_json::json;
use tch::Device;

#[test]
fn every_optimizer_on_cuda_matches_torch_optim_on_cuda() {
    tt_sys::require_cuda();
    let cases: Vec<_> = cases()
        .into_iter()
        .map(|(mut spec, alg, schedule)| {
            spec["device"] = json!("cuda");
            (spec, alg, schedule)
        })
        .collect();
    let specs: Vec<_> = cases.iter().map(|(j, _, _)| j.clone()).collect();
    let (mut exact, mut total) = (0, 0);
    for ((spec, alg, schedule), t) in cases.into_iter().zip(torch(&specs)) {
        let (a, b, _) = run_ours(alg, schedule, Device::Cuda(0));
        exact += assert_close(&spec, "a", &a, &t["a"], 1e-5);
        exact += assert_close(&spec, "b", &b, &t["b"], 1e-5);
        total += a.len() + b.len();
    }
    println!("{exact} of {total} elements bit for bit torch.optim's on CUDA");
}
