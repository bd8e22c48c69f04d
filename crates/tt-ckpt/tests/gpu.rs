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
