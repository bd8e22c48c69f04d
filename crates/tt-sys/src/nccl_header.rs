//! The NCCL version check of the build script (shared with the library's tests): the
//! `nccl.h` compiled against must be the version of the NCCL library that libtorch
//! loads at run time (the torch wheel's `nvidia-nccl-*` package). Another version's
//! structures (`ncclConfig_t` grows between releases) would corrupt memory silently.

use std::path::Path;

/// `(major, minor, patch)` from an `nccl.h`'s `#define NCCL_MAJOR 2` lines.
pub(crate) fn header_version(text: &str) -> Option<(u32, u32, u32)> {
    let define = |name: &str| {
        text.lines().find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some("#define") && words.next() == Some(name))
                .then(|| words.next()?.parse::<u32>().ok())
                .flatten()
        })
    };
    Some((
        define("NCCL_MAJOR")?,
        define("NCCL_MINOR")?,
        define("NCCL_PATCH")?,
    ))
}

/// The version of the NCCL wheel installed in `site_packages`
/// (`nvidia_nccl_cu13-2.28.9.dist-info`), if there is one.
pub(crate) fn wheel_version(site_packages: &Path) -> Option<(u32, u32, u32)> {
    std::fs::read_dir(site_packages)
        .ok()?
        .flatten()
        .find_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let rest = name
                .strip_prefix("nvidia_nccl")?
                .strip_suffix(".dist-info")?;
            let version = rest.rsplit('-').next()?;
            let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
            Some((parts.next()??, parts.next()??, parts.next()??))
        })
}

/// Why `header` cannot be used with the `wheel`'s library, if it cannot.
pub(crate) fn mismatch(header: (u32, u32, u32), wheel: (u32, u32, u32)) -> Option<String> {
    (header != wheel).then(|| {
        format!(
            "nccl.h is NCCL {}.{}.{} but libtorch loads NCCL {}.{}.{} (the torch wheel's \
             nvidia-nccl): their structures differ; point NCCL_INCLUDE at the headers of \
             NCCL {}.{}.{}, or unset it to use the wheel's own",
            header.0, header.1, header.2, wheel.0, wheel.1, wheel.2, wheel.0, wheel.1, wheel.2
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_must_be_the_wheels_version() {
        let header = "#ifndef NCCL_H_\n#define NCCL_MAJOR 2\n#define NCCL_MINOR 28\n\
                      #define NCCL_PATCH 9\n#define NCCL_SUFFIX \"\"\n";
        assert_eq!(header_version(header), Some((2, 28, 9)));
        assert_eq!(header_version("#define NCCL_MAJOR 2\n"), None);
        let site = tempfile::tempdir().unwrap();
        assert_eq!(wheel_version(site.path()), None);
        std::fs::create_dir(site.path().join("nvidia_nccl_cu13-2.28.9.dist-info")).unwrap();
        assert_eq!(wheel_version(site.path()), Some((2, 28, 9)));
        assert_eq!(mismatch((2, 28, 9), (2, 28, 9)), None);
        let why = mismatch((2, 21, 5), (2, 28, 9)).unwrap();
        assert!(
            why.contains("NCCL 2.21.5")
                && why.contains("NCCL 2.28.9")
                && why.contains("NCCL_INCLUDE"),
            "{why}"
        );
    }
}
