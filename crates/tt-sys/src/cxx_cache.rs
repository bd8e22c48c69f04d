//! The build script's cache of compiled C++ archives.
//!
//! Cargo runs a build script again for every new set of the package's features and
//! for every new build of the script itself (`cargo clippy` builds a workspace's
//! scripts with its own driver), each time in a new `out` directory. The shim's C++
//! does not change with most of those (`gpu-tests`, `default`, clippy): only with its
//! sources, libtorch's headers, the compiler and its flags. So each archive is kept
//! beside the build script's `out` directories, in `build/tt-sys-cxx-cache/`, under a
//! hash of exactly those inputs, and a later run with the same hash links it instead
//! of compiling again (15 s for the shim, 40 s with c10d, on 2 cores). `cargo clean`,
//! and `cargo clean -p tt-sys`, remove it with the rest.
//!
//! Shared by `build.rs` (through `#[path]`) and this crate's unit tests; not public.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// What a compiled archive is made from: its cache key hashes all of it, so that a
/// change to any of them compiles again (a key that left one out would link a stale
/// archive).
pub(crate) struct Inputs {
    /// The compiler, every flag it is given, and what `--version` said.
    pub(crate) compiler: PathBuf,
    pub(crate) args: Vec<std::ffi::OsString>,
    pub(crate) version: Vec<u8>,
    /// The archiver and its flags.
    pub(crate) archiver: std::ffi::OsString,
    pub(crate) archiver_args: Vec<std::ffi::OsString>,
    /// The target triple.
    pub(crate) target: String,
    /// The sources and the headers that name libraries' versions: each file's path and
    /// contents (an unreadable one counts as empty).
    pub(crate) files: Vec<PathBuf>,
}

impl Inputs {
    /// The cache key.
    pub(crate) fn key(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.compiler.hash(&mut h);
        self.args.hash(&mut h);
        self.version.hash(&mut h);
        self.archiver.hash(&mut h);
        self.archiver_args.hash(&mut h);
        self.target.hash(&mut h);
        for file in &self.files {
            file.hash(&mut h);
            fs::read(file).unwrap_or_default().hash(&mut h);
        }
        h.finish()
    }
}

/// How many archives of one library are kept: the most recently used.
pub(crate) const KEEP: usize = 8;

/// The cache's directory for a build script's `OUT_DIR`
/// (`<target>/<profile>/build/<package>-<hash>/out`): `<target>/<profile>/build/tt-sys-cxx-cache`.
/// `None` when `OUT_DIR` is not laid out that way; the caller then compiles as usual.
pub(crate) fn cache_root(out_dir: &Path) -> Option<PathBuf> {
    if out_dir.file_name()? != "out" {
        return None;
    }
    let build = out_dir.parent()?.parent()?;
    if build.file_name()? != "build" {
        return None;
    }
    Some(build.join("tt-sys-cxx-cache"))
}

/// The archive `lib{name}.a` built from inputs that hash to `key`: the cached one if
/// an earlier run made it (`true`), else the one `compile` writes into the directory it
/// is given (`false`), which is then kept for later runs. Two runs that compile the same
/// key at once both succeed; the first to finish is kept.
pub(crate) fn archive(
    root: &Path,
    name: &str,
    key: u64,
    compile: impl FnOnce(&Path) -> io::Result<()>,
) -> io::Result<(PathBuf, bool)> {
    let dir = root.join(format!("{name}-{key:016x}"));
    let lib = dir.join(format!("lib{name}.a"));
    if lib.is_file() {
        // Marks it as used, for `evict`; a read-only cache still serves.
        let _ = fs::File::options()
            .append(true)
            .open(&lib)
            .and_then(|f| f.set_modified(SystemTime::now()));
        return Ok((lib, true));
    }
    fs::create_dir_all(root)?;
    let tmp = root.join(format!(".{name}-{key:016x}.{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp)?;
    let made = compile(&tmp).and_then(|()| {
        let built = tmp.join(format!("lib{name}.a"));
        if !built.is_file() {
            return Err(io::Error::other(format!(
                "the compile step left no {}",
                built.display()
            )));
        }
        // The objects are in the archive; only the archive is kept.
        for entry in fs::read_dir(&tmp)? {
            let path = entry?.path();
            if path.extension().is_some_and(|e| e == "o") {
                fs::remove_file(path)?;
            }
        }
        Ok(())
    });
    if let Err(e) = made {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Err(e) = fs::rename(&tmp, &dir) {
        let _ = fs::remove_dir_all(&tmp);
        // Another run made the same archive first: use it.
        if !lib.is_file() {
            return Err(e);
        }
    }
    evict(root, name);
    Ok((lib, false))
}

/// Removes all but the [`KEEP`] most recently used archives of `name`.
fn evict(root: &Path, name: &str) {
    let prefix = format!("{name}-");
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    let mut kept: Vec<(SystemTime, PathBuf)> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .map(|p| {
            let used = fs::metadata(p.join(format!("lib{name}.a")))
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            (used, p)
        })
        .collect();
    kept.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
    for (_, old) in kept.into_iter().skip(KEEP) {
        let _ = fs::remove_dir_all(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn fake_compile<'a>(
        name: &str,
        calls: &'a Cell<u32>,
    ) -> impl FnOnce(&Path) -> io::Result<()> + 'a {
        let name = name.to_owned();
        move |dir: &Path| {
            calls.set(calls.get() + 1);
            fs::write(dir.join("a.o"), b"object")?;
            fs::write(dir.join(format!("lib{name}.a")), b"archive")
        }
    }

    /// Every input is in the key: one flag more, another compiler version, one byte of
    /// a source changed each give another key; the same inputs give the same one.
    #[test]
    fn every_input_of_a_compile_changes_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("shim.cpp");
        fs::write(&source, "int f() { return 1; }").unwrap();
        let base = || Inputs {
            compiler: "/usr/bin/c++".into(),
            args: vec!["-O2".into(), "-std=c++17".into()],
            version: b"c++ (Debian 14.2.0) 14.2.0".to_vec(),
            archiver: "ar".into(),
            archiver_args: vec!["cq".into()],
            target: "x86_64-unknown-linux-gnu".into(),
            files: vec![source.clone()],
        };
        let key = base().key();
        assert_eq!(base().key(), key);
        let changed: Vec<(&str, Inputs)> = vec![
            (
                "compiler",
                Inputs {
                    compiler: "/usr/bin/clang++".into(),
                    ..base()
                },
            ),
            (
                "a flag more",
                Inputs {
                    args: vec!["-O2".into(), "-std=c++17".into(), "-DNDEBUG".into()],
                    ..base()
                },
            ),
            (
                "a flag changed",
                Inputs {
                    args: vec!["-O0".into(), "-std=c++17".into()],
                    ..base()
                },
            ),
            (
                "version",
                Inputs {
                    version: b"c++ (Debian 15.1.0) 15.1.0".to_vec(),
                    ..base()
                },
            ),
            (
                "archiver",
                Inputs {
                    archiver: "llvm-ar".into(),
                    ..base()
                },
            ),
            (
                "archiver flags",
                Inputs {
                    archiver_args: vec!["crs".into()],
                    ..base()
                },
            ),
            (
                "target",
                Inputs {
                    target: "aarch64-unknown-linux-gnu".into(),
                    ..base()
                },
            ),
            (
                "a file more",
                Inputs {
                    files: vec![source.clone(), dir.path().join("version.h")],
                    ..base()
                },
            ),
        ];
        for (what, inputs) in changed {
            assert_ne!(inputs.key(), key, "{what} left the key as it was");
        }
        fs::write(&source, "int f() { return 2; }").unwrap();
        assert_ne!(
            base().key(),
            key,
            "a source's contents left the key as it was"
        );
    }

    #[test]
    fn the_cache_sits_beside_cargos_build_script_directories_or_nowhere() {
        let out = Path::new("/t/target/debug/build/tt-sys-0123abcd/out");
        assert_eq!(
            cache_root(out),
            Some(PathBuf::from("/t/target/debug/build/tt-sys-cxx-cache"))
        );
        assert_eq!(cache_root(Path::new("/somewhere/else")), None);
        assert_eq!(cache_root(Path::new("/x/tt-sys-0123/out")), None);
    }

    /// Seen failing with the lookup taken out: the second run compiled again.
    #[test]
    fn the_same_inputs_are_compiled_once_and_new_ones_again() {
        let root = tempfile::tempdir().unwrap();
        let calls = Cell::new(0);
        let (lib, hit) = archive(root.path(), "shim", 7, fake_compile("shim", &calls)).unwrap();
        assert!(!hit);
        assert_eq!(fs::read(&lib).unwrap(), b"archive");
        assert!(
            !lib.with_file_name("a.o").exists(),
            "only the archive is kept"
        );
        let (again, hit) = archive(root.path(), "shim", 7, fake_compile("shim", &calls)).unwrap();
        assert!(hit);
        assert_eq!(again, lib);
        assert_eq!(
            calls.get(),
            1,
            "the second run with the same inputs compiled"
        );
        let (other, hit) = archive(root.path(), "shim", 8, fake_compile("shim", &calls)).unwrap();
        assert!(!hit);
        assert_ne!(other, lib);
        assert_eq!(calls.get(), 2);
    }

    #[test]
    fn a_failed_compile_leaves_nothing_to_reuse() {
        let root = tempfile::tempdir().unwrap();
        let failed = archive(root.path(), "shim", 1, |_| {
            Err(io::Error::other("c++ said no"))
        });
        assert!(failed.unwrap_err().to_string().contains("c++ said no"));
        let empty = archive(root.path(), "shim", 1, |_| Ok(()));
        assert!(empty.unwrap_err().to_string().contains("libshim.a"));
        assert_eq!(
            fs::read_dir(root.path()).unwrap().count(),
            0,
            "no partial entry or temporary directory is left"
        );
        let calls = Cell::new(0);
        let (_, hit) = archive(root.path(), "shim", 1, fake_compile("shim", &calls)).unwrap();
        assert!(!hit && calls.get() == 1);
    }

    #[test]
    fn a_run_that_finishes_second_uses_the_first_runs_archive() {
        let root = tempfile::tempdir().unwrap();
        let (lib, hit) = archive(root.path(), "shim", 3, |dir: &Path| {
            // Another build script finishes the same archive while this one compiles.
            let first = root.path().join(format!("shim-{:016x}", 3));
            fs::create_dir_all(&first)?;
            fs::write(first.join("libshim.a"), b"first")?;
            fs::write(dir.join("libshim.a"), b"second")
        })
        .unwrap();
        assert!(!hit);
        assert_eq!(fs::read(lib).unwrap(), b"first");
        assert_eq!(fs::read_dir(root.path()).unwrap().count(), 1);
    }

    #[test]
    fn only_the_most_recently_used_archives_are_kept() {
        let root = tempfile::tempdir().unwrap();
        let calls = Cell::new(0);
        for key in 0..KEEP as u64 {
            archive(root.path(), "shim", key, fake_compile("shim", &calls)).unwrap();
            // mtimes one second apart, oldest first
            let lib = root.path().join(format!("shim-{key:016x}/libshim.a"));
            let when = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000 + key);
            fs::File::options()
                .append(true)
                .open(lib)
                .unwrap()
                .set_modified(when)
                .unwrap();
        }
        // Key 0, the oldest, is used again; another library is never touched.
        archive(root.path(), "shim", 0, fake_compile("shim", &calls)).unwrap();
        archive(root.path(), "c10d", 0, fake_compile("c10d", &calls)).unwrap();
        archive(root.path(), "shim", 99, fake_compile("shim", &calls)).unwrap();
        let left = |key: u64| root.path().join(format!("shim-{key:016x}")).exists();
        assert!(left(0) && left(99), "the used and the new archive are kept");
        assert!(!left(1), "the least recently used one is removed");
        assert!((2..KEEP as u64).all(left));
        assert!(root.path().join(format!("c10d-{:016x}", 0)).exists());
    }
}
