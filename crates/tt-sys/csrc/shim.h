// torchtools-sys: the C ABI over the parts of libtorch that tch does not expose.
//
// Every function returns NULL on success, or a malloc'd error message that the
// caller frees with tt_free_error. No C++ exception crosses this boundary.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int64_t current;
  int64_t peak;
  int64_t allocated;  // cumulative: every increase since the last reset
  int64_t freed;      // cumulative: every decrease since the last reset
} tt_stat;

typedef struct {
  tt_stat allocated_bytes;
  tt_stat reserved_bytes;
  tt_stat active_bytes;
  tt_stat requested_bytes;
  int64_t num_alloc_retries;
  int64_t num_ooms;
  int64_t num_device_alloc;
  int64_t num_device_free;
} tt_device_stats;

void tt_free_error(char* err);

// The libtorch version these headers belong to, e.g. "2.11.0". Static storage.
const char* tt_torch_version(void);
// Path of the loaded libc10.so (so libtorch_cuda.so can be found beside it).
char* tt_c10_library_path(char** out_path);
// Number of CUDA devices libtorch sees (0 when libtorch_cuda is not loaded).
char* tt_cuda_device_count(int32_t* out);
// CUDA runtime version libtorch_cuda was built with (e.g. 13000).
char* tt_cuda_runtime_version(int64_t* out);
char* tt_cuda_device_stats(int32_t device, tt_device_stats* out);
char* tt_cuda_empty_cache(void);
char* tt_cuda_reset_peak_stats(int32_t device);
char* tt_cuda_mem_get_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes);

// Autocast (torch.autocast) on device type 0 (CPU) or 1 (CUDA) with a c10::ScalarType
// code; the previous state is written back so the caller can restore it.
char* tt_autocast_set(int32_t device_type, bool enabled, int32_t dtype, bool* prev_enabled,
                      int32_t* prev_dtype);
// enter: a region opens; !enter: it closes (the cast cache is cleared at the outermost).
char* tt_autocast_nesting(bool enter);

// Sets each tensor's gradient to undefined (Python's `p.grad = None`, what
// torch.optim's `zero_grad()` does by default): no kernel, the memory goes back to the
// caching allocator.
char* tt_set_grads_none(void* const* tensors, size_t n);

// torch.optim.Adam / AdamW's multi-tensor step (`_multi_tensor_adam`, without AMSGrad):
// a few `_foreach_` kernels for all `n` tensors instead of several per tensor. Tensors
// are `at::Tensor*`; `step_sizes[i]` is -lr / (1 - beta1^step_i) and
// `bias_correction2_sqrts[i]` is sqrt(1 - beta2^step_i).
char* tt_foreach_adam(void* const* params, void* const* grads, void* const* exp_avgs,
                      void* const* exp_avg_sqs, size_t n, const double* step_sizes,
                      const double* bias_correction2_sqrts, double lr, double beta1,
                      double beta2, double weight_decay, double eps, bool decoupled,
                      bool maximize);

// Copies each of the `n` tensors `src` (on CUDA device `device`) into new pinned host
// tensors, written to `out` (`at::Tensor*`, owned by the caller), without waiting: the
// copies are queued on the device's current stream, after the work that produces the
// tensors and before any later work (an optimizer step) that changes them. `*out_event`
// (owned by the caller, freed with tt_event_free) completes when every copy has.
char* tt_copy_to_host_async(void* const* src, size_t n, int32_t device, void** out,
                            void** out_event);
// A new uint8 tensor of `n` bytes in pinned host memory from libtorch's caching host
// allocator (*out, owned by the caller as tch's C_tensor).
char* tt_empty_pinned(int64_t n, void** out);
// Queues dst.copy_(src, non_blocking=true) for a CUDA `dst` and a pinned host `src` on
// dst's device's current stream; *out_event (owned by the caller, freed with
// tt_event_free) completes when the copy has.
char* tt_copy_to_device_async(void* dst, void* src, void** out_event);
// Waits for an event of tt_copy_to_host_async or tt_copy_to_device_async.
char* tt_event_synchronize(void* event);
// Frees an event of tt_copy_to_host_async or tt_copy_to_device_async.
void tt_event_free(void* event);

#ifdef __cplusplus
}
#endif
