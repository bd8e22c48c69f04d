use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// A unit of (GPU) RAM, decimal as gpu_tracker's: `bytes` ... `terabytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum RamUnit {
    /// 1 byte.
    Bytes,
    /// 10^3 bytes.
    Kilobytes,
    /// 10^6 bytes.
    Megabytes,
    /// 10^9 bytes (gpu_tracker's default).
    #[default]
    Gigabytes,
    /// 10^12 bytes.
    Terabytes,
}

impl RamUnit {
    /// Bytes in this unit.
    pub fn of(self, bytes: f64) -> f64 {
        bytes
            / match self {
                RamUnit::Bytes => 1.0,
                RamUnit::Kilobytes => 1e3,
                RamUnit::Megabytes => 1e6,
                RamUnit::Gigabytes => 1e9,
                RamUnit::Terabytes => 1e12,
            }
    }

    fn name(self) -> &'static str {
        match self {
            RamUnit::Bytes => "bytes",
            RamUnit::Kilobytes => "kilobytes",
            RamUnit::Megabytes => "megabytes",
            RamUnit::Gigabytes => "gigabytes",
            RamUnit::Terabytes => "terabytes",
        }
    }
}

/// A unit of time: `seconds` ... `days`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TimeUnit {
    /// Seconds.
    Seconds,
    /// Minutes.
    Minutes,
    /// Hours (gpu_tracker's default).
    #[default]
    Hours,
    /// Days.
    Days,
}

impl TimeUnit {
    /// Seconds in this unit.
    pub fn of(self, seconds: f64) -> f64 {
        seconds
            / match self {
                TimeUnit::Seconds => 1.0,
                TimeUnit::Minutes => 60.0,
                TimeUnit::Hours => 3600.0,
                TimeUnit::Days => 86_400.0,
            }
    }

    fn name(self) -> &'static str {
        match self {
            TimeUnit::Seconds => "seconds",
            TimeUnit::Minutes => "minutes",
            TimeUnit::Hours => "hours",
            TimeUnit::Days => "days",
        }
    }
}

impl fmt::Display for RamUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl fmt::Display for TimeUnit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for RamUnit {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let all = [
            RamUnit::Bytes,
            RamUnit::Kilobytes,
            RamUnit::Megabytes,
            RamUnit::Gigabytes,
            RamUnit::Terabytes,
        ];
        all.into_iter()
            .find(|u| u.name() == s.trim())
            .ok_or_else(|| Error::InvalidUnit {
                value: s.to_owned(),
                kind: "RAM",
                valid: "bytes, kilobytes, megabytes, gigabytes, terabytes",
            })
    }
}

impl FromStr for TimeUnit {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let all = [
            TimeUnit::Seconds,
            TimeUnit::Minutes,
            TimeUnit::Hours,
            TimeUnit::Days,
        ];
        all.into_iter()
            .find(|u| u.name() == s.trim())
            .ok_or_else(|| Error::InvalidUnit {
                value: s.to_owned(),
                kind: "time",
                valid: "seconds, minutes, hours, days",
            })
    }
}

/// Python's `repr` of a float: the shortest text that reads back as the same float,
/// in exponent form below 1e-4 and from 1e16 on.
pub(crate) fn python_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    let e = format!("{x:e}");
    let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let sign = if x < 0.0 { "-" } else { "" };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let body = if exp >= 0 {
            let point = exp as usize + 1;
            let padded = format!("{digits:0<point$}");
            let (int, frac) = padded.split_at(point);
            format!("{int}.{}", if frac.is_empty() { "0" } else { frac })
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let rest = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{first}{rest}e{esign}{:02}", exp.abs())
    }
}
