//! The order is torch's: compared with `torch.utils.data.DistributedSampler` in the
//! venv's Python (TORCHTOOLS_PYTHON, set up by `cargo xtask setup`), a real peer.

use std::io::Write;
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tt_sampler::DistributedSampler;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Config {
    len: u64,
    replicas: u64,
    rank: u64,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

const REFERENCE: &str = r#"
import hashlib, json, sys, array
import torch
from torch.utils.data import DistributedSampler

class Len:
    def __init__(self, n): self.n = n
    def __len__(self): return self.n

for line in sys.stdin:
    c = json.loads(line)
    s = DistributedSampler(Len(c["len"]), num_replicas=c["replicas"], rank=c["rank"],
                           shuffle=c["shuffle"], seed=c["seed"], drop_last=c["drop_last"])
    s.set_epoch(c["epoch"])
    idx = list(iter(s))
    digest = hashlib.sha256(array.array("q", idx).tobytes()).hexdigest()
    print(json.dumps({"n": len(idx), "len_attr": len(s), "head": idx[:8], "sha256": digest}), flush=True)
"#;

#[derive(Debug, Deserialize)]
struct Answer {
    n: u64,
    len_attr: u64,
    head: Vec<u64>,
    sha256: String,
}

fn python() -> Command {
    tt_testkit::python()
}

fn ask_torch(script: &str, configs: &[Config]) -> Vec<Answer> {
    let mut child = python()
        .args(["-W", "ignore", "-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect(
            "the reference Python (TORCHTOOLS_PYTHON) could not start: run `cargo xtask setup`",
        );
    let mut stdin = child.stdin.take().unwrap();
    let input: String = configs
        .iter()
        .map(|c| serde_json::to_string(c).unwrap() + "\n")
        .collect();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "the torch reference failed: {out:?}");
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn ours(c: &Config) -> Vec<u64> {
    let mut s = DistributedSampler::new(c.len, c.replicas, c.rank)
        .unwrap()
        .with_shuffle(c.shuffle)
        .with_seed(c.seed)
        .with_drop_last(c.drop_last);
    s.set_epoch(c.epoch);
    assert_eq!(s.remaining(), s.num_samples());
    s.collect()
}

fn sha256(indices: &[u64]) -> String {
    let mut h = Sha256::new();
    for i in indices {
        h.update((*i as i64).to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Deterministic "random" configurations (SplitMix64), lengths spread on a log scale.
fn configs(count: usize) -> Vec<Config> {
    let mut state = 0x5eed_u64;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    (0..count)
        .map(|i| {
            let len = match i % 20 {
                0 => 10_000_000,                     // the issue's largest
                1 => 1_000_000 + next() % 9_000_001, // up to 10^7
                2..=5 => next() % 8,                 // tiny: heavy padding, empty
                6..=11 => next() % 1000,             // small
                _ => next() % 200_000,               // medium
            };
            let replicas = 1 + next() % 8;
            Config {
                len,
                replicas,
                rank: next() % replicas,
                shuffle: next() % 5 != 0,
                seed: if next() % 4 == 0 {
                    0
                } else {
                    next() % (1 << 40)
                },
                drop_last: next() % 3 == 0,
                epoch: next() % 6,
            }
        })
        .collect()
}

#[test]
fn same_indices_as_torch_on_240_random_configurations() {
    let configs = configs(240);
    let answers = ask_torch(REFERENCE, &configs);
    assert_eq!(answers.len(), configs.len());
    for (c, a) in configs.iter().zip(&answers) {
        let mine = ours(c);
        let head: Vec<u64> = mine.iter().take(8).copied().collect();
        assert_eq!(mine.len() as u64, a.n, "{c:?}: count differs");
        assert_eq!(a.n, a.len_attr, "torch's own len() for {c:?}");
        assert_eq!(head, a.head, "{c:?}: first indices differ");
        assert_eq!(sha256(&mine), a.sha256, "{c:?}: indices differ");
    }
}

const LARGE_REFERENCE: &str = r#"
import json, sys, torch
n, seed = map(int, sys.argv[1:3])
g = torch.Generator(); g.manual_seed(seed)
p = torch.randperm(n, generator=g)
step = n // 997
print(json.dumps({"head": p[:64].tolist(), "tail": p[-64:].tolist(), "every": p[::step].tolist(),
                  "weighted": int((p[:1000000] * torch.arange(1000000)).sum())}))
"#;

#[test]
fn randperm_above_the_large_threshold_uses_torchs_64_bit_algorithm() {
    // torch switches algorithm at u32::MAX / 20 (`n < u32::MAX / 20` keeps the 32-bit
    // one): the threshold itself is the first size drawn with the 64-bit algorithm.
    let (n, seed) = (tt_sampler::LARGE_RANDPERM, 12345u64);
    let out = python()
        .args([
            "-W",
            "ignore",
            "-c",
            LARGE_REFERENCE,
            &n.to_string(),
            &seed.to_string(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let torch: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let p = tt_sampler::randperm(n, seed);
    let list = |k: &str| {
        torch[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(p[..64], list("head")[..]);
    assert_eq!(p[p.len() - 64..], list("tail")[..]);
    let step = (n / 997) as usize;
    assert_eq!(
        p.iter().step_by(step).copied().collect::<Vec<_>>(),
        list("every")
    );
    // torch's int64 sum wraps; so does this one.
    let weighted = p[..1_000_000]
        .iter()
        .enumerate()
        .fold(0i64, |acc, (i, v)| acc.wrapping_add(i as i64 * *v as i64));
    assert_eq!(weighted, torch["weighted"].as_i64().unwrap());
}
