use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tt_device::{Bytes, Inventory, NvmlStatus};

use crate::file::{is_linked, same_file};
use crate::queue::{Ticket, Waiter, Wants, Watch};
use crate::record::OwnRecord;
use crate::share::NotAdmitted;
use crate::{Error, GpuKey, Holder, LockDir, Result};

/// The variable through which `torchtools reserve` hands its locks to the command it
/// runs: `<lock file name>=<fd>` pairs separated by commas. A process that finds its
/// GPU's lock there uses the inherited lock instead of waiting for itself.
pub const HELD_LOCKS_ENV: &str = "TORCHTOOLS_HELD_LOCKS";

/// How to wait for a lock that someone else holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Fail at once with [`Error::WouldBlock`], naming the holder; never queues. It
    /// fails too when the GPU is free but an earlier request waits for it.
    Try,
    /// Wait in the queue as long as it takes (woken when a holder lets go or dies).
    Block,
    /// Wait in the queue at most this long, then leave it and fail with
    /// [`Error::Timeout`], naming the holder. It never returns early, and returns
    /// within a few milliseconds after the deadline.
    Timeout(Duration),
}

/// A held GPU lock: released when dropped, or by the kernel when the process dies.
#[derive(Debug)]
#[must_use = "the lock is released when it is dropped: hold it while using the GPU"]
pub struct GpuLock {
    file: File,
    key: GpuKey,
    path: PathBuf,
    holder: Holder,
    inherited: bool,
    /// Where its usage record goes (not for an inherited lock: the parent records).
    dir: Option<LockDir>,
    /// The job's exit status, for the usage record.
    status: Option<i32>,
    /// The holder's record (a sharer's is its ledger record), which says who holds
    /// the GPU: removed after the unlock in `Drop`. An inherited lock's is its
    /// parent's, kept when this one is dropped.
    record: Option<OwnRecord>,
    /// Writes that the holder is alive into its user's usage log while it is held.
    alive: Option<Alive>,
    // Declared last: dropped after the unlock in `Drop`.
    _registered: Option<Registered>,
}

/// A thread that writes [`crate::UsageEvent::Alive`] for one reservation every
/// [`crate::ALIVE_EVERY`] until it is stopped: a holder killed holding its GPU is then
/// counted until shortly after its death, from its own user's log alone.
#[derive(Debug)]
struct Alive {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How often [`Alive`] writes (shorter in this crate's tests).
fn alive_every() -> std::time::Duration {
    #[cfg(test)]
    if let Some(every) = *ALIVE_EVERY_IN_TEST
        .lock()
        .unwrap_or_else(|e| e.into_inner())
    {
        return every;
    }
    crate::ALIVE_EVERY
}

#[cfg(test)]
static ALIVE_EVERY_IN_TEST: Mutex<Option<std::time::Duration>> = Mutex::new(None);

impl Alive {
    /// Starts writing for the reservation `id` into `dir`'s log of this user; `None`
    /// (said) when no thread can be started: the reservation then counts until its
    /// holder's death is seen, or until its start plus [`crate::ALIVE_EVERY`].
    fn start(dir: LockDir, id: String) -> Option<Alive> {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let every = alive_every();
        let thread = std::thread::Builder::new()
            .name("tt-lock-alive".into())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(every)
                {
                    dir.record(&crate::usage::UsageEvent::Alive {
                        id: id.clone(),
                        time: tt_device::now_unix(),
                    });
                }
            });
        match thread {
            Ok(thread) => Some(Alive {
                stop: Some(stop),
                thread: Some(thread),
            }),
            Err(e) => {
                tracing::warn!(
                    "cannot start the thread that records this reservation as alive: {e}; \
                     if this process is killed holding the GPU, its use is counted until \
                     {}s after it began at most",
                    crate::ALIVE_EVERY.as_secs()
                );
                None
            }
        }
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The lock files this process holds (taken here, not inherited).
static HELD: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// This process's claim on one lock path, from before its lock is taken until after it
/// is released.
#[derive(Debug)]
struct Registered(PathBuf);

impl Registered {
    fn new(path: &Path) -> Option<Registered> {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        if held.iter().any(|p| p == path) {
            return None;
        }
        held.push(path.to_owned());
        Some(Registered(path.to_owned()))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
        held.retain(|p| p != &self.0);
    }
}

impl GpuLock {
    /// The GPU.
    pub fn key(&self) -> &GpuKey {
        &self.key
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The holder's record, as every user reads it (`torchtools locks`).
    pub fn holder(&self) -> &Holder {
        &self.holder
    }

    /// Whether this lock was inherited from a parent (`torchtools reserve`) rather than
    /// taken here; dropping it then leaves the parent's lock in place.
    pub fn is_inherited(&self) -> bool {
        self.inherited
    }

    /// The budget of a lock that shares the GPU ([`LockDir::lock_shared`]); `None` for
    /// an exclusive one.
    pub fn share(&self) -> Option<Bytes> {
        self.holder.share
    }

    /// Rewrites the holder record (for example to add the pid of the command the lock
    /// was handed to). The GPU field is kept.
    pub fn set_holder(&mut self, mut holder: Holder) -> Result<()> {
        holder.gpu = self.holder.gpu.clone();
        holder.usage = self.holder.usage.clone();
        holder.share = self.holder.share;
        holder.admitting = false;
        if let Some(record) = &self.record {
            record.write(&holder)?;
        }
        self.holder = holder;
        Ok(())
    }
}

impl GpuLock {
    /// The exit status of the job that used the GPU (128 + a signal's number when it
    /// was killed), for the usage log's record of this holding.
    pub fn set_exit_status(&mut self, status: i32) {
        self.status = Some(status);
    }
}

impl AsRawFd for GpuLock {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl Drop for GpuLock {
    fn drop(&mut self) {
        // No line that it is alive after its end.
        drop(self.alive.take());
        // Recorded while still held: a reader of the log never takes it for a holder
        // that died.
        if let (Some(dir), Some(id)) = (&self.dir, &self.holder.usage) {
            dir.record(&crate::usage::UsageEvent::End {
                id: id.clone(),
                time: tt_device::now_unix(),
                status: self.status,
                lost: false,
            });
        }
        if !self.inherited {
            // The record first counts for nothing (unlocked), then the GPU is let go,
            // then the record is removed, which wakes the waiters: they find the GPU
            // free, and no reader takes this holder for the next one's.
            if let Some(record) = &self.record {
                record.unlock();
            }
            // Explicit unlock: a child forked without exec may still hold a copy of the
            // descriptor, and must not keep the GPU locked after we let go. (The
            // inherited case must not unlock: the lock belongs to the parent.)
            // SAFETY: the fd is open for as long as self.file lives.
            unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
        }
        drop(self.record.take());
    }
}

/// Lets `command` inherit `locks`: their descriptors stay open across its `exec`, and
/// [`HELD_LOCKS_ENV`] tells it which they are. The GPUs stay locked for as long as
/// either this process or the command lives; a `kill -9` of this process alone does not
/// free a GPU the command still uses.
pub fn share_with(command: &mut Command, locks: &[GpuLock]) {
    let (value, fds) = inheritance(locks);
    command.env(HELD_LOCKS_ENV, value);
    // SAFETY: the closure runs in the forked child before exec and only calls fcntl,
    // which is async-signal-safe; it allocates nothing.
    unsafe {
        command.pre_exec(move || {
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// What a child needs to inherit `locks`, for a spawner that is not a
/// [`Command`] of one's own (a launcher of several processes): the value of
/// [`HELD_LOCKS_ENV`], and the descriptors to keep open across its `exec` (each lock's
/// and its holder record's, so that the record stays live, and a sharer's budget
/// counted, while the child lives).
pub fn inheritance(locks: &[GpuLock]) -> (String, Vec<RawFd>) {
    let fds = locks
        .iter()
        .flat_map(|l| {
            std::iter::once(l.as_raw_fd()).chain(l.record.as_ref().map(|r| r.as_raw_fd()))
        })
        .collect();
    let value = locks
        .iter()
        .map(|l| match &l.record {
            Some(r) => format!(
                "{}={}+{}",
                l.key.file_name(),
                l.file.as_raw_fd(),
                r.as_raw_fd()
            ),
            None => format!("{}={}", l.key.file_name(), l.file.as_raw_fd()),
        })
        .collect::<Vec<_>>()
        .join(",");
    (value, fds)
}

impl LockDir {
    /// Locks one GPU. `holder` is its holder record (its `gpu` and `user` are filled in).
    ///
    /// The request takes its place in the directory's first-come-first-served queue
    /// when it has to wait (see [`LockDir::queue`]): it is granted when the GPU is free
    /// and no earlier live request waits for it. [`Wait::Try`] never queues.
    ///
    /// If this process inherited the lock from `torchtools reserve`
    /// ([`HELD_LOCKS_ENV`]), that lock is returned at once.
    pub fn lock(&self, key: &GpuKey, wait: Wait, holder: Holder) -> Result<GpuLock> {
        let wants = Wants::Gpus {
            gpus: vec![key.clone()],
        };
        let mut locks = self.acquire(wants, wait, holder)?;
        // One GPU asked, one lock granted.
        locks.pop().ok_or(Error::AlreadyHeld { gpu: key.clone() })
    }

    /// Locks several GPUs, all or nothing: nothing is held while it waits, and it is
    /// granted when all are free and no earlier request waits for any of them, so a
    /// stream of one-GPU requests cannot starve it. A timeout covers the whole set.
    pub fn lock_many(&self, keys: &[GpuKey], wait: Wait, holder: Holder) -> Result<Vec<GpuLock>> {
        let mut keys = keys.to_vec();
        keys.sort();
        keys.dedup();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.acquire(Wants::Gpus { gpus: keys }, wait, holder)
    }

    /// Locks `count` free GPUs among those NVML lists, preferring the most free memory.
    /// All or nothing: when fewer than `count` are free it takes none, and waits as
    /// `wait` says, in the queue: it takes the free GPUs that no earlier request waits
    /// for, and no later request takes a GPU before it is served. GPUs this process
    /// already holds are not candidates.
    pub fn lock_auto(
        &self,
        inventory: &Inventory,
        count: usize,
        wait: Wait,
        holder: Holder,
    ) -> Result<Vec<GpuLock>> {
        if let NvmlStatus::Unavailable { reason } = &inventory.nvml {
            return Err(Error::NotEnoughGpus {
                count,
                reason: format!(
                    "NVML is unavailable ({reason}), so the GPUs are unknown; name them \
                     (--gpu 0) to lock by index"
                ),
            });
        }
        if inventory.gpus.len() < count || count == 0 {
            return Err(Error::NotEnoughGpus {
                count,
                reason: format!("the machine has {} GPU(s)", inventory.gpus.len()),
            });
        }
        let mut candidates: Vec<_> = inventory.gpus.iter().collect();
        candidates.sort_by(|a, b| b.free.cmp(&a.free).then(a.nvml_index.cmp(&b.nvml_index)));
        let among = candidates
            .iter()
            .map(|g| GpuKey::of_uuid(&g.uuid))
            .collect();
        self.acquire(Wants::Auto { count, among }, wait, holder)
    }

    /// Shares one GPU with other jobs by memory budget: granted when nobody holds it
    /// exclusively, `bytes` fit beside the budgets of the jobs sharing it now within
    /// `capacity` (the GPU's memory), and no earlier request in the queue waits for it.
    /// An exclusive request ([`LockDir::lock`]) waits for every sharer to leave; a
    /// sharer that dies leaves the ledger by itself. `holder`'s [`Holder::share`] is
    /// set to `bytes`; [`LockDir::sharers`] lists the sharers.
    pub fn lock_shared(
        &self,
        key: &GpuKey,
        bytes: Bytes,
        capacity: Bytes,
        wait: Wait,
        mut holder: Holder,
    ) -> Result<GpuLock> {
        let refuse = |reason: String| Error::BadShare {
            gpu: key.clone(),
            reason,
        };
        if bytes.0 == 0 {
            return Err(refuse(
                "a share of 0 bytes: give the memory the job needs".into(),
            ));
        }
        if bytes > capacity {
            return Err(refuse(format!(
                "{bytes} asked, but the GPU has {capacity}: it would wait forever"
            )));
        }
        holder.share = Some(bytes);
        holder.who.reserved = Some(bytes);
        let wants = Wants::Share {
            gpu: key.clone(),
            bytes,
            capacity,
        };
        let mut locks = self.acquire(wants, wait, holder)?;
        locks.pop().ok_or(Error::AlreadyHeld { gpu: key.clone() })
    }

    /// Every form of request goes through here: inherited locks first, then the queue.
    fn acquire(&self, wants: Wants, wait: Wait, mut holder: Holder) -> Result<Vec<GpuLock>> {
        let start = Instant::now();
        // Records name the user who writes them, whatever the caller put there: a
        // reader believes a record only when it names its file's owner.
        holder.who.user = crate::owner::name_of_uid(crate::owner::euid());
        // Only an admission marks its record as being admitted (see `share.rs`).
        holder.admitting = false;
        let (mut granted, wants) = self.take_inherited(wants, &holder)?;
        let Some(wants) = wants else {
            return Ok(granted);
        };
        let policy = self.policy();
        // Marked in its records when made under another policy file than the
        // machine's: every view says so.
        holder.who.policy = (policy.path != std::path::Path::new(crate::DEFAULT_POLICY))
            .then(|| policy.path.display().to_string());
        if let Some(reason) = crate::fair::never_served(&policy.policy.limits, &wants) {
            return Err(Error::Policy {
                path: policy.path,
                reason,
            });
        }
        // Under fair share, this user's logs summarized for readers new to them (and
        // the logs read, as a decision reads them).
        if let Some(fair) = &policy.policy.fair_share {
            if let Err(e) = self.recent_use(fair.half_life.as_secs_f64()) {
                tracing::warn!("cannot summarize the GPU usage log: {e}");
            }
        }
        let mut slots = self.slots(&wants)?;
        let mut ticket: Option<Ticket> = None;
        let mut watch: Option<std::rc::Rc<Watch>> = None;
        let me = Waiter::new(0, &holder, wants.clone());
        loop {
            let own = ticket.as_ref().map(Ticket::number);
            let queue = self.scan_queue(own)?;
            let queued = queue
                .iter()
                .filter(|w| w.who.user == holder.who.user)
                .count();
            let arrival = ticket.as_ref().map(Ticket::arrival);
            let (earlier, held) = self.earlier(queue, arrival, &slots, &policy.policy, &me)?;
            let taken = match held {
                Some(why) => Taken::Busy(Busy::held(&wants, why)),
                None => self.take(&mut slots, &wants, &earlier, &holder)?,
            };
            let busy = match taken {
                Taken::All(taken) => {
                    let linked = taken
                        .iter()
                        .map(|&i| is_linked(&slots[i].file, &slots[i].path))
                        .collect::<Result<Vec<bool>>>()?;
                    if !linked.iter().all(|&l| l) {
                        // A lock file was replaced while we waited (deleted by a /tmp
                        // cleaner and created anew): the locks are on orphans; again.
                        release(&mut slots, &taken);
                        for &i in &taken {
                            slots[i].file = self.open_file(&slots[i].key.file_name())?;
                        }
                        continue;
                    }
                    let share_of = match &wants {
                        Wants::Share { capacity, .. } => Some(capacity.0),
                        _ => None,
                    };
                    granted.extend(self.grant(slots, &taken, holder, share_of)?);
                    drop(ticket); // leaves the queue only once the GPUs are held
                    return Ok(granted);
                }
                Taken::Busy(busy) => busy,
            };
            let remaining = still_to_wait(wait, start.elapsed(), &busy, &policy.path)?;
            match &ticket {
                Some(t) if t.is_in_place() => {}
                lost => {
                    if lost.is_none() {
                        queue_room(&policy, &holder.who.user, queued)?;
                    }
                    if lost.is_some() {
                        tracing::warn!(
                            "this request's queue ticket was deleted (a /tmp cleaner?): \
                             queueing again at the end"
                        );
                    }
                    // Watch first: an event between the next scan and the wait is kept.
                    watch = Some(Watch::of(self.path()));
                    ticket = Some(self.enqueue(&holder, &wants)?);
                    tracing::info!(
                        "waiting for {}, {}; {} earlier request(s) in the queue",
                        wants,
                        match (&busy.held, &busy.holder) {
                            (Some(why), _) => why.clone(),
                            (None, Some(h)) => format!("held by {h}"),
                            (None, None) => "held by an unknown process".into(),
                        },
                        earlier.len()
                    );
                    continue;
                }
            }
            if let Some(watch) = &watch {
                watch.wait(remaining);
            }
        }
    }

    /// The requests of `queue` served before this one (`me`, arrived at `own` with its
    /// ticket, none yet: after all of them by arrival), but for those waiting for a GPU this process
    /// holds: they cannot be served before we let go, and waiting behind them would wait
    /// for ourselves. Under a `policy` that orders the queue, the order is the policy's,
    /// requests it holds back are left out (they block nobody), and the second value is
    /// why it holds this one back, if it does.
    fn earlier(
        &self,
        queue: Vec<Waiter>,
        own: Option<(crate::queue::Placed, u64)>,
        slots: &[Slot],
        policy: &crate::Policy,
        me: &Waiter,
    ) -> Result<(Vec<Waiter>, Option<String>)> {
        let ordering = policy.orders_the_queue();
        if queue.is_empty() && !(ordering && policy.limits_apply()) {
            return Ok((Vec::new(), None));
        }
        let ours = held_by_this_process(self.path(), slots);
        let not_ours = |w: &Waiter| {
            !w.wants
                .gpus()
                .iter()
                .any(|k| ours.contains(&self.path().join(k.file_name())))
        };
        if !ordering {
            let earlier = queue
                .into_iter()
                .filter(|w| own.is_none_or(|a| w.arrival() < a))
                .filter(not_ours)
                .collect();
            return Ok((earlier, None));
        }
        let (placed, mine) = own.unwrap_or(((i64::MAX, 0), u64::MAX));
        let mut all = queue;
        let mut me = me.clone();
        me.ticket = mine;
        me.placed = placed;
        all.push(me);
        let standings = self.standings(policy, &all)?;
        crate::fair::serve_order(&mut all, policy, &standings, tt_device::now_unix_secs());
        let at = all
            .iter()
            .position(|w| w.ticket == mine)
            .unwrap_or(all.len());
        let held = all.get(at).and_then(|w| w.held.clone());
        all.truncate(at);
        let earlier = all
            .into_iter()
            .filter(|w| w.held.is_none())
            .filter(not_ours)
            .collect();
        Ok((earlier, held))
    }

    /// Takes the locks inherited from `torchtools reserve`; returns them and what is
    /// left to ask for (`None`: nothing).
    fn take_inherited(
        &self,
        wants: Wants,
        holder: &Holder,
    ) -> Result<(Vec<GpuLock>, Option<Wants>)> {
        if std::env::var_os(HELD_LOCKS_ENV).is_none() {
            return Ok((Vec::new(), Some(wants)));
        }
        let mut inherited = Vec::new();
        let mut rest = Vec::new();
        for key in wants.gpus() {
            let path = self.path().join(key.file_name());
            match self.inherited(key, &path, holder)? {
                Some(lock) => inherited.push(lock),
                None => rest.push(key.clone()),
            }
        }
        let left = match wants {
            Wants::Gpus { .. } => (!rest.is_empty()).then_some(Wants::Gpus { gpus: rest }),
            share @ Wants::Share { .. } => (!rest.is_empty()).then_some(share),
            Wants::Auto { count, .. } => {
                inherited.truncate(count);
                (inherited.len() < count).then(|| Wants::Auto {
                    count: count - inherited.len(),
                    among: rest,
                })
            }
        };
        Ok((inherited, left))
    }

    /// Opens the lock file of every GPU the request may take, once for the whole wait
    /// (a file closed after each failed attempt would wake every other waiter).
    fn slots(&self, wants: &Wants) -> Result<Vec<Slot>> {
        let mut slots = Vec::new();
        for key in wants.gpus() {
            let path = self.path().join(key.file_name());
            let registered = match wants {
                // A second lock of the same file in one process would wait for itself.
                Wants::Gpus { .. } | Wants::Share { .. } => Some(
                    Registered::new(&path)
                        .ok_or_else(|| Error::AlreadyHeld { gpu: key.clone() })?,
                ),
                Wants::Auto { .. } => {
                    if is_registered(&path) {
                        continue; // held by this process already: not a candidate
                    }
                    None
                }
            };
            slots.push(Slot {
                // Its type is checked once it is locked (`len_if_linked`).
                file: self.open_file(&key.file_name())?,
                key: key.clone(),
                path,
                registered,
                share: None,
            });
        }
        if let Wants::Auto { count, among } = wants {
            if slots.len() < *count {
                return Err(Error::NotEnoughGpus {
                    count: *count,
                    reason: format!(
                        "this process already holds {} of the machine's {} GPU(s)",
                        among.len() - slots.len(),
                        among.len()
                    ),
                });
            }
        }
        Ok(slots)
    }

    /// Turns the slots taken into locks: writes the holder's record of each.
    fn grant(
        &self,
        slots: Vec<Slot>,
        taken: &[usize],
        holder: Holder,
        share_of: Option<u64>,
    ) -> Result<Vec<GpuLock>> {
        let mut slots: Vec<Option<Slot>> = slots.into_iter().map(Some).collect();
        let mut locks = Vec::with_capacity(taken.len());
        // A copy of the holder for each GPU but the last, which takes it.
        let mut holders = std::iter::repeat_n(holder, taken.len());
        for &i in taken {
            let Some(slot) = slots.get_mut(i).and_then(Option::take) else {
                continue;
            };
            let registered = match slot.registered {
                Some(r) => r,
                None => Registered::new(&slot.path).ok_or_else(|| Error::AlreadyHeld {
                    gpu: slot.key.clone(),
                })?,
            };
            let Some(mut holder) = holders.next() else {
                break;
            };
            holder.gpu = slot.key.cuda_visible_entry();
            let id = crate::usage::new_id(&holder);
            holder.usage = Some(id.clone());
            let record = match slot.share {
                Some(record) => {
                    record.write(&holder)?;
                    record
                }
                None => OwnRecord::holding(self.path(), &slot.key, &holder)?,
            };
            self.record_start(&holder, &id, share_of);
            locks.push(GpuLock {
                file: slot.file,
                key: slot.key,
                path: slot.path,
                holder,
                inherited: false,
                dir: Some(self.clone()),
                status: None,
                record: Some(record),
                alive: Alive::start(self.clone(), id),
                _registered: Some(registered),
            });
        }
        Ok(locks)
    }

    /// The lock inherited from a parent through [`HELD_LOCKS_ENV`], if it is this GPU's
    /// and its descriptor really is that lock file (`<lock file>=<fd>+<record fd>`).
    fn inherited(&self, key: &GpuKey, path: &Path, holder: &Holder) -> Result<Option<GpuLock>> {
        let Some(value) = std::env::var_os(HELD_LOCKS_ENV) else {
            return Ok(None);
        };
        let value = value.to_string_lossy();
        let held: HashMap<&str, &str> = value
            .split(',')
            .filter_map(|pair| pair.split_once('='))
            .collect();
        let Some(fds) = held.get(key.file_name().as_str()) else {
            return Ok(None);
        };
        let (lock_fd, record_fd) = match fds.split_once('+') {
            Some((lock, record)) => (lock, Some(record)),
            None => (*fds, None),
        };
        let Some(file) = lock_fd.parse::<RawFd>().ok().and_then(dup_fd) else {
            tracing::warn!("{HELD_LOCKS_ENV} names fd {lock_fd} for {key}, but it is not open");
            return Ok(None);
        };
        if !same_file(&file, path) {
            tracing::warn!("{HELD_LOCKS_ENV} names fd {lock_fd} for {key}, but it is another file");
            return Ok(None);
        }
        let record = record_fd
            .and_then(|fd| fd.parse::<RawFd>().ok())
            .and_then(dup_fd)
            .map(|f| OwnRecord::inherited(f, path));
        let holder = record
            .as_ref()
            .and_then(OwnRecord::read)
            .unwrap_or_else(|| holder.clone());
        // Alive as long as this process holds it too: its parent may be killed first.
        let alive = holder
            .usage
            .clone()
            .and_then(|id| Alive::start(self.clone(), id));
        Ok(Some(GpuLock {
            file,
            key: key.clone(),
            path: path.to_owned(),
            holder,
            inherited: true,
            dir: None,
            status: None,
            record,
            alive,
            _registered: None,
        }))
    }
}

/// A close-on-exec copy of descriptor `fd`; `None` when it is not open.
fn dup_fd(fd: RawFd) -> Option<File> {
    // SAFETY: dup of any integer is safe; it fails with EBADF if fd is not open.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    // SAFETY: `copy` is a fresh descriptor that nothing else owns.
    (copy >= 0).then(|| unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(copy) })
}

/// One GPU a request may take: its lock file, open for the whole wait.
struct Slot {
    key: GpuKey,
    path: PathBuf,
    file: File,
    /// This process's claim on the path: taken up front for named GPUs, at the grant
    /// for `auto` ones.
    registered: Option<Registered>,
    /// The ledger record of a shared request admitted by the current attempt.
    share: Option<OwnRecord>,
}

/// Refuses a new request of `user`, who has `queued` requests waiting, when the
/// policy's per-user limit on waiting requests is reached.
fn queue_room(policy: &crate::PolicyInForce, user: &str, queued: usize) -> Result<()> {
    match policy.policy.limits.queued {
        Some(limit) if queued >= limit => Err(Error::Policy {
            path: policy.path.clone(),
            reason: format!(
                "{user} has {queued} request(s) waiting, and may have at most {limit} at \
                 once: wait for one to be served, or stop one"
            ),
        }),
        _ => Ok(()),
    }
}

/// How much longer a request that found `busy` may wait, having waited `waited`: none
/// for a try (the error), none left of a time limit (the error), or the rest.
fn still_to_wait(wait: Wait, waited: Duration, busy: &Busy, policy: &Path) -> Result<Duration> {
    if let Some(why) = &busy.held {
        let waited = match wait {
            Wait::Try => None,
            Wait::Timeout(limit) if waited >= limit => Some(waited),
            Wait::Timeout(limit) => return Ok(limit - waited),
            Wait::Block => return Ok(Duration::MAX),
        };
        return Err(Error::Held {
            path: policy.to_owned(),
            reason: why.clone(),
            waited,
        });
    }
    match wait {
        Wait::Try => Err(Error::WouldBlock {
            gpu: busy.gpu.clone(),
            holder: busy.holder.clone(),
            waiting: busy.waiting,
        }),
        Wait::Timeout(limit) if waited >= limit => Err(Error::Timeout {
            gpu: busy.gpu.clone(),
            waited,
            holder: busy.holder.clone(),
            waiting: busy.waiting,
        }),
        Wait::Timeout(limit) => Ok(limit - waited),
        Wait::Block => Ok(Duration::MAX),
    }
}

/// Why a request cannot be granted now.
struct Busy {
    gpu: GpuKey,
    holder: Option<Box<Holder>>,
    waiting: usize,
    /// Why the machine's policy holds the request back, when it does.
    held: Option<String>,
}

impl Busy {
    /// A request the policy holds back (`why`), whatever its GPUs' state.
    fn held(wants: &Wants, why: String) -> Busy {
        Busy {
            gpu: wants.gpus().first().cloned().unwrap_or(GpuKey::Index(0)),
            holder: None,
            waiting: 0,
            held: Some(why),
        }
    }
}

enum Taken {
    /// The indices of the slots now locked.
    All(Vec<usize>),
    Busy(Busy),
}

impl LockDir {
    /// One attempt: the GPUs wanted that are free and that no earlier request waits
    /// for, locked without blocking, all or nothing.
    fn take(
        &self,
        slots: &mut [Slot],
        wants: &Wants,
        earlier: &[Waiter],
        holder: &Holder,
    ) -> Result<Taken> {
        let waiting_for = |key: &GpuKey| {
            earlier
                .iter()
                .filter(|w| w.wants.gpus().contains(key))
                .count()
        };
        if let (Wants::Share { capacity, .. }, [slot]) = (wants, &mut *slots) {
            let waiting = waiting_for(&slot.key);
            let refused = if waiting > 0 {
                // Behind an earlier request: whoever is there now is the holder shown.
                let sharers = self.sharers(&slot.key)?;
                NotAdmitted::Full { sharers }
            } else {
                match self.try_share(&slot.key, &slot.file, &slot.path, *capacity, holder)? {
                    Ok(record) => {
                        slot.share = Some(record);
                        return Ok(Taken::All(vec![0]));
                    }
                    Err(refused) => refused,
                }
            };
            let holder = match refused {
                NotAdmitted::Exclusive(h) => h.map(|h| *h),
                NotAdmitted::Full { sharers } => sharers
                    .into_iter()
                    .next()
                    .or_else(|| self.holder_of(&slot.key)),
            };
            return Ok(Taken::Busy(Busy {
                gpu: slot.key.clone(),
                holder: holder.map(Box::new),
                waiting,
                held: None,
            }));
        }
        take_exclusive(self, slots, wants, &waiting_for)
    }
}

/// The exclusive form of [`LockDir::take`].
fn take_exclusive(
    dir: &LockDir,
    slots: &mut [Slot],
    wants: &Wants,
    waiting_for: &dyn Fn(&GpuKey) -> usize,
) -> Result<Taken> {
    let count = match wants {
        Wants::Gpus { .. } | Wants::Share { .. } => slots.len(),
        Wants::Auto { count, .. } => *count,
    };
    let mut taken = Vec::with_capacity(count);
    // The slots passed over, in the order of preference. Who holds them is read only
    // after the pass: a pass of lock attempts alone takes microseconds, so an `auto`
    // request that finds its first choice busy does not find a later one let go by
    // the same holder an instant after.
    let mut passed = Vec::new();
    for (i, slot) in slots.iter().enumerate() {
        if waiting_for(&slot.key) == 0 && try_flock(&slot.file, &slot.path)? {
            taken.push(i);
            if taken.len() == count {
                if matches!(wants, Wants::Auto { .. }) {
                    prefer_let_go(slots, &mut taken, &passed, waiting_for)?;
                }
                return Ok(Taken::All(taken));
            }
            continue;
        }
        passed.push(i);
        if matches!(wants, Wants::Gpus { .. }) {
            break; // all or nothing: one busy GPU is enough to wait
        }
    }
    release(slots, &taken);
    let Some(slot) = passed.first().map(|&i| &slots[i]) else {
        return Ok(Taken::Busy(Busy {
            gpu: slots.first().map_or(GpuKey::Index(0), |s| s.key.clone()),
            holder: None,
            waiting: 0,
            held: None,
        }));
    };
    let waiting = waiting_for(&slot.key);
    // Who is in the way, read from the records and the kernel's lock table: never by
    // probing the lock itself, whose shared lock, however brief, would make an earlier
    // request's try-lock fail at that instant (an `auto` request then took another GPU
    // than the one it was first in line for).
    let holder = match (dir.holder_of(&slot.key), waiting) {
        (Some(h), _) => Some(h),
        // Not held exclusively, yet not free: shared (the oldest sharer shown).
        (None, 0) => dir.sharers(&slot.key)?.into_iter().next(),
        // Free, but earlier requests wait for it.
        (None, _) => None,
    };
    Ok(Taken::Busy(Busy {
        gpu: slot.key.clone(),
        holder: holder.map(Box::new),
        waiting,
        held: None,
    }))
}

/// An `auto` request's last look at the GPUs it preferred but found busy (`passed`):
/// one let go since (a holder of several lets them go one after the other) replaces
/// the least preferred GPU taken, so that the request gets the GPUs with the most free
/// memory whenever they are free together.
fn prefer_let_go(
    slots: &mut [Slot],
    taken: &mut Vec<usize>,
    passed: &[usize],
    waiting_for: &dyn Fn(&GpuKey) -> usize,
) -> Result<()> {
    for &better in passed {
        let Some(&worst) = taken.last() else { break };
        if better > worst {
            break;
        }
        let slot = &slots[better];
        if waiting_for(&slot.key) == 0 && try_flock(&slot.file, &slot.path)? {
            release(slots, &[worst]);
            taken.pop();
            taken.push(better);
            taken.sort_unstable();
        }
    }
    Ok(())
}

/// Unlocks the slots of a failed attempt (their files stay open), and removes the
/// ledger record of a shared one.
fn release(slots: &mut [Slot], taken: &[usize]) {
    for &i in taken {
        // SAFETY: the fd is open for as long as the slot lives.
        unsafe { libc::flock(slots[i].file.as_raw_fd(), libc::LOCK_UN) };
        slots[i].share = None;
    }
}

/// Whether this process holds (or is taking) the lock at `path`.
fn is_registered(path: &Path) -> bool {
    let held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    held.iter().any(|p| p == path)
}

/// The lock files this process holds, its own request's aside: those taken here and
/// those inherited from `torchtools reserve` (named relative to `dir`).
fn held_by_this_process(dir: &Path, slots: &[Slot]) -> Vec<PathBuf> {
    let held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    let mut paths: Vec<PathBuf> = held
        .iter()
        .filter(|p| !slots.iter().any(|s| &s.path == *p))
        .cloned()
        .collect();
    drop(held);
    if let Some(value) = std::env::var_os(HELD_LOCKS_ENV) {
        let value = value.to_string_lossy();
        paths.extend(
            value
                .split(',')
                .filter_map(|pair| pair.split_once('='))
                .map(|(name, _)| dir.join(name)),
        );
    }
    paths
}

fn try_flock(file: &File, path: &Path) -> Result<bool> {
    // SAFETY: the fd is open for the duration of the call.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        Some(libc::EINTR) => Ok(false),
        _ => Err(Error::Io {
            op: "locking",
            path: path.to_owned(),
            cause: e,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_says_it_is_alive_until_it_is_released_and_never_after() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        *ALIVE_EVERY_IN_TEST.lock().unwrap() = Some(std::time::Duration::from_millis(20));
        let lock = dir
            .lock(&GpuKey::Index(0), Wait::Try, Holder::current())
            .unwrap();
        *ALIVE_EVERY_IN_TEST.lock().unwrap() = None;
        let id = lock.holder().usage.clone().unwrap();
        let log = dir.usage_log_path(crate::owner::euid());
        let lines = || -> Vec<crate::UsageEvent> {
            std::fs::read_to_string(&log)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        let is_alive =
            |e: &crate::UsageEvent| matches!(e, crate::UsageEvent::Alive { id: i, .. } if *i == id);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while lines().iter().filter(|e| is_alive(e)).count() < 2 {
            assert!(std::time::Instant::now() < deadline, "{:?}", lines());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        drop(lock);
        let after_end: Vec<_> = lines()
            .into_iter()
            .skip_while(|e| !matches!(e, crate::UsageEvent::End { .. }))
            .collect();
        assert!(!after_end.is_empty(), "{:?}", lines());
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(
            !lines()
                .iter()
                .skip_while(|e| !matches!(e, crate::UsageEvent::End { .. }))
                .any(is_alive),
            "{:?}",
            lines()
        );
        // Read back: the reservation ended, its last sign of life kept.
        let usage = dir.usage().unwrap();
        let r = usage.records.iter().find(|r| r.id == id).unwrap();
        assert!(
            r.ended_unix.is_some() && !r.lost && r.alive.is_some(),
            "{r:?}"
        );
    }

    #[test]
    fn a_holder_with_a_long_command_line_is_read_back_by_every_reader() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = LockDir::open(tmp.path().join("locks")).unwrap();
        // 800 file names of 100 bytes: a record of 80 KB, more than a reader reads.
        let command: Vec<String> = (0..800).map(|i| format!("{i:0>100}")).collect();
        let lock = dir
            .lock(
                &GpuKey::Index(0),
                Wait::Try,
                Holder::current().running(command.clone()),
            )
            .unwrap();
        let state = dir.list().unwrap();
        let holder = state[0]
            .holder
            .as_ref()
            .expect("the holder's record is read");
        let shown = &holder.who.command;
        assert!(shown.len() > 100 && shown[..shown.len() - 1] == command[..shown.len() - 1]);
        assert_eq!(
            shown.last().unwrap(),
            &format!(
                "… ({} more arguments not recorded)",
                800 - (shown.len() - 1)
            )
        );
        // The usage log's start line too: the log reads on past it.
        drop(lock);
        let usage = dir.usage().unwrap();
        assert_eq!(usage.skipped, Vec::<String>::new());
        assert!(usage.records[0].ended_unix.is_some() && usage.records[0].command == *shown);
    }
}
