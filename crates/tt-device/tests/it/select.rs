//! The selection rule with injected availability (no GPU needed).

use tt_device::{select_with, Availability, Bytes, CudaCandidate, Device, EnvConfig};

fn env(vars: &[(&str, &str)]) -> EnvConfig {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    EnvConfig::from_lookup(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        .unwrap()
}

fn gpus(free_gib: &[Option<u64>]) -> Availability {
    Availability {
        cuda: Ok(free_gib
            .iter()
            .enumerate()
            .map(|(index, f)| CudaCandidate {
                index,
                free: f.map(Bytes::gib),
            })
            .collect()),
        mps: Err("MPS exists only on macOS".into()),
    }
}

fn cpu_only() -> Availability {
    Availability {
        cuda: Err("no NVIDIA driver".into()),
        mps: Err("MPS exists only on macOS".into()),
    }
}

fn mac() -> Availability {
    Availability {
        cuda: Err("no NVIDIA driver".into()),
        mps: Ok(()),
    }
}

#[test]
fn auto_prefers_cuda_then_mps_then_cpu() {
    assert_eq!(
        select_with(&env(&[]), &gpus(&[Some(10)])).unwrap().device,
        Device::Cuda(0)
    );
    assert_eq!(select_with(&env(&[]), &mac()).unwrap().device, Device::Mps);
    let cpu = select_with(&env(&[]), &cpu_only()).unwrap();
    assert_eq!(cpu.device, Device::Cpu);
    assert!(
        cpu.reason.contains("no NVIDIA driver"),
        "the reason says why not CUDA: {}",
        cpu.reason
    );
}

#[test]
fn several_gpus_pick_most_free_memory_lowest_index_on_ties() {
    let s = select_with(&env(&[]), &gpus(&[Some(5), Some(70), Some(30)])).unwrap();
    assert_eq!(s.device, Device::Cuda(1));
    assert!(
        s.reason.contains("most free memory (70.00 GiB)"),
        "{}",
        s.reason
    );
    assert_eq!(
        select_with(&env(&[]), &gpus(&[Some(8), Some(8)]))
            .unwrap()
            .device,
        Device::Cuda(0)
    );
    assert_eq!(
        select_with(&env(&[]), &gpus(&[None, None, None]))
            .unwrap()
            .device,
        Device::Cuda(0)
    );
    // Plain `cuda` follows the same rule.
    let s = select_with(
        &env(&[("TORCHTOOLS_DEVICE", "cuda")]),
        &gpus(&[Some(1), Some(2)]),
    )
    .unwrap();
    assert_eq!(s.device, Device::Cuda(1));
}

#[test]
fn local_rank_picks_its_gpu_and_one_visible_gpu_serves_every_rank() {
    let four = gpus(&[Some(1), Some(1), Some(1), Some(80)]);
    assert_eq!(
        select_with(&env(&[("LOCAL_RANK", "2")]), &four)
            .unwrap()
            .device,
        Device::Cuda(2)
    );
    let one = gpus(&[Some(80)]);
    let s = select_with(&env(&[("LOCAL_RANK", "5")]), &one).unwrap();
    assert_eq!(s.device, Device::Cuda(0));
    assert!(s.reason.contains("per-rank isolation"), "{}", s.reason);
    // Without CUDA, LOCAL_RANK does not matter.
    assert_eq!(
        select_with(&env(&[("LOCAL_RANK", "5")]), &cpu_only())
            .unwrap()
            .device,
        Device::Cpu
    );
    // An explicit index beats LOCAL_RANK.
    let s = select_with(
        &env(&[("LOCAL_RANK", "2"), ("TORCHTOOLS_DEVICE", "cuda:1")]),
        &four,
    )
    .unwrap();
    assert_eq!(s.device, Device::Cuda(1));
}

#[test]
fn explicit_choices() {
    assert_eq!(
        select_with(&env(&[("TORCHTOOLS_DEVICE", "cpu")]), &gpus(&[Some(80)]))
            .unwrap()
            .device,
        Device::Cpu
    );
    assert_eq!(
        select_with(&env(&[("TORCHTOOLS_DEVICE", "mps")]), &mac())
            .unwrap()
            .device,
        Device::Mps
    );
    let s = select_with(
        &env(&[("TORCHTOOLS_DEVICE", "cuda:1")]),
        &gpus(&[Some(1), Some(1)]),
    )
    .unwrap();
    assert_eq!(s.device, Device::Cuda(1));
}

#[test]
fn impossible_requests_are_errors_that_say_what_to_do() {
    let cases: Vec<(Vec<(&str, &str)>, Availability)> = vec![
        (
            vec![
                ("TORCHTOOLS_DEVICE", "cuda:7"),
                ("CUDA_VISIBLE_DEVICES", "0,1"),
            ],
            gpus(&[Some(1), Some(1)]),
        ),
        (vec![("TORCHTOOLS_DEVICE", "cuda:1")], gpus(&[Some(1)])),
        (vec![("TORCHTOOLS_DEVICE", "cuda")], cpu_only()),
        (vec![("TORCHTOOLS_DEVICE", "cuda:0")], cpu_only()),
        (vec![("TORCHTOOLS_DEVICE", "mps")], cpu_only()),
        (
            vec![("LOCAL_RANK", "3"), ("CUDA_VISIBLE_DEVICES", "0,1")],
            gpus(&[Some(1), Some(1)]),
        ),
        (
            vec![("LOCAL_RANK", "2"), ("TORCHTOOLS_DEVICE", "cuda")],
            gpus(&[Some(1), Some(1)]),
        ),
    ];
    let mut out = String::new();
    for (vars, avail) in cases {
        let e = select_with(&env(&vars), &avail).expect_err(&format!("{vars:?}"));
        out.push_str(&format!("{vars:?}\n  => {e}\n"));
    }
    insta::assert_snapshot!(out);
}
