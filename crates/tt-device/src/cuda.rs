//! This process's view of the GPUs through the CUDA driver API (`libcuda.so`, loaded at
//! run time through cudarc): the logical ordinals `cuda:0`, `cuda:1`, ... after
//! `CUDA_VISIBLE_DEVICES`, and the UUID of each. This is how a logical index is tied to
//! a physical GPU: CUDA's default order (fastest first) can differ from NVML's (PCI bus),
//! so parsing `CUDA_VISIBLE_DEVICES` alone cannot do it.

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

/// Why the CUDA driver could not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No `libcuda.so`: a machine without an NVIDIA driver.
    #[error("no CUDA driver (libcuda.so could not be loaded)")]
    NoDriver,
    /// The driver is there but `cuInit` failed (a driver/library mismatch, no device
    /// node, a container without the GPU).
    #[error("the CUDA driver failed to initialise: {reason}")]
    Init {
        /// The driver's error.
        reason: String,
    },
    /// A logical ordinal beyond what this process sees.
    #[error("cuda:{ordinal} does not exist: this process sees {count} CUDA device(s)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// The devices visible (after `CUDA_VISIBLE_DEVICES`).
        count: usize,
    },
    /// A driver call failed.
    #[error("{call} failed: {reason}")]
    Call {
        /// The call, with its argument.
        call: String,
        /// What the driver said.
        reason: String,
    },
}

/// The CUDA driver, initialised (`cuInit`) in this process.
#[derive(Debug, Clone, Copy)]
pub struct CudaDriver {
    _private: (),
}

impl CudaDriver {
    /// Loads `libcuda.so` and calls `cuInit`. Fails, never panics, when there is no
    /// driver (a machine without NVIDIA GPUs) or it cannot initialise; the error says why.
    pub fn init() -> Result<CudaDriver, CudaError> {
        static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
        INIT.get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to dlopen the library and closes it;
            // it is the documented way to avoid cudarc's panic when the library is absent.
            if !unsafe { sys::is_culib_present() } {
                return Err(CudaError::NoDriver);
            }
            result::init().map_err(|e| CudaError::Init {
                reason: e.to_string(),
            })
        })
        .clone()
        .map(|()| CudaDriver { _private: () })
    }

    /// How many devices this process sees (after `CUDA_VISIBLE_DEVICES`).
    pub fn device_count(&self) -> Result<usize, CudaError> {
        let count = result::device::get_count().map_err(|e| CudaError::Call {
            call: "cuDeviceGetCount".into(),
            reason: e.to_string(),
        })?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    /// The `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` UUID of logical device `ordinal`,
    /// in the form NVML and `nvidia-smi -L` print.
    pub fn uuid(&self, ordinal: usize) -> Result<String, CudaError> {
        let count = self.device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoSuchDevice { ordinal, count });
        }
        let call = |call: String| {
            move |e: result::DriverError| CudaError::Call {
                call,
                reason: e.to_string(),
            }
        };
        let dev =
            result::device::get(ordinal as i32).map_err(call(format!("cuDeviceGet({ordinal})")))?;
        let uuid = result::device::get_uuid(dev)
            .map_err(call(format!("cuDeviceGetUuid(cuda:{ordinal})")))?;
        Ok(format_uuid(&uuid.bytes.map(|b| b as u8)))
    }

    /// Every visible device's UUID, in logical order.
    pub fn uuids(&self) -> Result<Vec<String>, CudaError> {
        (0..self.device_count()?).map(|i| self.uuid(i)).collect()
    }

    /// The logical ordinal of the GPU with this UUID (a full `GPU-...` UUID), if this
    /// process sees it.
    pub fn ordinal_of(&self, uuid: &str) -> Result<Option<usize>, CudaError> {
        Ok(self
            .uuids()?
            .iter()
            .position(|u| u.eq_ignore_ascii_case(uuid)))
    }
}

/// Formats 16 UUID bytes as NVML does: `GPU-` + 8-4-4-4-12 lowercase hex digits.
pub(crate) fn format_uuid(bytes: &[u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_formatted_like_nvml() {
        let bytes: [u8; 16] = [
            0x8a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71, 0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7,
            0xe8, 0xf9,
        ];
        assert_eq!(
            format_uuid(&bytes),
            "GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
        );
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // On a machine with a driver this initialises it; without one it must say so.
        match CudaDriver::init() {
            Ok(driver) => {
                let uuids = driver.uuids().unwrap_or_default();
                assert!(uuids.iter().all(|u| u.starts_with("GPU-") && u.len() == 40));
            }
            Err(e) => {
                assert!(
                    matches!(e, CudaError::NoDriver | CudaError::Init { .. }),
                    "{e:?}"
                );
                assert!(e.to_string().contains("CUDA driver"), "{e}");
            }
        }
    }
}
