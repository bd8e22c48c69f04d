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

/// The parent of `pid`, from `/proc/PID/stat`.
pub fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::{descends_from, parent_of};

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
}
