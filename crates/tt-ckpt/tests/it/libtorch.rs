//! tch tensors and VarStores through checkpoints (feature `tch`).

use tch::{nn, Device, Kind, Tensor};
use tt_ckpt::{Checkpoint, CheckpointDir, Error, LoadedCheckpoint};

fn model(vs: &nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(vs / "l1", 4, 8, Default::default()))
        .add(nn::linear(vs / "l2", 8, 2, Default::default()))
}

#[test]
fn a_var_store_round_trips_exactly() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    tch::manual_seed(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let _m = model(&vs.root());
    let mut c = Checkpoint::new(7);
    c.add_var_store(&vs).unwrap();
    dir.save(&c).unwrap();

    tch::manual_seed(2); // other initial values
    let mut fresh = nn::VarStore::new(Device::Cpu);
    let _m2 = model(&fresh.root());
    let before = fresh.variables()["l1.weight"].shallow_clone();
    assert!(!before.equal(&vs.variables()["l1.weight"]));
    dir.load_latest()
        .unwrap()
        .unwrap()
        .checkpoint
        .load_var_store(&mut fresh)
        .unwrap();
    for (name, t) in vs.variables() {
        assert!(t.equal(&fresh.variables()[&name]), "{name}");
    }
    assert!(
        fresh.variables()["l1.weight"].requires_grad(),
        "still trainable"
    );
}

#[test]
fn dtypes_and_shapes_are_preserved() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("t.safetensors");
    let tensors = [
        ("f64", Tensor::from_slice(&[1.5f64, -2.25]).reshape([2, 1])),
        ("i64", Tensor::from_slice(&[1i64 << 40, -3])),
        (
            "bf16",
            Tensor::from_slice(&[0.5f32, -1.0, 3.0]).to_kind(Kind::BFloat16),
        ),
        ("bool", Tensor::from_slice(&[true, false, true])),
        (
            "strided",
            Tensor::arange(12, (Kind::Float, Device::Cpu))
                .reshape([3, 4])
                .transpose(0, 1),
        ),
        ("scalar", Tensor::from(3.0f32)),
    ];
    let mut c = Checkpoint::new(1);
    for (name, t) in &tensors {
        c.add_tch(name, t).unwrap();
    }
    c.write_to(&path).unwrap();
    let loaded = tt_ckpt::LoadedCheckpoint::read(&path).unwrap();
    for (name, t) in &tensors {
        let back = loaded.tch(name, Device::Cpu).unwrap();
        assert_eq!((back.kind(), back.size()), (t.kind(), t.size()), "{name}");
        assert!(back.equal(t), "{name}");
    }
}

#[test]
fn mismatched_variables_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("t.safetensors");
    let vs = nn::VarStore::new(Device::Cpu);
    let _m = model(&vs.root());
    let mut c = Checkpoint::new(1);
    c.add_var_store(&vs).unwrap();
    c.write_to(&path).unwrap();
    let loaded = tt_ckpt::LoadedCheckpoint::read(&path).unwrap();
    let mut other = nn::VarStore::new(Device::Cpu);
    let _m = nn::linear(other.root() / "l1", 4, 9, Default::default());
    let before = other.variables()["l1.bias"].copy();
    let e = loaded.load_var_store(&mut other).unwrap_err();
    assert!(
        matches!(e, Error::StateDict { .. })
            && e.to_string().contains("\"l1.weight\" has shape [9, 4]"),
        "{e}"
    );
    assert!(
        other.variables()["l1.bias"].equal(&before),
        "nothing copied, not even the variables that fit"
    );
    let mut missing = nn::VarStore::new(Device::Cpu);
    let _m = nn::linear(missing.root() / "l9", 4, 8, Default::default());
    match loaded.load_var_store(&mut missing) {
        Err(Error::StateDict { missing, .. }) => assert_eq!(missing, ["l9.bias", "l9.weight"]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn recycled_host_buffers_hold_exactly_the_new_data() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    let big = Tensor::arange(1000, (Kind::Float, Device::Cpu));
    let mut first = dir.checkpoint(1);
    first.add_tch("x", &big).unwrap();
    dir.save_async(first).unwrap();
    dir.wait().unwrap();
    // The next checkpoint reuses those buffers, for a smaller and another tensor.
    let small = Tensor::from_slice(&[7i64, 8, 9]);
    let mut second = dir.checkpoint(2);
    second.add_tch("y", &small).unwrap();
    second.add_tch("z", &(big.shallow_clone() * 2.0)).unwrap();
    dir.save_async(second).unwrap();
    dir.wait().unwrap();
    let loaded = dir.load_latest().unwrap().unwrap().checkpoint;
    assert_eq!(loaded.step(), 2);
    assert!(loaded.tch("y", Device::Cpu).unwrap().equal(&small));
    assert!(loaded.tch("z", Device::Cpu).unwrap().equal(&(big * 2.0)));
    assert_eq!(loaded.tensors().names(), ["y", "z"]);
}

/// `tch_all` gives every tensor of the file, by sorted name, with its dtype and shape:
/// what `safetensors.torch.load_file` gives a PyTorch user.
#[test]
fn tch_all_gives_every_tensor_by_name_with_its_dtype_and_shape() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("all.safetensors");
    let saved = [
        ("b.scalar", Tensor::from(2.5f64)),
        (
            "a.weight",
            Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16),
        ),
        ("c.empty", Tensor::zeros([0, 2], (Kind::Int64, Device::Cpu))),
    ];
    let mut c = Checkpoint::new(1);
    for (name, t) in &saved {
        c.add_tch(name, t).unwrap();
    }
    c.write_to(&path).unwrap();
    let all = LoadedCheckpoint::read(&path)
        .unwrap()
        .tch_all(Device::Cpu)
        .unwrap();
    let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["a.weight", "b.scalar", "c.empty"]);
    for (name, t) in &all {
        let want = &saved.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!((t.kind(), t.size()), (want.kind(), want.size()), "{name}");
        assert!(t.equal(want), "{name}");
    }
}
