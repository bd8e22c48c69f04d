use std::fmt;

use serde::Serialize;

use crate::{Error, Result};

/// Selects the device: `auto` (default), `cpu`, `cuda`, `cuda:N`, `mps`.
pub const TORCHTOOLS_DEVICE: &str = "TORCHTOOLS_DEVICE";
/// Set by torchrun and other launchers: this process's rank on its node.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// CUDA's own device filter: indices or UUIDs, comma-separated.
pub const CUDA_VISIBLE_DEVICES: &str = "CUDA_VISIBLE_DEVICES";

/// The user's base directory of one kind, as the XDG spec names it: `$var` when set and
/// not empty, else `$HOME/home_default`; `None` without either. One reading for the
/// config, state and cache directories torchtools uses.
///
/// ```
/// // SAFETY: no other thread reads this example's variable.
/// unsafe { std::env::set_var("TT_EXAMPLE_CACHE_HOME", "/var/cache/ada") };
/// let dir = tt_device::user_dir("TT_EXAMPLE_CACHE_HOME", ".cache");
/// assert_eq!(dir, Some(std::path::PathBuf::from("/var/cache/ada")));
/// // Empty counts as unset: under $HOME.
/// unsafe { std::env::set_var("TT_EXAMPLE_CACHE_HOME", "") };
/// let home = std::env::var_os("HOME").filter(|h| !h.is_empty());
/// let dir = tt_device::user_dir("TT_EXAMPLE_CACHE_HOME", ".cache");
/// assert_eq!(dir, home.map(|h| std::path::PathBuf::from(h).join(".cache")));
/// ```
pub fn user_dir(var: &str, home_default: &str) -> Option<std::path::PathBuf> {
    let set = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    match set(var) {
        Some(dir) => Some(dir.into()),
        None => Some(std::path::PathBuf::from(set("HOME")?).join(home_default)),
    }
}

/// The log filter of torchtools' command and examples (`RUST_LOG`'s syntax).
pub const TORCHTOOLS_LOG: &str = "TORCHTOOLS_LOG";

/// `TORCHTOOLS_LOG` is not a log filter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "TORCHTOOLS_LOG={value:?} is not a log filter ({cause}): give a level (error, warn, \
     info, debug, trace) or RUST_LOG's directives (tt_lock=debug,warn), or unset it"
)]
pub struct LogFilterError {
    /// The value given.
    pub value: String,
    /// What the filter parser said.
    pub cause: String,
}

/// The log filter from `TORCHTOOLS_LOG`, else `default`, made by `parse` (the logging
/// library's parser: `tracing_subscriber::EnvFilter::builder().parse`): the one reading
/// of the variable, with the one message that names it and the fix.
///
/// ```
/// let parse = |v: &str| if v.is_empty() { Err("empty") } else { Ok(v.to_owned()) };
/// // SAFETY: no other thread reads the environment in this example.
/// unsafe { std::env::remove_var("TORCHTOOLS_LOG") };
/// assert_eq!(tt_device::log_filter("warn", parse).unwrap(), "warn");
/// unsafe { std::env::set_var("TORCHTOOLS_LOG", "") };
/// let e = tt_device::log_filter("warn", parse).unwrap_err();
/// assert!(e.to_string().starts_with("TORCHTOOLS_LOG=\"\" is not a log filter (empty)"));
/// ```
pub fn log_filter<F, E: fmt::Display>(
    default: &str,
    parse: impl FnOnce(&str) -> std::result::Result<F, E>,
) -> std::result::Result<F, LogFilterError> {
    let value = std::env::var(TORCHTOOLS_LOG).unwrap_or_else(|_| default.to_owned());
    parse(&value).map_err(|e| LogFilterError {
        cause: e.to_string(),
        value,
    })
}

/// What `TORCHTOOLS_DEVICE` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceRequest {
    /// CUDA if usable, else MPS, else the CPU.
    Auto,
    /// The CPU.
    Cpu,
    /// A CUDA device: `Some(n)` for `cuda:n`; `None` for plain `cuda`, which means
    /// `cuda:LOCAL_RANK` under a launcher and otherwise the GPU with most free memory.
    Cuda(Option<usize>),
    /// Apple's Metal backend.
    Mps,
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceRequest::Auto => f.write_str("auto"),
            DeviceRequest::Cpu => f.write_str("cpu"),
            DeviceRequest::Cuda(None) => f.write_str("cuda"),
            DeviceRequest::Cuda(Some(n)) => write!(f, "cuda:{n}"),
            DeviceRequest::Mps => f.write_str("mps"),
        }
    }
}

impl std::str::FromStr for DeviceRequest {
    type Err = Error;

    /// Parses a `TORCHTOOLS_DEVICE` value; case and surrounding spaces are ignored.
    fn from_str(value: &str) -> Result<Self> {
        let v = value.trim().to_ascii_lowercase();
        let invalid = |hint: &str| Error::InvalidDevice {
            value: value.to_owned(),
            hint: hint.to_owned(),
        };
        match v.as_str() {
            "" | "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" => Ok(DeviceRequest::Cuda(None)),
            "mps" => Ok(DeviceRequest::Mps),
            "gpu" | "nvidia" => Err(invalid("; did you mean `cuda`?")),
            "metal" => Err(invalid("; did you mean `mps`?")),
            _ => {
                let Some(index) = v.strip_prefix("cuda:").or_else(|| v.strip_prefix("gpu:")) else {
                    return Err(invalid(""));
                };
                match index.parse::<usize>() {
                    Ok(n) if v.starts_with("cuda:") => Ok(DeviceRequest::Cuda(Some(n))),
                    Ok(n) => Err(invalid(&format!("; did you mean `cuda:{n}`?"))),
                    Err(_) => Err(invalid(
                        "; the index after `cuda:` must be a number such as 0 or 1",
                    )),
                }
            }
        }
    }
}

/// One entry of `CUDA_VISIBLE_DEVICES`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisibleEntry {
    /// A device index (NVML's numbering when `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    Index(u32),
    /// A full or abbreviated `GPU-...` UUID.
    Uuid(String),
    /// A `MIG-...` instance.
    Mig(String),
}

/// The parsed `CUDA_VISIBLE_DEVICES`, with CUDA's semantics.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CudaVisibleDevices {
    /// Not set: every device is visible.
    Unset,
    /// Set: only these, in this order, become `cuda:0`, `cuda:1`, ... A negative
    /// index (the common `-1`) ends the list, as in CUDA; so does an empty value.
    List(Vec<VisibleEntry>),
}

impl CudaVisibleDevices {
    /// This process's `CUDA_VISIBLE_DEVICES`, parsed ([`CudaVisibleDevices::parse`]):
    /// the one reading of it that every part (the reservation, the launcher, the device
    /// choice) shares, so that a bad value is the same error everywhere, never a GPU
    /// silently hidden.
    pub fn from_env() -> Result<Self> {
        match std::env::var_os("CUDA_VISIBLE_DEVICES") {
            None => Ok(CudaVisibleDevices::Unset),
            Some(v) => CudaVisibleDevices::parse(&v.to_string_lossy()),
        }
    }

    /// Parses a value of `CUDA_VISIBLE_DEVICES`. Entries CUDA would silently stop
    /// at (anything but an integer or a `GPU-`/`MIG-` UUID) are errors.
    pub fn parse(value: &str) -> Result<Self> {
        let mut entries = Vec::new();
        if value.trim().is_empty() {
            return Ok(CudaVisibleDevices::List(entries));
        }
        for raw in value.split(',') {
            let entry = raw.trim();
            let invalid = || Error::InvalidCudaVisibleDevices {
                value: value.to_owned(),
                entry: entry.to_owned(),
            };
            if let Ok(n) = entry.parse::<i64>() {
                match u32::try_from(n) {
                    Ok(n) => entries.push(VisibleEntry::Index(n)),
                    Err(_) if n < 0 => break, // `-1`: hide everything from here on, as CUDA does.
                    Err(_) => return Err(invalid()),
                }
            } else if entry.len() > 4 && entry.starts_with("GPU-") {
                entries.push(VisibleEntry::Uuid(entry.to_owned()));
            } else if entry.len() > 4 && entry.starts_with("MIG-") {
                entries.push(VisibleEntry::Mig(entry.to_owned()));
            } else {
                return Err(invalid());
            }
        }
        Ok(CudaVisibleDevices::List(entries))
    }
}

/// The device-related environment of this process, parsed and checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EnvConfig {
    /// `TORCHTOOLS_DEVICE` (unset or empty means `auto`).
    pub request: DeviceRequest,
    /// `LOCAL_RANK`, when set and not empty.
    pub local_rank: Option<usize>,
    /// `CUDA_VISIBLE_DEVICES`.
    pub visible: CudaVisibleDevices,
    /// The raw values, for messages (`None` when unset).
    pub raw: RawEnv,
}

/// The raw values of the variables tt-device reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RawEnv {
    /// `TORCHTOOLS_DEVICE`.
    pub torchtools_device: Option<String>,
    /// `LOCAL_RANK`.
    pub local_rank: Option<String>,
    /// `CUDA_VISIBLE_DEVICES`.
    pub cuda_visible_devices: Option<String>,
}

impl RawEnv {
    /// Reads the variables through `lookup`, unchecked.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> RawEnv {
        RawEnv {
            torchtools_device: lookup(TORCHTOOLS_DEVICE),
            local_rank: lookup(LOCAL_RANK),
            cuda_visible_devices: lookup(CUDA_VISIBLE_DEVICES),
        }
    }

    /// Reads the variables of this process, unchecked.
    pub fn from_env() -> RawEnv {
        RawEnv::from_lookup(|name| std::env::var(name).ok())
    }

    /// `CUDA_VISIBLE_DEVICES` for a message: its quoted value, or `<unset>`.
    pub fn visible_for_message(&self) -> String {
        match &self.cuda_visible_devices {
            Some(v) => format!("{v:?}"),
            None => "<unset>".to_owned(),
        }
    }
}

impl EnvConfig {
    /// Reads and checks the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_raw(RawEnv::from_env())
    }

    /// Reads and checks variables through `lookup` (for tests and for launchers that
    /// prepare a child's environment).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        Self::from_raw(RawEnv::from_lookup(lookup))
    }

    /// Checks raw values.
    pub fn from_raw(raw: RawEnv) -> Result<Self> {
        let request = match &raw.torchtools_device {
            Some(v) => v.parse()?,
            None => DeviceRequest::Auto,
        };
        let local_rank = match raw.local_rank.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(v) => Some(v.parse::<usize>().map_err(|_| Error::InvalidLocalRank {
                value: raw.local_rank.clone().unwrap_or_default(),
            })?),
        };
        let visible = match &raw.cuda_visible_devices {
            Some(v) => CudaVisibleDevices::parse(v)?,
            None => CudaVisibleDevices::Unset,
        };
        Ok(EnvConfig {
            request,
            local_rank,
            visible,
            raw,
        })
    }
}
