//! The watch that tells a request the queue is still empty without listing the lock
//! directory. (A leaf: `dir` keeps one per directory, `queue` consults it.)

use std::path::Path;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

/// What lets a request see that the queue is empty without listing the directory: an
/// inotify watch of the names added to it, started before the listing that found no live
/// ticket. A ticket is placed by a rename into the directory, so none can appear without
/// an event, and a ticket found dead never comes back to life; one non-blocking `read`
/// that finds no event then stands for the listing (two `getdents`, an `lseek`, and a
/// probe of every ticket): about 2 µs of the uncontended lock's 16. Only on local
/// filesystems: inotify does not see what other hosts do on a network filesystem, so
/// there every request lists the directory.
#[derive(Debug, Default)]
pub(crate) struct QueueWatch {
    inotify: Option<Inotify>,
    /// Whether the watch was tried (`inotify` is what came of it).
    tried: bool,
    /// The last listing, made after every event before it was read away, found no live
    /// ticket.
    pub(crate) empty: bool,
}

impl QueueWatch {
    /// Whether the queue is still as the last listing found it, empty: no name was added
    /// to the directory since.
    pub(crate) fn still_empty(&mut self) -> bool {
        let empty = std::mem::take(&mut self.empty);
        let Some(inotify) = self.inotify.as_ref().filter(|_| empty) else {
            return false;
        };
        loop {
            match inotify.read_events() {
                Err(nix::errno::Errno::EAGAIN) => {
                    self.empty = true;
                    return true;
                }
                // Names added that cannot be tickets (a holder's record, placed at every
                // lock, or a temporary name) leave the queue as it was.
                Ok(events) if events.iter().all(not_a_ticket) => {}
                // A ticket may have been placed (or the watch overflowed or ended):
                // list the directory.
                _ => return false,
            }
        }
    }

    /// Before a listing: starts the watch (once) and reads away what it reported, so
    /// that every name added from now on is an event. False without a watch.
    pub(crate) fn arm(&mut self, dir: &Path) -> bool {
        if !self.tried {
            self.tried = true;
            self.inotify = new_names_watch(dir);
        }
        let Some(inotify) = &self.inotify else {
            return false;
        };
        loop {
            match inotify.read_events() {
                Ok(events) if events.is_empty() => return true,
                Ok(events) => {
                    if events
                        .iter()
                        .any(|e| e.mask.contains(AddWatchFlags::IN_IGNORED))
                    {
                        // The directory was removed: watch whatever has its path next time.
                        self.inotify = None;
                        self.tried = false;
                        return false;
                    }
                }
                Err(nix::errno::Errno::EAGAIN) => return true,
                Err(_) => {
                    self.inotify = None;
                    return false;
                }
            }
        }
    }
}

/// Whether an event is a name added that is surely no queue ticket (`wait-*`).
fn not_a_ticket(event: &nix::sys::inotify::InotifyEvent) -> bool {
    let plain = AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO;
    plain.contains(event.mask)
        && event
            .name
            .as_ref()
            .is_some_and(|n| !n.as_encoded_bytes().starts_with(b"wait-"))
}

/// A watch of the names added to `dir` (created or moved in), when `dir` is on a local
/// filesystem and inotify is available.
// Left out of mutation testing: without the watch every request lists the directory,
// which the queue's tests cannot tell apart (only the bench can).
#[cfg_attr(mutants, mutants::skip)]
fn new_names_watch(dir: &Path) -> Option<Inotify> {
    use nix::sys::statfs as fs;
    let local = [
        fs::EXT4_SUPER_MAGIC, // also ext2 and ext3
        fs::BTRFS_SUPER_MAGIC,
        fs::TMPFS_MAGIC,
        fs::OVERLAYFS_SUPER_MAGIC,
        fs::F2FS_SUPER_MAGIC,
        fs::FsType(libc::XFS_SUPER_MAGIC as _),
        fs::FsType(0x2fc1_2fc1), // zfs
    ];
    let kind = fs::statfs(dir).ok()?.filesystem_type();
    if !local.contains(&kind) {
        tracing::debug!(
            "{} is not on a local filesystem: every request lists it",
            dir.display()
        );
        return None;
    }
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).ok()?;
    let mask = AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ONLYDIR
        | AddWatchFlags::IN_DONT_FOLLOW;
    inotify.add_watch(dir, mask).ok()?;
    Some(inotify)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn the_queue_is_known_empty_until_a_name_is_added_to_the_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let mut watch = QueueWatch::default();
        assert!(!watch.still_empty(), "nothing listed yet");
        assert!(
            watch.arm(tmp.path()),
            "the test's directory is on a local filesystem"
        );
        watch.empty = true; // as a listing that found no ticket leaves it
        assert!(watch.still_empty());
        assert!(watch.still_empty(), "no event: still empty");
        // A ticket is placed by a rename (written under a temporary name first).
        fs::write(tmp.path().join("wait.tmp"), "{}").unwrap();
        fs::rename(tmp.path().join("wait.tmp"), tmp.path().join("wait-1.json")).unwrap();
        assert!(!watch.still_empty(), "a name was added: list the directory");
        assert!(!watch.still_empty(), "until a listing says otherwise");
        assert!(watch.arm(tmp.path()), "events read away before the listing");
        watch.empty = true;
        assert!(
            watch.still_empty(),
            "the events before the listing are spent"
        );
        // Removing a name cannot add a request: no event for it.
        fs::remove_file(tmp.path().join("wait-1.json")).unwrap();
        assert!(watch.still_empty());
        // Moved in from elsewhere, as a ticket of another directory might be.
        let other = tempfile::tempdir_in(tmp.path()).unwrap();
        assert!(
            !watch.still_empty(),
            "a directory created inside is a name too"
        );
        assert!(watch.arm(tmp.path()));
        watch.empty = true;
        fs::write(other.path().join("x"), "{}").unwrap();
        assert!(
            watch.still_empty(),
            "not watched recursively: names in subdirectories are not tickets"
        );
        fs::rename(other.path().join("x"), tmp.path().join("wait-2.json")).unwrap();
        assert!(!watch.still_empty());
    }
}
