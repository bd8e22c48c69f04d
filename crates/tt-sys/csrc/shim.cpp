// See shim.h. Keep this file small: it is the only C++ of torchtools.
#include "shim.h"
#include "protect.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/headeronly/version.h>

namespace {

c10::DeviceAllocator* cuda_allocator() {
  return c10::getDeviceAllocator(c10::DeviceType::CUDA);
}

void copy_stat(const c10::CachingAllocator::Stat& s, tt_stat* out) {
  out->current = s.current;
  out->peak = s.peak;
  out->allocated = s.allocated;
  out->freed = s.freed;
}

constexpr size_t kAggregate =
    static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

// Loads libtorch_cuda.so (beside the libc10.so in use) as the program starts, before
// main, so before any code can ask libtorch about CUDA: libtorch answers the first such
// question from its CPU-only stub when its CUDA library is not loaded yet, and keeps that
// answer for the process (`tch::Cuda::is_available()` first in main would hide every
// GPU). Only where an NVIDIA driver is (its device node; WSL's GPU node): elsewhere
// CUDA cannot work, and loading the library would cost every process startup time and
// memory. A CPU-only libtorch has no such library: nothing happens. Failures are left
// to tt_sys::ensure_cuda_loaded, which says why. TORCHTOOLS_CUDA_PRELOAD=0 turns it off.
__attribute__((constructor)) void tt_preload_cuda() {
  try {
    const char* off = std::getenv("TORCHTOOLS_CUDA_PRELOAD");
    if (off != nullptr && std::strcmp(off, "0") == 0) {
      return;
    }
    if (access("/dev/nvidiactl", F_OK) != 0 && access("/dev/dxg", F_OK) != 0) {
      return;
    }
    Dl_info info;
    auto addr = reinterpret_cast<void*>(&c10::GetAllocator);
    if (dladdr(addr, &info) == 0 || info.dli_fname == nullptr) {
      return;
    }
    std::string path(info.dli_fname);
    auto slash = path.rfind('/');
    path = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
           "libtorch_cuda.so";
    if (access(path.c_str(), F_OK) == 0) {
      dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    }
  } catch (...) {
    // Nothing may escape a constructor; ensure_cuda_loaded reports what went wrong.
  }
}

}  // namespace

extern "C" {

void tt_free_error(char* err) { std::free(err); }

const char* tt_torch_version(void) { return TORCH_VERSION; }

char* tt_c10_library_path(char** out_path) {
  TT_PROTECT({
    Dl_info info;
    auto addr = reinterpret_cast<void*>(&c10::GetAllocator);
    if (dladdr(addr, &info) == 0 || info.dli_fname == nullptr) {
      throw std::runtime_error("dladdr could not locate libc10.so");
    }
    *out_path = tt::dup_message(info.dli_fname);
  })
}

char* tt_cuda_device_count(int32_t* out) {
  TT_PROTECT({ *out = at::detail::getCUDAHooks().getNumGPUs(); })
}

char* tt_cuda_runtime_version(int64_t* out) {
  TT_PROTECT({ *out = at::detail::getCUDAHooks().versionCUDART(); })
}

char* tt_cuda_device_stats(int32_t device, tt_device_stats* out) {
  TT_PROTECT({
    // Before libtorch's first CUDA use the caching allocator refuses every device
    // ("did you call init?"): nothing is allocated yet, so the statistics are zeros,
    // as Python's torch.cuda.memory_stats() is empty then.
    if (!cuda_allocator()->initialized()) {
      std::memset(out, 0, sizeof(*out));
      return nullptr;
    }
    auto stats = cuda_allocator()->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    copy_stat(stats.allocated_bytes[kAggregate], &out->allocated_bytes);
    copy_stat(stats.reserved_bytes[kAggregate], &out->reserved_bytes);
    copy_stat(stats.active_bytes[kAggregate], &out->active_bytes);
    copy_stat(stats.requested_bytes[kAggregate], &out->requested_bytes);
    out->num_alloc_retries = stats.num_alloc_retries;
    out->num_ooms = stats.num_ooms;
    out->num_device_alloc = stats.num_device_alloc;
    out->num_device_free = stats.num_device_free;
  })
}

char* tt_cuda_empty_cache(void) { TT_PROTECT({ cuda_allocator()->emptyCache(); }) }

char* tt_cuda_reset_peak_stats(int32_t device) {
  TT_PROTECT({
    // Nothing allocated yet: every peak is already zero.
    if (cuda_allocator()->initialized()) {
      cuda_allocator()->resetPeakStats(static_cast<c10::DeviceIndex>(device));
    }
  })
}

char* tt_cuda_mem_get_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes) {
  TT_PROTECT({
    // The allocator answers only once libtorch has initialised CUDA (what its first
    // CUDA tensor would do; idempotent).
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    auto info = cuda_allocator()->getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    *free_bytes = info.first;
    *total_bytes = info.second;
  })
}

// Autocast (torch.autocast) for one device type: 0 = CPU, 1 = CUDA. `dtype` is a
// c10::ScalarType code (5 = Half, 15 = BFloat16). Writes the previous state.
char* tt_autocast_set(int32_t device_type, bool enabled, int32_t dtype, bool* prev_enabled,
                      int32_t* prev_dtype) {
  TT_PROTECT({
    c10::DeviceType dev;
    switch (device_type) {
      case 0: dev = c10::DeviceType::CPU; break;
      case 1: dev = c10::DeviceType::CUDA; break;
      default: throw std::invalid_argument("autocast: unknown device type");
    }
    *prev_enabled = at::autocast::is_autocast_enabled(dev);
    *prev_dtype = static_cast<int32_t>(at::autocast::get_autocast_dtype(dev));
    at::autocast::set_autocast_dtype(dev, static_cast<c10::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dev, enabled);
  })
}

// torch.autocast's __enter__ / __exit__ bookkeeping: the cast cache lives while any
// autocast region is open and is cleared when the outermost one closes.
char* tt_autocast_nesting(bool enter) {
  TT_PROTECT({
    if (enter) {
      at::autocast::increment_nesting();
    } else if (at::autocast::decrement_nesting() == 0) {
      at::autocast::clear_cache();
    }
  })
}

}  // extern "C"

namespace {

std::vector<at::Tensor> tensors_of(void* const* ps, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(*static_cast<at::Tensor*>(ps[i]));
  return out;
}

std::vector<at::Scalar> scalars_of(const double* xs, size_t n) {
  return std::vector<at::Scalar>(xs, xs + n);
}

}  // namespace

char* tt_set_grads_none(void* const* tensors, size_t n) {
  TT_PROTECT({
    for (size_t i = 0; i < n; ++i) static_cast<at::Tensor*>(tensors[i])->mutable_grad().reset();
  })
}

char* tt_foreach_adam(void* const* params, void* const* grads, void* const* exp_avgs,
                      void* const* exp_avg_sqs, size_t n, const double* step_sizes,
                      const double* bias_correction2_sqrts, double lr, double beta1,
                      double beta2, double weight_decay, double eps, bool decoupled,
                      bool maximize) {
  TT_PROTECT({
    at::NoGradGuard no_grad;
    auto ps = tensors_of(params, n);
    auto gs = tensors_of(grads, n);
    auto m = tensors_of(exp_avgs, n);
    auto v = tensors_of(exp_avg_sqs, n);
    if (maximize) gs = at::_foreach_neg(gs);
    if (weight_decay != 0) {
      if (decoupled) {
        at::_foreach_mul_(ps, 1 - lr * weight_decay);
      } else {
        gs = at::_foreach_add(gs, ps, weight_decay);
      }
    }
    at::_foreach_lerp_(m, gs, 1 - beta1);
    at::_foreach_mul_(v, beta2);
    at::_foreach_addcmul_(v, gs, gs, 1 - beta2);
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, scalars_of(bias_correction2_sqrts, n));
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(ps, m, denom, scalars_of(step_sizes, n));
  })
}

char* tt_copy_to_host_async(void* const* src, size_t n, int32_t device, void** out,
                            void** out_event) {
  TT_PROTECT({
    c10::Device cuda(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
    std::vector<at::Tensor> staged;
    staged.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const auto& t = *static_cast<at::Tensor*>(src[i]);
      if (t.device() != cuda) {
        throw std::invalid_argument("tt_copy_to_host_async: a tensor is not on " +
                                    cuda.str() + " but on " + t.device().str());
      }
      // Pinned memory from libtorch's caching host allocator: the blocks of one save
      // are reused by the next, with no new cudaHostAlloc.
      auto host = at::empty(t.sizes(), t.options().device(c10::kCPU).pinned_memory(true));
      host.copy_(t, /*non_blocking=*/true);
      staged.push_back(std::move(host));
    }
    auto event = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    event->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(cuda));
    for (size_t i = 0; i < n; ++i) out[i] = new at::Tensor(std::move(staged[i]));
    *out_event = event.release();
  })
}

char* tt_empty_pinned(int64_t n, void** out) {
  TT_PROTECT({
    auto t = at::empty({n}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    *out = new at::Tensor(std::move(t));
  })
}

char* tt_copy_to_device_async(void* dst, void* src, void** out_event) {
  TT_PROTECT({
    auto& d = *static_cast<at::Tensor*>(dst);
    const auto& s = *static_cast<at::Tensor*>(src);
    if (!d.is_cuda()) {
      throw std::invalid_argument("tt_copy_to_device_async: the target is on " +
                                  d.device().str() + ", not a CUDA device");
    }
    if (!s.is_pinned()) {
      throw std::invalid_argument("tt_copy_to_device_async: the source is not pinned");
    }
    // A load into a variable that requires grad is not a step of training.
    at::NoGradGuard no_grad;
    // From pinned memory a non-blocking copy is a DMA queued on the stream; libtorch
    // records it with the caching host allocator, which reuses the block only after.
    d.copy_(s, /*non_blocking=*/true);
    auto event = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    event->record(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(d.device()));
    *out_event = event.release();
  })
}

char* tt_event_synchronize(void* event) {
  TT_PROTECT({ static_cast<c10::Event*>(event)->synchronize(); })
}

void tt_event_free(void* event) {
  try {
    delete static_cast<c10::Event*>(event);
  } catch (...) {
    // A destructor that fails (a lost device) must not unwind into Rust.
  }
}
