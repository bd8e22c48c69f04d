//! Parsing of the values users type: sizes and durations, with errors that say what
//! was wrong and what is accepted.

use std::time::Duration;

use tt_device::Bytes;

/// `6GiB`, `512MiB`, `6G`, `1.5GB`, `1048576`.
pub(crate) fn size(text: &str) -> Result<Bytes, String> {
    text.parse::<Bytes>().map_err(|e| e.to_string())
}

/// `--bytes`: a size, or `auto` (probe the command first and reserve what it used).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Budget {
    /// Probe the command (`run --probe`'s contract), reserve its peak and the margin.
    Auto,
    /// This many bytes.
    Size(Bytes),
}

/// `--bytes`' values: [`size`]'s, or `auto`.
pub(crate) fn budget(text: &str) -> Result<Budget, String> {
    if text == "auto" {
        return Ok(Budget::Auto);
    }
    size(text)
        .map(Budget::Size)
        .map_err(|e| format!("{e}; or auto, to probe the command first and reserve what it used"))
}

/// A GPU as users name it: an index, a UUID (or a prefix of one), `cuda:N`, `auto`.
pub(crate) fn gpu_spec(text: &str) -> Result<tt_lock::GpuSpec, String> {
    text.parse().map_err(|e: tt_lock::Error| e.to_string())
}

/// `10m`, `30s`, `1h`, `500ms`, `1.5h`, `2d`, or plain seconds (`90`): tt-device's
/// parser, the one every option and variable that takes a time uses.
pub(crate) fn duration(text: &str) -> Result<Duration, String> {
    tt_device::parse_duration(text)
}

/// A command line as views print it: its words joined by spaces, control characters
/// made visible (a command line is its writer's text: see [`tt_device::printable`]).
pub(crate) fn shown(words: &[String]) -> String {
    tt_device::printable(&words.join(" ")).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        // tt-device's parser (tested there): the CLI's options take its forms.
        assert_eq!(duration("1.5h"), Ok(Duration::from_secs(5400)));
        assert!(duration("10 minutes").is_err_and(|e| e.contains("is not a duration")));
    }

    #[test]
    fn sizes() {
        assert_eq!(size("6GiB"), Ok(Bytes::gib(6)));
        assert_eq!(size("6G"), Ok(Bytes::gib(6)));
        assert_eq!(size("1.5GB"), Ok(Bytes(1_500_000_000)));
        assert_eq!(size("512MiB"), Ok(Bytes::mib(512)));
        assert!(size("6XB").is_err_and(|e| e.contains("is not a size")));
        assert_eq!(budget("auto"), Ok(Budget::Auto));
        assert_eq!(budget("2GiB"), Ok(Budget::Size(Bytes::gib(2))));
        assert!(budget("lots").is_err_and(|e| e.contains("is not a size") && e.contains("auto")));
    }
}
