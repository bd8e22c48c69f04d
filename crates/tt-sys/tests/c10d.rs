//! The raw c10d binding in one process: a real TCPStore served on loopback, Gloo groups
//! of one and of two (two threads, each a rank with its own store client), and c10d's
//! exceptions arriving as errors.

use std::time::Duration;

use tch::Tensor;
use tt_sys::c10d::{nccl_built, Backend, ReduceOp, Store};

const T: Duration = Duration::from_secs(30);

#[test]
fn tcp_store_set_get_add_and_prefixes() {
    let master = Store::tcp("127.0.0.1", 0, None, true, T, false).unwrap();
    let port = master.port().unwrap();
    assert_ne!(port, 0, "port 0 must pick a real port");
    let client = Store::tcp("127.0.0.1", port, None, false, T, false).unwrap();
    client.set("k", b"hello").unwrap();
    assert_eq!(master.get("k").unwrap(), b"hello");
    assert_eq!(master.add("n", 2).unwrap(), 2);
    assert_eq!(client.add("n", 3).unwrap(), 5);
    // PrefixStore keys are "<prefix>/<key>" on the underlying store, as torch.distributed's.
    let p = client.prefixed("default_pg").unwrap();
    p.set("x", b"1").unwrap();
    assert_eq!(master.get("default_pg/x").unwrap(), b"1");
    // A missing key times out with an error, not a hang or a crash.
    master.set_timeout(Duration::from_millis(200)).unwrap();
    let err = master.get("never").unwrap_err().to_string();
    assert!(err.contains("Store::get"), "{err}");
    // Embedded NUL is refused before reaching C++.
    assert!(master.set("a\0b", b"").is_err());
}

#[test]
fn gloo_group_of_two_threads_all_reduces_and_reports_bad_calls() {
    let master = Store::tcp("127.0.0.1", 0, Some(2), true, T, false).unwrap();
    let port = master.port().unwrap();
    let rank1 = std::thread::spawn(move || {
        let store = Store::tcp("127.0.0.1", port, Some(2), false, T, false).unwrap();
        let pg = Backend::gloo(&store, 1, 2, T).unwrap();
        let t = Tensor::from_slice(&[1.0f32, 2.0]) * 2.0;
        pg.all_reduce(&t, ReduceOp::Sum)
            .unwrap()
            .wait(None)
            .unwrap();
        pg.barrier().unwrap().wait(None).unwrap();
        Vec::<f32>::try_from(&t).unwrap()
    });
    let pg = Backend::gloo(&master, 0, 2, T).unwrap();
    assert_eq!((pg.rank(), pg.size()), (0, 2));
    let t = Tensor::from_slice(&[1.0f32, 2.0]);
    pg.all_reduce(&t, ReduceOp::Sum)
        .unwrap()
        .wait(None)
        .unwrap();
    pg.barrier().unwrap().wait(None).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![3.0, 6.0]);
    assert_eq!(rank1.join().unwrap(), vec![3.0, 6.0]);
    // c10d's own checks come back as errors (in a group of one, since rank 1 has left):
    // a root out of range, a rank out of range.
    drop(pg);
    let solo = Store::tcp("127.0.0.1", 0, None, true, T, false).unwrap();
    let pg = Backend::gloo(&solo, 0, 1, T).unwrap();
    let err = pg.broadcast(&t, 5).and_then(|w| w.wait(None)).unwrap_err();
    assert!(err.to_string().contains("broadcast"), "{err}");
    assert!(Backend::gloo(&solo, 2, 2, T).is_err());
}

#[test]
fn nccl_is_an_error_when_not_built_or_without_a_gpu() {
    let cuda = tt_sys::ensure_cuda_loaded().is_ok();
    if nccl_built() && cuda {
        return; // a working NCCL group: the GPU tests' business
    }
    let store = Store::tcp("127.0.0.1", 0, None, true, T, false).unwrap();
    let err = Backend::nccl(&store, 0, 1, T, 0).unwrap_err().to_string();
    // Each case has its own reason, and it reaches the user (a C++ exception caught at
    // the boundary and turned into this error).
    let reason = if nccl_built() {
        "ProcessGroupNCCL is only supported with GPUs, no GPUs found"
    } else {
        "nccl"
    };
    assert!(err.contains(reason), "{reason}: {err}");
}
