//! The fence of a shared GPU: memory no sharer budgeted is kept from processes outside
//! any reservation, and follows the ledger as sharers come and go.
//!
//! Every shared reservation with a fence runs a keeper thread; only the oldest live
//! sharer's keeper fences (the others hold nothing), so the duty passes on by itself
//! when that sharer leaves or dies. The keeper keeps free what the sharers were promised
//! and have not taken yet (each budget less its processes' GPU memory, as NVML lists
//! them) plus the margin, and fences the rest: it shrinks at once when a sharer arrives
//! or grows, and grows back when one leaves. A new sharer waits (briefly) for its
//! budget to be free before its command starts.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tt_device::{descends_from, Bytes, GpuBackend, NvmlBackend};
use tt_fence::{Fence, FenceOptions};
use tt_lock::{GpuKey, Holder, LockDir};

/// How often a keeper looks at the ledger and the GPU.
const LOOK_EVERY: Duration = Duration::from_millis(200);
/// How often a new sharer looks for its room on the GPU.
const ROOM_EVERY: Duration = Duration::from_millis(50);
/// Free memory beyond the target that is left unfenced (no churn for small changes).
const SLACK: Bytes = Bytes::mib(512);
/// How long a new sharer waits for the keeper to free its budget.
pub(crate) const ADMISSION_WAIT: Duration = Duration::from_secs(30);

/// A running keeper thread, stopped (and its fence lowered) when dropped.
#[derive(Debug)]
pub(crate) struct Keeper {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Where the keeper fences: the GPU's lock key and UUID, its CUDA ordinal here when
/// the driver shows it, and the margin left free on top of the promises.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    pub(crate) key: GpuKey,
    pub(crate) uuid: String,
    pub(crate) ordinal: Option<usize>,
    pub(crate) margin: Bytes,
}

impl Keeper {
    pub(crate) fn start(dir: LockDir, target: Target, me: Holder) -> Keeper {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("tt-share-fence".into())
            .spawn(move || keep(&dir, &target, &me, &flag))
            .ok();
        Keeper { stop, thread }
    }
}

fn keep(dir: &LockDir, target: &Target, me: &Holder, stop: &AtomicBool) {
    let backend = NvmlBackend::open();
    let mut fences: Vec<Fence> = Vec::new();
    let mut warned = false;
    while !stop.load(Ordering::SeqCst) {
        if let Err(e) = step(dir, target, me, &backend, &mut fences) {
            if !warned {
                tracing::warn!("the fence of shared {}: {e}", target.key);
                warned = true;
            }
        }
        std::thread::sleep(LOOK_EVERY);
    }
}

/// One look: step down when not the oldest sharer; else fence to the target.
fn step(
    dir: &LockDir,
    target: &Target,
    me: &Holder,
    backend: &NvmlBackend,
    fences: &mut Vec<Fence>,
) -> Result<(), String> {
    let sharers = dir.sharers(&target.key).map_err(|e| e.to_string())?;
    let is_me = |h: &Holder| {
        h.who.pid == me.who.pid && h.who.host == me.who.host && h.who.pid_ns == me.who.pid_ns
    };
    if !sharers.first().is_some_and(is_me) {
        fences.clear();
        return Ok(());
    }
    let inventory = backend.inventory();
    let Some(gpu) = inventory.gpu_of(&target.uuid) else {
        return Err("NVML does not list the GPU".into());
    };
    let own_fence: u64 = fences.iter().map(|f| f.fenced().0).sum();
    let used_by = |h: &Holder| -> u64 {
        let roots: Vec<u32> = match h.command_pid {
            Some(pid) => vec![pid],
            None => vec![h.who.pid],
        };
        let used: u64 = gpu
            .processes
            .iter()
            .filter(|p| descends_from(p.pid, &roots))
            .filter_map(|p| p.used)
            .map(|b| b.0)
            .sum();
        // The keeper's own fence is not its job's memory.
        if is_me(h) && h.command_pid.is_none() {
            used.saturating_sub(own_fence)
        } else {
            used
        }
    };
    let promised: u64 = sharers
        .iter()
        .map(|h| h.share.map_or(0, |b| b.0).saturating_sub(used_by(h)))
        .sum();
    let keep_free = promised + target.margin.0;
    let free = gpu.free.0;
    if free > keep_free + SLACK.0 {
        let options = FenceOptions {
            safety_margin: Bytes(0),
            ..FenceOptions::keep_free(Bytes(keep_free))
        };
        let fence = match target.ordinal {
            Some(ordinal) => Fence::raise(ordinal, &options),
            None => Fence::raise_on_uuid(&target.uuid, &options),
        }
        .map_err(|e| e.to_string())?;
        fences.push(fence);
    } else if free < keep_free {
        let mut short = keep_free - free;
        while short > 0 {
            let Some(fence) = fences.last_mut() else {
                break;
            };
            let freed = fence.shrink(Bytes(short)).map_err(|e| e.to_string())?;
            short = short.saturating_sub(freed.0);
            if fence.fenced().0 == 0 {
                fences.pop();
            } else if freed.0 == 0 {
                break;
            }
        }
    }
    Ok(())
}

/// Waits until `bytes` are free on the GPU (the keeper shrinks its fence for a new
/// sharer), as `machine` sees it, at most [`ADMISSION_WAIT`]; whether they were.
pub(crate) fn wait_for_room(machine: &dyn GpuBackend, uuid: &str, bytes: Bytes) -> bool {
    let start = Instant::now();
    loop {
        match machine.inventory().gpu_of(uuid).map(|g| g.free) {
            Some(f) if f >= bytes => return true,
            None => return false,
            Some(_) if start.elapsed() >= ADMISSION_WAIT => return false,
            Some(_) => std::thread::sleep(ROOM_EVERY),
        }
    }
}
