// torchtools-sys c10d: libtorch's distributed engine (TCPStore, PrefixStore,
// ProcessGroupGloo, ProcessGroupNCCL) behind a C ABI. Same conventions as shim.h:
// NULL on success, else a malloc'd message freed with tt_free_error; no exception
// crosses this boundary. Tensors are `at::Tensor*` as tch (torch-sys) hands them out.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tt_store tt_store;
typedef struct tt_backend tt_backend;
typedef struct tt_work tt_work;

// A TCPStore on host:port; the master also serves it (port 0 picks one: see tt_store_port).
// world_size < 0: unknown (no wait for workers).
char* tt_tcpstore_new(const char* host, uint16_t port, int32_t world_size, bool is_master,
                      int64_t timeout_ms, bool wait_workers, tt_store** out);
// The port a TCPStore listens on / connects to.
char* tt_store_port(tt_store* store, uint16_t* out);
// A view of `base` whose keys are "<prefix>/<key>" (c10d::PrefixStore).
char* tt_prefixstore_new(const char* prefix, tt_store* base, tt_store** out);
char* tt_store_set(tt_store* store, const char* key, const uint8_t* data, size_t len);
// *data is malloc'd (free with tt_free_error); waits up to the store's timeout.
char* tt_store_get(tt_store* store, const char* key, uint8_t** data, size_t* len);
char* tt_store_add(tt_store* store, const char* key, int64_t delta, int64_t* out);
char* tt_store_set_timeout(tt_store* store, int64_t timeout_ms);
void tt_store_free(tt_store* store);

// ProcessGroupGloo over `store` on the comma-separated `interfaces` when not null nor
// empty, else as Python does (GLOO_SOCKET_IFNAME, else the host name's address).
char* tt_gloo_new(tt_store* store, int32_t rank, int32_t size, int64_t timeout_ms,
                  const char* interfaces, tt_backend** out);
// ProcessGroupNCCL bound to CUDA device `device` and connected at once (only when
// built with the `nccl` feature; otherwise an error).
char* tt_nccl_new(tt_store* store, int32_t rank, int32_t size, int64_t timeout_ms,
                  int32_t device, tt_backend** out);
bool tt_nccl_built(void);
void tt_backend_free(tt_backend* backend);

// ReduceOp: 0 sum, 1 avg, 2 product, 3 min, 4 max (c10d's RedOpType).
// One tensor per call (c10d's tensor lists are one tensor per local device).
char* tt_allreduce(tt_backend* b, void* tensor, int32_t op, tt_work** out);
char* tt_broadcast(tt_backend* b, void* tensor, int32_t root, tt_work** out);
// outputs: world_size tensors shaped like input.
char* tt_allgather(tt_backend* b, void* const* outputs, size_t n_out, void* input,
                   tt_work** out);
// inputs: world_size tensors shaped like output.
char* tt_reduce_scatter(tt_backend* b, void* output, void* const* inputs, size_t n_in,
                        int32_t op, tt_work** out);
char* tt_barrier(tt_backend* b, tt_work** out);
// Waits for `work` (timeout_ms <= 0: the backend's own timeout); an error when it
// failed or did not complete in time.
char* tt_work_wait(tt_work* work, int64_t timeout_ms);
bool tt_work_is_completed(tt_work* work);
void tt_work_free(tt_work* work);

// DDP: c10d::Reducer, built as torch.nn.parallel.DistributedDataParallel builds it.
// Verifies that every rank has the same parameters (shapes, dtypes), broadcasts rank 0's
// parameters then buffers (in buffers of `broadcast_bytes`), assigns buckets as PyTorch
// does and registers the Reducer's autograd hooks on the parameters (leaf tensors).
// names: one per parameter (errors name them; may be NULL).
typedef struct tt_reducer tt_reducer;
char* tt_reducer_new(tt_backend* b, void* const* params, const char* const* names,
                     size_t n_params, void* const* buffers, size_t n_buffers,
                     size_t broadcast_bytes, int64_t bucket_bytes, int64_t first_bucket_bytes,
                     bool find_unused, bool gradient_as_bucket_view, tt_reducer** out);
// Before a backward whose gradients are to be averaged (DDP's forward hooks): counts the
// iteration, rebuilds the buckets once (a collective), arms the autograd hooks; with
// find_unused, walks the graph from `outputs` to mark the parameters it does not reach.
char* tt_reducer_prepare(tt_reducer* r, void* const* outputs, size_t n_outputs);
// The number of buckets, and the number of parameters in each (up to `cap` written).
char* tt_reducer_buckets(tt_reducer* r, size_t* sizes, size_t cap, size_t* n_buckets);
void tt_reducer_free(tt_reducer* r);
// c10d::broadcast_coalesced: `tensors` from `root`, flattened into buffers of up to
// `buffer_bytes` (what DDP uses for parameters and buffers). Synchronous.
char* tt_broadcast_coalesced(tt_backend* b, void* const* tensors, size_t n, size_t buffer_bytes,
                             int32_t root);

#ifdef __cplusplus
}
#endif
