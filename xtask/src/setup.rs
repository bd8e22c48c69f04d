//! `cargo xtask setup`: libtorch 2.11.0, once per machine, in a versioned cache.
//!
//! The PyPI `torch==2.11.0` wheel (a CUDA 13.0 build: the same libtorch runs on CPU
//! machines and on the GPU machine) goes into a venv at
//! `$TORCHTOOLS_CACHE_DIR` (default `$XDG_CACHE_HOME/torchtools` or
//! `~/.cache/torchtools`) `/torch-2.11.0`. A marker file is written last, so an
//! interrupted install is redone, never half-used. `.torchtools/libtorch` in the
//! repository links to the wheel's `torch` directory; `.cargo/config.toml` points
//! `LIBTORCH` there. A `LIBTORCH` or `LIBTORCH_USE_PYTORCH` set by the user wins.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

/// The libtorch version tch 0.24.0 needs.
pub(crate) const TORCH_VERSION: &str = "2.11.0";
/// What the venv holds: libtorch (from torch's wheel) and the Python packages that
/// tests compare with. The marker records this list; a cache with an older list is
/// completed in place. (`packaging` and `numpy`: `safetensors.torch` needs them without declaring them.)
/// (`cuda-toolkit[cccl,nvcc]`: CUDA's headers, `crt/` included, so tt-sys builds
/// ProcessGroupNCCL against the wheel's NCCL headers; ~100 MB.)
/// (`gpu-tracker`: tt-tracker's tests run its own readers on our timelines, and the
/// benchmark's baseline; it brings pandas and SQLAlchemy, ~60 MB.)
/// (`tensorboard`: the trainer's tests read its event files with TensorBoard's own
/// reader; ~30 MB with grpcio and protobuf.)
/// (`pytest`: the Python package's tests run with it; `toma`: its toma API is compared
/// with toma itself; `lightning`: its Lightning callback is tested with a real
/// `Trainer`, ~40 MB with torchmetrics and aiohttp, on the torch above.)
const REQUIREMENTS: [&str; 10] = [
    "torch==2.11.0",
    "safetensors==0.7.0",
    "packaging>=23",
    "numpy>=2",
    "cuda-toolkit[cccl,nvcc]==13.0.2",
    GPU_TRACKER,
    "tensorboard==2.21.0",
    "pytest==8.4.2",
    "toma==1.1.0",
    "lightning==2.6.6",
];
/// The gpu_tracker release our tracker is compared with.
pub(crate) const GPU_TRACKER: &str = "gpu-tracker==5.0.1";
/// Free space the wheel and its CUDA libraries need (about 4.6 GB installed).
const NEEDED_BYTES: u64 = 6 << 30;
const MARKER: &str = ".torchtools-ready";

/// Where libtorch comes from.
pub(crate) enum Libtorch {
    /// Our cached venv (its `bin/python` is also the reference for tests).
    Cached { venv: PathBuf },
    /// The user's `LIBTORCH` or `LIBTORCH_USE_PYTORCH`.
    User,
}

pub(crate) fn cache_dir() -> Result<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let dir = if let Some(dir) = var("TORCHTOOLS_CACHE_DIR") {
        if !dir.is_absolute() {
            bail!(
                "TORCHTOOLS_CACHE_DIR={} is not an absolute path: give a full path such as /data/cache/torchtools",
                dir.display()
            );
        }
        dir
    } else if let Some(dir) = var("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        dir.join("torchtools")
    } else if let Some(home) = var("HOME").filter(|d| d.is_absolute()) {
        home.join(".cache/torchtools")
    } else {
        bail!("neither TORCHTOOLS_CACHE_DIR nor HOME is set to an absolute path: set TORCHTOOLS_CACHE_DIR to a directory for libtorch (~5 GB)");
    };
    Ok(dir)
}

fn link_path() -> PathBuf {
    crate::root().join(".torchtools/libtorch")
}

/// The `torch` package directory inside a venv, if installed.
fn torch_dir(venv: &Path) -> Option<PathBuf> {
    let lib = venv.join("lib");
    std::fs::read_dir(&lib)
        .ok()?
        .flatten()
        .map(|e| e.path().join("site-packages/torch"))
        .find(|p| p.join("lib/libtorch_cpu.so").exists())
}

/// gloo's headers, which c10d's `ProcessGroupGloo.hpp` includes and the torch wheel lacks
/// (tt-sys's `c10d` feature, so tt-dist's process groups and the facade's trainer).
const GLOO_HEADER: &str = "/usr/include/gloo/algorithm.h";

/// Installs Debian's `libgloo-dev` when its headers are missing: with apt-get as root,
/// otherwise it names the command to run (or `GLOO_INCLUDE` for headers elsewhere).
fn ensure_gloo() -> Result<()> {
    if let Some(dir) = std::env::var_os("GLOO_INCLUDE") {
        let dir = PathBuf::from(dir);
        if !dir.join("gloo/algorithm.h").exists() {
            bail!(
                "GLOO_INCLUDE={} has no gloo/algorithm.h: point it at the directory holding gloo/, or unset it to use Debian's libgloo-dev",
                dir.display()
            );
        }
        return Ok(());
    }
    if Path::new(GLOO_HEADER).exists() {
        return Ok(());
    }
    if !can_apt_install() {
        bail!(
            "gloo's headers are missing ({GLOO_HEADER}); libtorch's distributed engine needs them to build. \
             Run `sudo apt-get install -y libgloo-dev` (Debian/Ubuntu), or set GLOO_INCLUDE to a directory holding gloo/ \
             (gloo from github.com/pytorch/gloo, headers only), then run this again"
        );
    }
    eprintln!("setup: installing Debian's libgloo-dev (gloo's headers for c10d)");
    if !apt_install("libgloo-dev") {
        bail!("`apt-get install libgloo-dev` failed (see apt's message above): check the package mirrors, or set GLOO_INCLUDE");
    }
    if !Path::new(GLOO_HEADER).exists() {
        bail!("libgloo-dev installed but {GLOO_HEADER} is missing: set GLOO_INCLUDE to gloo's include directory");
    }
    Ok(())
}

/// Whether this process can install Debian packages (root, with apt-get).
fn can_apt_install() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && Command::new("apt-get")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `apt-get install` of one package, updating the package lists once if it fails (a
/// fresh machine may have none yet).
fn apt_install(package: &str) -> bool {
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if install() {
        return true;
    }
    let _ = Command::new("apt-get").args(["update", "-q"]).status();
    install()
}

/// A Debian package some tests run for real (`program --version` answers when it is
/// there): installed when missing and possible, otherwise named (those tests then fail
/// saying so).
fn ensure_package(program: &str, version_arg: &str, package: &str, why: &str) {
    let present = || {
        Command::new(program)
            .arg(version_arg)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if present() {
        return;
    }
    if can_apt_install() {
        eprintln!("setup: installing Debian's {package} ({why})");
        if apt_install(package) && present() {
            return;
        }
    }
    eprintln!("setup: warning: {program} is missing; {why}: `sudo apt-get install -y {package}`");
}

pub(crate) fn setup() -> Result<Libtorch> {
    let start = Instant::now();
    ensure_gloo()?;
    ensure_package(
        "tmux",
        "-V",
        "tmux",
        "the terminal `torchtools top`'s live-view test drives",
    );
    ensure_package(
        "promtool",
        "--version",
        "prometheus",
        "the Prometheus server and promtool that `torchtools metrics`' test scrapes and checks with",
    );
    for (program, version, package) in [
        ("munged", "--version", "munge"),
        ("slurmctld", "-V", "slurmctld"),
        ("slurmd", "-V", "slurmd"),
        ("sbatch", "--version", "slurm-client"),
    ] {
        ensure_package(
            program,
            version,
            package,
            "the Slurm cluster (Debian's Slurm 22.05) the tests start to run torchtools in jobs",
        );
    }
    ensure_package(
        "zsh",
        "--version",
        "zsh",
        "the shell `torchtools`' zsh completion is tested in",
    );
    ensure_package(
        "fish",
        "--version",
        "fish",
        "the shell `torchtools`' fish completion is tested in",
    );
    ensure_package(
        "chromium",
        "--version",
        "chromium",
        "the browser `torchtools serve`'s page is tested in",
    );
    ensure_package(
        "chromedriver",
        "--version",
        "chromium-driver",
        "the WebDriver server that drives Chromium in `torchtools serve`'s page test",
    );
    // Cargo's [env] sets LIBTORCH to our link for processes it runs, this one included;
    // any other value was set by the user.
    if let Ok(v) = std::env::var("LIBTORCH_USE_PYTORCH") {
        eprintln!("setup: LIBTORCH_USE_PYTORCH={v} is set: using the torch of the python3 on PATH");
        return Ok(Libtorch::User);
    }
    if let Ok(v) = std::env::var("LIBTORCH") {
        let ours = link_path();
        if Path::new(&v) != ours {
            let lib = Path::new(&v).join("lib/libtorch_cpu.so");
            if !lib.exists() {
                bail!("LIBTORCH={v} has no lib/libtorch_cpu.so: point it at a libtorch {TORCH_VERSION} directory, or unset it to let `cargo xtask setup` install one");
            }
            eprintln!("setup: using your LIBTORCH={v}");
            return Ok(Libtorch::User);
        }
    }
    let venv = cache_dir()?.join(format!("torch-{TORCH_VERSION}"));
    let wanted = REQUIREMENTS.join("\n");
    let marker = std::fs::read_to_string(venv.join(MARKER)).ok();
    let torch = match (marker, torch_dir(&venv)) {
        (Some(m), Some(torch)) if m.trim() == wanted => torch,
        // An older cache (torch only): add what is missing, keep the 4.6 GB.
        (Some(_), Some(torch)) => {
            pip_install(&venv)?;
            std::fs::write(venv.join(MARKER), &wanted)?;
            torch
        }
        _ => install(&venv)?,
    };
    link(&torch, &link_path())?;
    // The venv itself, whose bin/python is the reference implementation tests compare
    // against (a link to the interpreter alone would lose the venv: Python looks for
    // pyvenv.cfg beside the path it was started as).
    link(&venv, &crate::root().join(".torchtools/venv"))?;
    eprintln!(
        "setup: libtorch {TORCH_VERSION} ready at {} ({:.1}s)",
        torch.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(Libtorch::Cached { venv })
}

/// The libtorch directory a project outside this repository sets as `LIBTORCH`
/// (installing it first when needed): the cache's torch package, or the user's own.
pub(crate) fn libtorch_for_other_projects() -> Result<PathBuf> {
    match setup()? {
        Libtorch::Cached { venv } => torch_dir(&venv).with_context(|| {
            format!(
                "no torch package under {}: run `cargo xtask setup` again",
                venv.display()
            )
        }),
        Libtorch::User => match std::env::var_os("LIBTORCH") {
            Some(dir) => Ok(PathBuf::from(dir)),
            None => bail!(
                "LIBTORCH_USE_PYTORCH is set: your projects find libtorch through the same \
                 variable and the python3 on PATH; nothing else to print"
            ),
        },
    }
}

/// `cargo xtask setup --print-env`: what another project needs to build against the
/// libtorch installed here, as shell lines and as a `.cargo/config.toml` block.
pub(crate) fn print_env() -> Result<()> {
    let libtorch = libtorch_for_other_projects()?;
    let gloo = std::env::var("GLOO_INCLUDE").ok();
    println!("# libtorch {TORCH_VERSION} for a project outside this repository.");
    println!("# Either in your shell:");
    println!(
        "export LIBTORCH={}",
        shell_quote(&libtorch.display().to_string())
    );
    if let Some(g) = &gloo {
        println!("export GLOO_INCLUDE={}", shell_quote(g));
    }
    println!("# or in your project's .cargo/config.toml:");
    println!("{}", config_block(&libtorch, gloo.as_deref()));
    Ok(())
}

/// The `.cargo/config.toml` block that points a project at `libtorch`.
pub(crate) fn config_block(libtorch: &Path, gloo: Option<&str>) -> String {
    let toml_string = |s: &str| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""));
    let mut block = format!(
        "[env]\nLIBTORCH = {}",
        toml_string(&libtorch.display().to_string())
    );
    if let Some(g) = gloo {
        block.push_str(&format!("\nGLOO_INCLUDE = {}", toml_string(g)));
    }
    block
}

fn shell_quote(s: &str) -> String {
    if s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/._-+".contains(&b))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Makes `link` a symlink to `target` (replacing an older one).
fn link(target: &Path, link: &Path) -> Result<()> {
    if std::fs::read_link(link).ok().as_deref() == Some(target) {
        return Ok(());
    }
    let parent = link.parent().context("link path has no parent")?;
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(target, link)
        .with_context(|| format!("cannot link {} -> {}", link.display(), target.display()))
}

fn free_bytes(dir: &Path) -> Option<u64> {
    let out = Command::new("df").args(["-Pk"]).arg(dir).output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let kib: u64 = text
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

fn install(venv: &Path) -> Result<PathBuf> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let version = Command::new(&python).arg("--version").output();
    match version {
        Ok(out) if out.status.success() => {}
        _ => bail!(
            "`{python}` was not found: libtorch comes from PyPI's torch=={TORCH_VERSION} wheel, installed with Python's venv and pip. \
             Install Python 3.10+ with venv and pip (Debian/Ubuntu: `apt-get install python3 python3-venv python3-pip`), \
             or set PYTHON to an interpreter, or set LIBTORCH to an existing libtorch {TORCH_VERSION}"
        ),
    }
    let parent = venv.parent().context("cache dir has no parent")?;
    std::fs::create_dir_all(parent).with_context(|| {
        format!(
            "cannot create the cache directory {} (set TORCHTOOLS_CACHE_DIR to a writable one)",
            parent.display()
        )
    })?;
    if let Some(free) = free_bytes(parent) {
        if free < NEEDED_BYTES {
            bail!(
                "{} has {:.1} GiB free; libtorch {TORCH_VERSION} needs about {} GiB: free some space or set TORCHTOOLS_CACHE_DIR to a larger disk",
                parent.display(),
                free as f64 / (1u64 << 30) as f64,
                NEEDED_BYTES >> 30
            );
        }
    }
    if venv.exists() {
        eprintln!(
            "setup: removing the unfinished install at {}",
            venv.display()
        );
        std::fs::remove_dir_all(venv)
            .with_context(|| format!("cannot remove {}", venv.display()))?;
    }
    eprintln!(
        "setup: installing torch=={TORCH_VERSION} (PyPI wheel, ~4.6 GB, a few minutes) into {}",
        venv.display()
    );
    let status = Command::new(&python)
        .args(["-m", "venv"])
        .arg(venv)
        .status()?;
    if !status.success() {
        bail!("`{python} -m venv` failed: install the venv module (Debian/Ubuntu: `apt-get install python3-venv`)");
    }
    pip_install(venv)?;
    let torch = torch_dir(venv).with_context(|| {
        format!(
            "torch installed, but no torch/lib/libtorch_cpu.so under {}",
            venv.display()
        )
    })?;
    std::fs::write(venv.join(MARKER), REQUIREMENTS.join("\n"))?;
    Ok(torch)
}

fn pip_install(venv: &Path) -> Result<()> {
    eprintln!("setup: pip install {}", REQUIREMENTS.join(" "));
    let status = Command::new(venv.join("bin/python"))
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
        ])
        .args(REQUIREMENTS)
        .status()?;
    if !status.success() {
        bail!(
            "pip could not install {} into {} (see pip's message above): check the network access to PyPI and the free disk space",
            REQUIREMENTS.join(" "),
            venv.display()
        );
    }
    Ok(())
}
