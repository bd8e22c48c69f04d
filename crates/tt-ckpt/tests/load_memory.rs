//! Loading costs one copy of the tensors, not two: the file is mapped (page cache,
//! reclaimable), not read into a buffer and then copied again (feature `tch`). Alone
//! in its binary, so that no other test's memory moves the figures.
#![cfg(feature = "tch")]
#![allow(clippy::unwrap_used)] // a panic is how a test reports

use tch::{Device, Kind, Tensor};
use tt_ckpt::{Checkpoint, LoadedCheckpoint};

/// This process's anonymous resident memory (heap, not file pages), in bytes.
fn rss_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib << 10
}

#[test]
fn a_loaded_checkpoint_holds_one_copy_of_its_tensors() {
    const MIB: u64 = 1 << 20;
    let root = tempfile::tempdir().unwrap();
    let path = root.path().join("big.safetensors");
    {
        let mut c = Checkpoint::new(1);
        for i in 0..4 {
            c.add_tch(
                &format!("t{i}"),
                &Tensor::rand([16 << 20], (Kind::Float, Device::Cpu)),
            )
            .unwrap();
        }
        c.write_to(&path).unwrap();
    }
    let file_bytes = std::fs::metadata(&path).unwrap().len();
    assert!(file_bytes > 255 * MIB);
    let before = rss_anon();
    let loaded = LoadedCheckpoint::read(&path).unwrap(); // verified: every byte read
    let verified = rss_anon();
    let tensors: Vec<Tensor> = loaded
        .tensors()
        .names()
        .iter()
        .map(|n| loaded.tch(n, Device::Cpu).unwrap())
        .collect();
    let converted = rss_anon();
    assert_eq!(tensors.len(), 4);
    assert!(
        verified - before.min(verified) < 32 * MIB,
        "reading and verifying took {} MiB of heap for a {} MiB file",
        (verified - before) / MIB,
        file_bytes / MIB
    );
    assert!(
        converted - before.min(converted) < file_bytes + 64 * MIB,
        "loaded tensors took {} MiB of heap for a {} MiB file: more than one copy",
        (converted - before) / MIB,
        file_bytes / MIB
    );
}
