//! Build-script helper: give a binary an rpath to the libtorch it was built against.
//!
//! `cargo:rustc-link-arg` reaches only the package whose build script prints it, so a
//! binary that links libtorch through tch (directly or through torchtools) needs one
//! line in its own `build.rs`:
//!
//! ```toml
//! [build-dependencies]
//! tt-sys = { version = "0.1", default-features = false } # libtorch-free
//! ```
//!
//! ```no_run
//! // build.rs
//! fn main() {
//!     tt_sys::build::link_libtorch_rpath();
//! }
//! ```
//!
//! The binary then runs from any directory with no `LD_LIBRARY_PATH`. The rpath is
//! written as `DT_RUNPATH`, so a user's own `LD_LIBRARY_PATH` still wins.
//!
//! Where the directory comes from, first match wins:
//! 1. `DEP_TORCHTOOLS_SYS_LIBTORCH_LIB`, `DEP_TORCHTOOLS_LIBTORCH_LIB` or
//!    `DEP_TCH_LIBTORCH_LIB`: set by cargo when the package depends directly on
//!    tt-sys, torchtools or torch-sys (the very libtorch that was linked);
//! 2. `LIBTORCH_USE_PYTORCH`: the `torch` package of `PYTHON_SYS_EXECUTABLE` or `python3`;
//! 3. `LIBTORCH_LIB`, then `LIBTORCH`: `<dir>/lib`, as torch-sys reads them.

// The example shows a whole build.rs, `fn main` included.
#![allow(clippy::needless_doctest_main)]

use std::env;
use std::fmt;
use std::path::PathBuf;
use std::process::Command;

/// Where a libtorch library directory was found, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibtorchLib {
    /// The directory holding `libtorch_cpu.so`, `libc10.so`, ...
    pub dir: PathBuf,
    /// The variable or method that named it.
    pub source: &'static str,
}

/// Why no libtorch library directory could be found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotFound {
    /// What was tried, in order.
    pub tried: Vec<String>,
}

impl fmt::Display for NotFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no libtorch found for the rpath (tried: {}); depend on tt-sys or torch-sys, or set \
             LIBTORCH to a libtorch directory (in this repository: run `cargo xtask setup`)",
            self.tried.join("; ")
        )
    }
}

impl std::error::Error for NotFound {}

const DEP_VARS: [&str; 3] = [
    "DEP_TORCHTOOLS_SYS_LIBTORCH_LIB",
    "DEP_TORCHTOOLS_LIBTORCH_LIB",
    "DEP_TCH_LIBTORCH_LIB",
];

fn var(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var(name).ok().filter(|v| !v.is_empty())
}

/// Finds the libtorch library directory, as described in the [module docs](self).
pub fn libtorch_lib_dir() -> Result<LibtorchLib, NotFound> {
    let mut tried = Vec::new();
    for name in DEP_VARS {
        match var(name) {
            Some(dir) => {
                return Ok(LibtorchLib {
                    dir: dir.into(),
                    source: name,
                })
            }
            None => tried.push(format!("{name} unset")),
        }
    }
    if var("LIBTORCH_USE_PYTORCH").is_some() {
        let python = var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|| "python3".to_owned());
        let script =
            "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))";
        match Command::new(&python).args(["-c", script]).output() {
            Ok(out) if out.status.success() => {
                let dir = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                return Ok(LibtorchLib {
                    dir: dir.into(),
                    source: "LIBTORCH_USE_PYTORCH",
                });
            }
            Ok(out) => tried.push(format!(
                "`{python} -c 'import torch'` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => tried.push(format!("could not run {python}: {e}")),
        }
    }
    if let Some(lib) = var("LIBTORCH_LIB") {
        return Ok(LibtorchLib {
            dir: PathBuf::from(lib).join("lib"),
            source: "LIBTORCH_LIB",
        });
    }
    if let Some(root) = var("LIBTORCH") {
        return Ok(LibtorchLib {
            dir: PathBuf::from(root).join("lib"),
            source: "LIBTORCH",
        });
    }
    tried.push("LIBTORCH_LIB and LIBTORCH unset".to_owned());
    Err(NotFound { tried })
}

/// Prints the `cargo:rustc-link-arg` that gives this package's binaries, tests and
/// examples an rpath (`DT_RUNPATH`) to libtorch, and returns the directory.
///
/// When none is found it prints a `cargo:warning` and returns `None`: the build goes
/// on, and the binary then needs `LD_LIBRARY_PATH` to start.
pub fn link_libtorch_rpath() -> Option<LibtorchLib> {
    match libtorch_lib_dir() {
        Ok(lib) => Some(emit_rpath(lib)),
        Err(e) => {
            println!("cargo:warning=tt-sys: {e}");
            None
        }
    }
}

/// Like [`link_libtorch_rpath`], but silent when no libtorch is found: for binaries
/// that link libtorch only in some builds (a workspace-wide build that unifies a
/// dependency's `tch` feature, say). An rpath the binary does not use is harmless.
pub fn try_link_libtorch_rpath() -> Option<LibtorchLib> {
    libtorch_lib_dir().ok().map(emit_rpath)
}

fn emit_rpath(mut lib: LibtorchLib) -> LibtorchLib {
    // The real directory, not a link to it: the binary then keeps working when the
    // link (e.g. a repository's `.torchtools/libtorch`) goes away.
    if let Ok(real) = lib.dir.canonicalize() {
        lib.dir = real;
    }
    println!(
        "cargo:rustc-link-arg=-Wl,--enable-new-dtags,-rpath,{}",
        lib.dir.display()
    );
    lib
}
