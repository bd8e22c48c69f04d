//! CUDA_VISIBLE_DEVICES applied to an inventory, and the report built on it, with an
//! injected two-GPU machine (the real NVML query runs in the CLI and GPU tests).

use tt_device::{
    Availability, Bytes, CudaVisibleDevices, DeviceReport, EnvConfig, GpuInfo, GpuProcess,
    Inventory, MigInstance, NvmlStatus, RawEnv, View,
};

fn gpu(nvml_index: u32, uuid: &str, free_gib: u64) -> GpuInfo {
    GpuInfo {
        nvml_index,
        uuid: uuid.into(),
        name: "NVIDIA H100 80GB HBM3".into(),
        total: Bytes::gib(80),
        free: Bytes::gib(free_gib),
        used: Bytes::gib(80 - free_gib),
        utilization: None,
        processes: vec![GpuProcess {
            pid: 4242,
            used: Some(Bytes::gib(80 - free_gib)),
        }],
        mig: vec![],
    }
}

fn machine() -> Inventory {
    Inventory {
        nvml: NvmlStatus::Available {
            driver_version: "580.00".into(),
        },
        gpus: vec![
            gpu(0, "GPU-0a1b2c3d-0000-0000-0000-000000000000", 10),
            gpu(1, "GPU-0f8e7d6c-1111-1111-1111-111111111111", 70),
        ],
        errors: vec![],
    }
}

fn visible(value: &str) -> Vec<u32> {
    let v = CudaVisibleDevices::parse(value).unwrap();
    machine()
        .visible(&v)
        .iter()
        .map(|g| g.gpu.nvml_index)
        .collect()
}

#[test]
fn the_drivers_uuids_tie_each_cuda_ordinal_to_its_gpu() {
    // CUDA's default order (fastest first) put NVML's GPU 1 at cuda:0: the UUIDs say so.
    let m = machine();
    let order = m.in_cuda_order(&[
        "GPU-0F8E7D6C-1111-1111-1111-111111111111".into(),
        "GPU-0a1b2c3d-0000-0000-0000-000000000000".into(),
        "GPU-ffffffff-2222-2222-2222-222222222222".into(), // a GPU NVML does not list
    ]);
    let indices: Vec<Option<u32>> = order.iter().map(|g| g.map(|g| g.nvml_index)).collect();
    assert_eq!(indices, [Some(1), Some(0), None]);
    assert_eq!(order[0].unwrap().free, Bytes::gib(70));
}

#[test]
fn visible_devices_follow_cuda_semantics() {
    let all = machine().visible(&CudaVisibleDevices::Unset);
    assert_eq!(
        all.iter()
            .map(|g| (g.index, g.gpu.nvml_index))
            .collect::<Vec<_>>(),
        [(0, 0), (1, 1)]
    );
    assert_eq!(visible("1"), [1]);
    assert_eq!(visible("1,0"), [1, 0]); // reordered: cuda:0 is NVML's 1
    assert_eq!(visible(""), Vec::<u32>::new());
    assert_eq!(visible("-1"), Vec::<u32>::new());
    assert_eq!(visible("0,5,1"), [0]); // an index that names no GPU ends the list
    assert_eq!(visible("0,0"), [0]); // so does a duplicate
    assert_eq!(visible("GPU-0f8e"), [1]); // abbreviated UUIDs
    assert_eq!(
        visible("GPU-0f8e7d6c-1111-1111-1111-111111111111,GPU-0a1b"),
        [1, 0]
    );
    assert_eq!(visible("GPU-0"), Vec::<u32>::new()); // ambiguous prefix ends the list
    assert_eq!(visible("0,GPU-0"), [0]);
    assert_eq!(visible("MIG-abcd,0"), Vec::<u32>::new()); // MIG is not resolved here
}

#[test]
fn nvml_availability_says_why_cuda_is_missing() {
    let raw = RawEnv::default();
    let none = Inventory {
        nvml: NvmlStatus::Unavailable {
            reason: "no NVIDIA driver".into(),
        },
        gpus: vec![],
        errors: vec![],
    };
    let a = Availability::from_nvml(&none, &CudaVisibleDevices::Unset, &raw);
    assert_eq!(a.cuda, Err("no NVIDIA driver".into()));
    let hidden_raw = RawEnv {
        cuda_visible_devices: Some("".into()),
        ..RawEnv::default()
    };
    let a = Availability::from_nvml(
        &machine(),
        &CudaVisibleDevices::parse("").unwrap(),
        &hidden_raw,
    );
    assert_eq!(
        a.cuda,
        Err("CUDA_VISIBLE_DEVICES=\"\" hides all 2 GPU(s)".into())
    );
    let a = Availability::from_nvml(&machine(), &CudaVisibleDevices::Unset, &raw);
    assert_eq!(
        a.cuda.unwrap().iter().map(|c| c.free).collect::<Vec<_>>(),
        [Some(Bytes::gib(10)), Some(Bytes::gib(70))]
    );
}

fn report(vars: &[(&str, &str)]) -> DeviceReport {
    let vars: Vec<(String, String)> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lookup = |name: &str| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let raw = RawEnv::from_lookup(lookup);
    let env = EnvConfig::from_raw(raw.clone());
    let visible = env
        .as_ref()
        .map(|e| e.visible.clone())
        .unwrap_or(CudaVisibleDevices::Unset);
    let inv = machine();
    let avail = Availability::from_nvml(&inv, &visible, &raw);
    DeviceReport::assemble(View::Nvml, env, raw, &inv, &avail, None)
}

#[test]
fn the_report_text_and_json() {
    let r = report(&[]);
    assert_eq!(
        r.selected.as_ref().unwrap().device,
        tt_device::Device::Cuda(1)
    );
    insta::assert_snapshot!("two_gpus_auto", r.to_string());
    let r = report(&[("CUDA_VISIBLE_DEVICES", "0"), ("LOCAL_RANK", "1")]);
    assert_eq!(r.hidden_gpus, 1);
    insta::assert_snapshot!("one_visible_rank_1", r.to_string());
    let r = report(&[("TORCHTOOLS_DEVICE", "cuda:4")]);
    assert!(r.selected.is_none());
    insta::assert_snapshot!("bad_request", r.to_string());
    insta::assert_json_snapshot!("two_gpus_json", report(&[("TORCHTOOLS_DEVICE", "cuda")]));
}

/// GPU 1 in MIG mode with two instances, as NVML lists them.
fn mig_machine() -> Inventory {
    let mut m = machine();
    m.gpus[1].mig = vec![
        MigInstance {
            uuid: "MIG-5c1e0f2a-aaaa-5555-9999-000000000001".into(),
        },
        MigInstance {
            uuid: "MIG-7d2f1e3b-bbbb-5555-9999-000000000002".into(),
        },
    ];
    m
}

#[test]
fn a_mig_instance_is_its_physical_gpu() {
    let m = mig_machine();
    // The CUDA driver reports a MIG instance by the instance's 16 bytes, formatted as
    // every CUDA UUID is: GPU-<the MIG UUID's digits>.
    let cuda = [
        "GPU-7d2f1e3b-bbbb-5555-9999-000000000002".to_owned(),
        "GPU-0a1b2c3d-0000-0000-0000-000000000000".to_owned(),
    ];
    let order: Vec<Option<u32>> = m
        .in_cuda_order(&cuda)
        .iter()
        .map(|g| g.map(|g| g.nvml_index))
        .collect();
    assert_eq!(order, [Some(1), Some(0)]);
    let parent = "GPU-0f8e7d6c-1111-1111-1111-111111111111";
    assert_eq!(m.gpu_of(&cuda[0]).map(|g| g.uuid.as_str()), Some(parent));
    assert_eq!(m.cuda_ordinal_of(parent, &cuda), Some(0));
    assert_eq!(
        m.cuda_ordinal_of("GPU-0a1b2c3d-0000-0000-0000-000000000000", &cuda),
        Some(1)
    );
    // Without MIG mode the same bytes are no GPU.
    assert!(machine().gpu_of(&cuda[0]).is_none());

    // CUDA_VISIBLE_DEVICES=MIG-... (whole or a unique prefix) is that GPU.
    let v = CudaVisibleDevices::parse("MIG-5c1e0f2a,0").unwrap();
    let seen: Vec<(usize, u32)> = m
        .visible(&v)
        .iter()
        .map(|g| (g.index, g.gpu.nvml_index))
        .collect();
    assert_eq!(seen, [(0, 1), (1, 0)]);
    // An instance NVML does not list ends the list, as CUDA does.
    let v = CudaVisibleDevices::parse("MIG-99999999,0").unwrap();
    assert!(m.visible(&v).is_empty());
}
