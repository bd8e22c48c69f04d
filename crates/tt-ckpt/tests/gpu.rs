//! GPU-only tests, selected by `cargo xtask test-gpu` (feature `gpu-tests`).
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use tch::{Device, Kind, Tensor};
use tt_ckpt::{Checkpoint, LoadedCheckpoint};

#[test]
fn cuda_tensors_are_saved_and_loaded_onto_the_device_asked_for() {
    tt_sys::require_cuda();
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("g.safetensors");
    let on_gpu = Tensor::randn([256, 256], (Kind::Half, Device::Cuda(0)));
    let mut c = Checkpoint::new(1);
    c.add_tch("g", &on_gpu).unwrap();
    c.write_to(&path).unwrap();
    let loaded = LoadedCheckpoint::read(&path).unwrap();
    let back = loaded.tch("g", Device::Cuda(0)).unwrap();
    assert_eq!((back.device(), back.kind()), (Device::Cuda(0), Kind::Half));
    assert!(back.equal(&on_gpu));
    assert_eq!(loaded.tch("g", Device::Cpu).unwrap().device(), Device::Cpu);
}

/// `TensorData::from_tch` of a CUDA tensor, strided and in bf16: its bytes copied to
/// host memory by libtorch, the same bytes as those of its CPU copy.
#[test]
fn a_cuda_tensor_becomes_host_bytes_identical_to_its_cpu_copy() {
    tt_sys::require_cuda();
    let on_gpu = Tensor::randn([64, 96], (Kind::BFloat16, Device::Cuda(0))).transpose(0, 1);
    let data = tt_ckpt::TensorData::from_tch(&on_gpu).unwrap();
    let on_cpu = on_gpu.to_device(Device::Cpu).contiguous();
    let mut expected = vec![0u8; 64 * 96 * 2];
    on_cpu.copy_data_u8(&mut expected, 64 * 96);
    assert_eq!(
        (data.dtype(), data.shape()),
        (tt_ckpt::Dtype::BF16, &[96usize, 64][..])
    );
    assert!(data.bytes() == expected.as_slice(), "the bytes differ");
}

/// `save_async` of CUDA state while training goes on: the checkpoint holds the values of
/// the moment it was taken (the in-place updates queued right after it run after its
/// copies), byte for byte what a checkpoint of CPU copies of the same values holds.
#[test]
fn an_async_checkpoint_of_cuda_state_holds_the_values_it_was_taken_with() {
    tt_sys::require_cuda();
    let root = tempfile::tempdir().unwrap();
    let dir = tt_ckpt::CheckpointDir::open(root.path().join("async"))
        .unwrap()
        .writer(true);
    let vs = tch::nn::VarStore::new(Device::Cuda(0));
    let _l = tch::nn::linear(vs.root() / "l", 4096, 4096, Default::default());
    let _b = vs.root().var(
        "big",
        &[64 << 20],
        tch::nn::Init::Randn {
            mean: 0.0,
            stdev: 1.0,
        },
    );
    // The values each checkpoint must hold: the same additions, in f32, on the CPU
    // (x + 1 + 1 is not always x + 2 in floating point).
    let mut expected: Vec<(String, Tensor)> = {
        let mut v: Vec<_> = vs
            .variables()
            .into_iter()
            .map(|(n, t)| (n, t.to_device(Device::Cpu)))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    for round in 0..3 {
        let mut ckpt = dir.checkpoint(round + 1);
        ckpt.add_var_store(&vs).unwrap();
        dir.save_async(ckpt).unwrap();
        // What an optimizer step does next: changes every parameter in place.
        tch::no_grad(|| {
            for (_, mut t) in vs.variables() {
                let _ = t.f_add_scalar_(1.0).unwrap();
            }
        });
        let path = dir.wait().unwrap().unwrap();
        let loaded = LoadedCheckpoint::read(&path).unwrap();
        for (name, cpu) in &expected {
            let saved = loaded.tch(name, Device::Cpu).unwrap();
            assert!(saved.equal(cpu), "{name} in round {round}");
        }
        // Byte for byte the file a checkpoint of CPU copies writes.
        let reference = root.path().join(format!("cpu-{round}.safetensors"));
        let mut c = Checkpoint::new(round + 1);
        for (name, cpu) in &mut expected {
            c.add_tch(name, cpu).unwrap();
            let _ = cpu.f_add_scalar_(1.0).unwrap();
        }
        c.write_to(&reference).unwrap();
        assert!(
            std::fs::read(&path).unwrap() == std::fs::read(&reference).unwrap(),
            "round {round}: the files differ"
        );
    }
}

/// A checkpoint of CPU tensors loaded onto the GPU through the pinned buffers: every
/// dtype and shape bit for bit (a tensor of more pieces than there are buffers, so the
/// buffers are reused; a piece that is not whole; a scalar; an empty tensor), and into
/// a VarStore on the GPU, whose variables stay trainable.
#[test]
fn a_checkpoint_loads_onto_the_gpu_through_pinned_buffers_bit_for_bit() {
    tt_sys::require_cuda();
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("load.safetensors");
    let chunk = tt_sys::DeviceUploads::CHUNK as i64;
    let pieces = tt_sys::DeviceUploads::DEPTH as i64 + 3;
    let cpu = (Kind::Float, Device::Cpu);
    let big = pieces * chunk / 4 + 3;
    // By name: the load returns them sorted, and the checks look them up.
    let tensors: std::collections::BTreeMap<&str, Tensor> = [
        ("bf", Tensor::randn([3, 5], cpu).to_kind(Kind::BFloat16)),
        // Pieces beyond the buffers' number, the last one short (3 bytes).
        ("big", Tensor::randn([big], cpu).view([-1, 1])),
        (
            "bytes",
            Tensor::randint(256, [1001], (Kind::Uint8, Device::Cpu)),
        ),
        ("empty", Tensor::zeros([0, 3], cpu)),
        (
            "flags",
            Tensor::randint(2, [7], (Kind::Int64, Device::Cpu)).to_kind(Kind::Bool),
        ),
        ("scalar", Tensor::from(2.5f64)),
        ("steps", Tensor::arange(9, (Kind::Int64, Device::Cpu))),
    ]
    .into_iter()
    .collect();
    let mut c = Checkpoint::new(1);
    for (name, t) in &tensors {
        c.add_tch(name, t).unwrap();
    }
    c.write_to(&path).unwrap();
    let loaded = LoadedCheckpoint::read(&path).unwrap();
    let all = loaded.tch_all(Device::Cuda(0)).unwrap();
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        ["bf", "big", "bytes", "empty", "flags", "scalar", "steps"]
    );
    for (name, gpu) in &all {
        let want = &tensors[name.as_str()];
        assert_eq!(
            (gpu.device(), gpu.kind()),
            (Device::Cuda(0), want.kind()),
            "{name}"
        );
        assert_eq!(gpu.size(), want.size(), "{name}");
        assert!(
            gpu.to_device(Device::Cpu).equal(want),
            "{name} differs after the load"
        );
    }
    // Into a VarStore on the GPU: straight into the variables' memory, and "steps"
    // (int64 in the file, f32 here) converted on the GPU.
    let mut vs = tch::nn::VarStore::new(Device::Cuda(0));
    let big_var = vs.root().zeros("big", &[big, 1]);
    let steps = vs.root().zeros_no_train("steps", &[9]);
    let report = tt_ckpt::TensorFile::read(&path)
        .unwrap()
        .load_var_store(
            &mut vs,
            tt_ckpt::LoadOptions::non_strict().convert_dtype(true),
        )
        .unwrap();
    assert_eq!(report.loaded, ["big", "steps"]);
    assert!(big_var.to_device(Device::Cpu).equal(&tensors["big"]));
    assert!(big_var.requires_grad(), "the variable is still trainable");
    let want = tensors["steps"].to_kind(Kind::Float);
    assert!(steps.to_device(Device::Cpu).equal(&want));
}
