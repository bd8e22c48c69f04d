//! Automatic mixed precision: `torch.autocast` for the CPU and CUDA, which tch exposes
//! for CUDA only.

use tch::{Device, Kind};

use crate::error::{Error, Result};
use crate::ffi::{self, check};

/// The c10::ScalarType code of the autocast dtypes.
fn code(kind: Kind) -> Option<i32> {
    match kind {
        Kind::Half => Some(5),
        Kind::BFloat16 => Some(15),
        _ => None,
    }
}

fn device_type(device: Device) -> Result<i32> {
    match device {
        Device::Cpu => Ok(0),
        Device::Cuda(_) => Ok(1),
        other => Err(Error::Torch {
            op: "autocast",
            reason: format!("autocast on {other:?}: only the CPU and CUDA are supported"),
        }),
    }
}

/// Restores the previous autocast state when the region ends, however it ends.
struct Region {
    device_type: i32,
    prev_enabled: bool,
    prev_dtype: i32,
}

impl Drop for Region {
    fn drop(&mut self) {
        let (mut e, mut d) = (false, 0);
        // SAFETY: plain values and out-pointers to locals; errors are reported as
        // messages, which cannot happen for a device type that was accepted on entry.
        unsafe {
            let _ = check(ffi::tt_autocast_set(
                self.device_type,
                self.prev_enabled,
                self.prev_dtype,
                &mut e,
                &mut d,
            ));
            let _ = check(ffi::tt_autocast_nesting(false));
        }
    }
}

/// Runs `f` with autocast on `device`'s type in `dtype` (`Kind::BFloat16`, or
/// `Kind::Half`), as Python's `with torch.autocast(device_type, dtype):` does: eligible
/// operations (matrix products, convolutions, ...) run in `dtype`, precision-sensitive
/// ones in float32. Regions nest; the previous state comes back when `f` returns or
/// panics.
///
/// ```
/// use tch::{Device, Kind, Tensor};
/// let a = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
/// let product = tt_sys::autocast(Device::Cpu, Kind::BFloat16, || a.matmul(&a))?;
/// assert_eq!(product.kind(), Kind::BFloat16);
/// assert_eq!(a.matmul(&a).kind(), Kind::Float); // off again outside
/// # Ok::<(), tt_sys::Error>(())
/// ```
pub fn autocast<R>(device: Device, dtype: Kind, f: impl FnOnce() -> R) -> Result<R> {
    let dt = device_type(device)?;
    let Some(code) = code(dtype) else {
        return Err(Error::Torch {
            op: "autocast",
            reason: format!("autocast to {dtype:?}: use Kind::BFloat16 or Kind::Half"),
        });
    };
    let (mut prev_enabled, mut prev_dtype) = (false, 0);
    // SAFETY: plain values and out-pointers to locals.
    unsafe { check(ffi::tt_autocast_nesting(true)) }.map_err(|message| Error::Torch {
        op: "autocast",
        reason: message,
    })?;
    // SAFETY: as above.
    let set = unsafe {
        check(ffi::tt_autocast_set(
            dt,
            true,
            code,
            &mut prev_enabled,
            &mut prev_dtype,
        ))
    };
    if let Err(message) = set {
        // SAFETY: closes the region opened above.
        unsafe {
            let _ = check(ffi::tt_autocast_nesting(false));
        }
        return Err(Error::Torch {
            op: "autocast",
            reason: message,
        });
    }
    let _region = Region {
        device_type: dt,
        prev_enabled,
        prev_dtype,
    };
    Ok(f())
}
