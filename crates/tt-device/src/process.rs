//! Which processes run under which: the one place that walks `/proc`'s parent links
//! (the GPU views that credit a GPU process to a reservation use it).

/// Whether `pid` is one of `roots` or descends from one, through the parent links of
/// `/proc/PID/stat` (at most 128 generations; PID 1 ends the walk). A process that is
/// gone, or a PID this PID namespace cannot see, descends from nothing.
pub fn descends_from(pid: u32, roots: &[u32]) -> bool {
    let mut pid = pid;
    for _ in 0..128 {
        if roots.contains(&pid) {
            return true;
        }
        match parent_of(pid) {
            Some(parent) if parent > 1 => pid = parent,
            _ => return false,
        }
    }
    false
}

/// The inode of the machine's first PID namespace (the kernel's `PROC_PID_INIT_INO`),
/// the one that sees every process.
pub const INITIAL_PID_NAMESPACE: u64 = 0xEFFF_FFFC;

/// This process's PID namespace: the inode in `/proc/self/ns/pid` (`pid:[4026531836]`);
/// `None` where it cannot be read. Read once (views compare every record with it).
pub fn own_pid_namespace() -> Option<u64> {
    static OWN: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| {
        let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
        link.to_str()?
            .strip_prefix("pid:[")?
            .strip_suffix(']')?
            .parse()
            .ok()
    })
}

/// Whether this process runs in a PID namespace other than the machine's first (a
/// container), where PIDs from the host (or NVML) may name other processes or none;
/// `false` where the namespace cannot be read.
pub fn in_a_pid_namespace() -> bool {
    own_pid_namespace().is_some_and(|ns| ns != INITIAL_PID_NAMESPACE)
}

/// The parent of `pid`, from `/proc/PID/stat`.
pub fn parent_of(pid: u32) -> Option<u32> {
    crate::procfs::stat(pid).map(|s| s.ppid)
}

#[cfg(test)]
mod tests {
    use super::{descends_from, in_a_pid_namespace, own_pid_namespace, parent_of};

    #[test]
    fn ancestry_is_read_from_proc() {
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        assert_eq!(parent_of(me), Some(parent));
        assert!(descends_from(me, &[me]));
        assert!(descends_from(me, &[parent]));
        assert!(!descends_from(parent, &[me]));
        assert!(!descends_from(u32::MAX, &[me]), "no such process");
    }

    #[test]
    fn the_pid_namespace_is_the_inode_of_proc_self_ns_pid() {
        use std::os::unix::fs::MetadataExt;
        let inode = std::fs::metadata("/proc/self/ns/pid").unwrap().ino();
        assert_eq!(own_pid_namespace(), Some(inode));
        assert_eq!(in_a_pid_namespace(), inode != super::INITIAL_PID_NAMESPACE);
    }
}

/// Seconds since the Unix epoch, now (0 on a clock set before 1970): the one clock the
/// usage records, jobs and reports share.
pub fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's name (`gethostname`, the kernel's), or `None` when it cannot be
/// read. The one reader of it: records, checkpoints' temporary files, TensorBoard's
/// file names and the network interface choice all name the host by it.
pub fn host_name_if_known() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length. (A name cut at its end may lack the NUL:
    // the search below then takes the whole buffer.)
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned()).filter(|h| !h.is_empty())
}

/// [`host_name_if_known`], or `localhost` when it cannot be read.
pub fn host_name() -> String {
    host_name_if_known().unwrap_or_else(|| "localhost".to_owned())
}

/// [`host_name`] as a part of a file's name: each path separator (`/`, `\`) made `_`.
/// The one rule for every file named after its host (checkpoints' temporary files,
/// TensorBoard's event files).
pub fn host_name_for_files() -> String {
    host_name().replace(['/', '\\'], "_")
}

/// The kernel's boot id (`/proc/sys/kernel/random/boot_id`), empty when it cannot be
/// read: another one than a record's means the machine rebooted since.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// [`now_unix`] in whole seconds, as the lock records (`since_unix`) count time.
pub fn now_unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The status a shell gives a process that ended with exit `code` or by `signal`: the
/// code, 128 + the signal's number, else 1. The one rule behind every exit status the
/// command passes on (a launch's, a job's, a tracked command's).
pub fn shell_status(code: Option<i32>, signal: Option<i32>) -> i32 {
    match (code, signal) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 1,
    }
}

/// Sysexits' `EX_TEMPFAIL` (75), "try again later": the status of a job that stopped
/// to come back (a preempted rank after its checkpoint) and of a request that gave up
/// waiting for its GPUs (`--timeout`).
pub const EX_TEMPFAIL: i32 = 75;

#[cfg(test)]
mod status_tests {
    #[test]
    fn the_status_is_the_code_else_128_plus_the_signal_else_1() {
        assert_eq!(super::shell_status(Some(3), None), 3);
        assert_eq!(super::shell_status(None, Some(9)), 137);
        assert_eq!(super::shell_status(None, None), 1);
        assert!(super::now_unix() > 1.7e9);
    }
}
