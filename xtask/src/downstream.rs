//! The README's "Using it from your project", checked as a user would follow it: a new
//! crate outside the repository with exactly the README's dependency lines, build
//! script and `src/main.rs` (the clone's path put in for `/path/to/torchtools`), the
//! `.cargo/config.toml` block that `cargo xtask setup --print-env` prints, built, then
//! run from another directory without `LD_LIBRARY_PATH`.
//!
//! It shares the workspace's build cache: the workspace's `[profile]` sections are
//! appended to its manifest and `tt-workspace-hack` added to its dependencies (the
//! external crates' features of the workspace's test builds), and when the printed libtorch is the directory the
//! workspace's `.torchtools/libtorch` link points to (checked), the block names it by
//! the workspace's `LIBTORCH` string. torch-sys's build script reruns whenever that
//! string changes, and everything above it with it: named by the other spelling of the
//! same directory, this step rebuilt libtorch's C++ bindings and the crates on them
//! (about three minutes of CI); the program still finds libtorch through the rpath
//! `tt_sys::build` gives it, which is the canonical directory either way.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::steps::StepResult;

const STEP: &str = "downstream project from the README's lines";

/// The matrix step.
pub(crate) fn check() -> StepResult {
    crate::steps::in_process(STEP, build_and_run)
}

/// The fenced code blocks of the README's section `heading`: (language, text).
fn blocks(readme: &str, heading: &str) -> Result<Vec<(String, String)>> {
    let start = readme
        .find(heading)
        .with_context(|| format!("README.md has no section {heading:?}"))?;
    let rest = &readme[start + heading.len()..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let mut out = Vec::new();
    let mut lines = section.lines();
    while let Some(line) = lines.next() {
        if let Some(lang) = line.strip_prefix("```") {
            let body: Vec<&str> = lines
                .by_ref()
                .take_while(|l| !l.starts_with("```"))
                .collect();
            out.push((lang.to_owned(), body.join("\n") + "\n"));
        }
    }
    Ok(out)
}

fn block<'a>(blocks: &'a [(String, String)], lang: &str, first_line: &str) -> Result<&'a str> {
    blocks
        .iter()
        .find(|(l, text)| l.starts_with(lang) && text.starts_with(first_line))
        .map(|(_, text)| text.as_str())
        .with_context(|| {
            format!("README's \"Using it from your project\" has no {lang} block starting {first_line:?}")
        })
}

pub(crate) fn build_and_run() -> Result<()> {
    let root = crate::root();
    let readme = std::fs::read_to_string(root.join("README.md")).context("reading README.md")?;
    let blocks = blocks(&readme, "## Using it from your project")?;
    let repo = root.display().to_string();
    let manifest = block(&blocks, "toml", "# Cargo.toml")?.replace("/path/to/torchtools", &repo);
    let manifest = with_the_workspaces_features(&manifest, &repo)?;
    let build_rs = block(&blocks, "rust", "// build.rs")?;
    let main_rs = block(&blocks, "rust", "// src/main.rs")?;
    // Outside the repository, so that its .cargo/config.toml is not found by walking up.
    let dir = std::env::temp_dir().join(format!("torchtools-downstream-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let result = write_build_run(&root, &dir, &manifest, build_rs, main_rs);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// The README's manifest with the workspace's one set of external features added
/// (`tt-workspace-hack`, which every test build of the workspace depends on): without
/// it the project's external crates, and tch and torch-sys above them, are built again
/// with the subset of features its own graph enables.
fn with_the_workspaces_features(manifest: &str, repo: &str) -> Result<String> {
    let table = "[dependencies]\n";
    if !manifest.contains(table) {
        bail!("README's \"Using it from your project\" manifest has no {table:?} table");
    }
    Ok(manifest.replacen(
        table,
        &format!("{table}tt-workspace-hack = {{ path = \"{repo}/crates/tt-workspace-hack\" }}\n"),
        1,
    ))
}

/// The `[profile...]` sections of a manifest, comments included: the downstream
/// project builds its dependencies as the workspace does, so they come from its cache.
fn profiles(manifest: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in manifest.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            inside = trimmed.starts_with("[profile.");
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The libtorch directory `--print-env` prints, spelled as the workspace's `LIBTORCH`
/// when both name the same directory (see the module's doc).
fn libtorch_sharing_the_workspaces_build() -> Result<PathBuf> {
    let printed = crate::setup::libtorch_for_other_projects()?;
    let Some(workspace) = std::env::var_os("LIBTORCH").map(PathBuf::from) else {
        return Ok(printed);
    };
    let real = |p: &Path| {
        p.canonicalize()
            .with_context(|| format!("libtorch directory {} does not resolve", p.display()))
    };
    if real(&printed)? != real(&workspace)? {
        bail!(
            "`cargo xtask setup --print-env` prints LIBTORCH={} but the workspace builds with LIBTORCH={}: \
             they are different libtorch directories; run `cargo xtask setup` again",
            printed.display(),
            workspace.display()
        );
    }
    println!(
        "downstream: LIBTORCH={} (the printed {}, by the workspace's spelling)",
        workspace.display(),
        printed.display()
    );
    Ok(workspace)
}

fn write_build_run(
    root: &Path,
    dir: &Path,
    manifest: &str,
    build_rs: &str,
    main_rs: &str,
) -> Result<()> {
    let write = |rel: &str, text: &str| -> Result<()> {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write(
        "Cargo.toml",
        &format!(
            "[package]\nname = \"my-training-job\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n{manifest}\n{}",
            profiles(&std::fs::read_to_string(root.join("Cargo.toml")).context("reading Cargo.toml")?)
        ),
    )?;
    write("build.rs", build_rs)?;
    write("src/main.rs", main_rs)?;
    let libtorch = libtorch_sharing_the_workspaces_build()?;
    let gloo = std::env::var("GLOO_INCLUDE").ok();
    write(
        ".cargo/config.toml",
        &(crate::setup::config_block(&libtorch, gloo.as_deref()) + "\n"),
    )?;
    // The workspace's versions (and its build cache): what is checked is that the
    // lines resolve and build, not which patch release crates.io has today.
    std::fs::copy(root.join("Cargo.lock"), dir.join("Cargo.lock")).context("copying Cargo.lock")?;
    let target = root.join("target");
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build
        .args(["build", "--quiet"])
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", &target);
    // What this repository's cargo configuration set for us is not the user's.
    for var in [
        "LIBTORCH",
        "LIBTORCH_USE_PYTORCH",
        "TORCHTOOLS_PYTHON",
        "LD_LIBRARY_PATH",
    ] {
        build.env_remove(var);
    }
    let status = build.status().context("starting cargo build")?;
    if !status.success() {
        bail!(
            "cargo build of the README's project failed ({status}) in {}",
            dir.display()
        );
    }
    let binary: PathBuf = target.join("debug/my-training-job");
    let out = Command::new(&binary)
        .current_dir("/")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LIBTORCH")
        .output()
        .with_context(|| format!("running {}", binary.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        bail!("the README's program failed ({})", out.status);
    }
    for expected in [
        "torchtools device report (libtorch's view)",
        "  threads      ",
        "sum on ",
    ] {
        if !stdout.contains(expected) {
            bail!("the README's program did not print {expected:?}");
        }
    }
    if !stdout.trim_end().ends_with(": 4") {
        bail!("the README's program computed the wrong sum");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_downstream_project_gets_the_workspaces_profiles_and_nothing_else() {
        let manifest = std::fs::read_to_string(crate::root().join("Cargo.toml")).unwrap();
        let profiles = profiles(&manifest);
        let headers: Vec<&str> = profiles.lines().filter(|l| l.starts_with('[')).collect();
        assert!(headers.contains(&"[profile.dev]"), "{profiles}");
        assert!(
            headers.contains(&"[profile.dev.package.\"*\"]"),
            "{profiles}"
        );
        assert!(
            headers.iter().all(|h| h.starts_with("[profile.")),
            "{headers:?}"
        );
        // Every profile section of the workspace, every key of each.
        let all = manifest
            .lines()
            .filter(|l| l.starts_with("[profile."))
            .count();
        assert_eq!(headers.len(), all, "{profiles}");
        assert!(profiles.contains("\nopt-level = 1\n"), "{profiles}");
    }
}
