//! Checksums of tensors' bytes, as the metadata stores them, computed on every core:
//! what the writer records and the reader verifies (a leaf both use).

use std::collections::BTreeMap;

/// A checksum of a tensor's bytes, as stored in the metadata.
pub(crate) fn checksum(bytes: &[u8]) -> String {
    format!("xxh3:{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// `Builder::spawn_scoped`, which this crate's tests can make fail as a container's
/// memory or pids limit does (a real limit cannot be aimed at one call: glibc reuses
/// cached thread stacks, and Rust's own start-up allocations then fail in the thread).
pub(crate) fn spawn_scoped<'scope, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    name: &str,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::io::Result<std::thread::ScopedJoinHandle<'scope, T>> {
    #[cfg(test)]
    if REFUSE_THREADS.with(std::cell::Cell::get) {
        return Err(std::io::Error::other("this test refuses threads"));
    }
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(scope, f)
}

#[cfg(test)]
thread_local! {
    /// Set by a test: this thread's spawns fail.
    pub(crate) static REFUSE_THREADS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A tensor's name and bytes.
type Named<'a> = (&'a str, &'a [u8]);

/// Checksums of `tensors` on all cores (one tensor per task), by name.
pub(crate) fn checksums_parallel<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> BTreeMap<String, String> {
    let items: Vec<(&str, &[u8])> = tensors.collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(items.len().max(1));
    if threads <= 1 {
        return items
            .into_iter()
            .map(|(n, b)| (n.to_owned(), checksum(b)))
            .collect();
    }
    // Largest first, each to the least loaded thread.
    let mut sorted = items;
    sorted.sort_by_key(|(_, b)| std::cmp::Reverse(b.len()));
    let mut shares: Vec<(usize, Vec<Named<'_>>)> = vec![(0, Vec::new()); threads];
    for item in sorted {
        if let Some(share) = shares.iter_mut().min_by_key(|(load, _)| *load) {
            share.0 += item.1.len();
            share.1.push(item);
        }
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = shares
            .into_iter()
            .map(|(_, share)| {
                let work = |share: Vec<Named<'_>>| {
                    share
                        .into_iter()
                        .map(|(n, b)| (n.to_owned(), checksum(b)))
                        .collect::<Vec<_>>()
                };
                // Where no thread can be had, this share is done here.
                let here = share.clone();
                spawn_scoped(scope, "tt-ckpt-sums", move || work(share)).map_err(|_| work(here))
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| match h {
                Ok(h) => h.join().unwrap_or_default(),
                Err(done) => done,
            })
            .collect()
    })
}
