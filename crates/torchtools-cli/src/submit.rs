//! `--slurm` on `reserve --detach` and `run --detach`: the same command line submitted
//! to Slurm instead of torchtools' own queue. The job becomes an `sbatch` script with
//! the options that match (`--gres=gpu:N`, `--time`, `--requeue` with Slurm's warning
//! signal, `--array`, `--dependency`, `--output`) running the same torchtools command
//! attached inside it, on the GPUs Slurm gives the job; `--dry-run` prints the script
//! instead. What Slurm cannot be asked for is refused before anything is submitted.

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;

use crate::arg_groups::{DetachArgs, TimeArgs};
use crate::exit::Exit;
use crate::jobs::keeper::{without_detach, without_options};

/// How long before a `--requeue`d job's time limit Slurm warns it (SIGUSR1) when
/// `--signal-before` does not say: time to checkpoint, as Lightning's guides use.
const WARN_BEFORE: Duration = Duration::from_secs(90);

/// What a submission is made of: the GPUs asked for, the time options, the detach
/// options, and the torchtools command line to run inside the job.
#[derive(Clone, Copy)]
pub(crate) struct Submission<'a> {
    pub(crate) gpus: &'a [tt_lock::GpuSpec],
    pub(crate) count: Option<u32>,
    pub(crate) time: &'a TimeArgs,
    pub(crate) detach: &'a DetachArgs,
    /// Where Slurm writes the job's output (`slurm-%j.out` in it).
    pub(crate) log_dir: &'a Path,
    /// This process's arguments after the program, without the detach options
    /// ([`without_detach`]).
    pub(crate) inner: &'a [OsString],
    /// How many of `inner`'s last words are the user's command.
    pub(crate) command: usize,
    /// For `launch`: the job's nodes, one launcher on each under `srun`.
    pub(crate) nodes: Option<usize>,
}

/// `text` quoted for `sh` (single quotes; a single quote as `'\''`).
fn quoted(text: &str) -> String {
    if !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+%@".contains(c))
    {
        return text.to_owned();
    }
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// A duration as Slurm's `--time` takes it: `D-HH:MM:SS`, rounded up to the second.
fn slurm_time(d: Duration) -> String {
    let s = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    format!(
        "{}-{:02}:{:02}:{:02}",
        s / 86_400,
        s / 3600 % 24,
        s / 60 % 60,
        s % 60
    )
}

/// A Slurm job id as `--dependency` takes it (`1234`, or `1234_7`), or a refusal: a
/// torchtools job id names a job of this machine's queue, which Slurm does not know.
fn slurm_job(id: &str, option: &str) -> Result<String, Exit> {
    crate::jobs::slurm::is_slurm_id(id)
        .then(|| id.to_owned())
        .ok_or_else(|| {
            Exit::usage(format!(
                "--slurm {option} {id}: Slurm waits only for Slurm jobs: give their ids \
             (`squeue --me`), not torchtools job ids"
            ))
        })
}

/// The `sbatch` script for `s`, or the reason it cannot be made.
pub(crate) fn script(s: &Submission) -> Result<String, Exit> {
    let refuse = |why: &str| Err(Exit::usage(format!("--slurm: {why}")));
    if s.time.preemptible {
        return refuse(
            "Slurm's preemption is its partitions' and QOS's (ask its administrator for a \
             preemptible QOS and give `sbatch --qos` in a script of your own); use \
             --requeue to go on after a preemption",
        );
    }
    let named: Vec<String> = s
        .gpus
        .iter()
        .filter(|g| !matches!(g, tt_lock::GpuSpec::Auto))
        .map(ToString::to_string)
        .collect();
    if !named.is_empty() {
        return refuse(&format!(
            "--gpu names {} of this machine, but Slurm chooses a job's GPUs: ask for how \
             many with --count N (--gpu auto)",
            named.join(",")
        ));
    }
    let mut lines = vec!["#!/bin/sh".to_owned()];
    let mut option = |o: String| lines.push(format!("#SBATCH {o}"));
    let program = s
        .inner
        .get(s.inner.len().saturating_sub(s.command))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name: String = Path::new(&program)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or(program);
    option(format!(
        "--job-name={}",
        quoted(&format!("torchtools-{name}"))
    ));
    if let Some(nodes) = s.nodes {
        option(format!("--nodes={nodes}"));
        option("--ntasks-per-node=1".to_owned());
    }
    if !s.gpus.is_empty() {
        option(format!("--gres=gpu:{}", s.count.unwrap_or(1)));
    }
    let output = if s.detach.array.is_some() {
        "slurm-%A_%a.out"
    } else {
        "slurm-%j.out"
    };
    option(format!(
        "--output={}",
        quoted(&s.log_dir.join(output).to_string_lossy())
    ));
    if let Some(time) = s.time.time {
        option(format!("--time={}", slurm_time(time)));
    } else if s.time.grace.is_some() || s.time.signal_before.is_some() {
        return refuse("--grace and --signal-before apply to a time limit: give --time too");
    }
    if s.time.grace.is_some() {
        return refuse(
            "--grace: Slurm's time from SIGTERM to SIGKILL is the cluster's KillWait, not \
             the job's; leave --grace out",
        );
    }
    if s.detach.requeue {
        option("--requeue".to_owned());
        option("--open-mode=append".to_owned());
    }
    if let Some(before) = s.time.signal_before.or(s
        .time
        .time
        .filter(|_| s.detach.requeue)
        .map(|_| WARN_BEFORE))
    {
        option(format!("--signal=USR1@{}", before.as_secs().max(1)));
    }
    if let Some(array) = &s.detach.array {
        let list: Vec<String> = array.indices.iter().map(u32::to_string).collect();
        let at_once = array.at_once.map(|k| format!("%{k}")).unwrap_or_default();
        option(format!("--array={}{at_once}", list.join(",")));
    }
    let mut waits = Vec::new();
    for id in &s.detach.after {
        waits.push(format!("afterany:{}", slurm_job(id, "--after")?));
    }
    for id in &s.detach.after_ok {
        waits.push(format!("afterok:{}", slurm_job(id, "--after-ok")?));
    }
    if !waits.is_empty() {
        option(format!("--dependency={}", waits.join(",")));
    }
    lines.push(inside(s));
    Ok(lines.join("\n") + "\n")
}

/// The script's last line: the same torchtools command, attached, on the job's GPUs;
/// for `launch`, one on each node under `srun` (each on its node's GPUs).
fn inside(s: &Submission) -> String {
    let mut words = vec!["exec".to_owned(), quoted(&torchtools_path())];
    // The options the script gives Slurm are not the inner command's: it runs on the
    // job's GPUs and nodes, and Slurm keeps its time.
    let inner = without_options(
        s.inner,
        s.command,
        &[],
        &[
            "--time",
            "--grace",
            "--signal-before",
            "--gpu",
            "--count",
            "--nnodes",
        ],
    );
    let head = inner.len().saturating_sub(s.command);
    words.extend(
        inner[..head]
            .iter()
            .filter(|w| *w != "--")
            .map(|w| quoted(&w.to_string_lossy())),
    );
    if !s.gpus.is_empty() {
        let gpus = match s.nodes {
            Some(_) => "\"$SLURM_STEP_GPUS\"",
            None => "\"$SLURM_JOB_GPUS\"",
        };
        words.push("--gpu".into());
        words.push(gpus.into());
    }
    if s.detach.requeue {
        words.push("--requeue".into());
    }
    words.push("--".into());
    words.extend(inner[head..].iter().map(|w| quoted(&w.to_string_lossy())));
    if s.nodes.is_none() {
        return words.join(" ");
    }
    let srun = "exec srun --ntasks-per-node=1";
    if s.gpus.is_empty() {
        return format!("{srun} {}", words[1..].join(" "));
    }
    // Each node's GPUs are its own step's: read there, by a shell of each task.
    format!("{srun} sh -c {}", quoted(&words.join(" ")))
}

/// This torchtools, as the job runs it (the nodes share the path on a cluster).
fn torchtools_path() -> String {
    std::env::current_exe()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "torchtools".into())
}

/// `--slurm` on `command` (`reserve`, `run` or `launch`) whose detach options are
/// `detach`, this process's arguments `argv`, the last `command_len` of them the user's
/// command; `hook`: whether a hook (an option, or the config's default) is set, which
/// is not run for a Slurm job.
pub(crate) fn run(
    command: &crate::commands::Command,
    detach: &DetachArgs,
    argv: &[OsString],
    command_len: usize,
    hook: bool,
) -> Result<ExitCode> {
    let (gpus, count, time, nodes) = match (command, command.reserving()) {
        (crate::commands::Command::Launch(a), _) => {
            let (gpus, count, nodes) = a.for_slurm()?;
            (gpus, count, a.time(), Some(nodes))
        }
        (_, Some(r)) => (
            r.reservation.gpu.clone(),
            r.reservation.count,
            &r.reservation.time,
            None,
        ),
        _ => {
            return Err(
                Exit::usage("--slurm is an option of reserve, run and launch".into()).into(),
            )
        }
    };
    if command.hook().is_some_and(|h| h.on_end.is_some()) {
        return Err(Exit::usage(
            "--slurm: an --on-end hook is not run for a Slurm job: use Slurm's \
             `--mail-type`, or run the hook at the end of a script of your own"
                .into(),
        )
        .into());
    }
    if hook {
        eprintln!("torchtools: the default on_end hook of your config is not run for a Slurm job");
    }
    let log_dir = crate::jobs::keeper::log_dir(detach.log_dir.as_deref())?;
    let inner = without_detach(argv.get(1..).unwrap_or_default(), command_len);
    submit(
        &Submission {
            gpus: &gpus,
            count,
            time,
            detach,
            log_dir: &log_dir,
            inner: &inner,
            command: command_len,
            nodes,
        },
        detach.dry_run,
    )
}

/// Prints the script (`--dry-run`) or submits it with `sbatch`, printing Slurm's job id.
fn submit(s: &Submission, dry_run: bool) -> Result<ExitCode> {
    let text = script(s)?;
    if dry_run {
        print!("{text}");
        return Ok(ExitCode::SUCCESS);
    }
    use std::io::Write as _;
    let mut sbatch = std::process::Command::new("sbatch")
        .arg("--parsable")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| {
            Exit::new(
                crate::exit::NOT_FOUND,
                format!("--slurm: cannot run sbatch: {e} (is Slurm's sbatch on PATH?)"),
            )
        })?;
    if let Some(mut stdin) = sbatch.stdin.take() {
        stdin.write_all(text.as_bytes())?;
    }
    let out = sbatch.wait_with_output()?;
    if !out.status.success() {
        return Err(Exit::new(
            crate::exit::FAILURE,
            format!(
                "--slurm: sbatch refused the job ({}): {} (see the script with --dry-run)",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        )
        .into());
    }
    let id = String::from_utf8_lossy(&out.stdout);
    let id = id.trim().split(';').next().unwrap_or_default();
    println!("{id}");
    eprintln!(
        "torchtools: submitted to Slurm as job {id}: `squeue -j {id}`, its output in {}",
        s.log_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(words: &[&str]) -> Vec<OsString> {
        words.iter().map(OsString::from).collect()
    }

    #[test]
    fn the_script_asks_slurm_for_what_the_options_say() {
        let time = TimeArgs {
            time: Some(Duration::from_secs(2 * 3600 + 5)),
            ..TimeArgs::default()
        };
        let detach = DetachArgs {
            detach: true,
            requeue: true,
            after_ok: vec!["41".into()],
            array: Some(crate::args::ArraySpec {
                indices: vec![0, 1, 2],
                at_once: Some(2),
            }),
            ..DetachArgs::default()
        };
        let inner = without_detach(
            &args(&[
                "reserve",
                "--detach",
                "--count",
                "2",
                "--time",
                "2h",
                "--slurm",
                "--requeue",
                "--no-fence",
                "--",
                "python",
                "train.py",
                "it's",
            ]),
            3,
        );
        let s = Submission {
            gpus: &[tt_lock::GpuSpec::Auto],
            count: Some(2),
            time: &time,
            detach: &detach,
            log_dir: Path::new("/logs"),
            inner: &inner,
            command: 3,
            nodes: None,
        };
        let text = script(&s).unwrap();
        let exe = quoted(&torchtools_path());
        assert_eq!(
            text,
            format!(
                "#!/bin/sh\n\
                 #SBATCH --job-name=torchtools-python\n\
                 #SBATCH --gres=gpu:2\n\
                 #SBATCH --output=/logs/slurm-%A_%a.out\n\
                 #SBATCH --time=0-02:00:05\n\
                 #SBATCH --requeue\n\
                 #SBATCH --open-mode=append\n\
                 #SBATCH --signal=USR1@90\n\
                 #SBATCH --array=0,1,2%2\n\
                 #SBATCH --dependency=afterok:41\n\
                 exec {exe} reserve --no-fence --gpu \"$SLURM_JOB_GPUS\" --requeue -- python \
                 train.py 'it'\\''s'\n"
            )
        );
    }

    #[test]
    fn a_launch_is_one_launcher_a_node_on_that_nodes_gpus() {
        let time = TimeArgs::default();
        let detach = DetachArgs::default();
        let inner = without_detach(
            &args(&[
                "launch", "--detach", "--slurm", "--nnodes", "2", "--gpu", "auto", "--count", "4",
                "train.py",
            ]),
            1,
        );
        let s = Submission {
            gpus: &[tt_lock::GpuSpec::Auto],
            count: Some(4),
            time: &time,
            detach: &detach,
            log_dir: Path::new("/logs"),
            inner: &inner,
            command: 1,
            nodes: Some(2),
        };
        let text = script(&s).unwrap();
        let exe = quoted(&torchtools_path());
        assert!(
            text.contains("#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n"),
            "{text}"
        );
        assert!(
            text.ends_with(&format!(
                "exec srun --ntasks-per-node=1 sh -c 'exec {exe} launch --gpu \"$SLURM_STEP_GPUS\" -- train.py'\n"
            )),
            "{text}"
        );
        // Without GPUs: no gres, and no shell between srun and the launcher.
        let s = Submission { gpus: &[], ..s };
        let text = script(&s).unwrap();
        assert!(!text.contains("--gres"), "{text}");
        assert!(
            text.ends_with(&format!(
                "exec srun --ntasks-per-node=1 {exe} launch -- train.py\n"
            )),
            "{text}"
        );
    }

    #[test]
    fn what_slurm_cannot_be_asked_for_is_refused_saying_why() {
        let inner = args(&["reserve", "--", "true"]);
        let time = TimeArgs::default();
        let detach = DetachArgs::default();
        let base = Submission {
            gpus: &[tt_lock::GpuSpec::Auto],
            count: None,
            time: &time,
            detach: &detach,
            log_dir: Path::new("/logs"),
            inner: &inner,
            command: 1,
            nodes: None,
        };
        let named = [tt_lock::GpuSpec::Nvml(3)];
        let preemptible = TimeArgs {
            preemptible: true,
            ..TimeArgs::default()
        };
        let grace = TimeArgs {
            time: Some(Duration::from_secs(60)),
            grace: Some(Duration::from_secs(5)),
            ..TimeArgs::default()
        };
        let after = DetachArgs {
            after: vec!["1765000000-4242".into()],
            ..DetachArgs::default()
        };
        for (s, says) in [
            (
                Submission {
                    gpus: &named,
                    ..base
                },
                "--gpu names GPU 3 of this machine",
            ),
            (
                Submission {
                    time: &preemptible,
                    ..base
                },
                "Slurm's preemption",
            ),
            (
                Submission {
                    time: &grace,
                    ..base
                },
                "KillWait",
            ),
            (
                Submission {
                    detach: &after,
                    ..base
                },
                "not torchtools job ids",
            ),
        ] {
            let e = script(&s).unwrap_err();
            assert_eq!(e.code, crate::exit::USAGE);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }
}
