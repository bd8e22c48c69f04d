//! Python reads our checkpoints, we read Python's: with the venv's torch and
//! safetensors (TORCHTOOLS_PYTHON, set up by `cargo xtask setup`), real peers.

use crate::common;
use common::python;

use tt_ckpt::{Checkpoint, CheckpointDir, Dtype, Error, LoadedCheckpoint, TensorData, TensorFile};

const READ: &str = r#"
import json, sys
from safetensors.torch import load_file
from safetensors import safe_open
t = load_file(sys.argv[1])
with safe_open(sys.argv[1], framework="pt") as f:
    meta = json.loads(f.metadata()["torchtools"])
print(json.dumps({"step": meta["step"], "sampler": meta["values"]["sampler"],
                  "tensors": {k: [str(v.dtype), list(v.shape), v.flatten().tolist()] for k, v in sorted(t.items())}}))
"#;

#[test]
fn python_loads_what_we_write() {
    let root = tempfile::tempdir().unwrap();
    let dir = CheckpointDir::open(root.path()).unwrap();
    let mut c = Checkpoint::new(42);
    c.set_value("sampler", &serde_json::json!({"epoch": 3, "progress": 17}))
        .unwrap();
    c.add_tensor(
        "w",
        TensorData::from_f32(vec![2, 3], &[1.5, -2.0, 0.25, 3.0, 4.0, -0.5]).unwrap(),
    )
    .unwrap();
    let ids: Vec<u8> = [7i64, -9, 1 << 40]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    c.add_tensor("ids", TensorData::new(Dtype::I64, vec![3], ids).unwrap())
        .unwrap();
    c.add_tensor(
        "mask",
        TensorData::new(Dtype::U8, vec![4], vec![0, 1, 1, 0]).unwrap(),
    )
    .unwrap();
    let path = dir.save(&c).unwrap().unwrap();
    let got: serde_json::Value =
        serde_json::from_str(&python(READ, &[path.to_str().unwrap()])).unwrap();
    assert_eq!(got["step"], 42);
    assert_eq!(got["sampler"]["progress"], 17);
    assert_eq!(
        got["tensors"]["w"],
        serde_json::json!(["torch.float32", [2, 3], [1.5, -2.0, 0.25, 3.0, 4.0, -0.5]])
    );
    assert_eq!(
        got["tensors"]["ids"],
        serde_json::json!(["torch.int64", [3], [7, -9, 1099511627776i64]])
    );
    assert_eq!(
        got["tensors"]["mask"],
        serde_json::json!(["torch.uint8", [4], [0, 1, 1, 0]])
    );
}

const WRITE: &str = r#"
import sys, torch
from safetensors.torch import save_file
save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4,
           "b": torch.tensor([1, -2, 3], dtype=torch.int32),
           "h": torch.tensor([0.5, -1.0], dtype=torch.bfloat16)},
          sys.argv[1], metadata={"origin": "python"})
"#;

#[test]
fn we_load_what_python_writes() {
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("from_python.safetensors");
    python(WRITE, &[path.to_str().unwrap()]);
    let f = TensorFile::read(&path).unwrap();
    assert_eq!(f.names(), ["a", "b", "h"]);
    assert_eq!(f.metadata()["origin"], "python");
    let a = f.tensor("a").unwrap();
    assert_eq!((a.dtype(), a.shape()), (Dtype::F32, &[2usize, 3][..]));
    let floats: Vec<f32> = a
        .data()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(floats, [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]);
    let b = f.tensor("b").unwrap();
    let ints: Vec<i32> = b
        .data()
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!((b.dtype(), ints), (Dtype::I32, vec![1, -2, 3]));
    let h = f.tensor("h").unwrap();
    assert_eq!(
        (h.dtype(), h.data()),
        (Dtype::BF16, &[0x00, 0x3f, 0x80, 0xbf][..])
    );
    // Not a torchtools checkpoint: reading it as one says so.
    let e = LoadedCheckpoint::read(&path).unwrap_err();
    assert!(
        matches!(e, Error::Corrupt { .. }) && e.to_string().contains("not written by torchtools"),
        "{e}"
    );
}
