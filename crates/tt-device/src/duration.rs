//! Durations as users type them, one parser for every torchtools command and variable.

use std::time::Duration;

/// Parses `10m`, `30s`, `1h`, `500ms`, `1.5h`, `2d`, or plain seconds (`90`): the form
/// every torchtools option and variable that takes a time accepts (`--timeout`,
/// `--interval`, `TORCHTOOLS_DIST_TIMEOUT`, ...). The error says what was wrong and what
/// is accepted.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(tt_device::parse_duration("10m"), Ok(Duration::from_secs(600)));
/// assert_eq!(tt_device::parse_duration("90"), Ok(Duration::from_secs(90)));
/// assert!(tt_device::parse_duration("10 minutes").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let err = || {
        format!(
            "{text:?} is not a duration: write a number with a unit, e.g. 500ms, 30s, 10m, 1.5h, \
             2d (a plain number is seconds)"
        )
    };
    let s = text.trim();
    if let Some(rest) = s.strip_prefix('-') {
        return Err(format!(
            "{text:?} is negative: give a positive duration, e.g. {} or 500ms (a plain \
             number is seconds)",
            if rest.is_empty() { "1s" } else { rest }
        ));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    let value: f64 = number.parse().map_err(|_| err())?;
    let seconds = match unit {
        "ms" => value / 1e3,
        "" | "s" | "sec" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        "d" => value * 86_400.0,
        _ => return Err(err()),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| err())
}

/// A duration as [`parse_duration`] reads it back, in its largest whole unit: `7d`,
/// `30m`, `90s`, `1500ms` (a policy or a job's time limit shown to users).
///
/// ```
/// use std::time::Duration;
/// assert_eq!(tt_device::format_duration(Duration::from_secs(7 * 86_400)), "7d");
/// assert_eq!(tt_device::format_duration(Duration::from_secs(90)), "90s");
/// ```
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms >= size && ms % size == 0 {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatted_durations_read_back() {
        for text in ["7d", "36h", "30m", "90s", "1500ms", "0ms"] {
            let d = parse_duration(text).unwrap_or_default();
            assert_eq!(format_duration(d), text);
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_duration("2d"), Ok(Duration::from_secs(172_800)));
        assert_eq!(parse_duration(" 90 "), Ok(Duration::from_secs(90)));
        assert!(parse_duration("-1").is_err_and(|e| e.contains("is negative")));
        for bad in ["", "m", "10 minutes", "1e400", "nan", "20x"] {
            let e = parse_duration(bad).err().unwrap_or_default();
            assert!(e.contains("is not a duration"), "{bad:?}: {e}");
        }
    }
}
