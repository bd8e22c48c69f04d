//! Named scoped threads whose start can fail, and be made to fail by a test (feature
//! `test-hooks`) as a container's memory or pids limit makes it fail: a real limit
//! cannot be aimed at one call (glibc reuses cached thread stacks, and Rust's own
//! start-up allocations then fail inside the thread). Callers do the work on their own
//! thread when no helper starts.

/// `std::thread::Builder::spawn_scoped` with a name: an error when the thread cannot
/// start (or, under the feature `test-hooks`, when `refuse_threads` said so on this
/// thread), never a panic.
pub fn spawn_scoped<'scope, T: Send + 'scope>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    name: &str,
    f: impl FnOnce() -> T + Send + 'scope,
) -> std::io::Result<std::thread::ScopedJoinHandle<'scope, T>> {
    #[cfg(any(test, feature = "test-hooks"))]
    if REFUSE.with(std::cell::Cell::get) {
        return Err(std::io::Error::other("this test refuses threads"));
    }
    std::thread::Builder::new()
        .name(name.into())
        .spawn_scoped(scope, f)
}

#[cfg(any(test, feature = "test-hooks"))]
thread_local! {
    static REFUSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// For tests (feature `test-hooks`): every [`spawn_scoped`] called from this thread
/// fails while `refuse` is set, as under a container's limit.
#[cfg(any(test, feature = "test-hooks"))]
pub fn refuse_threads(refuse: bool) {
    REFUSE.with(|r| r.set(refuse));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scoped_thread_runs_and_a_refused_one_is_an_error() {
        let n = std::thread::scope(|s| spawn_scoped(s, "t", || 7).unwrap().join().unwrap());
        assert_eq!(n, 7);
        // (The hook is compiled into tt-device's own tests whatever the features.)
        refuse_threads(true);
        let refused = std::thread::scope(|s| spawn_scoped(s, "t", || 7).map(|_| ()));
        refuse_threads(false);
        assert!(refused.is_err());
    }
}
