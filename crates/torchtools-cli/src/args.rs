//! Parsing of the values users type: sizes and durations, with errors that say what
//! was wrong and what is accepted; and the paths of reports, checked before a command
//! starts.

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

/// `--array`'s indices: `0-9`, `1,4,7`, `0-3,8`, with `%K` for at most K at once.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ArraySpec {
    /// The indices, in the order given, each once.
    pub(crate) indices: Vec<u32>,
    /// At most this many tasks at once (`%K`).
    pub(crate) at_once: Option<usize>,
}

/// The most tasks one `--array` starts (each is a process of its own while it waits).
pub(crate) const MAX_ARRAY: usize = 10_000;

/// `--array`'s values (see [`ArraySpec`]).
pub(crate) fn array(text: &str) -> Result<ArraySpec, String> {
    let form = "write indices as 0-9, 1,4,7 or 0-99%4 (at most 4 at once)";
    let (list, at_once) = match text.split_once('%') {
        Some((list, k)) => {
            let k: usize = k.trim().parse().ok().filter(|&k| k > 0).ok_or_else(|| {
                format!("{text:?}: %{k} is not a number of tasks above 0; {form}")
            })?;
            (list, Some(k))
        }
        None => (text, None),
    };
    let mut indices = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for part in list.split(',') {
        let number = |t: &str| -> Result<u32, String> {
            t.trim()
                .parse()
                .map_err(|_| format!("{text:?}: {t:?} is not an index; {form}"))
        };
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => (number(part)?, number(part)?),
        };
        if first > last {
            return Err(format!("{text:?}: {part:?} counts down; {form}"));
        }
        if (last - first) as usize >= MAX_ARRAY
            || indices.len() + (last - first) as usize >= MAX_ARRAY
        {
            return Err(format!("{text:?}: more than {MAX_ARRAY} tasks"));
        }
        indices.extend((first..=last).filter(|&i| seen.insert(i)));
    }
    Ok(ArraySpec { indices, at_once })
}

/// A report or plot path, checked before the command starts: an existing directory
/// to write in, not a directory itself, writable.
pub(crate) fn check_output(option: &str, path: &std::path::Path) -> anyhow::Result<()> {
    let bad = |message: String| anyhow::Error::from(crate::exit::Exit::usage(message));
    // `reports/` names a directory even when it does not exist (yet).
    if path.as_os_str().as_encoded_bytes().ends_with(b"/") && !path.is_dir() {
        return Err(bad(format!(
            "{option} {} ends with / (a directory): give a file name, e.g. {}",
            path.display(),
            path.join("report.txt").display()
        )));
    }
    if path.is_dir() {
        return Err(bad(format!(
            "{option} {} is a directory: give a file name, e.g. {}",
            path.display(),
            path.join("report.txt").display()
        )));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if !parent.is_dir() {
        return Err(bad(format!(
            "{option} {}: the directory {} does not exist: create it first, or choose \
             another path",
            path.display(),
            parent.display()
        )));
    }
    let target = if path.exists() { path } else { parent };
    let c_path = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()).map_err(|_| {
        bad(format!(
            "{option} {}: a path with a NUL byte",
            path.display()
        ))
    })?;
    // SAFETY: access(2) reads the NUL-terminated path, which lives across the call.
    if unsafe { libc::access(c_path.as_ptr(), libc::W_OK) } != 0 {
        return Err(bad(format!(
            "{option} {}: cannot write there ({})",
            path.display(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
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

    #[test]
    fn array_indices_read_as_slurm_writes_them() {
        let spec = array("0-3,8%2").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(spec.indices, [0, 1, 2, 3, 8]);
        assert_eq!(spec.at_once, Some(2));
        assert_eq!(array("5").map(|s| s.indices), Ok(vec![5]));
        assert_eq!(array("1,1,0-1").map(|s| s.indices), Ok(vec![1, 0]));
        for (bad, says) in [
            ("3-1", "counts down"),
            ("0-9%0", "above 0"),
            ("a-b", "not an index"),
            ("0-99999", "more than 10000"),
            ("", "not an index"),
        ] {
            let e = array(bad).err().unwrap_or_default();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
