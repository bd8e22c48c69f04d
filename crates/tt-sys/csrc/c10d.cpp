// See c10d.h. Thin: every call goes straight to libtorch's c10d; the only logic here is
// ownership (intrusive_ptr boxes) and the exception boundary.
#include "c10d.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "c10d_handles.h"
#include "protect.h"


namespace {

at::Tensor& tensor(void* p) {
  if (p == nullptr) throw std::invalid_argument("null tensor");
  return *static_cast<at::Tensor*>(p);
}

std::vector<at::Tensor> tensors(void* const* ps, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(tensor(ps[i]));
  return out;
}

c10d::ReduceOp reduce_op(int32_t op) {
  switch (op) {
    case 0: return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case 1: return c10d::ReduceOp(c10d::ReduceOp::AVG);
    case 2: return c10d::ReduceOp(c10d::ReduceOp::PRODUCT);
    case 3: return c10d::ReduceOp(c10d::ReduceOp::MIN);
    case 4: return c10d::ReduceOp(c10d::ReduceOp::MAX);
    default: throw std::invalid_argument("unknown reduce op " + std::to_string(op));
  }
}

c10d::Backend& backend(tt_backend* b) {
  if (b == nullptr || !b->backend) throw std::invalid_argument("null process group");
  return *b->backend;
}

c10d::Store& store(tt_store* s) {
  if (s == nullptr || !s->store) throw std::invalid_argument("null store");
  return *s->store;
}

void put_work(c10::intrusive_ptr<c10d::Work> work, tt_work** out) {
  *out = new tt_work{std::move(work)};
}

}  // namespace

extern "C" {

char* tt_tcpstore_new(const char* host, uint16_t port, int32_t world_size, bool is_master,
                      int64_t timeout_ms, bool wait_workers, tt_store** out) {
  TT_PROTECT({
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_master;
    if (world_size >= 0) opts.numWorkers = static_cast<size_t>(world_size);
    opts.waitWorkers = wait_workers;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    // Like Python's env:// rendezvous: other stores may share host:port in this process.
    opts.multiTenant = true;
    auto s = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    *out = new tt_store{std::move(s)};
  })
}

char* tt_store_port(tt_store* s, uint16_t* out) {
  TT_PROTECT({
    auto* tcp = dynamic_cast<c10d::TCPStore*>(&store(s));
    if (tcp == nullptr) throw std::invalid_argument("not a TCPStore");
    *out = tcp->getPort();
  })
}

char* tt_prefixstore_new(const char* prefix, tt_store* base, tt_store** out) {
  TT_PROTECT({
    store(base);
    auto s = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base->store);
    *out = new tt_store{std::move(s)};
  })
}

char* tt_store_set(tt_store* s, const char* key, const uint8_t* data, size_t len) {
  TT_PROTECT({ store(s).set(std::string(key), std::vector<uint8_t>(data, data + len)); })
}

char* tt_store_get(tt_store* s, const char* key, uint8_t** data, size_t* len) {
  TT_PROTECT({
    auto v = store(s).get(std::string(key));
    auto* buf = static_cast<uint8_t*>(std::malloc(v.size() + 1));
    if (buf == nullptr) throw std::bad_alloc();
    if (!v.empty()) std::memcpy(buf, v.data(), v.size());
    *data = buf;
    *len = v.size();
  })
}

char* tt_store_add(tt_store* s, const char* key, int64_t delta, int64_t* out) {
  TT_PROTECT({ *out = store(s).add(std::string(key), delta); })
}

char* tt_store_set_timeout(tt_store* s, int64_t timeout_ms) {
  TT_PROTECT({ store(s).setTimeout(std::chrono::milliseconds(timeout_ms)); })
}

void tt_store_free(tt_store* s) { delete s; }

char* tt_gloo_new(tt_store* s, int32_t rank, int32_t size, int64_t timeout_ms,
                  const char* interfaces, tt_backend** out) {
  TT_PROTECT({
    store(s);
    auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::milliseconds(timeout_ms));
    // The interfaces given; else as torch.distributed does: GLOO_SOCKET_IFNAME names
    // interfaces, else the address the host name resolves to (falling back to loopback).
    const char* ifname = (interfaces != nullptr && interfaces[0] != '\0')
                             ? interfaces
                             : std::getenv("GLOO_SOCKET_IFNAME");
    if (ifname != nullptr && ifname[0] != '\0') {
      std::string names(ifname);
      size_t start = 0;
      while (start <= names.size()) {
        size_t end = names.find(',', start);
        if (end == std::string::npos) end = names.size();
        if (end > start) {
          opts->devices.push_back(
              c10d::ProcessGroupGloo::createDeviceForInterface(names.substr(start, end - start)));
        }
        start = end + 1;
      }
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    opts->threads = static_cast<int>(opts->devices.size() * 2);
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(s->store, rank, size, opts);
    *out = new tt_backend{std::move(pg)};
  })
}

bool tt_nccl_built(void) {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

char* tt_nccl_new(tt_store* s, int32_t rank, int32_t size, int64_t timeout_ms,
                  int32_t device, tt_backend** out) {
  TT_PROTECT({
    store(s);
#ifdef USE_C10D_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = std::chrono::milliseconds(timeout_ms);
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(s->store, rank, size, opts);
    // The rank's own GPU, bound and connected now: otherwise a first barrier guesses
    // `rank % GPUs` and makes a context on another rank's GPU.
    const at::Device gpu(at::kCUDA, static_cast<c10::DeviceIndex>(device));
    pg->setBoundDeviceId(gpu);
    pg->eagerConnectSingleDevice(gpu);
    *out = new tt_backend{std::move(pg)};
#else
    (void)rank;
    (void)size;
    (void)timeout_ms;
    (void)device;
    (void)out;
    throw std::runtime_error(
        "tt-sys was built without NCCL: enable its `nccl` feature (needs the CUDA and NCCL "
        "headers: see tt-sys's README)");
#endif
  })
}

void tt_backend_free(tt_backend* b) {
  if (b == nullptr) {
    return;
  }
  // NCCL's communicators must be shut down before the destructor (which otherwise
  // warns and aborts them); Gloo's shutdown does nothing. Nothing may escape here.
  try {
    b->backend->shutdown();
  } catch (...) {
  }
  try {
    delete b;
  } catch (...) {
  }
}

char* tt_allreduce(tt_backend* b, void* t, int32_t op, tt_work** out) {
  TT_PROTECT({
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    put_work(backend(b).allreduce(ts, opts), out);
  })
}

char* tt_broadcast(tt_backend* b, void* t, int32_t root, tt_work** out) {
  TT_PROTECT({
    std::vector<at::Tensor> ts{tensor(t)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    put_work(backend(b).broadcast(ts, opts), out);
  })
}

char* tt_allgather(tt_backend* b, void* const* outputs, size_t n_out, void* input,
                   tt_work** out) {
  TT_PROTECT({
    std::vector<std::vector<at::Tensor>> outs{tensors(outputs, n_out)};
    std::vector<at::Tensor> ins{tensor(input)};
    put_work(backend(b).allgather(outs, ins), out);
  })
}

char* tt_reduce_scatter(tt_backend* b, void* output, void* const* inputs, size_t n_in,
                        int32_t op, tt_work** out) {
  TT_PROTECT({
    std::vector<at::Tensor> outs{tensor(output)};
    std::vector<std::vector<at::Tensor>> ins{tensors(inputs, n_in)};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    put_work(backend(b).reduce_scatter(outs, ins, opts), out);
  })
}

char* tt_barrier(tt_backend* b, tt_work** out) {
  TT_PROTECT({ put_work(backend(b).barrier(), out); })
}

char* tt_work_wait(tt_work* w, int64_t timeout_ms) {
  TT_PROTECT({
    if (w == nullptr || !w->work) throw std::invalid_argument("null work");
    auto timeout = timeout_ms > 0 ? std::chrono::milliseconds(timeout_ms) : std::chrono::milliseconds(0);
    if (!w->work->wait(timeout)) {
      throw std::runtime_error("the collective did not complete within " +
                               std::to_string(timeout_ms) + " ms");
    }
  })
}

bool tt_work_is_completed(tt_work* w) {
  try {
    return w != nullptr && w->work && w->work->isCompleted();
  } catch (...) {
    return true;
  }
}

void tt_work_free(tt_work* w) {
  try {
    delete w;
  } catch (...) {
  }
}

}  // extern "C"
