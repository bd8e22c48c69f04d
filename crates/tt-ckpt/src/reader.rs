//! Mapping a checkpoint file with its pages read in at the disk's speed.
//!
//! A mapping's page faults read the file one readahead window at a time (128 KiB by
//! default), one request in flight; `MAP_POPULATE` does the same from one thread, and
//! `POSIX_FADV_WILLNEED` asks for no more than one window either (the kernel caps it).
//! So a cold 1 GiB load ran at 0.35 to 0.6 times the disk's direct reads on the 2-core
//! VM. Here the mapping is populated (`MADV_POPULATE_READ`) in 8 MiB chunks from eight
//! threads, as `fio --bs=8M --iodepth=8` reads a disk: 1.16 to 1.57 times the direct
//! reads taking turns with the loads, every read from an empty page cache (`cargo
//! xtask bench`, ten rounds in two runs); the pages stay in the page cache
//! (reclaimable), not on the heap.

use std::fs::File;
use std::io;
use std::sync::{Condvar, Mutex, PoisonError};

use memmap2::{Advice, Mmap, MmapOptions};

use tt_device::spawn_scoped;

/// Bytes populated by one request.
const CHUNK: usize = 8 << 20;
/// Requests in flight.
const DEPTH: usize = 8;

/// How far the reading has come: the pages before `ready` are all in.
pub(crate) struct Front {
    state: Mutex<FrontState>,
    changed: Condvar,
}

struct FrontState {
    /// Chunks read in, by index.
    done: Vec<bool>,
    /// Bytes from the start, all read in.
    ready: usize,
    len: usize,
    failed: bool,
}

impl Front {
    fn new(len: usize) -> Self {
        Front {
            state: Mutex::new(FrontState {
                done: vec![false; len.div_ceil(CHUNK)],
                ready: 0,
                len,
                failed: false,
            }),
            changed: Condvar::new(),
        }
    }

    /// Waits until the first `end` bytes are in; false where reading failed first.
    pub(crate) fn wait(&self, end: usize) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while state.ready < end.min(state.len) && !state.failed {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        !state.failed
    }

    fn chunk_done(&self, c: usize) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.done[c] = true;
        let mut next = state.ready / CHUNK;
        while state.done.get(next) == Some(&true) {
            next += 1;
        }
        let ready = (next * CHUNK).min(state.len);
        // Waiters wake only when the front moved (a chunk past a gap moves nothing).
        if ready != state.ready {
            state.ready = ready;
            self.changed.notify_all();
        }
    }

    fn fail(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .failed = true;
        self.changed.notify_all();
    }
}

/// Marks the reading failed unless defused: a reading thread that panics stops the
/// waiters instead of leaving them waiting.
struct FailUnlessDone<'a>(Option<&'a Front>);

impl Drop for FailUnlessDone<'_> {
    fn drop(&mut self) {
        if let Some(front) = self.0 {
            front.fail();
        }
    }
}

/// `file` (of `len` bytes) mapped read-only with every page read in, and what `during`
/// returned: `during` runs on this thread while the pages arrive, and may read a byte
/// once [`Front::wait`] has said it is in (on a kernel without `MADV_POPULATE_READ` it
/// runs a second time, after one thread's `MAP_POPULATE`). `None` where the file cannot
/// be mapped or read that way (a filesystem without mappings, a disk error, a file cut
/// short since its size was read): the caller then reads it with `read(2)`, which
/// reports what went wrong as an error instead of a `SIGBUS` on first touch.
pub(crate) fn map_populated<T>(
    file: &File,
    len: u64,
    during: impl Fn(&[u8], &Front) -> T,
) -> Option<(Mmap, T)> {
    let len = usize::try_from(len).ok().filter(|&l| l > 0)?;
    // SAFETY: the mapping is read-only and private to its TensorFile; the file is a
    // checkpoint, which torchtools only ever replaces by a rename (the mapped inode is
    // never written), as documented on TensorFile.
    let map = unsafe { MmapOptions::new().len(len).map(file) }.ok()?;
    let front = Front::new(len);
    match populate(&map, &front, &during) {
        Ok(out) => Some((map, out)),
        // A kernel older than 5.14 knows no MADV_POPULATE_READ: one thread's
        // MAP_POPULATE, as before, then `during` on pages all in.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            drop(map);
            // SAFETY: as above.
            let map = unsafe { MmapOptions::new().len(len).populate().map(file) }.ok()?;
            let all = Front::new(len);
            (0..len.div_ceil(CHUNK)).for_each(|c| all.chunk_done(c));
            let out = during(&map, &all);
            Some((map, out))
        }
        Err(_) => None,
    }
}

/// Reads every page of `map` in from `DEPTH` threads while `during` runs here; the
/// first error.
fn populate<T>(map: &Mmap, front: &Front, during: impl Fn(&[u8], &Front) -> T) -> io::Result<T> {
    let len = map.len();
    let chunks = len.div_ceil(CHUNK);
    let depth = DEPTH.min(chunks);
    // Worker `k` reads chunks k, k + depth, ...: all of them move through the file
    // together, so the disk sees one stream of large reads and the front advances.
    let work = |k: usize| -> io::Result<()> {
        let mut guard = FailUnlessDone(Some(front));
        for c in (k..chunks).step_by(depth) {
            let offset = c * CHUNK;
            map.advise_range(Advice::PopulateRead, offset, CHUNK.min(len - offset))?;
            front.chunk_done(c);
        }
        guard.0 = None;
        Ok(())
    };
    std::thread::scope(|scope| {
        let mut result = Ok(());
        let mut workers = Vec::with_capacity(depth);
        for k in 0..depth {
            match spawn_scoped(scope, "tt-ckpt-read", move || work(k)) {
                Ok(handle) => workers.push(handle),
                // Where no thread can be had, that worker's chunks are read here first.
                Err(_) => result = result.and(work(k)),
            }
        }
        let out = during(map, front);
        for worker in workers {
            let done = worker
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("a reading thread panicked")));
            result = result.and(done);
        }
        result.map(|()| out)
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a panic is how a test reports
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// A file of `len` bytes (each byte its offset's low bits, so that no page is
    /// zero), written, synced and dropped from the page cache.
    fn cold_file(dir: &std::path::Path, len: usize) -> File {
        let path = dir.join("data");
        let mut f = File::create(&path).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        f.write_all(&bytes).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        // SAFETY: a plain system call on an open descriptor.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0);
        f
    }

    /// How many of `map`'s pages are in memory, and how many it has.
    fn resident(map: &Mmap) -> (usize, usize) {
        let page = 4096;
        let pages = map.len().div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: the mapping is page-aligned and `vec` has one byte per page.
        let rc = unsafe { libc::mincore(map.as_ptr() as *mut _, map.len(), vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        (vec.iter().filter(|&&b| b & 1 == 1).count(), pages)
    }

    /// A directory beside the test binary: on the build's disk (`/tmp` may be a tmpfs,
    /// whose pages cannot be dropped).
    fn disk_dir() -> tempfile::TempDir {
        let exe = std::env::current_exe().unwrap();
        tempfile::tempdir_in(exe.parent().unwrap()).unwrap()
    }

    #[test]
    fn every_page_of_a_cold_file_is_read_in_with_or_without_threads() {
        let dir = disk_dir();
        // Three chunks and a part: the workers' strides and the short last chunk.
        let len = 3 * CHUNK + 12_345;
        for refuse in [false, true] {
            let file = cold_file(dir.path(), len);
            // SAFETY: a read-only mapping of a file nothing else writes.
            let cold = unsafe { MmapOptions::new().map(&file) }.unwrap();
            let (before, pages) = resident(&cold);
            assert!(before < pages / 2, "not cold: {before} of {pages} pages");
            drop(cold);
            tt_device::refuse_threads(refuse);
            // What runs while the pages arrive sees each byte once the front passed it.
            let during = |bytes: &[u8], front: &Front| {
                (0..len)
                    .step_by(CHUNK / 2)
                    .chain([len - 1])
                    .all(|i| front.wait(i + 1) && bytes[i] == (i % 251) as u8)
            };
            let map = map_populated(&file, len as u64, during);
            tt_device::refuse_threads(false);
            let (map, seen) = map.unwrap();
            assert!(seen, "threads refused: {refuse}");
            assert_eq!(resident(&map), (pages, pages), "threads refused: {refuse}");
            for i in [0, CHUNK + 7, len - 1] {
                assert_eq!(map[i], (i % 251) as u8);
            }
        }
    }

    #[test]
    fn a_file_cut_short_after_its_size_was_read_is_not_mapped() {
        let dir = disk_dir();
        let file = cold_file(dir.path(), 2 * CHUNK);
        File::options()
            .write(true)
            .open(dir.path().join("data"))
            .unwrap()
            .set_len(4096)
            .unwrap();
        // The old size: touching the mapping past the end would be a SIGBUS. What waits
        // for those pages is told that they will not come.
        let waited = std::sync::atomic::AtomicBool::new(true);
        let during = |_: &[u8], front: &Front| {
            waited.store(front.wait(2 * CHUNK), std::sync::atomic::Ordering::SeqCst);
        };
        assert!(map_populated(&file, 2 * CHUNK as u64, during).is_none());
        assert!(!waited.load(std::sync::atomic::Ordering::SeqCst));
        assert!(map_populated(&file, 0, |_, _| ()).is_none());
    }
}
