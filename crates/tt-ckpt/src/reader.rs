//! Mapping a checkpoint file with its pages read in at the disk's speed.
//!
//! A mapping's page faults read the file one readahead window at a time (128 KiB by
//! default), one request in flight; `MAP_POPULATE` does the same from one thread, and
//! `POSIX_FADV_WILLNEED` asks for no more than one window either (the kernel caps it).
//! So a cold 1 GiB load ran at 0.4 to 0.5 times the disk's direct reads on the 2-core
//! VM. Here the mapping is populated (`MADV_POPULATE_READ`) in 8 MiB chunks from eight
//! threads, as `fio --bs=8M --iodepth=8` reads a disk: 1.0 to 1.3 times those direct
//! reads in every run measured, and the pages stay in the page cache (reclaimable), not
//! on the heap.

use std::fs::File;
use std::io;

use memmap2::{Advice, Mmap, MmapOptions};

use crate::checksum::spawn_scoped;

/// Bytes populated by one request.
const CHUNK: usize = 8 << 20;
/// Requests in flight.
const DEPTH: usize = 8;

/// `file` (of `len` bytes) mapped read-only with every page read in; `None` where it
/// cannot be mapped or read that way (a filesystem without mappings, a disk error, a
/// file cut short since its size was read): the caller then reads it with `read(2)`,
/// which reports what went wrong as an error instead of a `SIGBUS` on first touch.
pub(crate) fn map_populated(file: &File, len: u64) -> Option<Mmap> {
    let len = usize::try_from(len).ok().filter(|&l| l > 0)?;
    // SAFETY: the mapping is read-only and private to its TensorFile; the file is a
    // checkpoint, which torchtools only ever replaces by a rename (the mapped inode is
    // never written), as documented on TensorFile.
    let map = unsafe { MmapOptions::new().len(len).map(file) }.ok()?;
    match populate(&map) {
        Ok(()) => Some(map),
        // A kernel older than 5.14 knows no MADV_POPULATE_READ: one thread's
        // MAP_POPULATE, as before.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            // SAFETY: as above.
            unsafe { MmapOptions::new().len(len).populate().map(file) }.ok()
        }
        Err(_) => None,
    }
}

/// Reads every page of `map` in, `DEPTH` chunks at a time; the first error.
fn populate(map: &Mmap) -> io::Result<()> {
    let len = map.len();
    let chunks = len.div_ceil(CHUNK);
    let depth = DEPTH.min(chunks);
    // Worker `k` reads chunks k, k + depth, ...: all of them move through the file
    // together, so the disk sees one stream of large reads.
    let work = |k: usize| -> io::Result<()> {
        for c in (k..chunks).step_by(depth) {
            let offset = c * CHUNK;
            map.advise_range(Advice::PopulateRead, offset, CHUNK.min(len - offset))?;
        }
        Ok(())
    };
    std::thread::scope(|scope| {
        let workers: Vec<_> = (1..depth)
            .map(|k| spawn_scoped(scope, "tt-ckpt-read", move || work(k)).map_err(|_| k))
            .collect();
        let mut result = work(0);
        for worker in workers {
            // Where no thread could be had, that worker's chunks are read here.
            let done = match worker {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("a reading thread panicked"))),
                Err(k) => work(k),
            };
            result = result.and(done);
        }
        result
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a panic is how a test reports
    use super::*;
    use crate::checksum::REFUSE_THREADS;
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
            REFUSE_THREADS.with(|r| r.set(refuse));
            let map = map_populated(&file, len as u64);
            REFUSE_THREADS.with(|r| r.set(false));
            let map = map.unwrap();
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
        // The old size: touching the mapping past the end would be a SIGBUS.
        assert!(map_populated(&file, 2 * CHUNK as u64).is_none());
        assert!(map_populated(&file, 0).is_none());
    }
}
