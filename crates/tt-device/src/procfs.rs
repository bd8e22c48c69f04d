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
    // fields[0] is field 3 (state): ppid 4, session 6, utime 14, stime 15, threads 20.
    let number = |i: usize| fields.get(i)?.parse::<u64>().ok();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: u32::try_from(number(1)?).ok()?,
        session: u32::try_from(number(3)?).ok()?,
        cpu_ticks: number(11)? + number(12)?,
        threads: number(17)?,
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
        assert_eq!((s.cpu_ticks, s.threads), (10, 5));
        assert!(!s.exited());
        let zombie = text.replace(") S ", ") Z ");
        assert!(parse_stat(&zombie).unwrap().exited());
        assert_eq!(parse_stat("not a stat"), None);
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
