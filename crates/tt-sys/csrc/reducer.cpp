// See c10d.h: PyTorch's DDP engine, c10d::Reducer, driven the way
// torch.nn.parallel.DistributedDataParallel drives it (same collectives in the same
// order, so Rust and Python ranks can train one model together). Every call is wrapped
// in TT_PROTECT: no C++ exception reaches Rust.
#include "c10d.h"

#include <climits>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "c10d_handles.h"
#include "protect.h"

struct tt_reducer {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::unique_ptr<c10d::Reducer> reducer;
  bool find_unused;
};

namespace {

std::vector<at::Tensor> tensor_list(void* const* ps, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (ps[i] == nullptr) throw std::invalid_argument("null tensor");
    out.push_back(*static_cast<at::Tensor*>(ps[i]));
  }
  return out;
}

// The ProcessGroup torch.distributed.init_process_group makes around a backend: Gloo
// for CPU and CUDA tensors, NCCL for CUDA ones.
c10::intrusive_ptr<c10d::ProcessGroup> group_of(tt_backend* b) {
  if (b == nullptr || !b->backend) throw std::invalid_argument("null process group");
  auto& backend = b->backend;
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(backend->getRank(), backend->getSize());
  if (backend->getBackendName() == "nccl") {
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, backend);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
  } else {
    pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
    pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, backend);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  }
  return pg;
}

c10d::Reducer& reducer(tt_reducer* r) {
  if (r == nullptr || !r->reducer) throw std::invalid_argument("null reducer");
  return *r->reducer;
}

}  // namespace

extern "C" {

char* tt_reducer_new(tt_backend* b, void* const* params, const char* const* names,
                     size_t n_params, void* const* buffers, size_t n_buffers,
                     size_t broadcast_bytes, int64_t bucket_bytes, int64_t first_bucket_bytes,
                     bool find_unused, bool gradient_as_bucket_view, tt_reducer** out) {
  TT_PROTECT({
    if (n_params == 0) throw std::invalid_argument("no parameter that requires a gradient");
    auto pg = group_of(b);
    auto ps = tensor_list(params, n_params);
    std::unordered_map<size_t, std::string> param_names;
    for (size_t i = 0; i < n_params; ++i) {
      param_names.emplace(i, names != nullptr && names[i] != nullptr ? names[i] : "");
    }
    // DistributedDataParallel.__init__: the same model everywhere, then rank 0's
    // parameters and buffers everywhere (in buffers of `broadcast_bytes`).
    c10d::verify_params_across_processes(pg, ps, std::nullopt);
    std::vector<at::Tensor> states;
    for (auto& p : ps) states.push_back(p.detach());
    for (auto& t : tensor_list(buffers, n_buffers)) states.push_back(t.detach());
    c10d::broadcast_coalesced(pg, states, broadcast_bytes, 0);
    // _ddp_init_helper: one bucket until the first backward has shown the order in
    // which gradients become ready (then rebuilt with the small first bucket), unless
    // unused parameters are searched for (then sized buckets from the start).
    std::vector<size_t> limits;
    if (find_unused) {
      limits = {static_cast<size_t>(first_bucket_bytes), static_cast<size_t>(bucket_bytes)};
    } else {
      limits = {static_cast<size_t>(LLONG_MAX)};
    }
    std::vector<bool> sparse(n_params, false);
    // Only the indices: the per-bucket limits it also returns are what Python hands its
    // binding, which does not pass them to the Reducer.
    auto indices = std::get<0>(c10d::compute_bucket_assignment_by_size(ps, limits, sparse));
    std::vector<std::vector<size_t>> reversed_indices(indices.rbegin(), indices.rend());
    auto r = std::make_unique<c10d::Reducer>(
        ps, std::move(reversed_indices), pg, sparse, bucket_bytes, find_unused,
        gradient_as_bucket_view, std::move(param_names), first_bucket_bytes,
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
        /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
    *out = new tt_reducer{std::move(pg), std::move(r), find_unused};
  })
}

char* tt_reducer_prepare(tt_reducer* r, void* const* outputs, size_t n_outputs) {
  TT_PROTECT({
    auto& red = reducer(r);
    // DistributedDataParallel._pre_forward and _post_forward, in that order.
    red.prepare_for_forward();
    red.rebuild_buckets();
    if (r->find_unused) {
      red.prepare_for_backward(tensor_list(outputs, n_outputs));
    } else {
      red.prepare_for_backward({});
    }
  })
}

char* tt_reducer_buckets(tt_reducer* r, size_t* sizes, size_t cap, size_t* n_buckets) {
  TT_PROTECT({
    auto buckets = reducer(r).get_grad_buckets(/*return_zero_tensors=*/false);
    *n_buckets = buckets.size();
    for (size_t i = 0; i < buckets.size() && i < cap; ++i) {
      sizes[i] = buckets[i].getParameters().size();
    }
  })
}

char* tt_broadcast_coalesced(tt_backend* b, void* const* tensors, size_t n, size_t buffer_bytes,
                             int32_t root) {
  TT_PROTECT({
    auto pg = group_of(b);
    auto ts = tensor_list(tensors, n);
    c10d::broadcast_coalesced(pg, ts, buffer_bytes, root);
  })
}

void tt_reducer_free(tt_reducer* r) {
  if (r == nullptr) return;
  // ~Reducer removes its autograd hooks and may throw: nothing may escape here.
  try {
    r->reducer.reset();
  } catch (...) {
  }
  try {
    delete r;
  } catch (...) {
  }
}

}  // extern "C"
