//! The one reader of `/proc` the crates share: a process's `stat`, `status` and
//! `cmdline`, and the system's `meminfo`. Each file has a parser of its text (for
//! readers that keep their own buffers, such as the resource tracker's sampler) and a
//! function that reads it. Nothing here needs libtorch.

use std::fs;

/// The fields of `/proc/PID/stat` the crates read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// The state letter (`R`, `S`, `Z`, ...).
    pub state: char,
    /// The parent's PID.
    pub ppid: u32,
    /// The session's ID (its leader's PID).
    pub session: u32,
    /// User and system CPU time, in clock ticks.
    pub cpu_ticks: u64,
    /// Its threads.
    pub threads: u64,
    /// When it started, in clock ticks after the machine booted (see [`started_unix`]).
    pub start_ticks: u64,
}

impl Stat {
    /// Whether it has exited and waits to be reaped (state `Z`, or `X`).
    pub fn exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

/// `/proc/PID/stat`'s text parsed; `None` when it is not such a text. The fields
/// follow the command's name, which may itself hold spaces and parentheses.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let rest = text.get(text.rfind(')')? + 1..)?;
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // fields[0] is field 3 (state): ppid 4, session 6, utime 14, stime 15, threads 20,
    // starttime 22.
    let number = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: u32::try_from(number(1)?).ok()?,
        session: u32::try_from(number(3)?).ok()?,
        cpu_ticks: number(11)? + number(12)?,
        threads: number(17)?,
        start_ticks: number(19)?,
    })
}

/// When `pid` started, in seconds since the epoch (the boot time in `/proc/stat` plus
/// its start in clock ticks), to within a clock tick; `None` when it is gone or hidden
/// from this namespace. A pid names one process only while that process lives: a pid
/// that started after a record of it was written is another process.
pub fn started_unix(pid: u32) -> Option<f64> {
    let ticks = stat(pid)?.start_ticks;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz <= 0 {
        return None;
    }
    Some(boot_unix()? as f64 + ticks as f64 / hz as f64)
}

/// The machine's boot time (`btime` in `/proc/stat`), in seconds since the epoch; read
/// once per process (it does not change).
fn boot_unix() -> Option<u64> {
    static BOOT: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *BOOT.get_or_init(|| {
        let text = fs::read_to_string("/proc/stat").ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse().ok())
    })
}

/// `/proc/PID/stat` of `pid`; `None` when it is gone or hidden from this namespace.
pub fn stat(pid: u32) -> Option<Stat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// The fields of `/proc/PID/status` the crates read (bytes for memory); a zombie has no
/// memory lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Status {
    /// The real user ID.
    pub uid: Option<u32>,
    /// Resident memory now (`VmRSS`).
    pub rss: Option<u64>,
    /// Resident memory's high-water mark (`VmHWM`).
    pub hwm: Option<u64>,
    /// The address space's size (`VmSize`).
    pub vm_size: Option<u64>,
}

/// `/proc/PID/status`'s text parsed (the lines it lacks are `None`).
pub fn parse_status(text: &str) -> Status {
    let mut st = Status::default();
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("VmRSS:") {
            st.rss = kib(v);
        } else if let Some(v) = line.strip_prefix("VmHWM:") {
            st.hwm = kib(v);
        } else if let Some(v) = line.strip_prefix("VmSize:") {
            st.vm_size = kib(v);
        } else if let Some(v) = line.strip_prefix("Uid:") {
            st.uid = v.split_whitespace().next().and_then(|u| u.parse().ok());
        }
    }
    st
}

/// `/proc/PID/status` of `pid`.
pub fn status(pid: u32) -> Option<Status> {
    Some(parse_status(
        &fs::read_to_string(format!("/proc/{pid}/status")).ok()?,
    ))
}

/// The real user ID of `pid`, from its `/proc/PID/status`; `None` when it is gone or
/// hidden from this namespace.
pub fn uid(pid: u32) -> Option<u32> {
    status(pid)?.uid
}

/// The arguments of `pid` (`/proc/PID/cmdline`, lossily UTF-8); `None` when it is gone,
/// empty for a kernel thread or a zombie.
pub fn cmdline(pid: u32) -> Option<Vec<String>> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

/// The system's memory (`/proc/meminfo`), in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meminfo {
    /// `MemTotal`.
    pub total: u64,
    /// `MemAvailable`: what new work can use.
    pub available: u64,
}

/// `/proc/meminfo`'s text parsed; `None` without both lines.
pub fn parse_meminfo(text: &str) -> Option<Meminfo> {
    let (mut total, mut available) = (None, None);
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("MemTotal:") {
            total = kib(v);
        } else if let Some(v) = line.strip_prefix("MemAvailable:") {
            available = kib(v);
        }
    }
    Some(Meminfo {
        total: total?,
        available: available?,
    })
}

/// `/proc/meminfo`.
pub fn meminfo() -> Option<Meminfo> {
    parse_meminfo(&fs::read_to_string("/proc/meminfo").ok()?)
}

/// A `/proc` value in kB (`  1234 kB`), in bytes.
pub fn kib(value: &str) -> Option<u64> {
    let n: u64 = value.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(n * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_follow_a_name_with_spaces_and_parentheses() {
        let text = "1234 (a (b) c) S 1 1234 1234 0 -1 4194304 100 0 0 0 7 3 0 0 20 0 5 0 \
                    100 1000 50 18446744073709551615";
        let s = parse_stat(text).unwrap();
        assert_eq!((s.state, s.ppid, s.session), ('S', 1, 1234));
        assert_eq!((s.cpu_ticks, s.threads, s.start_ticks), (10, 5, 100));
        assert!(!s.exited());
        let zombie = text.replace(") S ", ") Z ");
        assert!(parse_stat(&zombie).unwrap().exited());
        assert_eq!(parse_stat("not a stat"), None);
    }

    #[test]
    fn a_process_started_between_boot_and_now() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let started = started_unix(child.id());
        let _ = child.kill();
        let _ = child.wait();
        let started = started.unwrap();
        // Not before it was spawned (less btime's whole second and a tick), and not
        // long after (a generous bound for a busy machine).
        assert!(
            started > now - 2.0 && started < now + 120.0,
            "{started} vs {now}"
        );
        assert!(started_unix(u32::MAX).is_none());
    }

    #[test]
    fn status_and_meminfo_in_bytes() {
        let st = parse_status("Name:\tx\nUid:\t1000\t1000\t1000\t1000\nVmSize:\t  200 kB\nVmHWM:\t  30 kB\nVmRSS:\t  20 kB\n");
        assert_eq!(st.uid, Some(1000));
        assert_eq!(
            (st.rss, st.hwm, st.vm_size),
            (Some(20 << 10), Some(30 << 10), Some(200 << 10))
        );
        assert_eq!(parse_status("Name:\tzombie\nState:\tZ\n").rss, None);
        let m = parse_meminfo("MemTotal:  100 kB\nMemFree: 10 kB\nMemAvailable:  40 kB\n").unwrap();
        assert_eq!((m.total, m.available), (100 << 10, 40 << 10));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn this_process_is_read_from_proc() {
        let me = std::process::id();
        let s = stat(me).unwrap();
        assert_eq!(s.ppid, std::os::unix::process::parent_id());
        assert!(s.threads >= 1);
        let st = status(me).unwrap();
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        assert_eq!(st.uid, Some(uid));
        assert!(st.rss.unwrap() > 0 && st.hwm.unwrap() >= st.rss.unwrap());
        let args = cmdline(me).unwrap();
        assert_eq!(
            args.first().map(String::as_str),
            std::env::args().next().as_deref()
        );
        let m = meminfo().unwrap();
        assert!(m.total > 0 && m.available <= m.total);
    }
}
