//! The cheap counters of Linux's `/proc`, read directly: a tick of the tracker reads two
//! small files per process (`stat`, `status`) and its `children` lists; `smaps_rollup`
//! (0.3 ms for a small process, ~7 ms with torch loaded) is read at most about once a
//! second. A process that exits between listing and reading is simply skipped.

use std::fs;
use std::io::Read;

use tt_device::procfs::kib as kb;

/// Clock ticks per second for `/proc/PID/stat` times.
pub(crate) fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Reads a small /proc file into `buf` (reused between calls). `false` when it is gone.
pub(crate) fn read_into(path: &str, buf: &mut String) -> bool {
    buf.clear();
    match fs::File::open(path) {
        Ok(mut f) => f.read_to_string(buf).is_ok(),
        Err(_) => false,
    }
}

/// A process's `stat` and `status`, kept open between ticks: re-reading an open /proc
/// file (`pread` at 0) gives fresh contents without the path walk of an `open`. A read
/// fails once the process is gone, even if its pid is reused.
pub(crate) struct ProcFiles {
    stat: fs::File,
    statm: fs::File,
    status: fs::File,
    children: Option<fs::File>,
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

impl ProcFiles {
    pub(crate) fn open(pid: u32) -> Option<ProcFiles> {
        Some(ProcFiles {
            stat: fs::File::open(format!("/proc/{pid}/stat")).ok()?,
            statm: fs::File::open(format!("/proc/{pid}/statm")).ok()?,
            status: fs::File::open(format!("/proc/{pid}/status")).ok()?,
            children: fs::File::open(format!("/proc/{pid}/task/{pid}/children")).ok(),
        })
    }

    /// The children of the process's main thread.
    pub(crate) fn leader_children(&self, buf: &mut String, out: &mut Vec<u32>) {
        if let Some(f) = &self.children {
            if pread(f, buf) {
                out.extend(
                    buf.split_ascii_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
    }

    /// CPU and threads, resident bytes (from the cheap `statm`), and with `hwm` the
    /// high-water mark from `status` (which the kernel takes longer to write).
    /// `None` once the process has exited.
    pub(crate) fn read(&self, buf: &mut String, hwm: bool) -> Option<(Stat, Status)> {
        let stat = pread(&self.stat, buf).then(|| parse_stat(buf)).flatten()?;
        let (size, rss) = pread(&self.statm, buf)
            .then(|| parse_statm(buf))
            .flatten()?;
        if size == 0 {
            // Exiting: the kernel releases a process's memory before it becomes a
            // zombie, and in between `statm` reads all zeros while `stat` still says
            // it runs. No live user process has an empty address space.
            return None;
        }
        let rss = rss * page_size();
        let hwm = if hwm {
            pread(&self.status, buf)
                .then(|| parse_status(buf))
                .flatten()
                .map_or(0, |s| s.hwm)
        } else {
            0
        };
        Some((stat, Status { rss, hwm }))
    }
}

fn pread(file: &fs::File, buf: &mut String) -> bool {
    use std::os::unix::fs::FileExt;
    let mut bytes = std::mem::take(buf).into_bytes();
    bytes.clear();
    bytes.resize(4096, 0);
    let mut len = 0;
    loop {
        match file.read_at(&mut bytes[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => {
                len += n;
                if len == bytes.len() {
                    bytes.resize(len * 2, 0);
                }
            }
            Err(_) => {
                *buf = String::new();
                return false;
            }
        }
    }
    bytes.truncate(len);
    match String::from_utf8(bytes) {
        Ok(text) => {
            *buf = text;
            true
        }
        Err(_) => false,
    }
}

/// From `/proc/PID/stat`: CPU time and threads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Stat {
    /// utime + stime, in clock ticks.
    pub(crate) cpu_ticks: u64,
    pub(crate) threads: u64,
    /// It has exited and waits to be reaped (state `Z`, or `X`): no memory, one thread.
    pub(crate) exited: bool,
}

pub(crate) fn stat(pid: u32, buf: &mut String) -> Option<Stat> {
    if !read_into(&format!("/proc/{pid}/stat"), buf) {
        return None;
    }
    parse_stat(buf)
}

/// tt-device's parser of `/proc/PID/stat`, in the sampler's shape.
pub(crate) fn parse_stat(text: &str) -> Option<Stat> {
    let s = tt_device::procfs::parse_stat(text)?;
    Some(Stat {
        cpu_ticks: s.cpu_ticks,
        threads: s.threads,
        exited: s.exited(),
    })
}

/// From `/proc/PID/statm`: the address space's size and the resident set, in pages.
pub(crate) fn parse_statm(text: &str) -> Option<(u64, u64)> {
    let mut fields = text.split_ascii_whitespace();
    let size = fields.next()?.parse().ok()?;
    let rss = fields.next()?.parse().ok()?;
    Some((size, rss))
}

/// From `/proc/PID/status`: resident memory now and its high-water mark, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Status {
    pub(crate) rss: u64,
    pub(crate) hwm: u64,
}

/// tt-device's parser of `/proc/PID/status`, in the sampler's shape; `None` for a
/// zombie (no memory lines).
pub(crate) fn parse_status(text: &str) -> Option<Status> {
    let s = tt_device::procfs::parse_status(text);
    Some(Status {
        rss: s.rss?,
        hwm: s.hwm.unwrap_or(0),
    })
}

/// From `/proc/PID/smaps_rollup`: private and shared resident memory, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Rollup {
    pub(crate) private: u64,
    pub(crate) shared: u64,
}

pub(crate) fn smaps_rollup(pid: u32, buf: &mut String) -> Option<Rollup> {
    if !read_into(&format!("/proc/{pid}/smaps_rollup"), buf) {
        return None;
    }
    parse_rollup(buf)
}

pub(crate) fn parse_rollup(text: &str) -> Option<Rollup> {
    let mut r = Rollup::default();
    let mut seen = false;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        match key {
            "Private_Clean" | "Private_Dirty" => r.private += kb(value)?,
            "Shared_Clean" | "Shared_Dirty" => r.shared += kb(value)?,
            _ => continue,
        }
        seen = true;
    }
    seen.then_some(r)
}

/// The direct children of `pid`, from every thread's `children` list (no scan of /proc).
pub(crate) fn children(pid: u32, buf: &mut String, out: &mut Vec<u32>) {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return;
    };
    for task in tasks.flatten() {
        let name = task.file_name();
        let Some(tid) = name.to_str() else { continue };
        if read_into(&format!("/proc/{pid}/task/{tid}/children"), buf) {
            out.extend(
                buf.split_ascii_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
}

/// The children of `pid`'s main thread only: one small read, no directory listing.
pub(crate) fn leader_children(pid: u32, buf: &mut String, out: &mut Vec<u32>) {
    if read_into(&format!("/proc/{pid}/task/{pid}/children"), buf) {
        out.extend(
            buf.split_ascii_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
}

/// Every descendant of `root`, breadth first. With `all_threads` the children of every
/// thread are listed; otherwise only those of each process's main thread (cheaper: the
/// tracker does the full walk about once a second).
pub(crate) fn descendants(
    root: u32,
    buf: &mut String,
    all_threads: bool,
    open: &std::collections::HashMap<u32, ProcFiles>,
) -> Vec<u32> {
    walk_tree(root, |pid, out| {
        if all_threads {
            children(pid, buf, out)
        } else if let Some(files) = open.get(&pid) {
            files.leader_children(buf, out)
        } else {
            leader_children(pid, buf, out)
        }
    })
}

/// Every process below `root`, breadth first, each once, from `list` (which appends a
/// process's children): a process listed under two parents (re-parented while the walk
/// ran) is walked once, and `root` listed below itself (its pid reused) is not walked
/// again, so the walk always ends.
fn walk_tree(root: u32, mut list: impl FnMut(u32, &mut Vec<u32>)) -> Vec<u32> {
    let mut out = Vec::new();
    list(root, &mut out);
    let mut i = 0;
    while i < out.len() {
        let pid = out[i];
        let mut more = Vec::new();
        list(pid, &mut more);
        for p in more {
            if p != root && !out.contains(&p) {
                out.push(p);
            }
        }
        i += 1;
    }
    out
}

/// System memory: (capacity, used = total - available), in bytes (tt-device's parser).
pub(crate) fn meminfo(buf: &mut String) -> (u64, u64) {
    if !read_into("/proc/meminfo", buf) {
        return (0, 0);
    }
    tt_device::procfs::parse_meminfo(buf)
        .map_or((0, 0), |m| (m.total, m.total.saturating_sub(m.available)))
}

/// Per-core (busy, total) jiffies from `/proc/stat`.
pub(crate) fn cpu_times(buf: &mut String) -> Vec<(u64, u64)> {
    if !read_into("/proc/stat", buf) {
        return Vec::new();
    }
    parse_cpu_times(buf)
}

/// Per-core (busy, total) jiffies of `/proc/stat`'s text: the first eight counters make
/// the total (guest time is already in user), idle and iowait are not busy.
fn parse_cpu_times(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let v: Vec<u64> = l
                .split_ascii_whitespace()
                .skip(1)
                .filter_map(|x| x.parse().ok())
                .collect();
            let total: u64 = v.iter().take(8).sum();
            let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
            (total.saturating_sub(idle), total)
        })
        .collect()
}

/// Resets the peak-RSS mark (`VmHWM`) of `pid` (`echo 5 > /proc/PID/clear_refs`,
/// Linux 4.0+), so that it measures from the start of tracking. `false` if not allowed.
pub(crate) fn reset_hwm(pid: u32) -> bool {
    fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_walk_lists_each_process_once_and_ends() {
        // 1 -> 2, 3; 2 -> 4; 3 -> 4 again (re-parented during the walk) and 1 itself
        // (its pid reused); 4 -> 5.
        let tree = |pid: u32, out: &mut Vec<u32>| {
            out.extend_from_slice(match pid {
                1 => &[2, 3],
                2 => &[4],
                3 => &[4, 1],
                4 => &[5],
                _ => &[],
            })
        };
        assert_eq!(walk_tree(1, tree), [2, 3, 4, 5]);
        assert_eq!(walk_tree(4, tree), [5]);
        assert_eq!(walk_tree(9, tree), Vec::<u32>::new());
    }

    #[test]
    fn a_file_longer_than_the_first_buffer_is_read_whole() {
        // The buffer starts at 4 KiB and grows; a kept buffer's old text is replaced.
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let text: String = (0..3000).map(|i| format!("{i}\n")).collect();
        assert!(text.len() > 3 * 4096);
        let path = dir.path().join("long");
        std::fs::write(&path, &text).unwrap_or_else(|e| panic!("{e}"));
        let file = fs::File::open(&path).unwrap_or_else(|e| panic!("{e}"));
        let mut buf = "old text".repeat(2000);
        assert!(pread(&file, &mut buf));
        assert_eq!(buf, text);
        std::fs::write(&path, "short").unwrap_or_else(|e| panic!("{e}"));
        assert!(pread(&file, &mut buf));
        assert_eq!(buf, "short");
    }

    #[test]
    fn per_core_busy_and_total_jiffies() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let text = "cpu  20 0 10 200 40 0 0 0 0 0\n\
                    cpu0 10 1 5 100 20 2 3 4 7 0\n\
                    cpu1 10 0 5 100 20 0 0 0 0 0\n\
                    intr 12345 1 2\n\
                    ctxt 999\n";
        // cpu0: total 10+1+5+100+20+2+3+4 = 145, idle 100 + iowait 20 = 120.
        assert_eq!(parse_cpu_times(text), [(25, 145), (15, 135)]);
    }

    #[test]
    fn a_grandchild_is_a_descendant_too() {
        use std::io::BufRead;
        // A shell that starts a shell that starts `sleep`; each says who it started.
        let mut sh = std::process::Command::new("sh")
            .args([
                "-c",
                "sh -c 'sleep 30 & echo grandchild $!; wait' & echo child $!; wait",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let stdout = sh.stdout.take().unwrap_or_else(|| panic!("no stdout"));
        let (mut child, mut grandchild) = (0u32, 0u32);
        for line in std::io::BufReader::new(stdout).lines().take(2) {
            let line = line.unwrap_or_else(|e| panic!("{e}"));
            let (who, pid) = line.split_once(' ').unwrap_or_else(|| panic!("{line:?}"));
            let pid = pid
                .trim()
                .parse()
                .unwrap_or_else(|e| panic!("{line:?}: {e}"));
            *if who == "child" {
                &mut child
            } else {
                &mut grandchild
            } = pid;
        }
        let mut buf = String::new();
        let open = std::collections::HashMap::new();
        let cheap = descendants(sh.id(), &mut buf, false, &open);
        let full = descendants(sh.id(), &mut buf, true, &open);
        // SAFETY: kill(2) of the shells' children and of our own child.
        unsafe {
            libc::kill(grandchild as i32, libc::SIGKILL);
            libc::kill(child as i32, libc::SIGKILL);
            libc::kill(sh.id() as i32, libc::SIGKILL);
        }
        let _ = sh.wait();
        assert_eq!(cheap, [child, grandchild]);
        assert_eq!(full, [child, grandchild]);
    }

    #[test]
    fn the_children_of_a_process_main_thread_are_its_descendants() {
        use std::io::BufRead;
        // A shell whose main thread starts `sleep`, then waits for it.
        let mut sh = std::process::Command::new("sh")
            .args(["-c", "sleep 30 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{e}"));
        let mut line = String::new();
        let stdout = sh.stdout.take().unwrap_or_else(|| panic!("no stdout"));
        std::io::BufReader::new(stdout)
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("{e}"));
        let sleep: u32 = line
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{line:?}: {e}"));
        let mut buf = String::new();
        let mut out = Vec::new();
        leader_children(sh.id(), &mut buf, &mut out);
        let mut open = std::collections::HashMap::new();
        let cheap = descendants(sh.id(), &mut buf, false, &open);
        let full = descendants(sh.id(), &mut buf, true, &open);
        // The tracker's cheap walk between full ones reads the `children` file it keeps
        // open for a process it already follows.
        let files = ProcFiles::open(sh.id()).unwrap_or_else(|| panic!("no /proc/{}", sh.id()));
        let mut kept = Vec::new();
        files.leader_children(&mut buf, &mut kept);
        open.insert(sh.id(), files);
        let through_open = descendants(sh.id(), &mut buf, false, &open);
        // SAFETY: kill(2) of the shell's child and of our own child.
        unsafe {
            libc::kill(sleep as i32, libc::SIGKILL);
            libc::kill(sh.id() as i32, libc::SIGKILL);
        }
        let _ = sh.wait();
        assert_eq!(out, [sleep]);
        assert_eq!(cheap, [sleep]);
        assert_eq!(full, [sleep]);
        assert_eq!(kept, [sleep]);
        assert_eq!(through_open, [sleep]);
    }

    #[test]
    fn parses_stat_with_a_hostile_name() {
        let line = "1234 (a) b (c) S 1 1234 1234 0 -1 4194560 1000 0 0 0 250 50 0 0 20 0 7 0 \
                    12345 1000000 500 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(Stat {
                cpu_ticks: 300,
                threads: 7,
                exited: false,
            })
        );
        // A zombie (exited, not reaped yet).
        let zombie = line.replace(") S ", ") Z ");
        assert!(parse_stat(&zombie).unwrap().exited);
    }

    #[test]
    fn parses_status_and_rollup() {
        let status = "Name:\tx\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\nThreads:\t1\n";
        assert_eq!(
            parse_status(status),
            Some(Status {
                rss: 1 << 20,
                hwm: 2 << 20
            })
        );
        assert_eq!(parse_status("Name:\tzombie\nState:\tZ\n"), None);
        // statm: size and resident pages; an exiting process's reads all zeros.
        assert_eq!(
            parse_statm("5360 1020 830 200 0 400 0\n"),
            Some((5360, 1020))
        );
        assert_eq!(parse_statm("0 0 0 0 0 0 0\n"), Some((0, 0)));
        assert_eq!(parse_statm(""), None);
        let rollup = "Rss: 10 kB\nShared_Clean: 4 kB\nShared_Dirty: 1 kB\nPrivate_Clean: 2 kB\nPrivate_Dirty: 3 kB\n";
        assert_eq!(
            parse_rollup(rollup),
            Some(Rollup {
                private: 5 << 10,
                shared: 5 << 10
            })
        );
    }

    #[test]
    fn reads_this_process() {
        let mut buf = String::new();
        let me = std::process::id();
        let files = ProcFiles::open(me).unwrap_or_else(|| panic!("no /proc/self"));
        let (_, st) = files.read(&mut buf, true).unwrap_or_default();
        // Not `hwm >= rss`: the two come from different files, and another test of this
        // binary resets this process's high-water mark (`clear_refs`) between the reads
        // (it failed so once under load).
        assert!(st.rss > 0 && st.hwm > 0, "{st:?}");
        let _big = std::hint::black_box(vec![1u8; 32 << 20]);
        let (_, again) = files.read(&mut buf, false).unwrap_or_default();
        assert!(
            again.rss >= st.rss + (30 << 20),
            "re-reading an open file is fresh"
        );
        assert!(stat(me, &mut buf).is_some_and(|s| s.threads >= 1));
        let (total, used) = meminfo(&mut buf);
        assert!(total > used && used > 0);
        assert!(!cpu_times(&mut buf).is_empty());
        assert!(
            stat(u32::MAX, &mut buf).is_none(),
            "a missing process is None"
        );
    }
}
