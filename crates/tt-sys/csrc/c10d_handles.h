// Internal to the shim: what the opaque handles of c10d.h hold, shared by its .cpp files.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

struct tt_store {
  c10::intrusive_ptr<c10d::Store> store;
};
struct tt_backend {
  c10::intrusive_ptr<c10d::Backend> backend;
};
struct tt_work {
  c10::intrusive_ptr<c10d::Work> work;
};
