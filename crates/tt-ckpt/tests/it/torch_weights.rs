//! Weights trained in PyTorch into a tch VarStore (feature `tch`): files written by
//! the venv's `safetensors.torch.save_file` (torch 2.11), loaded with torch's
//! `load_state_dict` rules, and the dtypes tch shares with safetensors both ways.

use crate::common;
use common::python;

use tch::{nn, nn::Module, Device, Kind, Tensor};
use tt_ckpt::{Checkpoint, Error, LoadOptions, TensorFile};

/// A PyTorch model with the same paths as `model` below, its state_dict saved with
/// safetensors, and its output on a fixed input printed.
const TRAIN_IN_PYTHON: &str = r#"
import json, sys, torch
from safetensors.torch import save_file
torch.manual_seed(3)
class M(torch.nn.Module):
    def __init__(s):
        super().__init__()
        s.l1 = torch.nn.Linear(4, 8)
        s.l2 = torch.nn.Linear(8, 2)
    def forward(s, x):
        return s.l2(torch.relu(s.l1(x)))
m = M()
sd = m.state_dict()
extra = sys.argv[2]
if extra == "extra":
    sd["running_note"] = torch.zeros(3)
elif extra == "f64":
    sd = {k: v.double() for k, v in sd.items()}
elif extra == "wide":
    sd["l2.weight"] = torch.zeros(2, 9)
save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[1])
x = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10
print(json.dumps(m(x).detach().flatten().tolist()))
"#;

fn model(p: &nn::Path) -> nn::Sequential {
    nn::seq()
        .add(nn::linear(p / "l1", 4, 8, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(p / "l2", 8, 2, Default::default()))
}

/// Saves the Python model (with `variant`), returns the file and its outputs.
fn from_python(dir: &std::path::Path, variant: &str) -> (std::path::PathBuf, Vec<f32>) {
    let path = dir.join(format!("{variant}.safetensors"));
    let out = python(TRAIN_IN_PYTHON, &[path.to_str().unwrap(), variant]);
    (path, serde_json::from_str(out.trim()).unwrap())
}

fn outputs(m: &nn::Sequential) -> Vec<f32> {
    let x = Tensor::arange(12, (Kind::Float, Device::Cpu)).reshape([3, 4]) / 10.0;
    Vec::<f32>::try_from(m.forward(&x).flatten(0, -1)).unwrap()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && !a.is_empty() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
}

#[test]
fn a_pytorch_state_dict_loads_into_a_var_store_and_computes_the_same() {
    let root = tempfile::tempdir().unwrap();
    let (path, expected) = from_python(root.path(), "plain");
    let mut vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs.root());
    assert!(!close(&outputs(&m), &expected), "random init differs");
    let file = TensorFile::read(&path).unwrap();
    assert!(file.metadata().get("torchtools").is_none(), "a plain file");
    let report = file
        .load_var_store(&mut vs, LoadOptions::default())
        .unwrap();
    assert_eq!(
        report.loaded,
        ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
    );
    assert!(report.missing.is_empty() && report.unexpected.is_empty());
    assert!(
        close(&outputs(&m), &expected),
        "{:?} vs {expected:?}",
        outputs(&m)
    );
    assert!(
        vs.variables()["l1.weight"].requires_grad(),
        "still trainable"
    );
}

#[test]
fn strict_by_default_non_strict_on_request() {
    let root = tempfile::tempdir().unwrap();
    let (extra, expected) = from_python(root.path(), "extra");
    let file = TensorFile::read(&extra).unwrap();
    // An unexpected name: refused, naming it, and nothing loaded.
    let mut vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs.root());
    let before = outputs(&m);
    let e = file
        .load_var_store(&mut vs, LoadOptions::strict())
        .unwrap_err();
    assert!(matches!(&e, Error::StateDict { unexpected, .. } if unexpected == &["running_note"]));
    let text = e.to_string();
    assert!(
        text.contains("unexpected in the file: \"running_note\"") && text.contains("non_strict"),
        "{text}"
    );
    assert_eq!(outputs(&m), before, "the VarStore is unchanged");
    // Non-strict: loaded, and the extra name reported.
    let report = file
        .load_var_store(&mut vs, LoadOptions::non_strict())
        .unwrap();
    assert_eq!(report.unexpected, ["running_note"]);
    assert!(close(&outputs(&m), &expected));
    // A variable the file lacks: missing, strict or reported.
    let mut bigger = nn::VarStore::new(Device::Cpu);
    let _m = model(&bigger.root());
    let _head = nn::linear(bigger.root() / "head", 2, 1, Default::default());
    let head_before = bigger.variables()["head.weight"].copy();
    match file.load_var_store(&mut bigger, LoadOptions::strict()) {
        Err(Error::StateDict { missing, .. }) => {
            assert_eq!(missing, ["head.bias", "head.weight"])
        }
        other => panic!("{other:?}"),
    }
    let report = file
        .load_var_store(&mut bigger, LoadOptions::non_strict())
        .unwrap();
    assert_eq!(report.missing, ["head.bias", "head.weight"]);
    assert!(bigger.variables()["head.weight"].equal(&head_before));
    // A shape that differs is an error even when non-strict (as in torch).
    let (wide, _) = from_python(root.path(), "wide");
    let e = TensorFile::read(&wide)
        .unwrap()
        .load_var_store(&mut vs, LoadOptions::non_strict())
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("\"l2.weight\" has shape [2, 8] in the VarStore but [2, 9] in the file"),
        "{e}"
    );
}

#[test]
fn another_dtype_is_converted_only_when_asked() {
    let root = tempfile::tempdir().unwrap();
    let (path, expected) = from_python(root.path(), "f64");
    let file = TensorFile::read(&path).unwrap();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let m = model(&vs.root());
    let e = file
        .load_var_store(&mut vs, LoadOptions::default())
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("\"l1.bias\" is Float in the VarStore but Double in the file"),
        "{e}"
    );
    let report = file
        .load_var_store(&mut vs, LoadOptions::default().convert_dtype(true))
        .unwrap();
    assert_eq!(report.loaded.len(), 4);
    assert_eq!(vs.variables()["l1.weight"].kind(), Kind::Float);
    assert!(close(&outputs(&m), &expected));
}

const FLOAT8_AND_COMPLEX: &str = r#"
import json, sys, torch
from safetensors.torch import save_file, load_file
base = torch.tensor([0.5, -1.25, 3.0, 448.0])
t = {"e4m3": base.to(torch.float8_e4m3fn), "e5m2": base.to(torch.float8_e5m2),
     "c64": torch.complex(base, -base), "u16": torch.tensor([0, 1, 2], dtype=torch.int32).to(torch.uint16)}
save_file(t, sys.argv[1])
# And what we wrote, read back by Python.
back = load_file(sys.argv[2])
print(json.dumps({"ours": {k: [str(v.dtype), torch.view_as_real(v).flatten().tolist() if v.is_complex() else v.float().tolist()] for k, v in sorted(back.items())},
                  "theirs": {k: t[k].float().tolist() for k in ["e4m3", "e5m2"]}}))
"#;

#[test]
fn float8_and_complex_cross_both_ways_and_other_dtypes_say_cannot_read() {
    let root = tempfile::tempdir().unwrap();
    // Ours first, for Python to read.
    let base = Tensor::from_slice(&[0.5f32, -1.25, 3.0, 448.0]);
    let ours = root.path().join("ours.safetensors");
    let mut c = Checkpoint::new(1);
    c.add_tch("e4m3", &base.to_kind(Kind::Float8e4m3fn))
        .unwrap();
    c.add_tch("e5m2", &base.to_kind(Kind::Float8e5m2)).unwrap();
    c.add_tch("c64", &Tensor::complex(&base, &(-&base)))
        .unwrap();
    c.write_to(&ours).unwrap();
    let theirs = root.path().join("theirs.safetensors");
    let out: serde_json::Value = serde_json::from_str(&python(
        FLOAT8_AND_COMPLEX,
        &[theirs.to_str().unwrap(), ours.to_str().unwrap()],
    ))
    .unwrap();
    assert_eq!(
        out["ours"]["c64"],
        serde_json::json!([
            "torch.complex64",
            [0.5, -0.5, -1.25, 1.25, 3.0, -3.0, 448.0, -448.0]
        ])
    );
    assert_eq!(out["ours"]["e4m3"][0], "torch.float8_e4m3fn");
    assert_eq!(out["ours"]["e5m2"][0], "torch.float8_e5m2");
    // Theirs, read by us: same kinds, same values as Python's own conversion.
    let file = TensorFile::read(&theirs).unwrap();
    for (name, kind) in [("e4m3", Kind::Float8e4m3fn), ("e5m2", Kind::Float8e5m2)] {
        let t = file.tch(name, Device::Cpu).unwrap();
        assert_eq!(t.kind(), kind);
        let values = Vec::<f32>::try_from(t.to_kind(Kind::Float)).unwrap();
        let python: Vec<f32> = serde_json::from_value(out["theirs"][name].clone()).unwrap();
        assert_eq!(values, python, "{name}");
        assert_eq!(
            out["ours"][name][1], out["theirs"][name],
            "{name}: same bytes both ways"
        );
    }
    let c64 = file.tch("c64", Device::Cpu).unwrap();
    assert_eq!(c64.kind(), Kind::ComplexFloat);
    assert!(c64.real().equal(&base) && c64.imag().equal(&(-&base)));
    // A dtype tch has no kind for: a read error that says so, naming the tensor.
    let e = file.tch("u16", Device::Cpu).unwrap_err();
    assert!(matches!(e, Error::Unreadable { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.starts_with("cannot read the tensors: tensor \"u16\": safetensors dtype U16"),
        "{text}"
    );
}
