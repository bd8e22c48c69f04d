//! Which errors are out-of-memory. Any other error is handed back untouched.

use std::fmt;

/// The kind of out-of-memory an error reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OomKind {
    /// CUDA's caching allocator: "CUDA out of memory".
    Cuda,
    /// cuDNN could not get workspace: `CUDNN_STATUS_NOT_SUPPORTED` / `ALLOC_FAILED`.
    Cudnn,
    /// cuBLAS could not allocate: `CUBLAS_STATUS_ALLOC_FAILED`.
    Cublas,
    /// The CPU allocator: "can't allocate memory".
    Cpu,
    /// Apple's MPS backend: "MPS backend out of memory".
    Mps,
}

impl fmt::Display for OomKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OomKind::Cuda => "CUDA out of memory",
            OomKind::Cudnn => "cuDNN out of memory",
            OomKind::Cublas => "cuBLAS out of memory",
            OomKind::Cpu => "CPU out of memory",
            OomKind::Mps => "MPS out of memory",
        })
    }
}

/// Classifies libtorch's messages, as `tch::TchError` carries them (and as panics of
/// tch's non-`f_` methods print them).
pub fn classify_message(message: &str) -> Option<OomKind> {
    if message.contains("CUDA out of memory") || message.contains("CUDA error: out of memory") {
        Some(OomKind::Cuda)
    } else if message.contains("CUDNN_STATUS_NOT_SUPPORTED")
        || message.contains("CUDNN_STATUS_ALLOC_FAILED")
    {
        Some(OomKind::Cudnn)
    } else if message.contains("CUBLAS_STATUS_ALLOC_FAILED") {
        Some(OomKind::Cublas)
    } else if message.contains("can't allocate memory")
        || message.contains("DefaultCPUAllocator: not enough memory")
    {
        Some(OomKind::Cpu)
    } else if message.contains("MPS backend out of memory") {
        Some(OomKind::Mps)
    } else {
        None
    }
}

/// Decides whether an error is an out-of-memory, which the adaptive helpers retry
/// smaller; any other error is returned at once. Implemented for `tch::TchError`
/// (feature `tch`), `String` and boxed errors; implement it for your own error types.
pub trait OomClassify {
    /// The kind of OOM this error is, or `None`.
    fn oom_kind(&self) -> Option<OomKind>;
}

impl OomClassify for String {
    fn oom_kind(&self) -> Option<OomKind> {
        classify_message(self)
    }
}

/// A boxed error (a training step's, say) is an out-of-memory one when its message,
/// or that of one of its causes, says so.
impl OomClassify for Box<dyn std::error::Error + Send + Sync> {
    fn oom_kind(&self) -> Option<OomKind> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(self.as_ref());
        while let Some(e) = next {
            if let Some(kind) = classify_message(&e.to_string()) {
                return Some(kind);
            }
            next = e.source();
        }
        None
    }
}

#[cfg(feature = "tch")]
impl OomClassify for tch::TchError {
    fn oom_kind(&self) -> Option<OomKind> {
        classify_message(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libtorch_messages_are_classified() {
        let cases = [
            ("CUDA out of memory. Tried to allocate 30.00 GiB. GPU 0 has a total capacity of 79.18 GiB", Some(OomKind::Cuda)),
            ("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.", Some(OomKind::Cudnn)),
            ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", Some(OomKind::Cublas)),
            ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes.", Some(OomKind::Cpu)),
            ("MPS backend out of memory (MPS allocated: 1.2 GB)", Some(OomKind::Mps)),
            ("shape '[2, 3]' is invalid for input of size 7", None),
            ("CUDA error: device-side assert triggered", None),
        ];
        for (message, kind) in cases {
            assert_eq!(classify_message(message), kind, "{message}");
        }
    }

    /// A training step's boxed error is an out-of-memory one when it, or one of its
    /// causes, says so: a user's wrapper around libtorch's error is still retried.
    #[test]
    fn a_boxed_error_is_classified_through_its_causes() {
        #[derive(Debug)]
        struct Wrapper(std::io::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("the forward pass failed")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let oom = std::io::Error::other("CUDA out of memory. Tried to allocate 2.00 GiB");
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(Wrapper(oom));
        assert_eq!(boxed.oom_kind(), Some(OomKind::Cuda));
        let other = std::io::Error::other("shape mismatch");
        let boxed: Box<dyn std::error::Error + Send + Sync> = Box::new(Wrapper(other));
        assert_eq!(boxed.oom_kind(), None);
    }
}
