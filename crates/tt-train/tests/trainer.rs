//! The unified trainer with real processes: the same code on one process and on two
//! Gloo ranks, and preemption (SIGTERM mid-epoch) followed by an exact resume.
//!
//! Custom harness: with `TT_TRAIN_ROLE` set this binary is a training process.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tt_optim::{Optimizer, SgdConfig};
use tt_train::{Direction, Eval, FitOutcome, Precision, Steps, TrainConfig, TrainError, Trainer};

type TestResult = Result<(), String>;

const DATASET: u64 = 96;
/// Held-out samples for evaluation: 25, so two ranks get 13 and 12.
const HELD_OUT: std::ops::Range<u64> = 96..121;
const EPOCHS: u64 = 3;

fn main() {
    if let Some(role) = std::env::var_os("TT_TRAIN_ROLE") {
        let result = if role == "agree" {
            agree_process()
        } else if role == "signals" {
            signals_process()
        } else if role == "rlimit" {
            rlimit_process()
        } else {
            train_process()
        };
        let code = match result {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("training process failed: {e}");
                1
            }
        };
        std::process::exit(code);
    }
    let tests: &[(&str, tt_testkit::TestFn)] = &[
        ("one_process_and_two_ranks_train_the_same_model", same_code),
        (
            "sigterm_mid_epoch_checkpoints_and_the_restart_resumes_exactly",
            preemption,
        ),
        ("ranks_agree_on_the_smallest_adaptive_batch_size", agree),
        ("bad_configuration_is_a_clear_error", bad_config),
        (
            "a_failed_step_evaluation_or_search_keeps_the_users_error",
            step_error,
        ),
        (
            "a_loss_that_is_not_a_scalar_is_an_error_naming_its_shape",
            non_scalar_loss,
        ),
        (
            "one_process_logs_the_mean_loss_of_each_window",
            logged_losses,
        ),
        (
            "signal_handlers_are_installed_once_and_can_be_declined",
            signals,
        ),
        (
            "accumulated_micro_batches_equal_the_whole_batch",
            accumulation,
        ),
        (
            "a_hand_written_loop_of_the_building_blocks_ends_as_fit_bit_for_bit",
            building_blocks,
        ),
        (
            "two_optimizers_on_two_parameter_groups_step_together_and_resume",
            two_optimizers,
        ),
        (
            "the_adaptive_micro_batch_halves_on_out_of_memory_and_resumes_with_it",
            adaptive_micro_batch,
        ),
        (
            "two_ranks_agree_on_the_smallest_adaptive_micro_batch",
            adaptive_two_ranks,
        ),
        (
            "under_a_real_memory_limit_the_micro_batch_found_trains_as_a_fixed_one",
            adaptive_under_a_memory_limit,
        ),
        (
            "two_ranks_accumulating_equal_one_process_on_the_whole_batch",
            accumulation_two_ranks,
        ),
        (
            "gradients_are_clipped_to_the_global_norm_and_logged",
            clipping,
        ),
        (
            "random_draws_after_a_crash_and_resume_are_the_uninterrupted_runs",
            reseeding,
        ),
        (
            "evaluation_averages_every_held_out_sample_over_the_ranks",
            evaluation,
        ),
        (
            "the_best_evaluation_keeps_its_checkpoint_across_resumes",
            best_checkpoint,
        ),
        ("bf16_autocast_runs_the_forward_pass_in_bfloat16", bf16),
        (
            "fp16_loss_scaling_skips_non_finite_steps_and_resumes_its_scale",
            fp16_scaler,
        ),
        (
            "prefetched_batches_are_built_ahead_on_a_thread_and_train_as_fit_does",
            prefetch,
        ),
        (
            "a_crash_with_batches_prepared_ahead_resumes_exactly",
            prefetch_resume,
        ),
        (
            "metrics_go_to_tensorboard_files_and_an_svg_loss_curve",
            tensorboard_and_curve,
        ),
        ("the_progress_bar_is_drawn_on_a_terminal_only", progress_bar),
        (
            "a_learning_rate_schedule_is_stepped_logged_and_resumed",
            lr_schedule,
        ),
        (
            "a_run_ending_at_a_periodic_checkpoint_writes_it_once",
            final_checkpoint_once,
        ),
        (
            "loggers_hear_of_each_checkpoint_once_it_is_durable",
            checkpoints_reported,
        ),
    ];
    tt_testkit::run_tests(tests);
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Sample `i`'s features and target: a fixed function of the index.
fn sample(indices: &[u64], device: tch::Device) -> (Tensor, Tensor) {
    let idx: Vec<f32> = indices.iter().map(|&i| i as f32).collect();
    let i = Tensor::from_slice(&idx).to_device(device).unsqueeze(1);
    let freq = Tensor::arange(8, (Kind::Float, device)).unsqueeze(0) + 1.0;
    let x = (&i * &freq * 0.05).sin();
    let y = (&i * 0.1).cos();
    (x, y)
}

/// Two ranks that found different batch sizes start from the smallest, through
/// tt-adaptive's agreement hook.
fn agree_process() -> TestResult {
    let trainer = Trainer::from_env(TrainConfig::new(DATASET, 4, 1)).map_err(|e| e.to_string())?;
    let rank = trainer.group().rank();
    let adaptive = tt_adaptive::Adaptive::new().agree(trainer.batch_agreement());
    let mine = 64 - 10 * rank;
    let mut started = None;
    adaptive
        .batch(mine, |size| -> Result<(), String> {
            started.get_or_insert(size);
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    match started {
        Some(54) => Ok(()),
        other => Err(format!("rank {rank} started from {other:?}, want 54")),
    }
}

fn train_process() -> TestResult {
    let batch: usize = var("TT_BATCH")
        .ok_or("TT_BATCH unset")?
        .parse()
        .map_err(|e| format!("TT_BATCH: {e}"))?;
    let mut cfg = TrainConfig::new(DATASET, batch, EPOCHS).seed(7);
    cfg = cfg.log_every(4);
    if let Some(dir) = var("TT_CKPT") {
        cfg = cfg.checkpoints(dir, 5);
    }
    if let Some(k) = var("TT_ACCUM") {
        cfg = cfg.accumulate(k.parse().map_err(|e| format!("TT_ACCUM: {e}"))?);
    }
    let evaluating = var("TT_EVAL").is_some();
    // "LIMIT0,LIMIT1": rank r's step runs out of memory above LIMITr samples.
    let oom_above: Option<usize> = match var("TT_OOM_ABOVE") {
        Some(limits) => {
            cfg = cfg.adaptive_micro_batch(true);
            let rank: usize = var("RANK").and_then(|r| r.parse().ok()).unwrap_or(0);
            let limit = limits
                .split(',')
                .nth(rank)
                .ok_or("TT_OOM_ABOVE: no limit for this rank")?;
            Some(limit.parse().map_err(|e| format!("TT_OOM_ABOVE: {e}"))?)
        }
        None => None,
    };
    let micro_seen = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let mut trainer = Trainer::from_env(cfg).map_err(|e| e.to_string())?;
    let rank = trainer.group().rank();
    // Different seeds per rank: the trainer's DDP broadcast must align them.
    tch::manual_seed(42 + rank as i64);
    let mut vs = nn::VarStore::new(trainer.device());
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 8, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 16, 1, Default::default()));
    let mut opt = Optimizer::sgd(
        &vs,
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    if let (Some(out), 0) = (var("TT_OUT"), rank) {
        // The starting point (every replica starts from rank 0's), to prove training moved.
        vs.save(format!("{out}.init.safetensors"))
            .map_err(|e| e.to_string())?;
    }
    let slow = var("TT_SLOW_MS").map(|v| Duration::from_millis(v.parse().unwrap_or(0)));
    let progress = var("TT_PROGRESS").map(PathBuf::from);
    let step = |ctx: &tt_train::StepContext<'_>| {
        if let Some(d) = slow {
            std::thread::sleep(d);
        }
        if let (Some(p), 0) = (&progress, rank) {
            let _ = std::fs::write(p, ctx.step.to_string());
        }
        if let Some(limit) = oom_above {
            if ctx.indices.len() > limit {
                return Err(tch::TchError::Torch(
                    "CUDA out of memory. Tried to allocate 20.00 MiB (a stand-in)".into(),
                ));
            }
            if ctx.step > 0 {
                micro_seen.borrow_mut().insert(ctx.micro_batches);
            }
        }
        let (x, y) = sample(ctx.indices, ctx.device);
        net.forward(&x).f_mse_loss(&y, tch::Reduction::Mean)
    };
    let eval = |ctx: &tt_train::StepContext<'_>| {
        let (x, y) = sample(ctx.indices, ctx.device);
        net.forward(&x).f_mse_loss(&y, tch::Reduction::Mean)
    };
    let mut work = Steps::new(step);
    if evaluating {
        work = work.eval(Eval::lower_is_better(4, HELD_OUT, batch, eval));
    }
    let report = trainer
        .fit(&mut vs, &mut opt, work)
        .map_err(|e| e.to_string())?;
    if rank == 0 && evaluating {
        println!("\n@@evals {}@@", serde_json::json!(report.evals));
    }
    if oom_above.is_some() {
        println!("\n@@micro {:?}@@", micro_seen.borrow());
    }
    println!(
        "\n@@outcome {:?} steps {} resumed {:?}@@",
        report.outcome, report.steps, report.resumed_from
    );
    if report.outcome == FitOutcome::Finished {
        if let Some(out) = var("TT_OUT") {
            vs.save(format!("{out}.rank{rank}.safetensors"))
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}

fn exe() -> PathBuf {
    std::env::current_exe().expect("the test binary's own path")
}

/// A training process: rank `rank` of `world` (or, with `world == 0`, a plain process
/// with no launcher variables at all).
fn spawn(rank: usize, world: usize, port: u16, batch: usize, extra: &[(&str, &Path)]) -> Child {
    piped(command("train", rank, world, port, batch, extra))
}

/// Starts `cmd` with its output piped.
fn piped(mut cmd: Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn a training process")
}

/// A process of this binary in `role` (`TT_TRAIN_ROLE`), its output not yet redirected.
fn command(
    role: &str,
    rank: usize,
    world: usize,
    port: u16,
    batch: usize,
    extra: &[(&str, &Path)],
) -> Command {
    let mut cmd = Command::new(exe());
    cmd.env("TT_TRAIN_ROLE", role)
        .env("TT_BATCH", batch.to_string())
        .env("TORCHTOOLS_DEVICE", "cpu")
        .env("TORCHTOOLS_DIST_TIMEOUT", "60");
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(v);
    }
    if world > 0 {
        cmd.env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd
}

fn finish(children: Vec<Child>) -> Result<Vec<String>, String> {
    let mut outs = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().map_err(|e| e.to_string())?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(format!(
                "process {i}: {}\n{stdout}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        outs.push(stdout);
    }
    Ok(outs)
}

fn outcome(stdout: &str) -> String {
    stdout
        .lines()
        .find(|l| l.starts_with("@@outcome"))
        .unwrap_or("no outcome line")
        .to_string()
}

fn port() -> u16 {
    tt_dist::free_port("127.0.0.1").expect("a free port")
}

/// Runs `world` ranks (0: one plain process) to the end; returns rank 0's parameters.
fn run(
    world: usize,
    batch: usize,
    extra: &[(&str, &Path)],
    out: &Path,
) -> Result<Vec<(String, Tensor)>, String> {
    run_with_outcome(world, batch, extra, out).map(|(params, _)| params)
}

/// As [`run`], with rank 0's outcome line.
fn run_with_outcome(
    world: usize,
    batch: usize,
    extra: &[(&str, &Path)],
    out: &Path,
) -> Result<(Vec<(String, Tensor)>, String), String> {
    let p = port();
    let mut all = extra.to_vec();
    all.push(("TT_OUT", out));
    let children = (0..world.max(1))
        .map(|r| spawn(r, world, p, batch, &all))
        .collect();
    let outs = finish(children)?;
    if !outcome(&outs[0]).contains("Finished") {
        return Err(format!("run ended {}", outcome(&outs[0])));
    }
    let params = Tensor::read_safetensors(format!("{}.rank0.safetensors", out.display()))
        .map_err(|e| e.to_string())?;
    Ok((params, outcome(&outs[0])))
}

/// A copy of a VarStore's parameters by name (compared by name with [`max_diff`]).
fn params_of(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    vs.variables()
        .into_iter()
        .map(|(name, t)| (name, t.copy()))
        .collect()
}

/// The largest difference between two sets of parameters of the same names; an error
/// when the sets differ (an empty set would otherwise compare as 0).
fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> Result<f64, String> {
    if a.is_empty() || a.len() != b.len() {
        return Err(format!("{} vs {} tensors", a.len(), b.len()));
    }
    let mut worst = 0.0f64;
    for (name, t) in a {
        let other = b
            .iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| format!("{name} missing"))?;
        worst = worst.max((t - &other.1).abs().max().double_value(&[]));
    }
    Ok(worst)
}

fn same_code() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    // Two ranks of 4 see, each step, the same 8 samples one process of 8 sees
    // (torch's DistributedSampler interleaves one permutation).
    let two = run(2, 4, &[], &dir.path().join("two"))?;
    let one = run(0, 8, &[], &dir.path().join("one"))?;
    let diff = max_diff(&two, &one)?;
    if diff > 1e-5 {
        return Err(format!("one process and two ranks differ by {diff}"));
    }
    // And rank 1 holds rank 0's parameters.
    let rank1 = Tensor::read_safetensors(dir.path().join("two.rank1.safetensors"))
        .map_err(|e| e.to_string())?;
    if max_diff(&two, &rank1)? != 0.0 {
        return Err("the ranks' replicas differ".into());
    }
    // And they trained: equal because both moved the same way, not because neither moved.
    let init = Tensor::read_safetensors(dir.path().join("two.init.safetensors"))
        .map_err(|e| e.to_string())?;
    let moved = max_diff(&two, &init)?;
    if moved < 1e-3 {
        return Err(format!(
            "the parameters barely moved ({moved}): no training happened"
        ));
    }
    Ok(())
}

fn preemption() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let whole = run(2, 4, &[], &dir.path().join("whole"))?;

    let ckpt = dir.path().join("ckpt");
    let progress = dir.path().join("progress");
    let p = port();
    let slow = Path::new("30");
    let extra: [(&str, &Path); 3] = [
        ("TT_CKPT", &ckpt),
        ("TT_SLOW_MS", slow),
        ("TT_PROGRESS", &progress),
    ];
    let children: Vec<Child> = (0..2).map(|r| spawn(r, 2, p, 4, &extra)).collect();
    // Mid-epoch, off the 5-step checkpoint grid: step 7 of 12 in the first epoch.
    let start = Instant::now();
    loop {
        let step: u64 = std::fs::read_to_string(&progress)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        if step >= 7 {
            break;
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err("training never reached step 7".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Only rank 1 is signalled, with Slurm's warning signal (`--signal=USR1@90`; SIGTERM
    // is the same flag, see `signals`): rank 0 must learn it and stop at the same step.
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(children[1].id() as i32, libc::SIGUSR1) };
    let outs = finish(children)?;
    for o in &outs {
        if !outcome(o).contains("Preempted") {
            return Err(format!("after SIGUSR1: {}", outcome(o)));
        }
    }
    if outcome(&outs[0]) != outcome(&outs[1]) {
        return Err(format!(
            "ranks stopped apart: {} vs {}",
            outcome(&outs[0]),
            outcome(&outs[1])
        ));
    }
    // "@@outcome Preempted steps N resumed None@@": the restart must start from N.
    let stopped_at = outcome(&outs[0])
        .split_whitespace()
        .nth(3)
        .and_then(|n| n.parse::<u64>().ok())
        .ok_or_else(|| format!("no step in {}", outcome(&outs[0])))?;
    if !(7..36).contains(&stopped_at) {
        return Err(format!("stopped at step {stopped_at}: not mid-run"));
    }
    let (resumed, said) =
        run_with_outcome(2, 4, &[("TT_CKPT", &ckpt)], &dir.path().join("resumed"))?;
    if !said.contains(&format!("resumed Some({stopped_at})")) {
        return Err(format!(
            "the restart did not resume from step {stopped_at}: {said}"
        ));
    }
    let diff = max_diff(&whole, &resumed)?;
    if diff > 1e-6 {
        return Err(format!(
            "resumed run differs from the uninterrupted one by {diff}"
        ));
    }
    Ok(())
}

fn agree() -> TestResult {
    let p = port();
    let children: Vec<Child> = (0..2)
        .map(|r| piped(command("agree", r, 2, p, 4, &[])))
        .collect();
    finish(children).map(|_| ())
}

fn bad_config() -> TestResult {
    for (cfg, word) in [
        (TrainConfig::new(0, 4, 1), "dataset_len"),
        (TrainConfig::new(10, 0, 1), "batch_size"),
    ] {
        match Trainer::with_group(cfg, tt_dist::ProcessGroup::single(), tch::Device::Cpu) {
            Err(TrainError::Config { reason: m }) if m.contains(word) => {}
            other => return Err(format!("{word}: {other:?}")),
        }
    }
    // An evaluation schedule that cannot run: refused before the first step (the
    // model untouched), naming what to give.
    let mut cfg = TrainConfig::new(64, 4, 1);
    cfg = cfg.handle_signals(false);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
    let before = vs.trainable_variables()[0].copy();
    type Loss = Result<Tensor, std::io::Error>;
    let loss = |ctx: &tt_train::StepContext<'_>| -> Loss {
        let (x, y) = sample(ctx.indices, ctx.device);
        Ok(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
    };
    for (every, held_out, batch) in [(0, 64..72, 4), (4, 64..64, 4), (4, 64..72, 0)] {
        let work = Steps::new(loss).eval(Eval::lower_is_better(every, held_out, batch, loss));
        match trainer.fit(&mut vs, &mut opt, work) {
            Err(TrainError::Config { reason: m }) if m.contains("eval: every") => {}
            other => return Err(format!("eval every {every}, batch {batch}: {other:?}")),
        }
    }
    if !vs.trainable_variables()[0].equal(&before) {
        return Err("a refused evaluation still trained".into());
    }
    Ok(())
}

/// A trainer of one process on the CPU, a linear model 8 -> 1 and SGD.
fn one_cpu_process(
    cfg: TrainConfig,
) -> Result<(Trainer, nn::VarStore, nn::Linear, Optimizer), String> {
    let mut cfg = cfg;
    cfg = cfg.progress(false); // no bar on the terminal of whoever runs the tests
    let trainer = Trainer::with_group(cfg, tt_dist::ProcessGroup::single(), tch::Device::Cpu)
        .map_err(|e| e.to_string())?;
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::linear(vs.root(), 8, 1, Default::default());
    let opt = Optimizer::sgd(&vs, SgdConfig::default()).map_err(|e| e.to_string())?;
    Ok((trainer, vs, net, opt))
}

/// The step of both loops: dropout on the input (so that the step's seed matters),
/// a linear model, the mean squared error.
fn dropout_loss(net: &nn::Linear, indices: &[u64]) -> Result<Tensor, tch::TchError> {
    let (x, y) = sample(indices, tch::Device::Cpu);
    net.forward(&x.f_dropout(0.25, true)?)
        .f_mse_loss(&y, tch::Reduction::Mean)
}

/// `fit` with shuffling, 2 micro-batches a step, clipping and dropout, against a loop
/// written by hand from the public pieces (the sampler's batches, `step_seed`,
/// `micro_batches`, DDP's `no_sync` and `backward`, `clip_grad_norm`, the optimizer):
/// the same parameters, bit for bit, and both moved from the start.
fn building_blocks() -> TestResult {
    let cfg = || {
        let mut cfg = TrainConfig::new(64, 8, 2).seed(5).accumulate(2);
        cfg = cfg.clip_grad_norm(0.05).handle_signals(false);
        cfg
    };
    tch::manual_seed(3);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg())?;
    let init = params_of(&vs);
    let work = Steps::new(|ctx| dropout_loss(&net, ctx.indices));
    trainer
        .fit(&mut vs, &mut opt, work)
        .map_err(|e| e.to_string())?;
    let by_fit = params_of(&vs);

    tch::manual_seed(3);
    let (_, vs, net, mut opt) = one_cpu_process(cfg())?;
    let mut by_hand = || -> Result<(), Box<dyn std::error::Error>> {
        let pg = tt_dist::ProcessGroup::single();
        let ddp = tt_dist::Ddp::new(&pg, &vs)?;
        let sampler = tt_sampler::DistributedSampler::new(64, 1, 0)?.with_seed(5);
        let mut batches = tt_train::EpochBatches::new(sampler, 8, 2)?;
        let params = vs.trainable_variables();
        let mut step = 0;
        while let Some(batch) = batches.next_batch()? {
            tch::manual_seed(tt_train::step_seed(5, 0, step));
            opt.zero_grad();
            let parts = tt_train::micro_batches(&batch.indices, 2);
            for (m, part) in parts.iter().enumerate() {
                let share = part.len() as f64 / batch.indices.len() as f64;
                let loss = dropout_loss(&net, part)? * share;
                if m + 1 < parts.len() {
                    ddp.no_sync(|| ddp.backward(&loss))?;
                } else {
                    ddp.backward(&loss)?;
                }
            }
            let _norm = tt_train::clip_grad_norm(&params, 0.05)?;
            opt.step()?;
            step += 1;
        }
        Ok(())
    };
    by_hand().map_err(|e| e.to_string())?;
    let hand = params_of(&vs);
    let (diff, moved) = (max_diff(&by_fit, &hand)?, max_diff(&init, &hand)?);
    if diff != 0.0 || moved == 0.0 {
        return Err(format!(
            "the hand-written loop differs from fit by {diff} (and moved {moved} from the start)"
        ));
    }
    Ok(())
}

/// A body (8 -> 16) and a head (16 -> 1), each its own parameter group and optimizer
/// (SGD at 0.01 and Adam at 0.05): `fit` steps both after each step and ends as a loop
/// written by hand stepping both (bit for bit), unlike one optimizer over everything; a
/// crash at step 6 resumed from the checkpoint at 4 (both optimizers' state) ends as the
/// uninterrupted run, bit for bit; overlapping groups are refused before any step.
fn two_optimizers() -> TestResult {
    use tt_optim::{AdamConfig, Algorithm, Schedule};
    let groups = |vs: &nn::VarStore| -> Result<Vec<Optimizer>, String> {
        let sgd = Algorithm::Sgd(SgdConfig {
            lr: 0.01,
            ..Default::default()
        });
        let adam = Algorithm::Adam(AdamConfig {
            lr: 0.05,
            ..AdamConfig::adam()
        });
        let body = Optimizer::with_params(vs, |n| n.starts_with("body."), sgd, Schedule::Constant);
        let head = Optimizer::with_params(vs, |n| n.starts_with("head."), adam, Schedule::Constant);
        Ok(vec![
            body.map_err(|e| e.to_string())?,
            head.map_err(|e| e.to_string())?,
        ])
    };
    let model = |vs: &nn::VarStore| {
        tch::manual_seed(3);
        let body = nn::linear(vs.root() / "body", 8, 16, Default::default());
        let head = nn::linear(vs.root() / "head", 16, 1, Default::default());
        move |indices: &[u64]| -> Result<Tensor, tch::TchError> {
            let (x, y) = sample(indices, tch::Device::Cpu);
            head.forward(&body.forward(&x).tanh())
                .f_mse_loss(&y, tch::Reduction::Mean)
        }
    };
    let fit = |ckpt: Option<&Path>,
               crash_at: Option<u64>,
               one: bool|
     -> Result<Vec<(String, Tensor)>, String> {
        let mut cfg = TrainConfig::new(64, 4, 1).seed(5).handle_signals(false);
        if let Some(dir) = ckpt {
            cfg = cfg.checkpoints(dir, 4);
        }
        let (mut trainer, _, _, _) = one_cpu_process(cfg)?;
        let mut vs = nn::VarStore::new(tch::Device::Cpu);
        let loss = model(&vs);
        let work = Steps::new(|ctx| {
            if Some(ctx.step) == crash_at {
                return Err(tch::TchError::Torch("crash".into()));
            }
            loss(ctx.indices)
        });
        let result = if one {
            let mut all = Optimizer::sgd(
                &vs,
                SgdConfig {
                    lr: 0.01,
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())?;
            trainer.fit(&mut vs, &mut all, work)
        } else {
            let mut opts = groups(&vs)?;
            trainer.fit(&mut vs, &mut opts, work)
        };
        match (result, crash_at) {
            (Ok(_), None) => Ok(params_of(&vs)),
            (Err(TrainError::Step { step, .. }), Some(at)) if step == at => Ok(Vec::new()),
            (other, _) => Err(format!("fit: {other:?}")),
        }
    };
    let by_fit = fit(None, None, false)?;
    // By hand: the same batches and seeds, both optimizers stepped after each step.
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let loss = model(&vs);
    let mut opts = groups(&vs)?;
    let sampler = tt_sampler::DistributedSampler::new(64, 1, 0)
        .map_err(|e| e.to_string())?
        .with_seed(5);
    let mut batches = tt_train::EpochBatches::new(sampler, 4, 1).map_err(|e| e.to_string())?;
    let mut step = 0;
    while let Some(batch) = batches.next_batch().map_err(|e| e.to_string())? {
        tch::manual_seed(tt_train::step_seed(5, 0, step));
        opts.iter_mut().for_each(Optimizer::zero_grad);
        loss(&batch.indices)
            .and_then(|l| l.f_backward())
            .map_err(|e| e.to_string())?;
        for o in &mut opts {
            o.step().map_err(|e| e.to_string())?;
        }
        step += 1;
    }
    let by_hand = params_of(&vs);
    let one = fit(None, None, true)?;
    let (diff, other) = (max_diff(&by_fit, &by_hand)?, max_diff(&by_fit, &one)?);
    if diff != 0.0 || other == 0.0 {
        return Err(format!(
            "two optimizers: {diff} from the loop by hand, {other} from one optimizer"
        ));
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (whole, crash) = (dir.path().join("whole"), dir.path().join("crash"));
    let uninterrupted = fit(Some(&whole), None, false)?;
    fit(Some(&crash), Some(6), false)?;
    let resumed = fit(Some(&crash), None, false)?;
    let diff = max_diff(&uninterrupted, &resumed)?;
    if diff != 0.0 {
        return Err(format!(
            "resumed with two optimizers: {diff} from the uninterrupted run"
        ));
    }
    // A group that names no variable is an error listing the variables.
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let _loss = model(&vs);
    let sgd = Algorithm::Sgd(SgdConfig::default());
    match Optimizer::with_params(&vs, |n| n.starts_with("neck."), sgd, Schedule::Constant) {
        Err(e) if e.to_string().contains("\"head.weight\"") => {}
        other => {
            return Err(format!(
                "an empty group: {:?}",
                other.map(|o| o.params().len())
            ))
        }
    }
    // A parameter in two groups is refused before any step.
    let (mut trainer, _, _, _) = one_cpu_process(TrainConfig::new(64, 4, 1).handle_signals(false))?;
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let loss = model(&vs);
    let all =
        |vs: &nn::VarStore| Optimizer::sgd(vs, SgdConfig::default()).map_err(|e| e.to_string());
    let mut both = [all(&vs)?, all(&vs)?];
    match trainer.fit(&mut vs, &mut both, Steps::new(|ctx| loss(ctx.indices))) {
        Err(TrainError::Config { reason: m }) if m.contains("in optimizers 0 and 1") => Ok(()),
        other => Err(format!("overlapping groups: {other:?}")),
    }
}

/// A step that runs out of memory (a stand-in for CUDA's message) above 3 samples:
/// the batch of 8 is tried whole, then 4, then trains in micro-batches of 2, exactly as
/// a fixed `accumulate(4)`; a crash at step 6 resumed from the checkpoint at 4 takes
/// the size from the checkpoint (nothing tried above it again) and ends as the
/// uninterrupted run, bit for bit; with `Steps::prefetched` the same.
fn adaptive_micro_batch() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    /// The parameters, each call's (step, samples, micro-batches), the resumed step,
    /// the reported micro-batch.
    type Fitted = (
        Vec<(String, Tensor)>,
        Vec<(u64, usize, usize)>,
        Option<u64>,
        Option<usize>,
    );
    let fit = |cfg: TrainConfig, crash_at: Option<u64>| -> Result<Fitted, String> {
        tch::manual_seed(3);
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg.handle_signals(false))?;
        let mut seen = Vec::new();
        let work = Steps::new(|ctx| {
            seen.push((ctx.step, ctx.indices.len(), ctx.micro_batches));
            if ctx.indices.len() > 3 {
                let oom = "CUDA out of memory. Tried to allocate 20.00 MiB (a stand-in)";
                return Err(tch::TchError::Torch(oom.into()));
            }
            if Some(ctx.step) == crash_at {
                return Err(tch::TchError::Torch("crash".into()));
            }
            dropout_loss(&net, ctx.indices)
        });
        let (resumed, micro) = match (trainer.fit(&mut vs, &mut opt, work), crash_at) {
            (Ok(report), None) => (report.resumed_from, report.micro_batch),
            (Err(TrainError::Step { step, .. }), Some(at)) if step == at => (None, None),
            (other, _) => return Err(format!("fit: {other:?}")),
        };
        Ok((params_of(&vs), seen, resumed, micro))
    };
    let cfg = || TrainConfig::new(64, 8, 1).seed(5);
    let (fixed, _, _, none) = fit(cfg().accumulate(4), None)?;
    let whole = dir.path().join("whole");
    let (adaptive, seen, _, micro) = fit(
        cfg().adaptive_micro_batch(true).checkpoints(&whole, 4),
        None,
    )?;
    if (none, micro) != (None, Some(2)) {
        return Err(format!(
            "reported micro-batches {none:?} (fixed), {micro:?} (adaptive)"
        ));
    }
    let tried: Vec<usize> = seen.iter().filter(|s| s.0 == 0).map(|s| s.1).collect();
    if tried[..3] != [8, 4, 2] || seen.iter().any(|s| s.0 > 0 && (s.1 != 2 || s.2 != 4)) {
        return Err(format!(
            "tried {tried:?}; the steps saw (step, samples, parts) {seen:?}"
        ));
    }
    let diff = max_diff(&fixed, &adaptive)?;
    if diff > 1e-6 {
        return Err(format!(
            "the adaptive run differs from accumulate(4) by {diff}"
        ));
    }
    let ckpt = dir.path().join("crash");
    let with_ckpt = || cfg().adaptive_micro_batch(true).checkpoints(&ckpt, 4);
    fit(with_ckpt(), Some(6))?;
    let (resumed, seen, from, micro) = fit(with_ckpt(), None)?;
    if from != Some(4) || micro != Some(2) || seen.iter().any(|s| s.1 != 2) {
        return Err(format!("resumed from {from:?}, the steps saw {seen:?}"));
    }
    let diff = max_diff(&adaptive, &resumed)?;
    if diff != 0.0 {
        return Err(format!(
            "the resumed run differs from the uninterrupted one by {diff}"
        ));
    }
    // With a loader: the tries' batches loaded before the loader starts, which then
    // splits every batch as the steps do; the same parameters, bit for bit.
    tch::manual_seed(3);
    let (mut trainer, mut vs, net, mut opt) =
        one_cpu_process(cfg().adaptive_micro_batch(true).handle_signals(false))?;
    let work = Steps::prefetched(
        |ctx| Ok::<_, tch::TchError>(ctx.indices.to_vec()),
        |_, indices: Vec<u64>| {
            if indices.len() > 3 {
                let oom = "CUDA out of memory. Tried to allocate 20.00 MiB (a stand-in)";
                return Err(tch::TchError::Torch(oom.into()));
            }
            dropout_loss(&net, &indices)
        },
    );
    let report = trainer
        .fit(&mut vs, &mut opt, work)
        .map_err(|e| e.to_string())?;
    let diff = max_diff(&adaptive, &params_of(&vs))?;
    if report.micro_batch != Some(2) || diff != 0.0 {
        return Err(format!(
            "with a loader: micro-batch {:?}, {diff} from the run without",
            report.micro_batch
        ));
    }
    Ok(())
}

/// Rank 0 fits 2 samples, rank 1 only 1: both train in micro-batches of 1 from the
/// first step on, and end as one process on the whole batch (1e-5).
fn adaptive_two_ranks() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let p = port();
    let out = dir.path().join("two");
    let extra = [
        ("TT_OOM_ABOVE", Path::new("2,1")),
        ("TT_OUT", out.as_path()),
    ];
    let outs = finish((0..2).map(|r| spawn(r, 2, p, 4, &extra)).collect())?;
    for (rank, stdout) in outs.iter().enumerate() {
        if !stdout.contains("@@micro {4}@@") {
            return Err(format!(
                "rank {rank} trained in other micro-batches:\n{stdout}"
            ));
        }
    }
    let two = Tensor::read_safetensors(format!("{}.rank0.safetensors", out.display()))
        .map_err(|e| e.to_string())?;
    let one = run(0, 8, &[], &dir.path().join("one"))?;
    let diff = max_diff(&two, &one)?;
    if diff > 1e-5 {
        return Err(format!(
            "two adaptive ranks and one process differ by {diff}"
        ));
    }
    Ok(())
}

/// Samples per step of the memory-limit test, and the hidden width that makes a whole
/// batch need about 128 MiB (its activations and their gradients, float32).
const LIMITED_BATCH: usize = 2048;
const HIDDEN: i64 = 4096;

/// The memory-limit test's training process: with `TT_ROOM_MIB` set, the step starts
/// at the whole batch under an address-space limit of that much above what the
/// process maps, and the adaptive micro-batch finds what fits (real out-of-memory
/// errors from libtorch's CPU allocator); with `TT_ACCUM`, a fixed accumulation and no
/// limit. Prints `@@micro N@@` (the micro-batches per step) and saves the parameters.
fn rlimit_process() -> TestResult {
    // Every allocation counted by the limit (one malloc arena, a fixed mmap threshold),
    // as the demo does; before any thread exists.
    // SAFETY: mallopt only sets malloc's parameters; no other thread allocates yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
    tch::set_num_threads(1);
    let out = var("TT_OUT").ok_or("TT_OUT unset")?;
    let mut cfg = TrainConfig::new(2 * LIMITED_BATCH as u64, LIMITED_BATCH, 1)
        .seed(5)
        .handle_signals(false)
        .progress(false);
    let room: Option<u64> = var("TT_ROOM_MIB").and_then(|v| v.parse().ok());
    match (room, var("TT_ACCUM")) {
        (Some(_), _) => cfg = cfg.adaptive_micro_batch(true),
        (None, Some(k)) => cfg = cfg.accumulate(k.parse().map_err(|e| format!("TT_ACCUM: {e}"))?),
        (None, None) => return Err("set TT_ROOM_MIB or TT_ACCUM".into()),
    }
    let mut trainer = Trainer::with_group(cfg, tt_dist::ProcessGroup::single(), tch::Device::Cpu)
        .map_err(|e| e.to_string())?;
    tch::manual_seed(3);
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let (l1, l2) = (
        nn::linear(vs.root() / "l1", 8, HIDDEN, Default::default()),
        nn::linear(vs.root() / "l2", HIDDEN, 1, Default::default()),
    );
    let mut opt = Optimizer::sgd(&vs, SgdConfig::default()).map_err(|e| e.to_string())?;
    // Every operation through its `f_` form: an allocation refused is an error to
    // retry smaller, not a panic.
    let loss = |indices: &[u64]| -> Result<Tensor, tch::TchError> {
        let (x, y) = sample(indices, tch::Device::Cpu);
        let h = x.f_linear(&l1.ws, l1.bs.as_ref())?.f_relu()?;
        h.f_linear(&l2.ws, l2.bs.as_ref())?
            .f_mse_loss(&y, tch::Reduction::Mean)
    };
    // One small step before the limit, so that libtorch's own buffers exist.
    loss(&[0, 1])
        .and_then(|l| l.f_backward())
        .map_err(|e| e.to_string())?;
    opt.zero_grad();
    if let Some(room) = room {
        let base = tt_adaptive::address_space_in_use().ok_or("no VmSize")?;
        tt_adaptive::set_cpu_memory_limit(Some(base + (room << 20))).map_err(|e| e.to_string())?;
    }
    let mut parts = 0;
    let work = Steps::new(|ctx| {
        parts = ctx.micro_batches;
        loss(ctx.indices)
    });
    let report = trainer.fit(&mut vs, &mut opt, work);
    tt_adaptive::set_cpu_memory_limit(None).map_err(|e| e.to_string())?;
    let report = report.map_err(|e| e.to_string())?;
    if report.steps != 2 {
        return Err(format!("{} steps", report.steps));
    }
    vs.save(format!("{out}.safetensors"))
        .map_err(|e| e.to_string())?;
    println!("\n@@micro {parts}@@");
    Ok(())
}

/// Under an address-space limit of 48 MiB above what the process maps, a whole batch
/// of 2048 (about 128 MiB of activations) does not fit: the trainer halves the
/// micro-batch on libtorch's real out-of-memory errors until one fits, and ends with
/// the parameters of a run accumulating as many fixed micro-batches (1e-6).
fn adaptive_under_a_memory_limit() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let child = |vars: &[(&str, String)], out: &Path| -> Result<String, String> {
        let mut cmd = command("rlimit", 0, 0, 0, LIMITED_BATCH, &[("TT_OUT", out)]);
        cmd.envs(vars.iter().map(|(k, v)| (k, v)));
        let outs = finish(vec![piped(cmd)])?;
        let line = outs[0].lines().find(|l| l.starts_with("@@micro "));
        Ok(line
            .ok_or_else(|| format!("no micro line: {}", outs[0]))?
            .to_owned())
    };
    let limited = dir.path().join("limited");
    let said = child(&[("TT_ROOM_MIB", "48".into())], &limited)?;
    let parts: usize = said
        .trim_start_matches("@@micro ")
        .trim_end_matches("@@")
        .parse()
        .map_err(|e| format!("{said}: {e}"))?;
    if parts < 2 {
        return Err(format!("the whole batch fit under the limit ({said})"));
    }
    let fixed = dir.path().join("fixed");
    child(&[("TT_ACCUM", parts.to_string())], &fixed)?;
    let read = |p: &Path| {
        Tensor::read_safetensors(format!("{}.safetensors", p.display())).map_err(|e| e.to_string())
    };
    let diff = max_diff(&read(&limited)?, &read(&fixed)?)?;
    if diff > 1e-6 {
        return Err(format!(
            "{parts} micro-batches found under the limit and fixed differ by {diff}"
        ));
    }
    Ok(())
}

fn step_error() -> TestResult {
    let mut cfg = TrainConfig::new(64, 4, 1);
    cfg = cfg.handle_signals(false);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
    let result = trainer.fit(
        &mut vs,
        &mut opt,
        Steps::new(|ctx| {
            if ctx.step == 2 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "shard 3 is missing",
                ));
            }
            let (x, y) = sample(ctx.indices, ctx.device);
            Ok(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
        }),
    );
    let e = match result {
        Err(e @ TrainError::Step { step: 2, .. }) => e,
        other => return Err(format!("want a step-2 error: {other:?}")),
    };
    let TrainError::Step { cause, .. } = &e else {
        return Err(format!("{e:?}"));
    };
    let io = cause
        .downcast_ref::<std::io::Error>()
        .ok_or("the step's io::Error is not its cause")?;
    // Said once: the cause is in the message, not also the source.
    if std::error::Error::source(&e).is_some() {
        return Err(format!("{e} also has a source"));
    }
    if io.kind() != std::io::ErrorKind::NotFound || !e.to_string().contains("shard 3 is missing") {
        return Err(format!("{e}: {io:?}"));
    }
    eval_and_search_errors()
}

/// `e` holds the user's `io::Error` as `cause`, said once.
fn users_error(
    e: &TrainError,
    cause: &(dyn std::error::Error + Send + Sync + 'static),
) -> TestResult {
    match cause.downcast_ref::<std::io::Error>() {
        Some(io)
            if io.to_string() == "metric shard gone" || io.to_string() == "step shard gone" => {}
        _ => {
            return Err(format!(
                "{e}: the cause is not the user's io::Error: {cause:?}"
            ))
        }
    }
    if std::error::Error::source(e).is_some() || !e.to_string().contains("shard gone") {
        return Err(format!("{e}: said twice or not at all"));
    }
    Ok(())
}

/// The evaluation's metric error and the micro-batch search's step error come back as
/// the user's own errors too: in the message once, downcastable, no `source()`.
fn eval_and_search_errors() -> TestResult {
    let (mut trainer, mut vs, net, mut opt) =
        one_cpu_process(TrainConfig::new(64, 4, 1).handle_signals(false))?;
    let step = |ctx: &tt_train::StepContext<'_>| {
        let (x, y) = sample(ctx.indices, ctx.device);
        Ok::<_, std::io::Error>(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
    };
    let metric = |_: &tt_train::StepContext<'_>| -> Result<Tensor, std::io::Error> {
        Err(std::io::Error::other("metric shard gone"))
    };
    let work = Steps::new(step).eval(Eval::lower_is_better(4, 64..72, 4, metric));
    match trainer.fit(&mut vs, &mut opt, work) {
        Err(e @ TrainError::Eval { step: 4, .. }) => {
            let TrainError::Eval { cause, .. } = &e else {
                unreachable!()
            };
            users_error(&e, cause.as_ref())?;
        }
        other => return Err(format!("want an evaluation error after step 4: {other:?}")),
    }
    let (mut trainer, mut vs, _, mut opt) = one_cpu_process(
        TrainConfig::new(64, 4, 1)
            .adaptive_micro_batch(true)
            .handle_signals(false),
    )?;
    let failing = |_: &tt_train::StepContext<'_>| -> Result<Tensor, std::io::Error> {
        Err(std::io::Error::other("step shard gone"))
    };
    match trainer.fit(&mut vs, &mut opt, Steps::new(failing)) {
        Err(
            e @ TrainError::MicroBatch {
                step: 0,
                no_fit: false,
                ..
            },
        ) => {
            let TrainError::MicroBatch { cause, .. } = &e else {
                unreachable!()
            };
            users_error(&e, cause.as_ref())
        }
        other => Err(format!("want the micro-batch search's error: {other:?}")),
    }
}

fn non_scalar_loss() -> TestResult {
    let mut cfg = TrainConfig::new(64, 4, 1);
    cfg = cfg.handle_signals(false);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
    let result = trainer.fit(
        &mut vs,
        &mut opt,
        Steps::new(|ctx| {
            let (x, y) = sample(ctx.indices, ctx.device);
            // Forgot the reduction: one loss per sample.
            Ok::<_, std::io::Error>(net.forward(&x).mse_loss(&y, tch::Reduction::None))
        }),
    );
    match result {
        Err(e @ TrainError::Step { step: 0, .. })
            if e.to_string().contains("scalar") && e.to_string().contains("[4, 1]") =>
        {
            Ok(())
        }
        other => Err(format!("want a step-0 error naming the shape: {other:?}")),
    }
}

/// The logged loss is the mean of the steps' losses since the last log line (kept on
/// the device between log lines).
fn logged_losses() -> TestResult {
    let mut cfg = TrainConfig::new(64, 4, 1);
    cfg = cfg.handle_signals(false);
    cfg = cfg.log_every(4);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
    let mut seen = Vec::new();
    let report = trainer
        .fit(
            &mut vs,
            &mut opt,
            Steps::new(|ctx| {
                let (x, y) = sample(ctx.indices, ctx.device);
                let loss = net.forward(&x).mse_loss(&y, tch::Reduction::Mean);
                seen.push(loss.double_value(&[]));
                Ok::<_, std::io::Error>(loss)
            }),
        )
        .map_err(|e| e.to_string())?;
    // 16 steps, logged at 4, 8, 12, 16.
    let want: Vec<(u64, f64)> = seen
        .chunks(4)
        .enumerate()
        .map(|(i, c)| ((i as u64 + 1) * 4, c.iter().sum::<f64>() / 4.0))
        .collect();
    if report.losses.len() != want.len() || want.len() != 4 {
        return Err(format!("logged {:?}, want {want:?}", report.losses));
    }
    for ((step, got), (want_step, want)) in report.losses.iter().zip(&want) {
        if step != want_step || (got - want).abs() > 1e-6 * want.abs().max(1.0) {
            return Err(format!("logged {:?}, want {want:?}", report.losses));
        }
    }
    Ok(())
}

/// Trainers made one after another: with `TT_HANDLE=0` none installs a handler (SIGTERM
/// then ends the process as it would without torchtools); otherwise the first installs
/// them once for the process and later ones share them.
fn signals_process() -> TestResult {
    let handle = var("TT_HANDLE").as_deref() != Some("0");
    let mut trainers = Vec::new();
    for _ in 0..3 {
        let mut cfg = TrainConfig::new(8, 4, 1);
        cfg = cfg.handle_signals(handle);
        trainers.push(
            Trainer::with_group(cfg, tt_dist::ProcessGroup::single(), tch::Device::Cpu)
                .map_err(|e| e.to_string())?,
        );
    }
    if handle {
        // The process's flag, shared by every trainer: asking again changes nothing.
        let a = tt_train::install_signal_handlers().map_err(|e| e.to_string())?;
        let b = tt_train::install_signal_handlers().map_err(|e| e.to_string())?;
        if !std::sync::Arc::ptr_eq(&a, &b) {
            return Err("a second set of handlers was installed".into());
        }
    }
    println!("ready");
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

fn signals() -> TestResult {
    use std::os::unix::process::ExitStatusExt;
    for handle in ["0", "1"] {
        let mut child = Command::new(exe())
            .env("TT_TRAIN_ROLE", "signals")
            .env("TT_HANDLE", handle)
            .env("TORCHTOOLS_DEVICE", "cpu")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| e.to_string())?;
        let out = child.stdout.take().ok_or("no stdout")?;
        tt_testkit::wait_for_line(out, "ready", Duration::from_secs(120));
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        if handle == "1" {
            // Handled: the first SIGTERM only asks to stop; the second exits 128 + 15.
            std::thread::sleep(Duration::from_millis(200));
            if child.try_wait().map_err(|e| e.to_string())?.is_some() {
                return Err("the first SIGTERM ended a process with handlers".into());
            }
            // SAFETY: as above.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        let status = child.wait().map_err(|e| e.to_string())?;
        let ok = match handle {
            "0" => status.signal() == Some(libc::SIGTERM),
            _ => status.code() == Some(128 + libc::SIGTERM),
        };
        if !ok {
            return Err(format!("TT_HANDLE={handle}: ended {status}"));
        }
    }
    Ok(())
}

/// Parameters by name, the report, the micro-batch sizes the step saw.
type Fitted = (Vec<(String, Tensor)>, tt_train::FitReport, Vec<usize>);

/// A linear model trained by one CPU process through `fit` with `cfg` (no shuffle, so
/// batch `i` is samples `4i..4i+4` when the batch is 4); returns the parameters, the
/// report and the micro-batch sizes the step function saw.
fn fit_linear(cfg: TrainConfig) -> Result<Fitted, String> {
    let mut cfg = cfg;
    cfg = cfg.shuffle(false);
    let (params, report, seen) = fit_linear_seen(cfg)?;
    Ok((params, report, seen.iter().map(Vec::len).collect()))
}

/// Parameters by name, the report, the indices of each micro-batch.
type FittedSeen = (Vec<(String, Tensor)>, tt_train::FitReport, Vec<Vec<u64>>);

/// As [`fit_linear`], in the configuration's order; returns the indices of each
/// micro-batch the step saw.
fn fit_linear_seen(cfg: TrainConfig) -> Result<FittedSeen, String> {
    let mut cfg = cfg;
    cfg = cfg.handle_signals(false);
    tch::manual_seed(3);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
    let mut seen = Vec::new();
    let report = trainer
        .fit(
            &mut vs,
            &mut opt,
            Steps::new(|ctx| {
                seen.push(ctx.indices.to_vec());
                let (x, y) = sample(ctx.indices, ctx.device);
                Ok::<_, std::io::Error>(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
            }),
        )
        .map_err(|e| e.to_string())?;
    let params = params_of(&vs);
    Ok((params, report, seen))
}

fn accumulation() -> TestResult {
    let (whole, whole_report, sizes) = fit_linear(TrainConfig::new(64, 8, 1))?;
    if sizes != vec![8; 8] {
        return Err(format!("without accumulation the step saw {sizes:?}"));
    }
    let (acc, acc_report, sizes) = fit_linear(TrainConfig::new(64, 8, 1).accumulate(3))?;
    // 8 samples in 3 parts: 3, 3, 2, each step.
    if sizes != [3, 3, 2].repeat(8) {
        return Err(format!("accumulating over 3, the step saw {sizes:?}"));
    }
    let diff = max_diff(&whole, &acc)?;
    if diff > 1e-6 || acc_report.steps != whole_report.steps {
        return Err(format!(
            "accumulated run differs by {diff} ({} vs {} steps)",
            acc_report.steps, whole_report.steps
        ));
    }
    // The logged loss is the whole batch's.
    for ((s1, l1), (s2, l2)) in whole_report.losses.iter().zip(&acc_report.losses) {
        if s1 != s2 || (l1 - l2).abs() > 1e-6 {
            return Err(format!(
                "losses {:?} vs {:?}",
                whole_report.losses, acc_report.losses
            ));
        }
    }
    // More micro-batches than samples is refused before training.
    match Trainer::with_group(
        TrainConfig::new(64, 4, 1).accumulate(5),
        tt_dist::ProcessGroup::single(),
        tch::Device::Cpu,
    ) {
        Err(e) if e.to_string().contains("accumulate is 5") => Ok(()),
        other => Err(format!("accumulate 5 of a batch of 4: {other:?}")),
    }
}

fn accumulation_two_ranks() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let two = run(
        2,
        4,
        &[("TT_ACCUM", Path::new("2"))],
        &dir.path().join("two"),
    )?;
    let one = run(0, 8, &[], &dir.path().join("one"))?;
    let diff = max_diff(&two, &one)?;
    if diff > 1e-5 {
        return Err(format!(
            "two ranks accumulating 2 micro-batches and one process differ by {diff}"
        ));
    }
    Ok(())
}

fn clipping() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let metrics = dir.path().join("metrics.jsonl");
    let max_norm = 0.05;
    let mut cfg = TrainConfig::new(64, 4, 1)
        .clip_grad_norm(max_norm)
        .metrics(&metrics);
    cfg = cfg.log_every(4);
    let (clipped, report, _) = fit_linear(cfg)?;
    // The same steps by hand with PyTorch's clip_grad_norm_ formula.
    tch::manual_seed(3);
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = nn::linear(vs.root(), 8, 1, Default::default());
    let mut opt = Optimizer::sgd(&vs, SgdConfig::default()).map_err(|e| e.to_string())?;
    let mut norms = Vec::new();
    for b in 0..16u64 {
        let idx: Vec<u64> = (4 * b..4 * b + 4).collect();
        opt.zero_grad();
        let (x, y) = sample(&idx, tch::Device::Cpu);
        net.forward(&x)
            .mse_loss(&y, tch::Reduction::Mean)
            .backward();
        let grads: Vec<Tensor> = vs.trainable_variables().iter().map(Tensor::grad).collect();
        let norm = grads
            .iter()
            .map(|g| g.square().sum(Kind::Double).double_value(&[]))
            .sum::<f64>()
            .sqrt();
        norms.push(norm);
        let coef = (max_norm / (norm + 1e-6)).min(1.0);
        tch::no_grad(|| {
            for g in &grads {
                let _ = g.shallow_clone().g_mul_scalar_(coef);
            }
        });
        opt.step().map_err(|e| e.to_string())?;
    }
    if norms.iter().all(|&n| n <= max_norm) {
        return Err(format!("no step needed clipping: {norms:?}"));
    }
    let by_hand = params_of(&vs);
    let diff = max_diff(&clipped, &by_hand)?;
    if diff > 1e-6 {
        return Err(format!(
            "clipped training differs from clip_grad_norm_ by hand by {diff}"
        ));
    }
    let (unclipped, _, _) = fit_linear(TrainConfig::new(64, 4, 1))?;
    if max_diff(&clipped, &unclipped)? < 1e-4 {
        return Err("clipping changed nothing".into());
    }
    // One metrics line per log step: its loss, the learning rate, the norm before
    // clipping of the step logged.
    let text = std::fs::read_to_string(&metrics).map_err(|e| e.to_string())?;
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).map_err(|e| format!("{e}: {l}")))
        .collect::<Result<_, _>>()?;
    if lines.len() != report.losses.len() || lines.len() != 4 {
        return Err(format!(
            "{} metrics lines for {:?}",
            lines.len(),
            report.losses
        ));
    }
    for (line, (step, loss)) in lines.iter().zip(&report.losses) {
        let norm = norms[*step as usize - 1];
        let ok = line["step"] == *step
            && line["loss"]
                .as_f64()
                .is_some_and(|l| (l - loss).abs() < 1e-12)
            && line["lr"].as_f64() == Some(SgdConfig::default().lr)
            && line["grad_norm"]
                .as_f64()
                .is_some_and(|n| (n - norm).abs() < 1e-6 * norm.max(1.0))
            && line["samples_per_s"].as_f64().is_some_and(|t| t > 0.0);
        if !ok {
            return Err(format!("metrics line {line} for step {step} (norm {norm})"));
        }
    }
    Ok(())
}

/// A step with random draws (dropout) that fails once at step 5 after a checkpoint at
/// step 4: the resumed run ends with the uninterrupted run's parameters, bit for bit.
fn reseeding() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let train = |ckpt: &Path,
                 fail_at: Option<u64>,
                 reseed: bool|
     -> Result<Vec<(String, Tensor)>, String> {
        let mut cfg = TrainConfig::new(64, 4, 1).checkpoints(ckpt, 2);
        cfg = cfg.handle_signals(false);
        cfg = cfg.seed_every_step(reseed);
        tch::manual_seed(3); // the same initial parameters in every run
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
        let result = trainer.fit(
            &mut vs,
            &mut opt,
            Steps::new(|ctx| {
                if Some(ctx.step) == fail_at {
                    return Err(std::io::Error::other("crash"));
                }
                let (x, y) = sample(ctx.indices, ctx.device);
                let x = x.dropout(0.5, true);
                Ok(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
            }),
        );
        match (result, fail_at) {
            (Ok(_), None) | (Err(TrainError::Step { .. }), Some(_)) => {}
            (other, _) => return Err(format!("fit: {other:?}")),
        }
        let params = params_of(&vs);
        Ok(params)
    };
    for reseed in [true, false] {
        let whole = train(&dir.path().join(format!("whole-{reseed}")), None, reseed)?;
        let ckpt = dir.path().join(format!("crash-{reseed}"));
        train(&ckpt, Some(5), reseed)?;
        // Some other random draws between the crash and the restart.
        let _ = Tensor::rand([100], (Kind::Float, tch::Device::Cpu));
        let resumed = train(&ckpt, None, reseed)?;
        let diff = max_diff(&whole, &resumed)?;
        match (reseed, diff == 0.0) {
            (true, true) | (false, false) => {}
            (true, false) => return Err(format!("the resumed run differs by {diff}")),
            (false, true) => {
                return Err(
                    "without reseeding the resumed run should differ (is dropout on?)".into(),
                )
            }
        }
    }
    Ok(())
}

/// Rank 0's `@@evals [[step, value], ...]@@` line.
fn evals_of(stdout: &str) -> Result<Vec<(u64, f64)>, String> {
    let line = stdout
        .lines()
        .find_map(|l| {
            l.strip_prefix("@@evals ")
                .and_then(|l| l.strip_suffix("@@"))
        })
        .ok_or_else(|| format!("no evals line in {stdout}"))?;
    serde_json::from_str(line).map_err(|e| format!("{e}: {line}"))
}

fn evaluation() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let eval = [("TT_EVAL", Path::new("1"))];
    let mut lines = Vec::new();
    for (world, batch, name) in [(2, 4, "two"), (0, 8, "one")] {
        let p = port();
        let mut all = eval.to_vec();
        let out = dir.path().join(name);
        all.push(("TT_OUT", &out));
        let children = (0..world.max(1))
            .map(|r| spawn(r, world, p, batch, &all))
            .collect();
        let outs = finish(children)?;
        lines.push(evals_of(&outs[0])?);
    }
    let (two, one) = (&lines[0], &lines[1]);
    // Every 4 of the 36 steps.
    let steps: Vec<u64> = one.iter().map(|e| e.0).collect();
    if steps != (1..=9).map(|i| i * 4).collect::<Vec<_>>() || two.len() != one.len() {
        return Err(format!("evaluations at {steps:?} and {two:?}"));
    }
    for ((s2, v2), (s1, v1)) in two.iter().zip(one) {
        if s2 != s1 || (v2 - v1).abs() > 1e-6 * v1.abs().max(1.0) {
            return Err(format!("two ranks evaluated {two:?}, one process {one:?}"));
        }
    }
    // The last one is the final model's mean squared error over all 25 samples.
    let params = Tensor::read_safetensors(dir.path().join("one.rank0.safetensors"))
        .map_err(|e| e.to_string())?;
    let mut vs = nn::VarStore::new(tch::Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "l1", 8, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&root / "l2", 16, 1, Default::default()));
    vs.load(dir.path().join("one.rank0.safetensors"))
        .map_err(|e| e.to_string())?;
    if params.len() != 4 {
        return Err(format!("{} tensors saved", params.len()));
    }
    let idx: Vec<u64> = HELD_OUT.collect();
    let (x, y) = sample(&idx, tch::Device::Cpu);
    let want =
        tch::no_grad(|| net.forward(&x).mse_loss(&y, tch::Reduction::Mean)).double_value(&[]);
    let got = one[one.len() - 1].1;
    if (got - want).abs() > 1e-6 * want.max(1e-3) {
        return Err(format!(
            "final evaluation {got}, the model's error over the held-out set {want}"
        ));
    }
    Ok(())
}

fn best_checkpoint() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let ckpt = dir.path().join("ckpt");
    let fit = |epochs: u64| -> Result<tt_train::FitReport, String> {
        let mut cfg = TrainConfig::new(64, 4, epochs).checkpoints(&ckpt, 4);
        cfg = cfg.handle_signals(false);
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
        let step = |ctx: &tt_train::StepContext<'_>| {
            let (x, y) = sample(ctx.indices, ctx.device);
            Ok::<_, std::io::Error>(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
        };
        // A metric that is best at step 8 and worse ever after.
        let metric = |ctx: &tt_train::StepContext<'_>| {
            Ok::<_, std::io::Error>(Tensor::from((ctx.step as f64 - 8.0).abs() + 1.0))
        };
        let work = Steps::new(step).eval(Eval::lower_is_better(4, 64..72, 4, metric));
        trainer
            .fit(&mut vs, &mut opt, work)
            .map_err(|e| e.to_string())
    };
    let first = fit(1)?;
    if first.best != Some((8, 1.0)) || first.evals.len() != 4 {
        return Err(format!("best {:?} of {:?}", first.best, first.evals));
    }
    let best_steps = |d: &Path| -> Result<Vec<u64>, String> {
        let entries = tt_ckpt::CheckpointDir::open(d)
            .and_then(|c| c.list())
            .map_err(|e| e.to_string())?;
        Ok(entries.iter().map(|e| e.step).collect())
    };
    if best_steps(&ckpt.join("best"))? != vec![8] {
        return Err(format!("best/ holds {:?}", best_steps(&ckpt.join("best"))?));
    }
    // Resumed for a second epoch: every new evaluation is worse; the best stays.
    let second = fit(2)?;
    if second.resumed_from != Some(16) || second.best != Some((8, 1.0)) {
        return Err(format!(
            "resumed {:?}, best {:?}",
            second.resumed_from, second.best
        ));
    }
    if best_steps(&ckpt.join("best"))? != vec![8] || best_steps(&ckpt)?.last() != Some(&32) {
        return Err(format!(
            "best/ {:?}, latest {:?}",
            best_steps(&ckpt.join("best"))?,
            best_steps(&ckpt)?
        ));
    }
    // A NaN evaluation (a diverged model) is never the best, even as the first one;
    // with higher is better (an accuracy), the best is the highest.
    for (direction, want) in [
        (Direction::LowerIsBetter, (8, 8.0)),
        (Direction::HigherIsBetter, (16, 16.0)),
    ] {
        let mut cfg = TrainConfig::new(64, 4, 1);
        cfg = cfg.handle_signals(false);
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
        let step = |ctx: &tt_train::StepContext<'_>| {
            let (x, y) = sample(ctx.indices, ctx.device);
            Ok::<_, std::io::Error>(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
        };
        let metric = |ctx: &tt_train::StepContext<'_>| {
            let value = if ctx.step == 4 {
                f64::NAN
            } else {
                ctx.step as f64
            };
            Ok::<_, std::io::Error>(Tensor::from(value))
        };
        let work = Steps::new(step).eval(Eval::new(4, 64..72, 4, direction, metric));
        let report = trainer
            .fit(&mut vs, &mut opt, work)
            .map_err(|e| e.to_string())?;
        if report.best != Some(want) {
            return Err(format!(
                "{direction:?}, a NaN first evaluation: best {:?} of {:?}, want {want:?}",
                report.best, report.evals
            ));
        }
    }
    Ok(())
}

fn bf16() -> TestResult {
    type Bf16Run = (Vec<(String, Tensor)>, Vec<Kind>);
    let fit = |precision: Precision| -> Result<Bf16Run, String> {
        let mut cfg = TrainConfig::new(64, 8, 2).precision(precision);
        cfg = cfg.handle_signals(false);
        cfg = cfg.shuffle(false);
        tch::manual_seed(3);
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
        let mut kinds = Vec::new();
        trainer
            .fit(
                &mut vs,
                &mut opt,
                Steps::new(|ctx| {
                    let (x, y) = sample(ctx.indices, ctx.device);
                    let out = net.forward(&x);
                    kinds.push(out.kind());
                    Ok::<_, std::io::Error>(
                        out.to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean),
                    )
                }),
            )
            .map_err(|e| e.to_string())?;
        let params = params_of(&vs);
        Ok((params, kinds))
    };
    let (full, kinds) = fit(Precision::Full)?;
    if kinds.iter().any(|&k| k != Kind::Float) {
        return Err(format!("full precision ran in {kinds:?}"));
    }
    let (half, kinds) = fit(Precision::Bf16)?;
    if kinds.len() != 16 || kinds.iter().any(|&k| k != Kind::BFloat16) {
        return Err(format!("bf16 ran in {kinds:?}"));
    }
    // Parameters stay float32; the result is near full precision's, not equal.
    if half.iter().any(|(_, t)| t.kind() != Kind::Float) {
        return Err("bf16 training changed the parameters' dtype".into());
    }
    let diff = max_diff(&full, &half)?;
    if !(diff > 0.0 && diff < 2e-2) {
        return Err(format!("bf16 and full precision differ by {diff}"));
    }
    // Autocast is off again after fit.
    let a = Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu));
    if a.matmul(&a).kind() != Kind::Float {
        return Err("autocast left on after fit".into());
    }
    Ok(())
}

/// Fp16 with a loss that is infinite at step 3: one more step is skipped than without
/// it (parameters stay finite), the scale ends halved, and a crash-and-resume keeps
/// the scale.
fn fp16_scaler() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    type Fp16Run = (tt_train::FitReport, Vec<(String, Tensor)>);
    let fit = |ckpt: &Path, inf_at: Option<u64>, fail_at: Option<u64>| -> Result<Fp16Run, String> {
        let mut cfg = TrainConfig::new(64, 4, 1)
            .precision(Precision::Fp16)
            .checkpoints(ckpt, 2);
        cfg = cfg.handle_signals(false);
        tch::manual_seed(3);
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
        let report = trainer.fit(
            &mut vs,
            &mut opt,
            Steps::new(|ctx| {
                if Some(ctx.step) == fail_at {
                    return Err(std::io::Error::other("crash"));
                }
                let (x, y) = sample(ctx.indices, ctx.device);
                let loss = net
                    .forward(&x)
                    .to_kind(Kind::Float)
                    .mse_loss(&y, tch::Reduction::Mean);
                Ok(if Some(ctx.step) == inf_at {
                    loss * f64::INFINITY
                } else {
                    loss
                })
            }),
        );
        let params = params_of(&vs);
        match (report, fail_at) {
            (Ok(r), None) => Ok((r, params)),
            (Err(TrainError::Step { .. }), Some(_)) => Err("crashed".into()),
            (other, _) => Err(format!("fit: {other:?}")),
        }
    };
    // Without the infinite loss: GradScaler's first steps overflow float16 at 65536 and
    // are skipped until the scale fits.
    let (plain, _) = fit(&dir.path().join("plain"), None, None)?;
    let plain_scale = plain.loss_scale.ok_or("no loss scale reported")?;
    let (whole, params) = fit(&dir.path().join("whole"), Some(12), None)?;
    if whole.skipped_steps != plain.skipped_steps + 1 || whole.loss_scale != Some(plain_scale / 2.0)
    {
        return Err(format!(
            "with an infinite loss: skipped {} steps, scale {:?}; without: {} and {plain_scale}",
            whole.skipped_steps, whole.loss_scale, plain.skipped_steps
        ));
    }
    if params
        .iter()
        .any(|(_, t)| t.isfinite().all().int64_value(&[]) == 0)
    {
        return Err("an infinite loss reached the parameters".into());
    }
    let ckpt = dir.path().join("crash");
    match fit(&ckpt, Some(12), Some(15)) {
        Err(e) if e == "crashed" => {}
        other => return Err(format!("the crash run: {other:?}")),
    }
    let (resumed, resumed_params) = fit(&ckpt, Some(12), None)?;
    if resumed.resumed_from != Some(14) || resumed.loss_scale != whole.loss_scale {
        return Err(format!(
            "resumed from {:?} with scale {:?}: want 14 and {:?}",
            resumed.resumed_from, resumed.loss_scale, whole.loss_scale
        ));
    }
    let diff = max_diff(&params, &resumed_params)?;
    if diff != 0.0 {
        return Err(format!("the resumed fp16 run differs by {diff}"));
    }
    Ok(())
}

/// Which micro-batches the loader has started, on which thread; a condition variable
/// tells the step when another starts.
type Started = std::sync::Arc<(
    std::sync::Mutex<Vec<(u64, usize, std::thread::ThreadId)>>,
    std::sync::Condvar,
)>;

/// `fit_prefetched` with a loader that builds the samples, against `fit` building them
/// in the step: the same parameters (shuffled, two micro-batches a step). The loader
/// runs on its own thread, and prepares the next micro-batch while the step runs: each
/// step waits (up to a minute) for the loader to start the next one, which a loader
/// called only when the step asks would never do.
fn prefetch() -> TestResult {
    let cfg = || {
        let mut cfg = TrainConfig::new(64, 8, 2).accumulate(2).seed(5);
        cfg = cfg.handle_signals(false);
        cfg
    };
    let (plain, _, plain_seen) = fit_linear_seen(cfg())?;

    tch::manual_seed(3);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg())?;
    let init = params_of(&vs);
    let started: Started = Default::default();
    let loader_log = std::sync::Arc::clone(&started);
    let total = plain_seen.len();
    let mut seen = Vec::new();
    let mut late = Vec::new();
    let report = trainer
        .fit(
            &mut vs,
            &mut opt,
            Steps::prefetched(
                move |ctx| {
                    let (log, cv) = &*loader_log;
                    if let Ok(mut log) = log.lock() {
                        log.push((ctx.step, ctx.micro_batch, std::thread::current().id()));
                    }
                    cv.notify_all();
                    let (x, y) = sample(ctx.indices, ctx.device);
                    Ok::<_, std::io::Error>((x, y, ctx.indices.to_vec()))
                },
                |ctx, (x, y, indices)| {
                    if indices != ctx.indices {
                        late.push(format!("step {} got the batch of {indices:?}", ctx.step));
                    }
                    seen.push(indices);
                    let (log, cv) = &*started;
                    let want = seen.len() + 1; // this micro-batch and the next
                                               // After one late batch, the failure is known: no more minutes of waiting.
                    if want <= total && late.is_empty() {
                        let log = log
                            .lock()
                            .map_err(|e| std::io::Error::other(e.to_string()))?;
                        let (log, timeout) = cv
                            .wait_timeout_while(log, Duration::from_secs(60), |l| l.len() < want)
                            .map_err(|e| std::io::Error::other(e.to_string()))?;
                        if timeout.timed_out() {
                            late.push(format!(
                                "step {} micro-batch {}: the next was not prepared while it ran \
                             ({} started)",
                                ctx.step,
                                ctx.micro_batch,
                                log.len()
                            ));
                        }
                    }
                    Ok(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
                },
            ),
        )
        .map_err(|e| e.to_string())?;
    if !late.is_empty() {
        return Err(late.join("\n"));
    }
    if seen != plain_seen || report.steps != 16 {
        return Err(format!(
            "{} steps; the step saw {seen:?}, fit saw {plain_seen:?}",
            report.steps
        ));
    }
    let log = started.0.lock().map_err(|e| e.to_string())?;
    let main = std::thread::current().id();
    if log.len() != total || log.iter().any(|(_, _, t)| *t == main) {
        return Err(format!(
            "the loader built {} of {total} micro-batches, on threads {:?} (this is {main:?})",
            log.len(),
            log.iter().map(|l| l.2).collect::<Vec<_>>()
        ));
    }
    let diff = max_diff(&plain, &params_of(&vs))?;
    let moved = max_diff(&init, &plain)?;
    if diff != 0.0 || moved < 1e-3 {
        return Err(format!(
            "prefetched and plain training differ by {diff} (moved {moved})"
        ));
    }
    Ok(())
}

/// A run whose loader is several micro-batches ahead crashes after a checkpoint; the
/// restart resumes at the checkpoint's step with the batches the uninterrupted run had
/// there (the checkpoint holds the position of the steps done, not of the batches
/// prepared), and ends with its parameters.
fn prefetch_resume() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    /// The parameters, each step's indices, the step resumed from.
    type Trained = (Vec<(String, Tensor)>, Vec<(u64, Vec<u64>)>, Option<u64>);
    let train = |ckpt: &Path, fail_at: Option<u64>| -> Result<Trained, String> {
        let mut cfg = TrainConfig::new(64, 4, 2).checkpoints(ckpt, 5);
        cfg = cfg.handle_signals(false);
        cfg = cfg.prefetch(6);
        tch::manual_seed(3);
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
        let mut seen = Vec::new();
        let work = Steps::prefetched(
            |ctx| Ok(sample(ctx.indices, ctx.device)),
            |ctx, (x, y)| {
                if Some(ctx.step) == fail_at {
                    return Err(std::io::Error::other("crash"));
                }
                seen.push((ctx.step, ctx.indices.to_vec()));
                Ok(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
            },
        );
        let result = trainer.fit(&mut vs, &mut opt, work);
        let resumed = match (result, fail_at) {
            (Ok(report), None) => report.resumed_from,
            (Err(TrainError::Step { step, .. }), Some(at)) if step == at => None,
            (other, _) => return Err(format!("fit: {other:?}")),
        };
        Ok((params_of(&vs), seen, resumed))
    };
    let (whole, whole_seen, _) = train(&dir.path().join("whole"), None)?;
    let ckpt = dir.path().join("crash");
    train(&ckpt, Some(7))?;
    let (resumed, resumed_seen, from) = train(&ckpt, None)?;
    if from != Some(5) || resumed_seen.as_slice() != &whole_seen[5..] {
        return Err(format!(
            "resumed from {from:?} with {resumed_seen:?}; the uninterrupted run from step 5: \
             {:?}",
            &whole_seen[5..]
        ));
    }
    let diff = max_diff(&whole, &resumed)?;
    if diff != 0.0 {
        return Err(format!("the resumed run differs by {diff}"));
    }
    Ok(())
}

/// TensorBoard's own reader (the `tensorboard` package's EventAccumulator) finds the
/// logged losses, learning rate, gradient norm, throughput and evaluations at their
/// steps; the SVG curve is well-formed XML (Python's parser) with a point per logged
/// loss and evaluation.
fn tensorboard_and_curve() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let (tb, curve) = (dir.path().join("tb"), dir.path().join("loss.svg"));
    let mut cfg = TrainConfig::new(64, 4, 1)
        .clip_grad_norm(10.0)
        .tensorboard(&tb)
        .loss_curve(&curve)
        .metrics(dir.path().join("metrics.jsonl"));
    cfg = cfg.handle_signals(false);
    cfg = cfg.log_every(4);
    let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
    let loss = |ctx: &tt_train::StepContext<'_>| {
        let (x, y) = sample(ctx.indices, ctx.device);
        net.forward(&x).f_mse_loss(&y, tch::Reduction::Mean)
    };
    let seen = Recorder::default();
    trainer.add_logger(seen.clone());
    let work = Steps::new(loss).eval(Eval::lower_is_better(6, 64..80, 4, loss));
    let report = trainer
        .fit(&mut vs, &mut opt, work)
        .map_err(|e| e.to_string())?;
    // A logger of the user's own sees what the report says, once each, in order.
    let seen = seen.0.lock().map_err(|e| e.to_string())?.clone();
    let want: Vec<String> = std::iter::once("start 0 of 16".to_owned())
        .chain(report.losses.iter().map(|(s, l)| format!("log {s} {l}")))
        .chain(report.evals.iter().map(|(s, v)| format!("eval {s} {v}")))
        .chain(std::iter::once("finish 16".to_owned()))
        .collect();
    let mut sorted: Vec<String> = seen
        .iter()
        .filter(|l| !l.starts_with("step "))
        .cloned()
        .collect();
    let last = sorted.len().saturating_sub(1);
    sorted[1.min(last)..last].sort_by_key(|l| l.starts_with("eval"));
    if sorted != want || !seen.iter().any(|l| l.starts_with("step 16")) {
        return Err(format!(
            "the user's logger saw {seen:?}; the report {want:?}"
        ));
    }
    let script = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}))
"#;
    let tb_path = tb.to_string_lossy();
    let out = tt_testkit::run_python(script, &[&tb_path]);
    let scalars: std::collections::BTreeMap<String, Vec<(u64, f64)>> =
        serde_json::from_str(out.trim()).map_err(|e| format!("{e}: {out}"))?;
    let close = |got: &[(u64, f64)], want: &[(u64, f64)]| {
        got.len() == want.len()
            && !want.is_empty()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| g.0 == w.0 && (g.1 - w.1).abs() <= 1e-6 * w.1.abs().max(1.0))
    };
    let get = |tag: &str| scalars.get(tag).cloned().unwrap_or_default();
    // 16 steps: losses at 4, 8, 12, 16; evaluations at 6, 12 and after the last.
    if !close(&get("train/loss"), &report.losses) || !close(&get("eval/metric"), &report.evals) {
        return Err(format!(
            "tensorboard has {scalars:?}; the run logged {:?} and evaluated {:?}",
            report.losses, report.evals
        ));
    }
    let steps = |tag: &str| get(tag).iter().map(|p| p.0).collect::<Vec<_>>();
    let logged: Vec<u64> = report.losses.iter().map(|p| p.0).collect();
    let lr_ok = get("train/lr")
        .iter()
        .all(|p| (p.1 - opt.lr()).abs() < 1e-9);
    let positive = |tag: &str| get(tag).iter().all(|p| p.1 > 0.0);
    if steps("train/lr") != logged
        || steps("train/grad_norm") != logged
        || steps("train/samples_per_s") != logged
        || !lr_ok
        || !positive("train/grad_norm")
        || !positive("train/samples_per_s")
    {
        return Err(format!("tensorboard has {scalars:?}"));
    }
    let script = r#"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
for p in root.iter("{http://www.w3.org/2000/svg}polyline"):
    print(p.get("class"), len(p.get("points").split()))
"#;
    let curve_path = curve.to_string_lossy();
    let out = tt_testkit::run_python(script, &[&curve_path]);
    let want = format!("loss {}\neval {}", report.losses.len(), report.evals.len());
    if out.trim() != want {
        return Err(format!("the SVG's polylines: {out}, want {want}"));
    }
    Ok(())
}

/// A one-process run whose standard error is a terminal (a pseudo-terminal) shows the
/// bar, ending at all 72 steps; the same run with standard error in a pipe prints none.
fn progress_bar() -> TestResult {
    use std::io::Read;
    use std::os::fd::{FromRawFd, OwnedFd};
    let bar = "72/72 steps";
    for terminal in [true, false] {
        let mut cmd = command("train", 0, 0, 0, 4, &[]);
        cmd.env("TERM", "xterm").stdout(Stdio::piped());
        let reader = if terminal {
            let (mut master, mut slave) = (-1, -1);
            let size = libc::winsize {
                ws_row: 24,
                ws_col: 120,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            // SAFETY: openpty writes two descriptors, which are then owned here.
            let rc = unsafe {
                libc::openpty(
                    &mut master,
                    &mut slave,
                    std::ptr::null_mut(),
                    std::ptr::null(),
                    &size,
                )
            };
            if rc != 0 {
                return Err(format!("openpty: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: fresh descriptors from openpty, owned once each.
            let (master, slave) =
                unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
            cmd.stderr(Stdio::from(slave));
            let mut master = std::fs::File::from(master);
            Some(std::thread::spawn(move || {
                let mut out = Vec::new();
                // Ends with EIO once the child, the last holder of the terminal, exits.
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = master.read(&mut buf) {
                    out.extend_from_slice(&buf[..n]);
                }
                String::from_utf8_lossy(&out).into_owned()
            }))
        } else {
            cmd.stderr(Stdio::piped());
            None
        };
        let child = cmd.spawn().map_err(|e| e.to_string())?;
        drop(cmd); // the parent's copy of the terminal's end
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        let stderr = match reader {
            Some(r) => r.join().map_err(|_| "the terminal reader panicked")?,
            None => String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        if !out.status.success()
            || !outcome(&String::from_utf8_lossy(&out.stdout)).contains("Finished")
        {
            return Err(format!("the run failed ({}): {stderr}", out.status));
        }
        match (terminal, stderr.contains(bar), stderr.contains("loss ")) {
            (true, true, true) | (false, false, false) => {}
            _ => {
                return Err(format!(
                    "standard error a terminal: {terminal}; it held:\n{stderr}"
                ))
            }
        }
    }
    Ok(())
}

/// A tt-optim schedule (torch's StepLR: halved every 4 steps) under the trainer: each
/// step's metrics line has the rate that step used, and a crash at step 6 resumed from
/// the checkpoint at 4 continues the schedule where it was (the optimizer's step count
/// is in the checkpoint), ending with the uninterrupted run's parameters, bit for bit.
fn lr_schedule() -> TestResult {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    type Run = (Vec<(String, Tensor)>, Vec<(u64, f64)>);
    let train = |name: &str, fail_at: Option<u64>| -> Result<Run, String> {
        let metrics = dir.path().join(format!("{name}.jsonl"));
        let mut cfg = TrainConfig::new(64, 4, 1)
            .checkpoints(dir.path().join(name), 4)
            .metrics(&metrics);
        cfg = cfg.handle_signals(false);
        cfg = cfg.log_every(1);
        tch::manual_seed(3);
        let (mut trainer, mut vs, net, _) = one_cpu_process(cfg)?;
        let sgd = SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        };
        let schedule = tt_optim::Schedule::Step {
            step_size: 4,
            gamma: 0.5,
        };
        let mut opt = Optimizer::new(&vs, tt_optim::Algorithm::Sgd(sgd), schedule)
            .map_err(|e| e.to_string())?;
        let result = trainer.fit(
            &mut vs,
            &mut opt,
            Steps::new(|ctx| {
                if Some(ctx.step) == fail_at {
                    return Err(std::io::Error::other("crash"));
                }
                let (x, y) = sample(ctx.indices, ctx.device);
                Ok(net.forward(&x).mse_loss(&y, tch::Reduction::Mean))
            }),
        );
        match (result, fail_at) {
            (Ok(_), None) | (Err(TrainError::Step { .. }), Some(_)) => {}
            (other, _) => return Err(format!("fit: {other:?}")),
        }
        let text = std::fs::read_to_string(&metrics).map_err(|e| e.to_string())?;
        let mut lrs = Vec::new();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
            if let (Some(step), Some(lr)) = (v["step"].as_u64(), v["lr"].as_f64()) {
                lrs.push((step, lr));
            }
        }
        Ok((params_of(&vs), lrs))
    };
    // The line after step s has the rate of the s-th step (0-based s - 1).
    let want: Vec<(u64, f64)> = (1..=16u64)
        .map(|s| (s, 0.1 * 0.5f64.powi(((s - 1) / 4) as i32)))
        .collect();
    let (whole, lrs) = train("whole", None)?;
    if lrs != want {
        return Err(format!("logged rates {lrs:?}, want {want:?}"));
    }
    train("crash", Some(6))?;
    let (resumed, lrs) = train("crash", None)?;
    // The crashed run logged steps 1 to 6; the resumed one 5 to 16.
    if lrs.len() != 6 + 12 || lrs[6..] != want[4..] {
        return Err(format!("the resumed run logged rates {lrs:?}"));
    }
    let diff = max_diff(&whole, &resumed)?;
    if diff != 0.0 {
        return Err(format!("the resumed run differs by {diff}"));
    }
    Ok(())
}

/// How many times a file named `name` was placed in `dir` (renamed there or created)
/// while `f` ran, as inotify reports it.
fn placements<T>(dir: &Path, name: &str, f: impl FnOnce() -> T) -> Result<(T, usize), String> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: inotify_init1 has no memory-safety preconditions.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if fd < 0 {
        return Err(format!("inotify: {}", std::io::Error::last_os_error()));
    }
    let path = CString::new(dir.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: fd is an inotify descriptor and path a NUL-terminated string.
    if unsafe { libc::inotify_add_watch(fd, path.as_ptr(), libc::IN_MOVED_TO | libc::IN_CREATE) }
        < 0
    {
        return Err(format!(
            "inotify watch: {}",
            std::io::Error::last_os_error()
        ));
    }
    let out = f();
    let mut count = 0;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: buf is writable for its length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        let mut at = 0;
        while at + std::mem::size_of::<libc::inotify_event>() <= n as usize {
            // SAFETY: the kernel wrote whole events; read_unaligned copes with alignment.
            let event: libc::inotify_event =
                unsafe { std::ptr::read_unaligned(buf[at..].as_ptr().cast()) };
            let start = at + std::mem::size_of::<libc::inotify_event>();
            let raw = &buf[start..start + event.len as usize];
            let len = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
            if &raw[..len] == name.as_bytes() {
                count += 1;
            }
            at = start + event.len as usize;
        }
    }
    // SAFETY: fd is ours and closed once.
    unsafe { libc::close(fd) };
    Ok((out, count))
}

/// 16 steps with a checkpoint every 4: the one of step 16, started in the background,
/// is the final checkpoint; `fit` waits for it rather than writing the same state
/// again (a second write of a GPU model's state costs as much as the first).
fn final_checkpoint_once() -> TestResult {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let ckpt = tmp.path().join("ckpt");
    std::fs::create_dir_all(&ckpt).map_err(|e| e.to_string())?;
    let cfg = TrainConfig::new(64, 4, 1).checkpoints(&ckpt, 4);
    let (fitted, placed) = placements(&ckpt, "ckpt-00000016.safetensors", || fit_linear(cfg))?;
    let (_, report, _) = fitted?;
    if report.steps != 16 {
        return Err(format!("{} steps, not 16", report.steps));
    }
    let final_path = report
        .checkpoint
        .ok_or("no final checkpoint in the report")?;
    if !final_path.ends_with("ckpt-00000016.safetensors") || !final_path.exists() {
        return Err(format!("final checkpoint {}", final_path.display()));
    }
    if placed != 1 {
        return Err(format!(
            "the checkpoint of step 16 was written {placed} times, not once"
        ));
    }
    Ok(())
}

/// Every 5 steps of 16: the background checkpoints 5, 10 and 15 and the final 16 are
/// reported to a logger once each, in order, each file there when reported; every 4:
/// 4, 8, 12 and 16 (the last periodic one is the final one, reported once).
fn checkpoints_reported() -> TestResult {
    for (every, want) in [(5, [5, 10, 15, 16]), (4, [4, 8, 12, 16])] {
        let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
        let cfg = TrainConfig::new(64, 4, 1)
            .checkpoints(tmp.path(), every)
            .keep_last(5)
            .handle_signals(false);
        let (mut trainer, mut vs, net, mut opt) = one_cpu_process(cfg)?;
        let seen = Recorder::default();
        trainer.add_logger(seen.clone());
        let work = Steps::new(|ctx| {
            let (x, y) = sample(ctx.indices, ctx.device);
            net.forward(&x).f_mse_loss(&y, tch::Reduction::Mean)
        });
        trainer
            .fit(&mut vs, &mut opt, work)
            .map_err(|e| e.to_string())?;
        let lines = seen.0.lock().map_err(|e| e.to_string())?.clone();
        let got: Vec<&String> = lines
            .iter()
            .filter(|l| l.starts_with("checkpoint"))
            .collect();
        let want: Vec<String> = want
            .iter()
            .map(|s| format!("checkpoint {s} there"))
            .collect();
        if got != want.iter().collect::<Vec<_>>() {
            return Err(format!(
                "every {every}: the logger heard {got:?}, want {want:?}"
            ));
        }
    }
    Ok(())
}

/// A logger of the user's own: every call as a line ("step N" lines for the last step).
#[derive(Clone, Default)]
struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Recorder {
    fn push(&self, line: String) {
        if let Ok(mut lines) = self.0.lock() {
            lines.push(line);
        }
    }
}

impl tt_train::Logger for Recorder {
    fn on_start(&mut self, start: &tt_train::RunStart) -> Result<(), tt_train::BoxError> {
        self.push(format!("start {} of {}", start.step, start.total_steps));
        Ok(())
    }

    fn on_step(&mut self, step: u64) {
        if step == 16 {
            self.push(format!("step {step}"));
        }
    }

    fn on_log(&mut self, r: &tt_train::LogRecord) -> Result<(), tt_train::BoxError> {
        self.push(format!("log {} {}", r.step, r.loss));
        Ok(())
    }

    fn on_eval(&mut self, r: &tt_train::EvalRecord) -> Result<(), tt_train::BoxError> {
        self.push(format!("eval {} {}", r.step, r.value));
        Ok(())
    }

    fn on_finish(&mut self, report: &tt_train::FitReport) -> Result<(), tt_train::BoxError> {
        self.push(format!("finish {}", report.steps));
        Ok(())
    }

    fn on_checkpoint(&mut self, step: u64, path: &Path) -> Result<(), tt_train::BoxError> {
        let there = if path.exists() { "there" } else { "missing" };
        self.push(format!("checkpoint {step} {there}"));
        Ok(())
    }
}
