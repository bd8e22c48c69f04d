//! Keeping the memory a training step frees for the next step (glibc's allocator).

use std::sync::OnceLock;

/// glibc's variables and tunables that set what [`keep_freed_memory`] would: where one
/// is set, the environment has chosen and is left alone.
pub const MALLOC_VARIABLES: [&str; 4] = [
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
];

/// The largest block served from the heap (glibc's own ceiling for its moving
/// threshold on 64-bit machines); larger ones are mapped and unmapped each time.
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Free memory at the top of the heap kept before any is given back.
const TRIM_THRESHOLD: i32 = 1 << 30;

/// What [`keep_freed_memory`] did (the first call decides for the process).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreedMemory {
    /// The allocator now keeps freed memory: blocks up to 32 MiB come from the heap,
    /// and up to 1 GiB free at its top stays mapped.
    Kept,
    /// Left alone, and why: the environment sets the allocator's thresholds (the
    /// variable named), or the process has an address-space limit (`RLIMIT_AS`), under
    /// which kept memory could refuse a large block the default would have mapped.
    Left(String),
    /// Not glibc's allocator, or it refused the settings.
    Unsupported,
}

/// Keeps the memory that a training step frees for the next step, once per process.
///
/// glibc's `malloc` gives memory back to the kernel as soon as more than a threshold
/// lies free at the top of its heap (128 KiB, raised as blocks are freed), and maps
/// every block above another threshold afresh: a training step that allocates its
/// activations and frees them at its end can then hand them back and fault every page
/// in again at the next step. On the 2-core VM a 4.2M-parameter decoder's step took
/// 1,500 to 6,000 page faults (about 20% of the step) whenever the heap's layout put
/// the step's memory at its top, and none otherwise, so the same loop ran 10-25% slower
/// from one run to the next. This sets `M_MMAP_THRESHOLD` to 32 MiB and
/// `M_TRIM_THRESHOLD` to 1 GiB (PyTorch's CPU guide gets the same from jemalloc or
/// tcmalloc): the process keeps its step's high-water mark, as PyTorch's CUDA caching
/// allocator does on the GPU.
///
/// [`Trainer`](crate::Trainer) calls it unless
/// [`TrainConfig::keep_freed_memory`](crate::TrainConfig::keep_freed_memory) is
/// `false` or the run expects out-of-memory errors
/// ([`TrainConfig::adaptive_micro_batch`](crate::TrainConfig::adaptive_micro_batch));
/// a loop of your own can call it first. Nothing changes where one of
/// [`MALLOC_VARIABLES`] or a `glibc.malloc` threshold in `GLIBC_TUNABLES` is set, or
/// under an address-space limit (`ulimit -v`). If your program sets the thresholds
/// itself (`mallopt`), set `keep_freed_memory(false)`: glibc cannot be asked for them.
///
/// ```
/// let done = tt_train::keep_freed_memory();
/// assert_eq!(done, tt_train::keep_freed_memory()); // once per process
/// ```
pub fn keep_freed_memory() -> FreedMemory {
    static DONE: OnceLock<FreedMemory> = OnceLock::new();
    DONE.get_or_init(|| {
        if let Some(name) = chosen_by(|name| std::env::var(name).ok()) {
            return FreedMemory::Left(format!("{name} is set"));
        }
        if matches!(tt_adaptive::address_space_limit(), Ok(Some(_))) {
            return FreedMemory::Left("the process has an address-space limit (RLIMIT_AS)".into());
        }
        set_thresholds()
    })
    .clone()
}

/// The variable through which the environment sets glibc's thresholds, if any.
fn chosen_by(var: impl Fn(&str) -> Option<String>) -> Option<String> {
    if let Some(name) = MALLOC_VARIABLES.iter().find(|n| var(n).is_some()) {
        return Some((*name).to_owned());
    }
    let tunables = var("GLIBC_TUNABLES")?;
    let names = ["trim_threshold", "mmap_threshold", "top_pad", "mmap_max"];
    tunables
        .split(':')
        .filter_map(|t| t.split('=').next())
        .find(|t| {
            t.strip_prefix("glibc.malloc.")
                .is_some_and(|rest| names.contains(&rest))
        })
        .map(|t| format!("GLIBC_TUNABLES ({t})"))
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> FreedMemory {
    // SAFETY: mallopt only changes the allocator's parameters, under its own lock.
    let set = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    };
    if set {
        FreedMemory::Kept
    } else {
        FreedMemory::Unsupported
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> FreedMemory {
    FreedMemory::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_threshold_the_environment_sets_is_named_and_others_are_not_ours() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        assert_eq!(chosen_by(env(&[])), None);
        assert_eq!(
            chosen_by(env(&[("MALLOC_TOP_PAD_", "0")])).as_deref(),
            Some("MALLOC_TOP_PAD_")
        );
        assert_eq!(
            chosen_by(env(&[(
                "GLIBC_TUNABLES",
                "glibc.rtld.nns=2:glibc.malloc.trim_threshold=0"
            )]))
            .as_deref(),
            Some("GLIBC_TUNABLES (glibc.malloc.trim_threshold)")
        );
        // Other tunables, and malloc's that do not set these thresholds: ours to set.
        let others = env(&[(
            "GLIBC_TUNABLES",
            "glibc.malloc.arena_max=1:glibc.pthread.x=1",
        )]);
        assert_eq!(chosen_by(others), None);
    }
}
