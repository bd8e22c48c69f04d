use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// A number of bytes. Displays in binary units (`1.50 GiB`); parses `512MiB`, `6GiB`,
/// `1.5GB`, `1048576`, `2 k` (decimal `kB/MB/GB/TB`, binary `KiB/MiB/GiB/TiB`, bare
/// `K/M/G/T` binary, as PyTorch and nvidia-smi mean them).
///
/// ```
/// use tt_device::Bytes;
/// let b: Bytes = "1.5GiB".parse()?;
/// assert_eq!(b, Bytes(3 << 29));
/// assert_eq!(b.to_string(), "1.50 GiB");
/// # Ok::<(), tt_device::Error>(())
/// ```
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

impl Bytes {
    /// `n` kibibytes.
    pub const fn kib(n: u64) -> Self {
        Bytes(n << 10)
    }
    /// `n` mebibytes.
    pub const fn mib(n: u64) -> Self {
        Bytes(n << 20)
    }
    /// `n` gibibytes.
    pub const fn gib(n: u64) -> Self {
        Bytes(n << 30)
    }
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit < UNITS.len() - 1 {
            value /= 1024.0;
            unit += 1;
        }
        write!(f, "{value:.2} {}", UNITS[unit])
    }
}

impl FromStr for Bytes {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let err = || Error::InvalidSize {
            value: text.to_owned(),
        };
        let s = text.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, unit) = (&s[..split], s[split..].trim());
        if number.is_empty() {
            return Err(err());
        }
        let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            _ => return Err(err()),
        };
        if let Ok(whole) = number.parse::<u64>() {
            return whole.checked_mul(multiplier).map(Bytes).ok_or_else(err);
        }
        let value: f64 = number.parse().map_err(|_| err())?;
        let bytes = (value * multiplier as f64).ceil();
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(err());
        }
        Ok(Bytes(bytes as u64))
    }
}
