//! `cargo xtask mutants [CRATE...] [--shard K/N | --full] [--again]`: mutation testing
//! with cargo-mutants (installed at a pinned version when missing) of the libtorch-free
//! crates, each with its own tests. Not part of `cargo xtask test`: a whole crate takes
//! half an hour to hours on 2 cores, so a shard (1/8 of the mutants) is the default.
//! `--again` re-tests only the mutants the last run (same shard) did not catch, after a
//! fix: cargo-mutants' `--iterate`.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::setup::Libtorch;
use crate::steps::cargo;

/// The cargo-mutants release this project's figures come from.
const VERSION: &str = "27.1.0";

/// Crates measured, with the features their core is measured with.
const TARGETS: [(&str, &[&str]); 4] = [
    ("tt-lock", &[]),
    ("tt-tracker", &["--features", "sqlite"]),
    ("tt-sampler", &[]),
    ("tt-ckpt", &["--no-default-features"]),
];

// Code no CPU test can reach is left out of the measure where it is written:
// `#[cfg_attr(mutants, mutants::skip)]` on the file, impl or function, with the reason
// in a comment beside it (`grep -rn "mutants::skip" crates` lists them). What remains
// here are single mutants inside functions that are otherwise measured: an attribute
// cannot name one operator of an expression.

/// Single mutants no test can tell from the original on this machine (a regular
/// expression over cargo-mutants' description of the mutant), and why: they change how
/// fast the code runs, what it logs, or a path no filesystem here takes.
const EXCLUDED_MUTANTS: [(&str, &str); 36] = [
    (
        r"replace write_direct_body -> std::io::Result<Option<usize>> with Ok\(None\)",
        "tt-ckpt: the O_DIRECT path declined, which the writer then does buffered: the same \
         bytes (the benchmark measures the difference)",
    ),
    (
        r"replace open_direct -> Option<File> with None$",
        "tt-ckpt: O_DIRECT not offered, so the writer writes buffered: the same bytes",
    ),
    (
        r"replace match guard refuses_direct_io\((true|first), &e\) with (true|false) in write_(with|direct_body)$",
        "tt-ckpt: where the fall-back for a filesystem that opens a file with O_DIRECT \
         and refuses its first write (EINVAL) is taken; ext4 and tmpfs here take O_DIRECT \
         writes (the decision itself, `refuses_direct_io`, is unit-tested)",
    ),
    (
        r"replace - with (\+|/) in write_direct_body$",
        "tt-ckpt: the last chunk's length; a longer one writes zeros past the end, which \
         the cut to the file's length removes",
    ),
    (
        r"replace > with (==|>=) in Stream<'a>::fill$",
        "tt-ckpt: whether the padding past the stream's end is zeroed; the file is cut to \
         its length after the last write, so the padding never stays",
    ),
    (
        r"replace (\+= with \*=|<= with >) in checksums_parallel$",
        "tt-ckpt: the load balance of the checksum threads, or one thread instead of \
         several (every tensor still gets its checksum)",
    ),
    (
        r"replace > with >= in clean_stale_temps$",
        "tt-ckpt: a foreign temp file exactly 24 h old to the nanosecond, removed or not",
    ),
    (
        r"replace != with == in remove_all$",
        "tt-ckpt: which failed removal of a rotated file is logged as a warning (logging \
         only: the file is gone or stays either way)",
    ),
    (
        r"replace > with >= in TensorFile::read$",
        "tt-ckpt: whether an empty file is mapped or read; either way its 0 bytes are \
         parsed and refused with the same error",
    ),
    (
        r"tt-sampler/src/randperm.rs:\d+:\d+: replace << with >>$",
        "tt-sampler: `PIPELINE_MIN`, the size from which the draws move to a second \
         thread (its mutant makes every size pipelined: the same permutation, which a \
         test checks; only the speed differs). The pattern also covers `CHUNK`, whose \
         mutant (chunks of 0) hangs and would count as caught",
    ),
    (
        r"tt-lock/src/holder.rs:\d+:36: replace \|\| with && in user_name_of$",
        "tt-lock: `result.is_null() || pw_name.is_null()` as `&&`: without a passwd entry \
         glibc leaves the zeroed record as it was, so both are null and the answer is the \
         same `None` (the `rc` half of the test is measured: a uid without an entry)",
    ),
    (
        r"replace \|\| with && in kernel_flocks$",
        "tt-lock: whether `/proc/locks` is read for a directory on overlayfs; this \
         machine's kernel (6.18) names overlayfs files there by the overlay's own device \
         and inode, so both give the same answer (a test locks on an overlay mount); \
         older kernels named the inode underneath",
    ),
    (
        r"replace \* with \+ in read_in_one_call$",
        "tt-lock: how fast the buffer for `/proc/locks` grows (by 2 bytes instead of \
         doubling): the same text, read in more steps",
    ),
    (
        r"replace match guard e.kind\(\) == std::io::ErrorKind::Interrupted with false in read_in_one_call$",
        "tt-lock: a read of `/proc/locks` interrupted by a signal (EINTR) gives no table \
         instead of a retry; no test can land a signal inside that read",
    ),
    (
        r"delete - in share_with$",
        "tt-lock: the error check of `fcntl(F_SETFD)` on a descriptor the lock keeps \
         open, which cannot fail",
    ),
    (
        r"replace < with <= in LockDir::acquire$",
        "tt-lock: whether a request counts its own ticket as earlier; the queue scan \
         already leaves its own ticket out",
    ),
    (
        r"replace - with \+ in LockDir::acquire$",
        "tt-lock: the time left before a timeout; every wait is capped at the 100 ms \
         re-check and the deadline is tested after it, so the mutant overshoots by at \
         most 100 ms, which a busy machine's scheduling hides",
    ),
    (
        r"replace != with == in DirLock::take$",
        "tt-lock: a blocking `flock` of the open lock directory, which fails only when \
         interrupted by a signal",
    ),
    (
        r"replace && with \|\| in LockDir::remove_dead$",
        "tt-lock: the re-check, under the directory lock, that a dead ticket is still the \
         same file and still unlocked; the two conditions differ only if a ticket is \
         replaced between two scans, a race no test can place",
    ),
    (
        r"replace < with <= in LockDir::inherited$",
        "tt-lock: a duplicated descriptor numbered 0 taken for a failure; `fcntl` \
         returns the lowest free number, and 0 (standard input) is open",
    ),
    (
        r"delete match arm Some\(libc::EINTR\) in try_flock$",
        "tt-lock: a non-blocking `flock` interrupted by a signal, retried at the next \
         check instead of failing; no test can land a signal inside that call",
    ),
    (
        r"replace (<= with (>|<|==)|\+ with (-|\*)) in DistributedSampler::ensure_order$",
        "tt-sampler: whether this rank's share is kept as 32- or 64-bit indices (the same \
         indices either way); 32 bits would fall short only past 2^32 samples, whose \
         permutation (32 GiB) no machine here holds",
    ),
    (
        r"replace small_pipelined -> bool with false$",
        "tt-sampler: the pipelined draw declined, as when no thread can be had: the \
         caller makes the same permutation on its own thread (a test checks this case)",
    ),
    (
        r"replace % with \+ in epoch_samples$",
        "tt-sampler: with `drop_last`, `span / replicas` and `span.div_ceil(replicas)` \
         agree when the remainder is 0, so testing the remainder or not gives the same \
         count",
    ),
    (
        r"replace (>= with <|> with (>=|==|<)) in small$",
        "tt-sampler: whether the draws run on a second thread (by size, by core count): \
         the same permutation either way (a test compares the two); only the speed differs",
    ),
    (
        r"randperm.rs:\d+:18: replace - with / in small$",
        "tt-sampler: `let last = n - 1` as `n / 1`: one more loop turn at the last \
         element, whose draw modulo 1 swaps it with itself: the same permutation (the \
         other `-` of the function are measured; a moved line shows up as missed)",
    ),
    (
        r"replace && with \|\| in Sampler::tick$",
        "tt-tracker: `gpus.available() && emit`, whether the GPU use of the baseline read \
         counts; without NVML both give 0 % in every figure (the GPU tests run the GPU \
         path)",
    ),
    (
        r"replace (> with >=|< with <=) in python_repr$",
        "tt-tracker: the sign of an infinite float (`x > 0.0` or `>= 0.0`: the same for \
         every infinity) and of a finite one (`x < 0.0` or `<= 0.0`: zero has returned \
         before)",
    ),
    (
        r"replace > with (<|==|>=) in (clock_ticks|page_size)$",
        "tt-tracker: the fall-back of `sysconf` (100 ticks a second, 4096-byte pages) \
         taken instead of its answer, which on x86-64 Linux is the same value",
    ),
    (
        r"replace \* with \+ in pread$",
        "tt-tracker: how fast the buffer for a /proc file grows (by 2 bytes instead of \
         doubling): the same text, read in more steps",
    ),
    (
        r"replace != with == in no_sqlite_here$|replace no_sqlite_here -> Result<\(\)> with Ok\(\(\)\)$",
        "tt-tracker: the refusal of a `.sqlite` timeline in a build without SQLite; the \
         measured build has the `sqlite` feature, where the function returns before the \
         test (the CI matrix's no-features step tests the refusal)",
    ),
    (
        r"replace \+ with (\*|-) in Sampler::tick$",
        "tt-tracker: the GPU memory of the tracked process and its descendants added up \
         (`g.main + g.descendants`, the only sums in the sampling step); without a GPU \
         both are 0 (the GPU tests check the sums)",
    ),
    (
        r"tracker.rs:\d+:16: delete ! in Sampler::read_tree$",
        "tt-tracker: `if !is_main`, which processes count as live descendants for the GPU \
         readings only; without a GPU nothing reads that set (the GPU tests do)",
    ),
    (
        r"replace match guard .* with false in Sampler::shared_rss$",
        "tt-tracker: a process's cached `smaps_rollup` never used (read again at every \
         sample): the same values at a higher cost, which the tracker benchmark measures. \
         When a reading stands is its own function, tested at each bound",
    ),
    (
        r"replace > with >= in Sampler::report$",
        "tt-tracker: which method a peak is credited to when wait4's figure, a \
         descendant's high-water mark or the floor of the combined peak ties the sampled \
         figure: the same bytes, another label. Which figure wins when they differ is \
         tested; the command's own high-water mark is credited by a unit-tested function",
    ),
    (
        r"replace match guard !p.as_os_str\(\).is_empty\(\) with true in combine$",
        "tt-tracker: the directory of a bare output name taken as `.` or as the empty \
         path; `Path::new(\"\").join(name)` is `name`, the same file as `./name`",
    ),
];

/// The default shard: the first of 8.
const DEFAULT_SHARD: &str = "0/8";

/// A measured crate and the features its mutants are built with.
type Target = (&'static str, &'static [&'static str]);

/// `run`'s arguments: the shard (`None`: `--full`), `--again`, the crates (default:
/// every one of [`TARGETS`]).
fn parse(args: &[&str]) -> Result<(Option<String>, bool, Vec<Target>)> {
    let mut shard = Some(DEFAULT_SHARD.to_owned());
    let mut again = false;
    let mut crates = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match *arg {
            "--full" => shard = None,
            "--again" => again = true,
            "--shard" => {
                let value = args.next().context("--shard needs K/N, e.g. --shard 3/8")?;
                let ok = value
                    .split_once('/')
                    .and_then(|(k, n)| Some((k.parse::<u32>().ok()?, n.parse::<u32>().ok()?)))
                    .is_some_and(|(k, n)| n > 0 && k < n);
                if !ok {
                    bail!("--shard {value}: give K/N with K below N, e.g. --shard 3/8");
                }
                shard = Some((*value).to_owned());
            }
            name => match TARGETS.iter().find(|(c, _)| *c == name) {
                Some(t) => crates.push(*t),
                None => bail!(
                    "{name}: not a measured crate; choose among {}",
                    TARGETS.map(|t| t.0).join(", ")
                ),
            },
        }
    }
    if crates.is_empty() {
        crates = TARGETS.to_vec();
    }
    Ok((shard, again, crates))
}

pub(crate) fn run(args: &[&str]) -> Result<()> {
    let (shard, again, crates) = parse(args)?;
    install()?;
    let python = match crate::setup::setup()? {
        Libtorch::Cached { venv } => venv.join("bin/python"),
        Libtorch::User => std::env::var("PYTHON")
            .unwrap_or_else(|_| "python3".into())
            .into(),
    };
    println!("left out of the measure:");
    println!("  the code marked #[cfg_attr(mutants, mutants::skip)], each with its reason");
    for (mutant, why) in EXCLUDED_MUTANTS {
        println!("  mutants matching {mutant}: {why}");
    }
    let mut rows = Vec::new();
    for (krate, features) in crates {
        // One folder per crate and shard: the shards of a crate measured on different
        // days add up to the whole, and `--again` finds the run it continues.
        let out = crate::root()
            .join("target/mutants")
            .join(krate)
            .join(run_name(shard.as_deref()));
        if !again {
            let _ = std::fs::remove_dir_all(&out);
        }
        std::fs::create_dir_all(&out)?;
        let mut args = vec!["mutants", "-p", krate, "--output"];
        let out_arg = out.to_string_lossy().into_owned();
        args.push(&out_arg);
        if again {
            // Only what the last run did not catch (its shard and options: give the same).
            args.push("--iterate");
        }
        args.extend(features.iter().copied());
        // A busy machine slows every test: a short timeout would count a slow run as
        // a mutant caught (and `--again`, which skips the baseline, starts from 20 s).
        args.extend([
            "--timeout-multiplier",
            "3",
            "--minimum-test-timeout",
            "120",
            "--no-shuffle",
        ]);
        if let Some(s) = &shard {
            // Round-robin: a shard samples every file, not the first files only.
            args.extend(["--shard", s, "--sharding", "round-robin"]);
        }
        for (re, _) in EXCLUDED_MUTANTS {
            args.extend(["--exclude-re", re]);
        }
        let mut cmd = cargo(&args);
        // The copy cargo-mutants builds in has no `.torchtools` link: name the venv's
        // Python (the reference of the PyTorch and gpu_tracker comparisons) outright.
        cmd.env("TORCHTOOLS_PYTHON", &python);
        eprintln!("\n==> cargo {}", args.join(" "));
        // cargo-mutants exits non-zero when a mutant is missed: the table says it.
        let _ = cmd.status().context("could not start cargo mutants")?;
        rows.push((krate, outcomes(&out.join("mutants.out/outcomes.json"))?));
    }
    println!(
        "\nmutation testing{}",
        shard
            .as_ref()
            .map_or(String::new(), |s| format!(" (shard {s})"))
    );
    println!(
        "{:<12} {:>7} {:>7} {:>7} {:>9} {:>9} {:>8}",
        "crate", "tested", "caught", "missed", "timeout", "unviable", "caught%"
    );
    for (krate, o) in &rows {
        let pct = o.caught_percent();
        println!(
            "{krate:<12} {:>7} {:>7} {:>7} {:>9} {:>9} {pct:>8}",
            o.caught + o.missed + o.timeout + o.unviable,
            o.caught,
            o.missed,
            o.timeout,
            o.unviable
        );
    }
    if again {
        println!("(--again: only the mutants the last run did not catch; its catches stand)");
    }
    println!(
        "(missed mutants: target/mutants/CRATE/{}/mutants.out/missed.txt)",
        run_name(shard.as_deref())
    );
    Ok(())
}

/// The folder of one run under `target/mutants/CRATE`: `full`, or `shard-K-of-N`.
fn run_name(shard: Option<&str>) -> String {
    shard.map_or("full".to_owned(), |s| {
        format!("shard-{}", s.replace('/', "-of-"))
    })
}

#[derive(Default)]
struct Outcomes {
    caught: u64,
    missed: u64,
    timeout: u64,
    unviable: u64,
}

impl Outcomes {
    /// Caught (a test failed, or hung past the timeout) out of the viable mutants, to
    /// a tenth of a percent; a run with a miss never reads 100.0%.
    fn caught_percent(&self) -> String {
        let scored = self.caught + self.missed + self.timeout;
        if scored == 0 {
            return "-".to_owned();
        }
        let pct = 100.0 * (self.caught + self.timeout) as f64 / scored as f64;
        let pct = if self.missed > 0 { pct.min(99.9) } else { pct };
        format!("{pct:.1}%")
    }
}

/// Counts from cargo-mutants' `outcomes.json`.
fn outcomes(path: &Path) -> Result<Outcomes> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cargo mutants wrote no {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    Ok(Outcomes {
        caught: n("caught"),
        missed: n("missed"),
        timeout: n("timeout"),
        unviable: n("unviable"),
    })
}

/// cargo-mutants at the pinned version, installed from crates.io when missing.
fn install() -> Result<()> {
    let have = std::process::Command::new("cargo")
        .args(["mutants", "--version"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    if have.as_deref().is_some_and(|v| v.contains(VERSION)) {
        return Ok(());
    }
    crate::steps::run(
        &format!("install cargo-mutants {VERSION}"),
        cargo(&["install", "cargo-mutants", "--locked", "--version", VERSION]),
    )
}

#[cfg(test)]
mod tests {
    use super::Outcomes;

    fn pct(caught: u64, missed: u64, timeout: u64) -> String {
        let unviable = 7;
        Outcomes {
            caught,
            missed,
            timeout,
            unviable,
        }
        .caught_percent()
    }

    #[test]
    fn timeouts_count_as_caught_and_unviable_mutants_not_at_all() {
        assert_eq!(pct(187, 20, 10), "90.8%");
        assert_eq!(pct(0, 0, 3), "100.0%");
        assert_eq!(pct(0, 0, 0), "-");
    }

    #[test]
    fn one_miss_never_reads_as_all_caught() {
        assert_eq!(pct(202, 1, 13), "99.5%");
        assert_eq!(pct(99_999, 1, 0), "99.9%");
        assert_eq!(pct(10, 0, 0), "100.0%");
    }
}
