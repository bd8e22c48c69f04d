use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tt_device::{CudaDriver, Inventory, NvmlStatus};

use crate::{Error, Result};

/// A GPU as a user names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GpuSpec {
    /// NVML's index, the one `nvidia-smi` shows (`--gpu 3`).
    Nvml(u32),
    /// A `GPU-...` UUID or a unique prefix of one.
    Uuid(String),
    /// `cuda:N`: this process's N-th visible CUDA device, mapped to its physical GPU
    /// through the CUDA driver (`cuDeviceGetUuid`), whatever `CUDA_VISIBLE_DEVICES` and
    /// `CUDA_DEVICE_ORDER` say.
    Cuda(usize),
    /// The free GPU with the most free memory (NVML), or the first free one.
    Auto,
}

impl FromStr for GpuSpec {
    type Err = Error;

    /// Parses `3`, `GPU-8a1b...`, `cuda:0` or `auto`.
    fn from_str(text: &str) -> Result<GpuSpec> {
        let s = text.trim();
        let invalid = |hint: &str| Error::InvalidGpu {
            value: text.to_owned(),
            hint: hint.to_owned(),
        };
        if s.eq_ignore_ascii_case("auto") {
            return Ok(GpuSpec::Auto);
        }
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return s.parse().map(GpuSpec::Nvml).map_err(|_| invalid(""));
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            return n.parse().map(GpuSpec::Cuda).map_err(|_| invalid(""));
        }
        if s.len() > 4 && s[..4].eq_ignore_ascii_case("GPU-") {
            let rest = &s[4..];
            if rest.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
                return Ok(GpuSpec::Uuid(format!("GPU-{}", rest.to_ascii_lowercase())));
            }
            return Err(invalid(
                "; a UUID has only hex digits and dashes after GPU-",
            ));
        }
        if s.len() > 4 && s[..4].eq_ignore_ascii_case("MIG-") {
            return Err(invalid(
                "; MIG instances are not locked separately: lock their parent GPU",
            ));
        }
        Err(invalid(""))
    }
}

impl fmt::Display for GpuSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuSpec::Nvml(i) => write!(f, "GPU {i}"),
            GpuSpec::Uuid(u) => f.write_str(u),
            GpuSpec::Cuda(i) => write!(f, "cuda:{i}"),
            GpuSpec::Auto => f.write_str("auto"),
        }
    }
}

/// What a lock is keyed by: the physical GPU's UUID, or, where NVML is absent, the index
/// the user gave (so that locks work, and are testable, on machines without GPUs).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuKey {
    /// `GPU-...`, lowercase, as NVML prints it.
    Uuid(String),
    /// An index, used only without NVML.
    Index(u32),
}

impl GpuKey {
    /// The key of a GPU NVML names by this UUID (`GPU-` and lowercase hex, as NVML
    /// prints it, whatever the case given).
    pub fn of_uuid(uuid: &str) -> GpuKey {
        GpuKey::Uuid(normalize_uuid(uuid))
    }

    /// The lock file's name: `gpu-<UUID>.lock` or `gpu-<index>.lock`.
    pub fn file_name(&self) -> String {
        match self {
            GpuKey::Uuid(u) => format!("gpu-{u}.lock"),
            GpuKey::Index(i) => format!("gpu-{i}.lock"),
        }
    }

    /// The key a lock file's name stands for, if it is one of ours.
    pub fn from_file_name(name: &str) -> Option<GpuKey> {
        let inner = name.strip_prefix("gpu-")?.strip_suffix(".lock")?;
        if let Ok(i) = inner.parse() {
            return Some(GpuKey::Index(i));
        }
        let rest = inner.strip_prefix("GPU-")?;
        (!rest.is_empty() && rest.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-'))
            .then(|| GpuKey::Uuid(inner.to_owned()))
    }

    /// The value that names this GPU in `CUDA_VISIBLE_DEVICES`: the UUID, or the index.
    pub fn cuda_visible_entry(&self) -> String {
        match self {
            GpuKey::Uuid(u) => u.clone(),
            GpuKey::Index(i) => i.to_string(),
        }
    }
}

impl fmt::Display for GpuKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuKey::Uuid(u) => write!(f, "GPU {u}"),
            GpuKey::Index(i) => write!(f, "GPU index {i} (keyed by index: no NVML)"),
        }
    }
}

impl GpuSpec {
    /// The lock key of this GPU, given the machine's NVML inventory.
    ///
    /// With NVML every form resolves to the physical GPU's UUID, so `--gpu 3`, its
    /// UUID and `cuda:0` under `CUDA_VISIBLE_DEVICES=3` take the same lock. Without NVML
    /// an index is used as given (and a UUID must be complete). [`GpuSpec::Auto`] has
    /// no single key: use [`crate::LockDir::lock_auto`].
    pub fn resolve(&self, inventory: &Inventory) -> Result<GpuKey> {
        let nvml = matches!(inventory.nvml, NvmlStatus::Available { .. });
        match self {
            GpuSpec::Auto => Err(Error::InvalidGpu {
                value: "auto".into(),
                hint: "; auto picks among several GPUs: use lock_auto".into(),
            }),
            GpuSpec::Nvml(i) if nvml => inventory
                .gpus
                .iter()
                .find(|g| g.nvml_index == *i)
                .map(|g| GpuKey::of_uuid(&g.uuid))
                .ok_or_else(|| unknown(self, inventory)),
            GpuSpec::Nvml(i) => Ok(GpuKey::Index(*i)),
            GpuSpec::Uuid(prefix) if nvml => {
                let mut found = inventory
                    .gpus
                    .iter()
                    .filter(|g| normalize_uuid(&g.uuid).starts_with(&normalize_uuid(prefix)));
                match (found.next(), found.next()) {
                    (Some(g), None) => Ok(GpuKey::of_uuid(&g.uuid)),
                    (Some(_), Some(_)) => Err(Error::UnknownGpu {
                        spec: prefix.clone(),
                        known: format!(
                            "the prefix matches several GPUs ({}); give more of the UUID",
                            known(inventory)
                        ),
                    }),
                    (None, _) => Err(unknown(self, inventory)),
                }
            }
            GpuSpec::Uuid(uuid) => {
                if uuid.len() == 40 {
                    Ok(GpuKey::of_uuid(uuid))
                } else {
                    Err(Error::UnknownGpu {
                        spec: uuid.clone(),
                        known: "without NVML a prefix cannot be completed; give the whole \
                                UUID (GPU- and 36 characters) or an index"
                            .into(),
                    })
                }
            }
            GpuSpec::Cuda(ordinal) => {
                let uuid = CudaDriver::init()
                    .and_then(|driver| driver.uuid(*ordinal))
                    .map_err(|e| Error::Cuda {
                        spec: self.to_string(),
                        reason: e.to_string(),
                    })?;
                Ok(key_of_cuda_uuid(&uuid, inventory))
            }
        }
    }
}

/// The lock key of the CUDA device the driver names `uuid`: its physical GPU's UUID,
/// also when it is a MIG instance (one lock per physical GPU: a MIG instance's user and
/// a whole-GPU user exclude each other). Without NVML, the driver's UUID as it is.
fn key_of_cuda_uuid(uuid: &str, inventory: &Inventory) -> GpuKey {
    GpuKey::of_uuid(inventory.gpu_of(uuid).map_or(uuid, |g| g.uuid.as_str()))
}

/// `GPU-` followed by the lowercase hex of the UUID, as NVML prints it.
pub(crate) fn normalize_uuid(uuid: &str) -> String {
    match uuid.get(..4) {
        Some(p) if p.eq_ignore_ascii_case("GPU-") => {
            format!("GPU-{}", uuid[4..].to_ascii_lowercase())
        }
        _ => uuid.to_ascii_lowercase(),
    }
}

fn unknown(spec: &GpuSpec, inventory: &Inventory) -> Error {
    Error::UnknownGpu {
        spec: spec.to_string(),
        known: if inventory.gpus.is_empty() {
            "NVML lists no GPU".to_owned()
        } else {
            format!("NVML lists {}", known(inventory))
        },
    }
}

fn known(inventory: &Inventory) -> String {
    inventory
        .gpus
        .iter()
        .map(|g| format!("{} ({})", g.nvml_index, g.uuid))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tt_device::{Bytes, GpuInfo};

    fn machine(uuids: &[&str]) -> Inventory {
        Inventory {
            nvml: NvmlStatus::Available {
                driver_version: "test".into(),
            },
            gpus: uuids
                .iter()
                .enumerate()
                .map(|(i, u)| GpuInfo {
                    nvml_index: i as u32,
                    uuid: (*u).into(),
                    name: "H100".into(),
                    total: Bytes::gib(80),
                    free: Bytes::gib(80),
                    used: Bytes(0),
                    utilization: None,
                    processes: vec![],
                    mig: vec![],
                })
                .collect(),
            errors: vec![],
        }
    }

    #[test]
    fn a_mig_instance_locks_its_physical_gpu() {
        let mut m = machine(&[
            "GPU-0a1b2c3d-0000-0000-0000-000000000000",
            "GPU-0f8e7d6c-1111-1111-1111-111111111111",
        ]);
        m.gpus[1].mig = vec![tt_device::MigInstance {
            uuid: "MIG-7d2f1e3b-bbbb-5555-9999-000000000002".into(),
        }];
        // What the CUDA driver reports for that instance.
        let instance = "GPU-7d2f1e3b-bbbb-5555-9999-000000000002";
        let whole = GpuSpec::Nvml(1).resolve(&m).unwrap();
        assert_eq!(key_of_cuda_uuid(instance, &m), whole);
        assert_eq!(
            key_of_cuda_uuid("GPU-0a1b2c3d-0000-0000-0000-000000000000", &m),
            GpuSpec::Nvml(0).resolve(&m).unwrap()
        );
        // Without NVML nothing can be mapped: the driver's UUID is the key.
        assert_eq!(
            key_of_cuda_uuid(instance, &no_nvml()),
            GpuKey::of_uuid(instance)
        );
    }

    #[test]
    fn keys_are_nvmls_spelling_and_never_invent_a_gpu_prefix() {
        let gpu = "GPU-8A1B2C3D-4E5F-6071-8293-A4B5C6D7E8F9";
        let want = GpuKey::Uuid("GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9".into());
        assert_eq!(GpuKey::of_uuid(gpu), want);
        assert_eq!(GpuKey::of_uuid(&gpu.to_ascii_lowercase()), want);
        // Another kind of UUID keeps its own prefix: it must never take a GPU's lock file.
        let mig = "MIG-7D2F1E3B-BBBB-5555-9999-000000000002";
        assert_eq!(GpuKey::of_uuid(mig), GpuKey::Uuid(mig.to_ascii_lowercase()));
    }

    fn no_nvml() -> Inventory {
        Inventory {
            nvml: NvmlStatus::Unavailable {
                reason: "none".into(),
            },
            gpus: vec![],
            errors: vec![],
        }
    }

    const A: &str = "GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9";
    const B: &str = "GPU-8a1b9999-4e5f-6071-8293-a4b5c6d7e8f9";

    #[test]
    fn edge_forms_are_refused_or_read_as_they_should() {
        // "GPU-" alone or "MIG-" alone: nothing after the prefix, not a UUID.
        for bare in ["GPU-", "gpu-", "MIG-"] {
            let e = bare.parse::<GpuSpec>().unwrap_err().to_string();
            assert!(!e.contains("MIG instances"), "{bare}: {e}");
            assert!(!e.contains("only hex digits"), "{bare}: {e}");
        }
        assert!("MIG-1234"
            .parse::<GpuSpec>()
            .unwrap_err()
            .to_string()
            .contains("MIG instances are not locked separately"));
        assert_eq!(
            "GPU-A".parse::<GpuSpec>().ok(),
            Some(GpuSpec::Uuid("GPU-a".into()))
        );
        // Lock file names: ours only.
        let uuid = "GPU-8a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9";
        assert_eq!(
            GpuKey::from_file_name(&format!("gpu-{uuid}.lock")),
            Some(GpuKey::Uuid(uuid.into()))
        );
        assert_eq!(GpuKey::from_file_name("gpu-3.lock"), Some(GpuKey::Index(3)));
        for other in [
            "gpu-GPU-.lock",
            "gpu-GPU-xyz.lock",
            "gpu-3.lck",
            "cpu-3.lock",
            "gpu-.lock",
        ] {
            assert_eq!(GpuKey::from_file_name(other), None, "{other}");
        }
        // What users read in messages.
        assert_eq!(GpuKey::Uuid(uuid.into()).to_string(), format!("GPU {uuid}"));
        assert_eq!(
            GpuKey::Index(2).to_string(),
            "GPU index 2 (keyed by index: no NVML)"
        );
        // UUIDs are compared in NVML's spelling whatever the case typed.
        assert_eq!(normalize_uuid("gpu-ABC"), "GPU-abc");
        assert_eq!(normalize_uuid("ABC"), "abc");
    }

    #[test]
    fn parses_every_form() {
        assert_eq!("3".parse::<GpuSpec>().ok(), Some(GpuSpec::Nvml(3)));
        assert_eq!(" auto ".parse::<GpuSpec>().ok(), Some(GpuSpec::Auto));
        assert_eq!("cuda:1".parse::<GpuSpec>().ok(), Some(GpuSpec::Cuda(1)));
        assert_eq!(
            "gpu-8A1B".parse::<GpuSpec>().ok(),
            Some(GpuSpec::Uuid("GPU-8a1b".into()))
        );
        for bad in [
            "",
            "-1",
            "cuda:x",
            "GPU-zz",
            "MIG-1234",
            "gpu3",
            "99999999999",
        ] {
            let err = bad.parse::<GpuSpec>().err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("is not a GPU")),
                "{bad:?}: {err:?}"
            );
        }
    }

    #[test]
    fn every_name_of_a_gpu_gives_the_same_key() {
        let inv = machine(&[A, B]);
        let key = GpuKey::Uuid(A.to_owned());
        assert_eq!(GpuSpec::Nvml(0).resolve(&inv).ok(), Some(key.clone()));
        assert_eq!(
            GpuSpec::Uuid("GPU-8a1b2".into()).resolve(&inv).ok(),
            Some(key.clone())
        );
        assert_eq!(key.file_name(), format!("gpu-{A}.lock"));
        assert_eq!(GpuKey::from_file_name(&key.file_name()), Some(key));
    }

    #[test]
    fn unknown_and_ambiguous_gpus_are_errors_listing_the_machine() {
        let inv = machine(&[A, B]);
        let e = GpuSpec::Nvml(5).resolve(&inv).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.contains(A) && e.contains("GPU 5")),
            "{e:?}"
        );
        let e = GpuSpec::Uuid("GPU-8a1b".into()).resolve(&inv).err();
        assert!(e.is_some_and(|e| e.to_string().contains("several GPUs")));
    }

    #[test]
    fn without_nvml_the_index_is_the_key() {
        assert_eq!(
            GpuSpec::Nvml(3).resolve(&no_nvml()).ok(),
            Some(GpuKey::Index(3))
        );
        assert_eq!(GpuKey::Index(3).file_name(), "gpu-3.lock");
        assert_eq!(GpuKey::from_file_name("gpu-3.lock"), Some(GpuKey::Index(3)));
        assert_eq!(GpuKey::from_file_name("gpu-x.lock"), None);
        assert_eq!(GpuKey::from_file_name("notes.txt"), None);
        assert!(GpuSpec::Uuid("GPU-8a".into()).resolve(&no_nvml()).is_err());
        assert_eq!(
            GpuSpec::Uuid(A.to_owned()).resolve(&no_nvml()).ok(),
            Some(GpuKey::Uuid(A.to_owned()))
        );
    }
}
