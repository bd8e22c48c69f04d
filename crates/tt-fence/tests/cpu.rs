//! What a machine without a GPU sees: a clear error, never a panic.

use tt_device::{Bytes, CudaDriver};
use tt_fence::{Error, Fence, FenceOptions};

#[test]
fn without_a_driver_raise_is_a_clear_error() {
    if CudaDriver::init().is_ok() {
        return; // a GPU machine: tests/gpu.rs covers it
    }
    let e = Fence::raise(0, &FenceOptions::keep_free(Bytes::gib(1))).err();
    match &e {
        Some(Error::NoDriver { reason }) => assert!(reason.contains("libcuda"), "{reason}"),
        other => panic!("expected NoDriver, got {other:?}"),
    }
    let text = e.map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("--no-fence"), "{text}");
    let e = Fence::raise_on_uuid("GPU-0000", &FenceOptions::keep_free(Bytes(0))).err();
    assert!(matches!(e, Some(Error::NoDriver { .. })), "{e:?}");
}
