//! Checksums of tensors' bytes, as the metadata stores them, computed on every core:
//! what the writer records and the reader verifies (a leaf both use).

use std::collections::BTreeMap;

/// A checksum of a tensor's bytes, as stored in the metadata.
pub(crate) fn checksum(bytes: &[u8]) -> String {
    stored(xxhash_rust::xxh3::xxh3_64(bytes))
}

/// An xxh3 digest as the metadata stores it: `xxh3:` and 16 hex digits (every
/// checksum has the same width, which the writer's header reservation relies on).
pub(crate) fn stored(digest: u64) -> String {
    format!("xxh3:{digest:016x}")
}

/// A tensor's name and bytes.
type Named<'a> = (&'a str, &'a [u8]);

/// Checksums of `tensors` on all cores (one tensor per task), by name.
pub(crate) fn checksums_parallel<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [u8])>,
) -> BTreeMap<String, String> {
    checksums_gated(tensors, |_| true).unwrap_or_default()
}

/// Bytes hashed between two calls of the gate.
const PIECE: usize = 8 << 20;
/// Threads hashing at most: eight hash faster than any disk delivers (xxh3 runs at
/// several GB/s a core), and a machine of many cores is not woken whole for each piece.
const MAX_THREADS: usize = 8;

/// Checksums of `tensors` on all cores, each read in pieces of up to 8 MiB in order of
/// address, and each piece only once `ready(piece)` has said it may be read (a file's
/// pages still arriving: `ready` waits for them). `None` as soon as `ready` says no.
pub(crate) fn checksums_gated<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [u8])>,
    ready: impl Fn(&[u8]) -> bool + Sync,
) -> Option<BTreeMap<String, String>> {
    let items: Vec<(&str, &[u8])> = tensors.collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_THREADS)
        .min(items.len().max(1));
    // Largest first, each to the least loaded thread; then each thread's share in
    // order of address, so that every thread follows pages arriving front to back.
    let mut sorted = items;
    sorted.sort_by_key(|(_, b)| std::cmp::Reverse(b.len()));
    let mut shares: Vec<(usize, Vec<Named<'_>>)> = vec![(0, Vec::new()); threads];
    for item in sorted {
        if let Some(share) = shares.iter_mut().min_by_key(|(load, _)| *load) {
            share.0 += item.1.len();
            share.1.push(item);
        }
    }
    let ready = &ready;
    let work = move |mut share: Vec<Named<'_>>| -> Option<Vec<(String, String)>> {
        share.sort_by_key(|(_, b)| b.as_ptr() as usize);
        share
            .into_iter()
            .map(|(name, bytes)| {
                let mut hasher = xxhash_rust::xxh3::Xxh3::new();
                for piece in bytes.chunks(PIECE) {
                    if !ready(piece) {
                        return None;
                    }
                    hasher.update(piece);
                }
                Some((name.to_owned(), stored(hasher.digest())))
            })
            .collect()
    };
    let mut shares = shares.into_iter().map(|(_, share)| share);
    let mine = shares.next().unwrap_or_default();
    std::thread::scope(|scope| {
        let others: Vec<_> = shares
            .map(|share| {
                // Where no thread can be had, this share is done here, after the first.
                let here = share.clone();
                tt_device::spawn_scoped(scope, "tt-ckpt-sums", move || work(share))
                    .map_err(|_| here)
            })
            .collect();
        let mut sums = work(mine)?;
        for other in others {
            let done = match other {
                Ok(handle) => handle.join().ok()?,
                Err(here) => work(here),
            };
            sums.extend(done?);
        }
        Some(sums.into_iter().collect())
    })
}
