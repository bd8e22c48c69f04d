//! The READMEs against the command itself: every command is in the README's table, every
//! option it shows exists, and every option the command requires is shown as required
//! (not in brackets); the shell blocks marked `sh cpu` run as written and each line ends
//! as its comment says, and every other shell block says why it does not run here.

use std::collections::BTreeSet;
use std::process::Command;

fn readme() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md");
    std::fs::read_to_string(path).expect("the workspace README")
}

fn help(words: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .args(words)
        .arg("--help")
        .env_remove("TORCHTOOLS_LOG")
        .output()
        .expect("runs");
    assert!(out.status.success(), "torchtools {words:?} --help failed");
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// The synopses of the table's first column: each code span of the first cell, with
/// Markdown's `\|` read as `|`.
fn synopses(readme: &str) -> Vec<String> {
    let start = readme
        .find("## The `torchtools` command")
        .expect("the command's section");
    let section = &readme[start..];
    let end = section[3..].find("\n## ").map_or(section.len(), |e| e + 3);
    let mut out = Vec::new();
    for row in section[..end].lines().filter(|l| l.starts_with("| `")) {
        let row = row.replace("\\|", "\u{1}");
        let first = row.split(" | ").next().unwrap_or_default();
        for (i, span) in first.split('`').enumerate() {
            if i % 2 == 1 {
                out.push(span.replace('\u{1}', "|"));
            }
        }
    }
    assert!(!out.is_empty(), "no synopsis found in the README's table");
    out
}

/// The subcommand words a synopsis starts with (`track compare A.json` -> track, compare).
fn words(synopsis: &str) -> Vec<&str> {
    synopsis
        .split_whitespace()
        .take_while(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .filter(|w| !w.starts_with('-'))
        .collect()
}

/// `--long` options in `text`, each with whether it sits inside `[...]`.
fn options(text: &str) -> Vec<(String, bool)> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'[' => depth += 1,
            b']' => depth = depth.saturating_sub(1),
            b'-' if bytes.get(i + 1) == Some(&b'-')
                && bytes.get(i + 2).is_some_and(u8::is_ascii_lowercase)
                && (i == 0 || !bytes[i - 1].is_ascii_alphanumeric()) =>
            {
                let mut end = i + 2;
                while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'-') {
                    end += 1;
                }
                out.push((text[i..end].to_owned(), depth > 0));
                i = end;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// What `--help` says the options of `words` are (long names and visible aliases).
fn known(help: &str) -> BTreeSet<String> {
    options(help).into_iter().map(|(o, _)| o).collect()
}

/// The options the usage line of `words` requires: those outside `[...]`.
fn required(help: &str, words: &[&str]) -> Vec<String> {
    let prefix = format!("Usage: torchtools {}", words.join(" "));
    help.lines()
        .map(|l| l.trim_start().trim_start_matches("Usage: "))
        .filter_map(|l| l.strip_prefix(&prefix[7..]))
        .filter(|rest| rest.is_empty() || rest.starts_with(' '))
        .flat_map(options)
        .filter(|(_, optional)| !optional)
        .map(|(o, _)| o)
        .collect()
}

#[test]
fn every_command_is_in_the_readme_table() {
    let readme = readme();
    let table: BTreeSet<String> = synopses(&readme)
        .iter()
        .filter_map(|s| words(s).first().map(|w| w.to_string()))
        .collect();
    let main = help(&[]);
    let commands = main
        .split("Commands:")
        .nth(1)
        .and_then(|s| s.split("Options:").next())
        .expect("a Commands section");
    for line in commands.lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if name != "help" {
            assert!(
                table.contains(name),
                "`torchtools {name}` is missing from the README's table"
            );
        }
    }
}

#[test]
fn the_readme_table_shows_the_options_as_the_command_takes_them() {
    for synopsis in synopses(&readme()) {
        let words = words(&synopsis);
        assert!(!words.is_empty(), "no command in the synopsis {synopsis:?}");
        let help = help(&words);
        let known = known(&help);
        let shown = options(&synopsis);
        for (option, _) in &shown {
            assert!(
                known.contains(option),
                "the README shows `{synopsis}`, but `torchtools {} --help` has no {option}",
                words.join(" ")
            );
        }
        for option in required(&help, &words) {
            assert!(
                shown.iter().any(|(o, optional)| *o == option && !optional),
                "`torchtools {}` requires {option}, which the README's `{synopsis}` does not \
                 show as required",
                words.join(" ")
            );
        }
    }
}

#[test]
fn synopses_are_read_as_written() {
    assert_eq!(
        options("run (--probe | --bytes B) [--gpu G [--count N]] -- CMD"),
        [
            ("--probe".to_owned(), false),
            ("--bytes".to_owned(), false),
            ("--gpu".to_owned(), true),
            ("--count".to_owned(), true),
        ]
    );
    assert_eq!(
        words("track compare A.json B.json [--json]"),
        ["track", "compare"]
    );
    assert_eq!(words("track sub-track ..."), ["track", "sub-track"]);
    assert_eq!(
        required(
            "Usage: torchtools run [OPTIONS] <--bytes <BYTES>|--probe> -- <CMD>...",
            &["run"]
        ),
        ["--bytes", "--probe"]
    );
}

/// Every README of the workspace: (path from the root, text).
pub(crate) fn all_readmes() -> Vec<(String, String)> {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let mut out = vec![("README.md".to_owned(), readme())];
    let mut crates: Vec<_> = std::fs::read_dir(root.join("crates"))
        .expect("crates/")
        .flatten()
        .map(|e| e.path().join("README.md"))
        .filter(|p| p.exists())
        .collect();
    crates.sort();
    for path in crates {
        let text = std::fs::read_to_string(&path).expect("readable");
        let name = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .display()
            .to_string();
        out.push((name, text));
    }
    out
}

/// The shell blocks of `text`: (line number of the fence, the marker after `sh`, lines).
pub(crate) fn shell_blocks(text: &str) -> Vec<(usize, String, Vec<String>)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String, Vec<String>)> = None;
    let mut in_other = false;
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        if !t.starts_with("```") {
            if let Some((_, _, lines)) = &mut current {
                lines.push(line.to_owned());
            }
            continue;
        }
        let info = t.trim_start_matches('`');
        if let Some(block) = current.take() {
            if info.is_empty() {
                out.push(block);
            } else {
                current = Some(block);
            }
        } else if in_other {
            in_other = !info.is_empty();
        } else if let Some(rest) = info
            .strip_prefix("sh")
            .filter(|r| r.is_empty() || r.starts_with(' '))
        {
            current = Some((n + 1, rest.trim().to_owned(), Vec::new()));
        } else {
            in_other = true;
        }
    }
    out
}

/// The exit status a line's comment announces ("# exits 2: ..."), else 0.
fn expected_status(line: &str) -> i32 {
    let (mut single, mut double) = (false, false);
    let bytes = line.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        match b {
            b'\'' if !double => single = !single,
            b'"' if !single => double = !double,
            b'#' if !single && !double && (i == 0 || bytes[i - 1] == b' ') => {
                let comment = &line[i..];
                return comment
                    .split("exits ")
                    .nth(1)
                    .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                    .and_then(|d| d.parse().ok())
                    .unwrap_or(0);
            }
            _ => {}
        }
    }
    0
}

#[test]
fn every_shell_block_runs_here_or_says_why_not() {
    for (path, text) in all_readmes() {
        for (line, marker, _) in shell_blocks(&text) {
            assert!(
                marker == "cpu"
                    || marker == "slurm"
                    || marker.starts_with("skip-") && marker.len() > 5,
                "{path}:{line}: a shell block without a marker: write ```sh cpu when it runs \
                 as written on a machine without a GPU (a test then runs it), ```sh slurm \
                 for the lines the Slurm tests run on a real cluster, else ```sh skip-WHY"
            );
        }
    }
}

#[test]
fn shell_blocks_marked_cpu_run_as_written() {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_torchtools"))
        .parent()
        .expect("the binary's directory")
        .to_owned();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    for (readme, text) in all_readmes() {
        for (at, marker, lines) in shell_blocks(&text) {
            if marker != "cpu" {
                continue;
            }
            // One directory per block: a line may read what an earlier one wrote.
            let dir = tempfile::tempdir().expect("tempdir");
            for line in lines
                .iter()
                .filter(|l| !l.trim().is_empty() && !l.trim().starts_with('#'))
            {
                let want = expected_status(line);
                let out = Command::new("timeout")
                    .args(["300", "bash", "-c", line])
                    .current_dir(dir.path())
                    .env("PATH", &path)
                    .env("TORCHTOOLS_LOCK_DIR", dir.path().join("locks"))
                    .env("XDG_STATE_HOME", dir.path().join("state"))
                    .env_remove("PYTHONUNBUFFERED")
                    .env_remove("TORCHTOOLS_LOG")
                    .env_remove("TORCHTOOLS_DEVICE")
                    .output()
                    .expect("bash runs");
                assert_eq!(
                    out.status.code(),
                    Some(want),
                    "{readme} (block at line {at}): `{line}` ended with {} where the README \
                     says {want}\nstdout: {}\nstderr: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                ran += 1;
            }
        }
    }
    assert!(
        ran >= 10,
        "only {ran} README lines ran: the cpu blocks went missing"
    );
}

#[test]
fn shell_blocks_and_statuses_are_read_as_written() {
    let text = "```sh cpu\na # exits 2: no\n```\n```rust\n```sh\n```\n```sh skip-gpu\nb\n```\n";
    let blocks = shell_blocks(text);
    assert_eq!(blocks.len(), 2);
    assert_eq!(
        (blocks[0].1.as_str(), blocks[0].2.clone()),
        ("cpu", vec!["a # exits 2: no".to_owned()])
    );
    assert_eq!(blocks[1].1, "skip-gpu");
    assert_eq!(
        expected_status("sh -c 'exit 1 # exits 3' # exits 1: rank 1"),
        1
    );
    assert_eq!(expected_status("echo \"# exits 4\""), 0);
    assert_eq!(expected_status("torchtools devices # fine"), 0);
}

#[test]
fn the_readmes_policy_example_is_in_force_as_written() {
    use std::os::unix::fs::PermissionsExt;
    let readme = readme();
    let example = readme
        .split("```toml\n")
        .find(|block| block.starts_with("# /etc/torchtools/policy.toml"))
        .and_then(|block| block.split("```").next())
        .expect("the README's policy example");
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("policy.toml");
    std::fs::write(&path, example).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_torchtools"))
        .arg("policy")
        .env("TORCHTOOLS_LOCK_DIR", tmp.path().join("locks"))
        .env("TORCHTOOLS_POLICY", &path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("fair share by use decayed with a half-life of 7d")
            && text.contains("2 GPU(s), 80.00 GiB shared, 20 request(s) waiting")
            && text.contains("a request waiting 30m may preempt"),
        "{text}"
    );
}
