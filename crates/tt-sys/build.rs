//! Compiles the C++ shim against the libtorch that torch-sys found, exports its lib
//! directory to dependents (`DEP_TORCHTOOLS_SYS_LIBTORCH_LIB`) and gives this
//! package's own tests an rpath to it.

#[allow(dead_code, unreachable_pub)] // shared with the library; only part is used here
#[path = "src/build.rs"]
mod helper;

#[cfg(feature = "c10d")]
#[path = "src/nccl_header.rs"]
mod nccl_header;

#[cfg(feature = "tch")]
#[path = "src/cxx_cache.rs"]
mod cxx_cache;

fn main() {
    // Without `tch` this is a libtorch-free build: only `tt_sys::build` is compiled.
    #[cfg(feature = "tch")]
    shim::build();
}

#[cfg(feature = "tch")]
mod shim {
    use std::path::PathBuf;

    pub(super) fn build() {
        // torch-sys (links = "tch") tells us the lib dir of the libtorch it linked.
        let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from) else {
            panic!("tt-sys: torch-sys did not export DEP_TCH_LIBTORCH_LIB; is torch-sys =0.24.0 a dependency?");
        };
        println!("cargo:rerun-if-env-changed=LIBTORCH_INCLUDE");
        println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
        let include_root = match std::env::var_os("LIBTORCH_INCLUDE") {
            Some(dir) => PathBuf::from(dir).join("include"),
            None => lib
                .parent()
                .map(|p| p.join("include"))
                .unwrap_or_else(|| lib.join("../include")),
        };
        if !include_root
            .join("c10/core/CachingDeviceAllocator.h")
            .exists()
        {
            panic!(
                "tt-sys: libtorch headers not found under {} (libtorch lib dir: {}); \
                 set LIBTORCH_INCLUDE to the directory that holds include/, or run `cargo xtask setup`",
                include_root.display(),
                lib.display()
            );
        }
        // Same ABI default as torch-sys: PyPI wheels since torch 2.7 use the C++11 ABI.
        let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
        println!("cargo:rerun-if-changed=csrc/shim.cpp");
        println!("cargo:rerun-if-changed=csrc/shim.h");
        let mut shim = cxx(&include_root, &abi);
        shim.file("csrc/shim.cpp");
        compile(&shim, "torchtools_shim", &libtorch_config(&include_root));
        #[cfg(feature = "c10d")]
        c10d(&include_root, &abi, &lib);
        // The shim's own references to libtorch, after the static lib in link order (torch-sys
        // links them too, but rustc drops it from binaries that name nothing of tch).
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=torch_cpu");
        println!("cargo:rustc-link-lib=c10");
        println!("cargo:rustc-link-lib=dl");
        // Dependents read this as DEP_TORCHTOOLS_SYS_LIBTORCH_LIB.
        println!("cargo:libtorch_lib={}", lib.display());
        super::helper::link_libtorch_rpath();
    }

    /// A C++ build against libtorch's headers. Debug builds get line tables only
    /// (`-g1`, as the workspace's Rust code): cargo asks cc for full debug info, and
    /// with libtorch's headers that doubled each file's compile time (shim.cpp: 30 s
    /// against 16 s on a 2-core machine). `CXXFLAGS` still wins (`CXXFLAGS=-g`).
    fn cxx(include_root: &std::path::Path, abi: &str) -> cc::Build {
        let mut build = cc::Build::new();
        build
            .cpp(true)
            .pic(true)
            .std("c++17")
            .warnings(false)
            .include(include_root)
            .include(include_root.join("torch/csrc/api/include"))
            .define("_GLIBCXX_USE_CXX11_ABI", abi)
            .define("GLOG_USE_GLOG_EXPORT", None);
        if std::env::var("DEBUG").is_ok_and(|d| !matches!(d.as_str(), "" | "false" | "0" | "none"))
        {
            build.debug(false).flag("-g1");
        }
        build
    }

    /// libtorch's headers that say which libtorch they are (its version and build
    /// options): part of the cache key, with the paths in the compiler's `-I` flags.
    fn libtorch_config(include_root: &std::path::Path) -> Vec<PathBuf> {
        [
            "torch/csrc/api/include/torch/version.h",
            "ATen/Config.h",
            "c10/macros/cmake_macros.h",
        ]
        .iter()
        .map(|h| include_root.join(h))
        .collect()
    }

    /// Compiles `build` into `lib{name}.a` and links it, or links the archive an earlier
    /// run compiled from the same inputs (see `src/cxx_cache.rs`): the compiler with
    /// every flag and its version, the archiver, the target, every file in `csrc/`, and
    /// `headers` (the contents of those outside it that name their library's version).
    fn compile(build: &cc::Build, name: &str, headers: &[PathBuf]) {
        let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
        let Some(root) = crate::cxx_cache::cache_root(&out) else {
            build.compile(name);
            return;
        };
        let key = cache_key(build, headers);
        let made = crate::cxx_cache::archive(&root, name, key, |dir| {
            build
                .clone()
                .out_dir(dir)
                .cargo_metadata(false)
                .try_compile(name)
                .map_err(|e| std::io::Error::other(format!("{e:?}")))
        });
        // Linked from OUT_DIR, as `compile` does: a kept archive evicted later (see
        // `cxx_cache::KEEP`) cannot break a build whose script is not run again.
        let local = out.join(format!("lib{name}.a"));
        let placed = made.and_then(|(lib, _)| {
            let _ = std::fs::remove_file(&local);
            std::fs::hard_link(&lib, &local).or_else(|_| std::fs::copy(&lib, &local).map(drop))
        });
        match placed {
            Ok(()) => cc::emit_link_directives(build, &local),
            Err(e) => panic!("tt-sys: compiling {name}: {e}"),
        }
    }

    fn cache_key(build: &cc::Build, headers: &[PathBuf]) -> u64 {
        // Reading them also tells cargo to run this script again when CXX, CXXFLAGS,
        // AR, ... change, as `compile` does.
        let compiler = build.get_compiler();
        let archiver = build.get_archiver();
        let mut files: Vec<PathBuf> = std::fs::read_dir("csrc")
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default();
        files.sort();
        files.extend(headers.iter().cloned());
        crate::cxx_cache::Inputs {
            compiler: compiler.path().to_owned(),
            args: compiler.args().to_vec(),
            version: compiler
                .to_command()
                .arg("--version")
                .output()
                .map(|o| o.stdout)
                .unwrap_or_default(),
            archiver: archiver.get_program().to_owned(),
            archiver_args: archiver.get_args().map(ToOwned::to_owned).collect(),
            target: std::env::var("TARGET").unwrap_or_default(),
            files,
        }
        .key()
    }

    /// libtorch's distributed engine: Gloo always, NCCL with the `nccl` feature.
    #[cfg(feature = "c10d")]
    fn c10d(include_root: &std::path::Path, abi: &str, lib: &std::path::Path) {
        println!("cargo:rerun-if-changed=csrc/c10d.cpp");
        println!("cargo:rerun-if-changed=csrc/c10d.h");
        println!("cargo:rerun-if-changed=csrc/c10d_handles.h");
        println!("cargo:rerun-if-changed=csrc/reducer.cpp");
        println!("cargo:rerun-if-changed=csrc/protect.h");
        println!("cargo:rerun-if-env-changed=GLOO_INCLUDE");
        // ProcessGroupGloo.hpp includes gloo's own headers, which the wheel lacks.
        let gloo = std::env::var_os("GLOO_INCLUDE")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/include"));
        if !gloo.join("gloo/algorithm.h").exists() {
            panic!(
                "tt-sys (feature c10d): gloo's headers are not under {}: run `cargo xtask setup` \
                 (it installs Debian's libgloo-dev when run as root), or `sudo apt-get install libgloo-dev`, \
                 or set GLOO_INCLUDE to the directory that holds gloo/",
                gloo.display()
            );
        }
        let mut build = cxx(include_root, abi);
        build
            .include(&gloo)
            .define("USE_C10D_GLOO", None)
            .file("csrc/c10d.cpp")
            .file("csrc/reducer.cpp");
        let mut inputs = libtorch_config(include_root);
        inputs.push(gloo.join("gloo/config.h"));
        inputs.extend(nccl(&mut build, lib));
        compile(&build, "torchtools_c10d", &inputs);
    }

    /// ProcessGroupNCCL when CUDA's and NCCL's headers are there: `CUDA_INCLUDE` /
    /// `NCCL_INCLUDE`, else the pip packages beside the wheel (`nvidia/cu13/include`
    /// with `crt/` from cuda-toolkit[nvcc], `nvidia/nccl/include`). Without them it is
    /// left out (`tt_sys::c10d::nccl_built()` says so), unless feature `nccl` demands it.
    /// Returns the headers that name the CUDA and NCCL versions it built with.
    #[cfg(feature = "c10d")]
    fn nccl(build: &mut cc::Build, lib: &std::path::Path) -> Vec<PathBuf> {
        println!("cargo:rerun-if-env-changed=CUDA_INCLUDE");
        println!("cargo:rerun-if-env-changed=NCCL_INCLUDE");
        let required = cfg!(feature = "nccl");
        // lib = site-packages/torch/lib; the nvidia packages sit in site-packages.
        let lib = lib.canonicalize().unwrap_or_else(|_| lib.to_path_buf());
        let site = lib
            .parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("nvidia"));
        let find = |var: &str, rel: &str, probe: &str| -> Result<PathBuf, String> {
            let dir = std::env::var_os(var)
                .map(PathBuf::from)
                .or_else(|| site.as_ref().map(|s| s.join(rel)))
                .unwrap_or_default();
            // Rebuild when the headers appear (a directory's mtime changes as files land).
            let watch = if dir.join(probe).exists() {
                dir.join(probe)
            } else {
                dir.clone()
            };
            if watch.exists() {
                println!("cargo:rerun-if-changed={}", watch.display());
            }
            if dir.join(probe).exists() {
                Ok(dir)
            } else {
                Err(format!(
                    "{probe} not found under {} (or set {var})",
                    dir.display()
                ))
            }
        };
        let found = find("CUDA_INCLUDE", "cu13/include", "crt/host_config.h").and_then(|cuda| {
            find("NCCL_INCLUDE", "nccl/include", "nccl.h").map(|nccl| (cuda, nccl))
        });
        // The header must be the version of the NCCL libtorch loads (the wheel's).
        let mismatch = found.as_ref().ok().and_then(|(_, nccl)| {
            let header = std::fs::read_to_string(nccl.join("nccl.h"))
                .ok()
                .and_then(|t| crate::nccl_header::header_version(&t))?;
            let wheel = lib
                .parent()
                .and_then(|p| p.parent())
                .and_then(crate::nccl_header::wheel_version)?;
            crate::nccl_header::mismatch(header, wheel)
        });
        if let Some(why) = mismatch {
            if required {
                panic!("tt-sys (feature nccl): {why}");
            }
            println!("cargo:warning=tt-sys: NCCL left out: {why}");
            return Vec::new();
        }
        match found {
            Ok((cuda, nccl)) => {
                build
                    .include(&cuda)
                    .include(&nccl)
                    .define("USE_C10D_NCCL", None)
                    .define("USE_CUDA", None);
                // ProcessGroupNCCL lives in libtorch_cuda.
                println!("cargo:rustc-link-lib=torch_cuda");
                vec![cuda.join("cuda.h"), nccl.join("nccl.h")]
            }
            Err(why) if required => panic!(
                "tt-sys (feature nccl): {why}: install CUDA's headers into the torch venv \
                 (`pip install \"cuda-toolkit[cccl,nvcc]==13.0.2\"`, which `cargo xtask setup` does; \
                 NCCL's come with torch's nvidia-nccl wheel)"
            ),
            Err(_) => Vec::new(),
        }
    }
}
