// Internal to the shim: the exception boundary shared by its .cpp files.
#pragma once
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>

namespace tt {

inline char* dup_message(const char* msg) {
  size_t n = std::strlen(msg);
  char* out = static_cast<char*>(std::malloc(n + 1));
  if (out != nullptr) std::memcpy(out, msg, n + 1);
  return out;
}

}  // namespace tt

// Catch everything at the boundary: an exception unwinding into Rust is UB. Variadic:
// a body may hold commas (template arguments, structured bindings).
#define TT_PROTECT(...)                                       \
  try {                                                       \
    __VA_ARGS__;                                              \
    return nullptr;                                           \
  } catch (const c10::Error& e) {                             \
    return tt::dup_message(e.what_without_backtrace());       \
  } catch (const std::exception& e) {                         \
    return tt::dup_message(e.what());                         \
  } catch (...) {                                             \
    return tt::dup_message("unknown C++ exception in libtorch"); \
  }
