//! Several jobs on one GPU by memory budget.
//!
//! A sharer holds a *shared* `flock` (`LOCK_SH`) on the GPU's lock file, so the kernel
//! keeps sharers and an exclusive holder apart by itself: an exclusive request cannot
//! take the lock while any sharer holds it, and a sharer cannot while an exclusive
//! holder does. Each sharer's budget is in the ledger: one record per sharer,
//! `share-<GPU>.<id>.json` (mode 0644: every user reads it, only its owner removes it),
//! write-locked by its sharer for as long as it shares. A record without that lock
//! belongs to a sharer that died (`kill -9`, the OOM killer) and counts for nothing, so
//! the ledger heals as a lock does. A shared request is admitted when no exclusive
//! holder has the GPU, no earlier request in the queue waits for it (first come, first
//! served, shared and exclusive requests alike), and its bytes fit beside the live
//! sharers' within the GPU's capacity. That last check takes no lock that anyone could
//! keep: the request writes its record first, then sums every live record, its own
//! included, and withdraws when the sum is over. Of two requests that race, the one
//! that wrote last reads after the other wrote, so it sees both and withdraws when they
//! do not fit together: the budgets are never overbooked, and nobody's lock stops an
//! admission. A budget is counted as at most the GPU's capacity, so no record can wrap
//! the sum.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use tt_device::Bytes;

use crate::record::{live, share_prefix, OwnRecord};
use crate::{Error, GpuKey, Holder, Ignored, LockDir, Result};

/// Why a shared request cannot be admitted now.
pub(crate) enum NotAdmitted {
    /// Someone holds the GPU exclusively (its record, when readable).
    Exclusive(Option<Box<Holder>>),
    /// The live sharers' budgets leave less than asked.
    Full {
        /// The live sharers, oldest first.
        sharers: Vec<Holder>,
    },
}

/// The sum of the sharers' budgets, each counted as at most `capacity` (a record's
/// budget is its writer's word: one past the GPU's memory must neither wrap the sum nor
/// count for less than the whole GPU).
fn budgets_sum(sharers: &[Holder], capacity: Bytes) -> u128 {
    sharers
        .iter()
        .filter_map(|h| h.share)
        .map(|b| u128::from(b.0.min(capacity.0)))
        .sum()
}

impl LockDir {
    /// The jobs sharing `key`'s GPU now, oldest first, each with its budget in
    /// [`Holder::share`]. A sharer that died is not listed (its record is removed when
    /// this user owns it), nor a record that names another user than its file's owner
    /// ([`LockDir::ignored`] lists those).
    pub fn sharers(&self, key: &GpuKey) -> Result<Vec<Holder>> {
        Ok(self.sharers_checked(key)?.0)
    }

    /// [`LockDir::sharers`], and the records ignored on the way.
    pub(crate) fn sharers_checked(&self, key: &GpuKey) -> Result<(Vec<Holder>, Vec<Ignored>)> {
        let (mut sharers, ignored) = self.sharers_and_admitting(key)?;
        sharers.retain(|h| !h.admitting);
        Ok((sharers, ignored))
    }

    /// The live sharers' records, those of requests being admitted included.
    fn sharers_and_admitting(&self, key: &GpuKey) -> Result<(Vec<Holder>, Vec<Ignored>)> {
        let (found, ignored) = live(self.path(), self.names()?, &share_prefix(key));
        let sharers = found
            .into_iter()
            .map(|f| f.holder)
            .filter(|h| h.share.is_some())
            .collect();
        Ok((sharers, ignored))
    }

    /// One attempt to admit a shared request of `bytes` on `key`'s GPU of `capacity`,
    /// with `lock_file` (the GPU's lock file, opened by the caller): on success the
    /// shared `flock` is held on it and the ledger record written.
    pub(crate) fn try_share(
        &self,
        key: &GpuKey,
        lock_file: &File,
        lock_path: &Path,
        capacity: Bytes,
        holder: &Holder,
    ) -> Result<std::result::Result<OwnRecord, NotAdmitted>> {
        // SAFETY: the fd is open for the duration of the call.
        if unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EWOULDBLOCK | libc::EINTR) => Ok(Err(NotAdmitted::Exclusive(
                    self.holder_of(key).map(Box::new),
                ))),
                _ => Err(Error::Io {
                    op: "share-locking",
                    path: lock_path.to_owned(),
                    cause: e,
                }),
            };
        }
        let unlock = || {
            // SAFETY: the fd is open for the duration of the call.
            unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_UN) };
        };
        // Written first (as being admitted: views do not show it yet), then every live
        // record summed, this one's and those of other admissions included.
        let admitting = Holder {
            admitting: true,
            ..holder.clone()
        };
        let record = match self.create_record(key, &admitting) {
            Ok(record) => record,
            Err(e) => {
                unlock();
                return Err(e);
            }
        };
        let sharers = match self.sharers_and_admitting(key) {
            Ok((s, _)) => s,
            Err(e) => {
                drop(record);
                unlock();
                return Err(e);
            }
        };
        if budgets_sum(&sharers, capacity) > u128::from(capacity.0) {
            drop(record);
            unlock();
            // This request's own record is among those being admitted.
            let others = sharers.into_iter().filter(|h| !h.admitting).collect();
            return Ok(Err(NotAdmitted::Full { sharers: others }));
        }
        // Still marked as being admitted: the grant writes the sharer's record whole
        // (with its usage id) right after, and from then on views show it.
        Ok(Ok(record))
    }

    /// Writes and locks a ledger record (see [`OwnRecord::create`]).
    fn create_record(&self, key: &GpuKey, holder: &Holder) -> Result<OwnRecord> {
        OwnRecord::create(self.path(), &share_prefix(key), holder)
    }
}
