use std::collections::HashMap;
use std::fmt;
use std::panic::{self, AssertUnwindSafe, Location};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::classify::{classify_message, OomClassify, OomKind};
use crate::memory::{release_cached_memory, MemoryProbe};

/// How the size goes down after an out-of-memory, and back up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// toma's rule: halve on OOM, never grow back.
    Halve,
    /// accelerate's rule: multiply by the factor (e.g. 0.9) on OOM.
    Factor(f64),
    /// Remember the largest size that worked and the smallest that failed (per cache
    /// key); later calls, and later steps of a `range`/`chunked`, try between them, so
    /// the size converges to at least 95% of the largest that fits without redoing
    /// finished work. The default.
    Search,
}

/// What the remembered sizes are keyed by.
///
/// The `*_keyed` methods ([`Adaptive::batch_keyed`], [`Adaptive::range_keyed`]) replace
/// the call site by a key of yours: use them when one helper function runs the
/// adaptive call for several models or inputs of different sizes. The call site is
/// then the helper's line for all of them (toma keys by the whole call stack), so
/// without a key model A would start from model B's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// The call site (`#[track_caller]`), or the explicit key, and the free memory of
    /// the device, in 256 MiB buckets (toma's default). Free memory counts what
    /// libtorch's allocator holds but does not use, so a second call finds the first
    /// one's entry.
    CallSite,
    /// One entry for this [`Adaptive`] (toma's `GlobalBatchsizeCache`); one per key
    /// for the `*_keyed` methods.
    Global,
    /// Nothing is remembered between calls (toma's `NoBatchsizeCache`): every call
    /// starts from its initial size and lowers from there, like toma; within one
    /// `range` or `chunked` call the policy may search back up between what that call
    /// saw fit and fail. Statistics are still counted.
    None,
}

/// The cache [`Adaptive::new`] starts with, for the whole process (toma's
/// `DEFAULT_CACHE_TYPE`): [`Cache::CallSite`] until [`set_default_cache`] says otherwise.
static DEFAULT_CACHE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Sets the cache every later [`Adaptive::new`] starts with, in this process (toma's
/// `toma.DEFAULT_CACHE_TYPE = ...`); [`Adaptive::cache`] still chooses per instance.
pub fn set_default_cache(cache: Cache) {
    let code = match cache {
        Cache::CallSite => 0,
        Cache::Global => 1,
        Cache::None => 2,
    };
    DEFAULT_CACHE.store(code, std::sync::atomic::Ordering::Relaxed);
}

/// The cache [`Adaptive::new`] starts with now (see [`set_default_cache`]).
pub fn default_cache() -> Cache {
    match DEFAULT_CACHE.load(std::sync::atomic::Ordering::Relaxed) {
        1 => Cache::Global,
        2 => Cache::None,
        _ => Cache::CallSite,
    }
}

/// Why an adaptive call failed.
#[derive(Debug)]
pub enum AdaptiveError<E> {
    /// An error that is not an out-of-memory, returned untouched at its first occurrence.
    Failed(E),
    /// Even the minimum size ran out of memory.
    NoFit {
        /// The minimum size.
        min: usize,
        /// The last out-of-memory error (absent when it was a caught panic); the message
        /// says it.
        cause: Option<E>,
        /// What kind of out-of-memory it was, or the caught panic's message.
        reason: String,
    },
}

impl<E: fmt::Display> fmt::Display for AdaptiveError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AdaptiveError::Failed(e) => e.fmt(f),
            AdaptiveError::NoFit { min, reason, cause } => {
                write!(f, "out of memory even at the minimum size {min}: ")?;
                // The last error's own words (what it says is its cause: never also
                // given as `source()`), else the caught panic's message.
                match cause {
                    Some(e) => e.fmt(f)?,
                    None => f.write_str(reason)?,
                }
                f.write_str("; free memory (smaller model, other processes) or lower the minimum")
            }
        }
    }
}

/// The cause is said once, as everywhere in torchtools: in the message, never also in
/// `source()`. `Failed` is transparent (its message and source are the error's own);
/// `NoFit`'s message holds the last out-of-memory error's, and its source is what that
/// error's own source was (so `{:#}` and error reporters print each cause once). Error
/// types without `std::error::Error` (a `String`) still print and match; convert with
/// `.map_err(|e| e.to_string())` to use `?`.
impl<E: std::error::Error + 'static> std::error::Error for AdaptiveError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AdaptiveError::Failed(e) => e.source(),
            AdaptiveError::NoFit { cause: Some(e), .. } => e.source(),
            AdaptiveError::NoFit { .. } => None,
        }
    }
}

/// What one call site has done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiteStats {
    /// `file:line:column` of the call, the key of a `*_keyed` call, or `global`.
    pub site: String,
    /// Free memory bucket (256 MiB units) of the entry.
    pub bucket: u64,
    /// Calls.
    pub calls: u64,
    /// Attempts (calls plus retries).
    pub attempts: u64,
    /// Out-of-memory errors.
    pub ooms: u64,
    /// The largest size that worked, where the next call starts from (0 when nothing
    /// is remembered, as with [`Cache::None`]).
    pub size: usize,
}

/// Where a call comes from, as far as the cache is concerned.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Site {
    Caller(&'static Location<'static>),
    Named(Arc<str>),
    Global,
}

/// A cache entry's key: the site and the free-memory bucket.
type Key = (Site, u64);

/// What is known about the sizes: the largest that worked and the smallest that failed.
#[derive(Debug, Clone, Copy, Default)]
struct Sizes {
    largest_ok: Option<usize>,
    smallest_fail: Option<usize>,
}

#[derive(Debug, Clone, Default)]
struct Counters {
    calls: u64,
    attempts: u64,
    ooms: u64,
}

#[derive(Debug, Clone, Default)]
struct Entry {
    sizes: Sizes,
    counters: Counters,
}

/// One call's view of the cache: its entry, and with [`Cache::None`] the sizes this
/// call alone has learned (nothing crosses from one call to the next).
struct Call {
    key: Key,
    own: Option<Sizes>,
}

/// Called on an out-of-memory with its kind and the size that failed, before the size is
/// lowered; returning `true` means memory was handed back (a tt-fence shrunk, say), so
/// the same size is tried once more.
pub type OomHook = Arc<dyn Fn(OomKind, usize) -> bool + Send + Sync>;

/// Called with the size a call would start from; returns the size every process agrees
/// on (the minimum over ranks, in tt-dist). It is a collective: every rank must make the
/// same calls.
pub type AgreeHook = Arc<dyn Fn(usize) -> usize + Send + Sync>;

const BUCKET: u64 = 256 << 20;
const REFRESH_EVERY: Duration = Duration::from_secs(1);

struct Shared {
    entries: Mutex<HashMap<Key, Entry>>,
    bucket: Mutex<Option<(Instant, u64)>>,
}

/// OOM-adaptive execution: [`Adaptive::batch`], [`Adaptive::range`] and (feature `tch`)
/// `Adaptive::chunked`. Clones share their caches and statistics.
#[derive(Clone)]
pub struct Adaptive {
    policy: Policy,
    cache: Cache,
    min: usize,
    max: usize,
    grow: bool,
    catch_panics: bool,
    memory: Arc<dyn MemoryProbe>,
    on_oom: Option<OomHook>,
    agree: Option<AgreeHook>,
    shared: Arc<Shared>,
}

impl fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adaptive")
            .field("policy", &self.policy)
            .field("cache", &self.cache)
            .field("min", &self.min)
            .field("max", &self.max)
            .field("grow", &self.grow)
            .field("catch_panics", &self.catch_panics)
            .finish_non_exhaustive()
    }
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive::new()
    }
}

impl Adaptive {
    /// `Search`, the process's default cache ([`set_default_cache`]; the call site
    /// unless set) keyed by the free memory of the device this process trains on (with
    /// the `tch` feature: `DeviceMemory`, a GPU's when tt-device selects one; without
    /// it the CPU's; [`Adaptive::memory`] chooses another), minimum 1, no maximum, no
    /// growth, panics not caught.
    pub fn new() -> Adaptive {
        #[cfg(feature = "tch")]
        let memory: Arc<dyn MemoryProbe> = Arc::new(crate::memory::DeviceMemory::default());
        #[cfg(not(feature = "tch"))]
        let memory: Arc<dyn MemoryProbe> = Arc::new(crate::memory::CpuMemory);
        Adaptive {
            policy: Policy::Search,
            cache: default_cache(),
            min: 1,
            max: usize::MAX,
            grow: false,
            catch_panics: false,
            memory,
            on_oom: None,
            agree: None,
            shared: Arc::new(Shared {
                entries: Mutex::new(HashMap::new()),
                bucket: Mutex::new(None),
            }),
        }
    }

    /// The policy.
    pub fn policy(mut self, policy: Policy) -> Adaptive {
        self.policy = policy;
        self
    }

    /// The cache.
    pub fn cache(mut self, cache: Cache) -> Adaptive {
        self.cache = cache;
        self
    }

    /// The smallest size to try: below it, [`AdaptiveError::NoFit`].
    pub fn min(mut self, min: usize) -> Adaptive {
        self.min = min.max(1);
        self
    }

    /// The largest size ever tried.
    pub fn max(mut self, max: usize) -> Adaptive {
        self.max = max.max(1);
        self
    }

    /// Grow from a small start (Lightning's power mode): double after each success
    /// until an OOM or [`Adaptive::max`], then search between.
    pub fn grow(mut self, grow: bool) -> Adaptive {
        self.grow = grow;
        self
    }

    /// Also treat a panic whose message is an out-of-memory as an OOM (tch's non-`f_`
    /// methods panic on errors). Off by default: prefer the `f_` methods, which return
    /// `Result`. Other panics propagate.
    pub fn catch_oom_panics(mut self, catch: bool) -> Adaptive {
        self.catch_panics = catch;
        self
    }

    /// Where free memory is read for the cache key: the device the work runs on.
    pub fn memory(mut self, probe: impl MemoryProbe + 'static) -> Adaptive {
        self.memory = Arc::new(probe);
        *self.shared.bucket.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self
    }

    /// A hook called on each OOM before lowering (see [`OomHook`]).
    pub fn on_oom(
        mut self,
        hook: impl Fn(OomKind, usize) -> bool + Send + Sync + 'static,
    ) -> Adaptive {
        self.on_oom = Some(Arc::new(hook));
        self
    }

    /// A hook that makes several processes agree on the starting size (see
    /// [`AgreeHook`]).
    pub fn agree(mut self, hook: impl Fn(usize) -> usize + Send + Sync + 'static) -> Adaptive {
        self.agree = Some(Arc::new(hook));
        self
    }

    /// Re-reads free memory now (it is otherwise re-read at most once a second, and
    /// after each OOM).
    pub fn refresh_memory(&self) {
        self.bucket(true);
    }

    /// Every cache entry's statistics.
    pub fn stats(&self) -> Vec<SiteStats> {
        let entries = self
            .shared
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<SiteStats> = entries
            .iter()
            .map(|((site, bucket), e)| SiteStats {
                site: match site {
                    Site::Caller(l) => l.to_string(),
                    Site::Named(name) => name.to_string(),
                    Site::Global => "global".into(),
                },
                bucket: *bucket,
                calls: e.counters.calls,
                attempts: e.counters.attempts,
                ooms: e.counters.ooms,
                size: e.sizes.largest_ok.unwrap_or(0),
            })
            .collect();
        out.sort_by(|a, b| a.site.cmp(&b.site).then(a.bucket.cmp(&b.bucket)));
        out
    }

    /// Runs `f(batch_size)` from `initial` (or the remembered size), retrying smaller on
    /// out-of-memory, and returns its result.
    ///
    /// ```
    /// use tt_adaptive::Adaptive;
    /// let adaptive = Adaptive::new();
    /// // A fake budget: sizes above 100 fail with libtorch's CPU OOM message.
    /// let run = |n: usize| -> Result<usize, String> {
    ///     if n > 100 { Err("DefaultCPUAllocator: can't allocate memory".into()) } else { Ok(n) }
    /// };
    /// assert_eq!(adaptive.batch(512, run).ok(), Some(64)); // 512, 256, 128 failed
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[track_caller]
    pub fn batch<T, E: OomClassify>(
        &self,
        initial: usize,
        f: impl FnMut(usize) -> Result<T, E>,
    ) -> Result<T, AdaptiveError<E>> {
        self.batch_at(Site::Caller(Location::caller()), initial, f)
    }

    /// [`batch`](Self::batch) with the cache entry named by `key` instead of the call
    /// site: for a helper that runs several models (or inputs of different sizes)
    /// through one line of code, give each its own key (the model's name, say), or
    /// they share one remembered size.
    ///
    /// ```
    /// use tt_adaptive::{Adaptive, Cache};
    /// let adaptive = Adaptive::new().cache(Cache::Global); // one entry per key
    /// // One helper for every model: its call site is the same for all of them.
    /// let run = |model: &str, fits: usize| {
    ///     adaptive.batch_keyed(model, 1024, |n| -> Result<usize, String> {
    ///         if n > fits { Err("CUDA out of memory. Tried to allocate".into()) } else { Ok(n) }
    ///     })
    /// };
    /// assert_eq!(run("small", 1000).ok(), Some(512));
    /// assert_eq!(run("large", 100).ok(), Some(64));
    /// assert_eq!(run("small", 1000).ok(), Some(768)); // its own entry, searching up
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn batch_keyed<T, E: OomClassify>(
        &self,
        key: impl AsRef<str>,
        initial: usize,
        f: impl FnMut(usize) -> Result<T, E>,
    ) -> Result<T, AdaptiveError<E>> {
        self.batch_at(Site::Named(Arc::from(key.as_ref())), initial, f)
    }

    fn batch_at<T, E: OomClassify>(
        &self,
        site: Site,
        initial: usize,
        mut f: impl FnMut(usize) -> Result<T, E>,
    ) -> Result<T, AdaptiveError<E>> {
        let mut call = self.call(site);
        let mut size = self.start(&mut call, initial);
        loop {
            match self.attempt(&mut call, size, &mut f)? {
                Ok(value) => {
                    let _ = self.succeeded(&mut call, size);
                    return Ok(value);
                }
                Err(next) => size = next,
            }
        }
    }

    /// Calls `f(from, to)` over `start..end` in steps of `initial_step` (or the
    /// remembered step); on out-of-memory the step is lowered and the loop continues
    /// from where it failed, so every index is processed exactly once.
    #[track_caller]
    pub fn range<E: OomClassify>(
        &self,
        start: usize,
        end: usize,
        initial_step: usize,
        f: impl FnMut(usize, usize) -> Result<(), E>,
    ) -> Result<(), AdaptiveError<E>> {
        self.range_at(
            Site::Caller(Location::caller()),
            start,
            end,
            initial_step,
            f,
        )
    }

    /// [`range`](Self::range) with the cache entry named by `key` instead of the call
    /// site (see [`batch_keyed`](Self::batch_keyed)).
    pub fn range_keyed<E: OomClassify>(
        &self,
        key: impl AsRef<str>,
        start: usize,
        end: usize,
        initial_step: usize,
        f: impl FnMut(usize, usize) -> Result<(), E>,
    ) -> Result<(), AdaptiveError<E>> {
        let site = Site::Named(Arc::from(key.as_ref()));
        self.range_at(site, start, end, initial_step, f)
    }

    pub(crate) fn range_at<E: OomClassify>(
        &self,
        site: Site,
        start: usize,
        end: usize,
        initial_step: usize,
        mut f: impl FnMut(usize, usize) -> Result<(), E>,
    ) -> Result<(), AdaptiveError<E>> {
        let mut call = self.call(site);
        let mut step = self.start(&mut call, initial_step);
        let mut at = start;
        while at < end {
            let size = step.min(end - at);
            match self.attempt(&mut call, size, &mut |n| f(at, at + n))? {
                Ok(()) => {
                    at += size;
                    if size == step {
                        step = self.succeeded(&mut call, size);
                    } else {
                        self.with_entry(&mut call, |_, c| c.attempts += 1);
                    }
                }
                Err(next) => step = next,
            }
        }
        Ok(())
    }

    /// The cache entry of a call from `site`, and its own memory under [`Cache::None`].
    fn call(&self, site: Site) -> Call {
        let key = match (self.cache, site) {
            (Cache::CallSite, site) => (site, self.bucket(false)),
            (Cache::Global | Cache::None, Site::Named(name)) => (Site::Named(name), 0),
            (Cache::Global | Cache::None, _) => (Site::Global, 0),
        };
        Call {
            key,
            own: (self.cache == Cache::None).then(Sizes::default),
        }
    }

    /// Free-memory bucket, re-read at most once a second (or when forced by an OOM):
    /// reading memory stays off the success path's hot loop.
    fn bucket(&self, force: bool) -> u64 {
        let mut b = self.shared.bucket.lock().unwrap_or_else(|e| e.into_inner());
        match *b {
            Some((at, value)) if !force && at.elapsed() < REFRESH_EVERY => value,
            _ => {
                let value = self.memory.free_bytes().unwrap_or(0) / BUCKET;
                *b = Some((Instant::now(), value));
                value
            }
        }
    }

    /// Runs `f` on the sizes this call goes by (the shared entry's, or the call's own
    /// under [`Cache::None`]) and the entry's counters, under the one lock.
    fn with_entry<R>(&self, call: &mut Call, f: impl FnOnce(&mut Sizes, &mut Counters) -> R) -> R {
        let mut entries = self
            .shared
            .entries
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let entry = match entries.get_mut(&call.key) {
            Some(entry) => entry,
            None => entries.entry(call.key.clone()).or_default(),
        };
        match &mut call.own {
            Some(own) => f(own, &mut entry.counters),
            None => f(&mut entry.sizes, &mut entry.counters),
        }
    }

    fn start(&self, call: &mut Call, initial: usize) -> usize {
        let size = self.with_entry(call, |sizes, c| {
            c.calls += 1;
            self.propose(sizes, initial)
        });
        let size = size.clamp(self.min, self.max);
        match &self.agree {
            Some(agree) => agree(size).clamp(self.min, self.max),
            None => size,
        }
    }

    fn propose(&self, e: &Sizes, initial: usize) -> usize {
        let grown = |ok: usize| {
            if self.grow {
                ok.saturating_mul(2).min(self.max)
            } else {
                ok.max(initial)
            }
        };
        match self.policy {
            Policy::Search => match (e.largest_ok, e.smallest_fail) {
                (Some(ok), Some(fail)) if fail > ok => {
                    if converged(ok, fail) {
                        ok
                    } else {
                        ok + (fail - ok) / 2
                    }
                }
                (Some(ok), Some(_)) => ok,
                (Some(ok), None) => grown(ok),
                (None, Some(fail)) if initial >= fail => (fail / 2).max(1),
                _ => initial,
            },
            Policy::Halve | Policy::Factor(_) => match (e.largest_ok, e.smallest_fail) {
                (Some(ok), None) => grown(ok),
                (Some(ok), Some(_)) => ok,
                _ => initial,
            },
        }
    }

    /// Records a success (one lock on the success path) and returns the size to try
    /// next (for the next step of a range).
    fn succeeded(&self, call: &mut Call, size: usize) -> usize {
        self.with_entry(call, |e, c| {
            c.attempts += 1;
            e.largest_ok = Some(e.largest_ok.map_or(size, |ok| ok.max(size)));
            if e.smallest_fail.is_some_and(|fail| fail <= size) {
                e.smallest_fail = None; // memory got freer since
            }
            self.propose(e, size)
        })
        .clamp(self.min, self.max)
    }

    /// One attempt: `Ok(Ok(value))`, or `Ok(Err(next size))` after an OOM, or the error.
    fn attempt<T, E: OomClassify>(
        &self,
        call: &mut Call,
        size: usize,
        f: &mut dyn FnMut(usize) -> Result<T, E>,
    ) -> Result<Result<T, usize>, AdaptiveError<E>> {
        let mut hook_retried = false;
        loop {
            // An error, or a caught panic's OOM kind and message.
            let outcome: Result<T, (Option<E>, Option<OomKind>, String)> = if self.catch_panics {
                match panic::catch_unwind(AssertUnwindSafe(|| f(size))) {
                    Ok(Ok(value)) => Ok(value),
                    Ok(Err(e)) => Err((Some(e), None, String::new())),
                    Err(payload) => {
                        let message = payload
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                            .unwrap_or_default();
                        match classify_message(&message) {
                            Some(kind) => Err((None, Some(kind), message)),
                            None => panic::resume_unwind(payload),
                        }
                    }
                }
            } else {
                f(size).map_err(|e| (Some(e), None, String::new()))
            };
            let (error, kind, message) = match outcome {
                Ok(value) => return Ok(Ok(value)),
                Err(failure) => failure,
            };
            let kind = match (kind, error.as_ref().and_then(OomClassify::oom_kind)) {
                (Some(kind), _) | (None, Some(kind)) => kind,
                (None, None) => match error {
                    Some(e) => return Err(AdaptiveError::Failed(e)),
                    None => unreachable_no_error(),
                },
            };
            self.with_entry(call, |e, c| {
                c.attempts += 1;
                c.ooms += 1;
                e.smallest_fail = Some(e.smallest_fail.map_or(size, |f| f.min(size)));
                if e.largest_ok.is_some_and(|ok| ok >= size) {
                    e.largest_ok = None; // memory got tighter since
                }
            });
            release_cached_memory(kind);
            if !hook_retried {
                if let Some(hook) = &self.on_oom {
                    if hook(kind, size) {
                        hook_retried = true;
                        continue;
                    }
                }
            }
            let free = self.bucket(true) * BUCKET;
            let next = self.lower(call, size);
            tracing::info!(size, next, %kind, free_bytes = free, "out of memory: retrying smaller");
            if next < self.min || next >= size {
                return Err(AdaptiveError::NoFit {
                    min: self.min,
                    reason: if message.is_empty() {
                        kind.to_string()
                    } else {
                        message
                    },
                    cause: error,
                });
            }
            return Ok(Err(next));
        }
    }

    fn lower(&self, call: &mut Call, size: usize) -> usize {
        let ok = self.with_entry(call, |e, _| e.largest_ok);
        match self.policy {
            Policy::Halve => size / 2,
            Policy::Factor(f) => {
                let next = (size as f64 * f.clamp(0.0, 1.0)).floor() as usize;
                next.min(size.saturating_sub(1))
            }
            Policy::Search => match ok {
                Some(ok) if ok < size && !converged(ok, size) => ok + (size - ok) / 2,
                Some(ok) if ok < size => ok,
                _ => size / 2,
            },
        }
    }
}

/// A failure is either an error or a caught panic's message; never neither.
#[cold]
fn unreachable_no_error() -> OomKind {
    OomKind::Cpu
}

/// Within 5%: the largest size that worked is at least 95% of the smallest that failed.
fn converged(ok: usize, fail: usize) -> bool {
    fail - ok <= (fail / 20).max(1)
}
