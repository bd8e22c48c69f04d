//! Parsing of the values users type: sizes and durations, with errors that say what
//! was wrong and what is accepted.

use std::time::Duration;

use tt_device::Bytes;

/// `6GiB`, `512MiB`, `6G`, `1.5GB`, `1048576`.
pub(crate) fn size(text: &str) -> Result<Bytes, String> {
    text.parse::<Bytes>().map_err(|e| e.to_string())
}

/// `10m`, `30s`, `1h`, `500ms`, `1.5h`, `2d`, or plain seconds (`90`).
pub(crate) fn duration(text: &str) -> Result<Duration, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert_eq!(duration("90"), Ok(Duration::from_secs(90)));
        assert!(duration("-1").is_err_and(|e| e.contains("is negative")));
        for bad in ["", "m", "10 minutes", "1e400", "nan"] {
            let e = duration(bad).err().unwrap_or_default();
            assert!(e.contains("is not a duration"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(size("6GiB"), Ok(Bytes::gib(6)));
        assert_eq!(size("6G"), Ok(Bytes::gib(6)));
        assert_eq!(size("1.5GB"), Ok(Bytes(1_500_000_000)));
        assert_eq!(size("512MiB"), Ok(Bytes::mib(512)));
        assert!(size("6XB").is_err_and(|e| e.contains("is not a size")));
    }
}
