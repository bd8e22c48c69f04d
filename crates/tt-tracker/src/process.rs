//! The kernel's exact figures for one process, shared by everything that runs and
//! measures a child (`torchtools track` / `reserve`, tt-probe): its resident memory and
//! high-water mark, resetting that mark, waiting for its end without reaping it, and
//! reaping it with `wait4`'s peak RSS.

use std::io;
use std::time::{Duration, Instant};

use crate::procfs;

/// A process's resident memory now and its high-water mark (`VmRSS`, `VmHWM`), in
/// bytes; `None` when it is gone or a zombie.
pub fn memory(pid: u32) -> Option<(u64, u64)> {
    let s = tt_device::procfs::status(pid)?;
    Some((s.rss?, s.hwm.unwrap_or(0)))
}

/// The system's memory that new work can use (`MemAvailable` of `/proc/meminfo`), in
/// bytes; `None` where it cannot be read.
pub fn available_memory() -> Option<u64> {
    tt_device::procfs::meminfo().map(|m| m.available)
}

/// Resets the high-water mark of `pid` to its current RSS (`clear_refs` 5, Linux 4.0+),
/// so that it measures from now; `false` where that is not allowed.
pub fn reset_peak(pid: u32) -> bool {
    procfs::reset_hwm(pid)
}

/// Waits until our child `pid` has ended, without reaping it (its pid stays reserved,
/// so signals sent to it meanwhile cannot reach another process). With a deadline,
/// returns `Ok(false)` once it passes with the child still running.
pub fn wait_for_exit(pid: u32, deadline: Option<Instant>) -> io::Result<bool> {
    let flags = libc::WEXITED | libc::WNOWAIT | if deadline.is_some() { libc::WNOHANG } else { 0 };
    loop {
        // SAFETY: an all-zero siginfo_t is a valid value for waitid to overwrite.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on a child of ours with a valid siginfo_t pointer.
        let rc = unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: si_pid is valid to read in a siginfo_t filled by waitid; it is 0 when
        // WNOHANG found no child ready.
        if unsafe { info.si_pid() } != 0 {
            return Ok(true);
        }
        match deadline {
            Some(d) if Instant::now() >= d => return Ok(false),
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Asks to see our child `pid` exit: ptrace's `PTRACE_SEIZE` with `PTRACE_O_TRACEEXIT`,
/// which neither stops it nor changes what it sees, so that
/// [`wait_for_exit_with_peak`] can read its own peak RSS at the moment it exits, before
/// its memory is released. Call it from the thread that will wait (ptrace's rule).
/// `false` where ptrace is not allowed (Yama's `ptrace_scope` 2 or 3, a seccomp
/// profile, a debugger already attached): the peak is then the sampled one.
pub fn watch_exit(pid: u32) -> bool {
    // SAFETY: ptrace on our own child with no pointers (the data is the options).
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_SEIZE,
            pid as libc::pid_t,
            std::ptr::null_mut::<libc::c_void>(),
            libc::PTRACE_O_TRACEEXIT as usize as *mut libc::c_void,
        )
    };
    rc == 0
}

/// [`wait_for_exit`] for a child given to [`watch_exit`] (from this thread): waits until
/// it has ended, without reaping it, passing on every signal it receives and leaving
/// its stops to it, and returns its own high-water mark of resident memory (`VmHWM`)
/// read as it exited: never its children's, which `wait4`'s `ru_maxrss` includes, nor
/// the image it had before `exec`. `None` when it ended without that stop (killed by
/// SIGKILL, or another of its threads ended the process).
pub fn wait_for_exit_with_peak(pid: u32) -> io::Result<Option<u64>> {
    let mut peak = None;
    let ptrace = |request: libc::c_uint, data: usize| {
        // SAFETY: ptrace on our own traced child, no pointers (data is a signal number).
        unsafe {
            libc::ptrace(
                request,
                pid as libc::pid_t,
                std::ptr::null_mut::<libc::c_void>(),
                data as *mut libc::c_void,
            )
        }
    };
    loop {
        // SAFETY: an all-zero siginfo_t is a valid value for waitid to overwrite.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let flags = libc::WEXITED | libc::WSTOPPED | libc::WNOWAIT | libc::__WALL;
        // SAFETY: waitid on a child of ours with a valid siginfo_t pointer.
        if unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if matches!(
            info.si_code,
            libc::CLD_EXITED | libc::CLD_KILLED | libc::CLD_DUMPED
        ) {
            return Ok(peak);
        }
        // A stop: take it (never an exit: WEXITED is not asked), then let it go on.
        // SAFETY: as above.
        let mut stop: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let flags = libc::WSTOPPED | libc::WNOHANG | libc::__WALL;
        // SAFETY: as above.
        if unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut stop, flags) } != 0 {
            continue;
        }
        // SAFETY: filled by waitid (si_pid 0: the stop went away, e.g. SIGKILL).
        if unsafe { stop.si_pid() } == 0 {
            continue;
        }
        // SAFETY: as above.
        let status = unsafe { stop.si_status() };
        let (event, signal) = (status >> 8, status & 0xff);
        if event == libc::PTRACE_EVENT_EXIT {
            let mut buf = String::new();
            peak = procfs::read_into(&format!("/proc/{pid}/status"), &mut buf)
                .then(|| procfs::parse_status(&buf))
                .flatten()
                .map(|s| s.hwm);
            // It goes on exiting, untraced.
            ptrace(libc::PTRACE_DETACH, 0);
        } else if event == libc::PTRACE_EVENT_STOP
            && matches!(
                signal,
                libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
            )
        {
            // A group stop (SIGSTOP, Ctrl-Z): it stays stopped until SIGCONT, as it
            // would untraced.
            ptrace(libc::PTRACE_LISTEN, 0);
        } else if event == libc::PTRACE_EVENT_STOP {
            // The end of a group stop (SIGCONT) reported to us: it runs again.
            ptrace(libc::PTRACE_CONT, 0);
        } else {
            // A signal on its way to it: delivered as if nobody watched.
            ptrace(libc::PTRACE_CONT, signal as usize);
        }
    }
}

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reaped {
    /// The raw wait status.
    pub status: i32,
    /// Its peak RSS (`ru_maxrss`: the largest of the child and the descendants it
    /// reaped), in bytes.
    pub max_rss: u64,
}

impl Reaped {
    /// Its exit code, when it exited.
    pub fn code(&self) -> Option<i32> {
        libc::WIFEXITED(self.status).then(|| libc::WEXITSTATUS(self.status))
    }

    /// The signal that killed it, when one did.
    pub fn signal(&self) -> Option<i32> {
        libc::WIFSIGNALED(self.status).then(|| libc::WTERMSIG(self.status))
    }

    /// The status a shell would give: the exit code, 128 + the signal, else 1.
    pub fn exit_code(&self) -> i32 {
        tt_device::shell_status(self.code(), self.signal())
    }
}

/// Reaps our child `pid` (blocking until it ends) with `wait4`, for its status and peak
/// RSS.
pub fn reap(pid: u32) -> io::Result<Reaped> {
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: wait4 on a child of ours, with valid pointers.
        let rc = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
        if rc == pid as libc::pid_t {
            return Ok(Reaped {
                status,
                max_rss: (usage.ru_maxrss.max(0) as u64) * 1024,
            });
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_reader_samples_a_live_process_and_ends_with_it() {
        let mut me = ProcessReader::open(std::process::id()).unwrap_or_else(|| panic!("self"));
        let s = me
            .read(true)
            .unwrap_or_else(|| panic!("no sample of this process"));
        assert!(s.threads >= 1 && s.rss > 0, "{s:?}");
        assert!(
            s.hwm >= s.rss,
            "the high-water mark is at least the RSS: {s:?}"
        );
        assert_eq!(
            me.read(false).map(|s| s.hwm),
            Some(0),
            "hwm only when asked"
        );
        let mut child = Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let mut reader = ProcessReader::open(child.id()).unwrap_or_else(|| panic!("child"));
        assert!(reader.read(false).is_some());
        child.kill().unwrap_or_else(|e| panic!("{e}"));
        child.wait().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(reader.read(false), None, "a reaped process gives no sample");
    }

    #[test]
    // The children are reaped by `reap` (wait4), which is what this test checks.
    #[allow(clippy::zombie_processes)]
    fn a_child_is_waited_for_then_reaped_with_its_status_and_peak() {
        let child = Command::new("sh")
            .args(["-c", "exit 3"])
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(wait_for_exit(child.id(), None).unwrap_or(false));
        // Not reaped yet: still there as a zombie.
        assert!(std::path::Path::new(&format!("/proc/{}", child.id())).exists());
        let r = reap(child.id()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.code(), r.signal(), r.exit_code()), (Some(3), None, 3));
        assert!(r.max_rss > 0);

        let child = Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let deadline = Instant::now() + Duration::from_millis(50);
        assert!(!wait_for_exit(child.id(), Some(deadline)).unwrap_or(true));
        // SAFETY: kill(2) of our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let r = reap(child.id()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((r.signal(), r.exit_code()), (Some(9), 137));
    }

    #[test]
    // Reaped by `reap`, as above.
    #[allow(clippy::zombie_processes)]
    fn a_child_that_ends_before_the_deadline_is_seen_ending() {
        // The child waits for its stdin to close, which a thread does a little later:
        // the wait must keep polling until then, well within the two-minute deadline.
        let mut child = Command::new("sh")
            .args(["-c", "read x; exit 4"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let stdin = child.stdin.take();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(stdin);
        });
        let deadline = Instant::now() + Duration::from_secs(120);
        assert!(wait_for_exit(child.id(), Some(deadline)).unwrap_or(false));
        closer
            .join()
            .unwrap_or_else(|_| panic!("the closing thread panicked"));
        let r = reap(child.id()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.code(), Some(4));
    }

    #[test]
    // Reaped by `reap`, which is what this test checks.
    #[allow(clippy::zombie_processes)]
    fn the_peak_rss_of_a_reaped_child_is_in_bytes() {
        // 64 MiB touched (a bytes object of b'1's), then an exit.
        let child = tt_testkit::python()
            .args(["-c", "b = b'1' * (64 << 20)"])
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let r = reap(child.id()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.code(), Some(0));
        let mib = r.max_rss as f64 / f64::from(1u32 << 20);
        assert!((64.0..1024.0).contains(&mib), "peak {mib:.1} MiB");
    }

    #[test]
    fn waiting_for_a_process_that_is_not_our_child_is_an_error() {
        // pid 1 is never this process's child: ECHILD, at once (not a wait for ever).
        let e = wait_for_exit(1, None).expect_err("pid 1 is not our child");
        assert_eq!(e.raw_os_error(), Some(libc::ECHILD), "{e}");
        let e = reap(1).expect_err("pid 1 is not our child");
        assert_eq!(e.raw_os_error(), Some(libc::ECHILD), "{e}");
    }

    #[test]
    fn resetting_the_peak_brings_it_down_to_the_rss_of_now() {
        // A child that held 128 MiB (two touched copies of 64 MiB), gave them back, and
        // waits: its high-water mark is far above its RSS until the reset.
        let script = "import sys\nb = bytearray(b'1' * (64 << 20))\ndel b\n\
                      print('ready', flush=True)\nsys.stdin.read()";
        let mut child = tt_testkit::python()
            .args(["-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let out = child.stdout.take().unwrap_or_else(|| panic!("no stdout"));
        tt_testkit::wait_for_line(out, "ready", Duration::from_secs(120));
        let pid = child.id();
        let mib = 1u64 << 20;
        let (rss, hwm) = memory(pid).unwrap_or_default();
        assert!(hwm >= rss + 60 * mib, "rss {rss}, peak {hwm}");
        assert!(reset_peak(pid));
        let (rss, hwm) = memory(pid).unwrap_or_default();
        assert!(
            hwm < rss + 16 * mib,
            "after the reset: rss {rss}, peak {hwm}"
        );
        drop(child.stdin.take());
        assert!(child.wait().is_ok_and(|s| s.success()));
        assert!(!reset_peak(u32::MAX), "no such process");
    }

    #[test]
    fn this_process_memory_and_peak() {
        let (rss, hwm) = memory(std::process::id()).unwrap_or_default();
        assert!(rss > 0 && hwm >= rss);
        assert_eq!(memory(u32::MAX), None);
    }
}

/// One process's `/proc` files kept open for repeated samples, as the tracker reads
/// every tracked process at every tick: re-reading an open `/proc` file (`pread` at 0)
/// gives fresh figures without an `open` and its path walk each time.
pub struct ProcessReader {
    files: procfs::ProcFiles,
    buf: String,
}

/// What one [`ProcessReader::read`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessSample {
    /// User + system CPU time, in clock ticks.
    pub cpu_ticks: u64,
    /// Threads.
    pub threads: u64,
    /// Resident memory, in bytes.
    pub rss: u64,
    /// The resident high-water mark, in bytes (0 unless asked for).
    pub hwm: u64,
}

impl ProcessReader {
    /// Opens `pid`'s files; `None` when it is gone or unreadable.
    pub fn open(pid: u32) -> Option<ProcessReader> {
        Some(ProcessReader {
            files: procfs::ProcFiles::open(pid)?,
            buf: String::new(),
        })
    }

    /// A sample now (with `hwm`, the high-water mark too, which costs a read of
    /// `status`); `None` once the process has ended.
    pub fn read(&mut self, hwm: bool) -> Option<ProcessSample> {
        let (stat, status) = self.files.read(&mut self.buf, hwm)?;
        Some(ProcessSample {
            cpu_ticks: stat.cpu_ticks,
            threads: stat.threads,
            rss: status.rss,
            hwm: status.hwm,
        })
    }
}
