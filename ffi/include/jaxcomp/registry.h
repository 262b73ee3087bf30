// The one list of FFI targets a module exposes. Each family file registers its
// handlers where it defines them, with JAXCOMP_REGISTER at namespace scope;
// the nanobind module of the build (_jaxcomp_cpu, _jaxcomp_cuda) turns the
// list into its registrations() dict. So adding a family adds files and
// touches no list. Plain C++: the host compiler and nvcc both include it.
//
// The registrations run as static initializers when the module is loaded,
// which needs every family's object file linked into the module: they are
// sources of the module target (a static library would drop the ones nothing
// references).
#pragma once

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace jaxcomp {

// One FFI target: its registered name and the handler symbol's address.
struct HandlerEntry {
  const char* name;
  void* handler;
};

// Hidden: each module keeps its own list. With default visibility the
// function-local static would be one process-wide object (a unique global
// symbol), shared by the CPU and CUDA modules when both are loaded.
#if defined(__GNUC__)
__attribute__((visibility("hidden")))
#endif
inline std::vector<HandlerEntry>& registered_handlers() {
  static std::vector<HandlerEntry> list;  // built on first use: safe in any static-init order
  return list;
}

// The registered handlers, after checking that no two share a name (which
// would be a mistake in a family file).
inline const std::vector<HandlerEntry>& unique_handlers() {
  const std::vector<HandlerEntry>& all = registered_handlers();
  for (size_t i = 0; i < all.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (std::strcmp(all[i].name, all[j].name) == 0)
        throw std::logic_error(std::string("two handlers registered as ") + all[i].name);
  return all;
}

struct Registration {
  Registration(const char* name, void* handler) { registered_handlers().push_back(HandlerEntry{name, handler}); }
};

}  // namespace jaxcomp

#define JAXCOMP_CONCAT_IMPL(a, b) a##b
#define JAXCOMP_CONCAT(a, b) JAXCOMP_CONCAT_IMPL(a, b)

// Registers the handler symbol `handler` (of XLA_FFI_DEFINE_HANDLER_SYMBOL)
// under the target name `name`. At namespace scope, once per target.
#define JAXCOMP_REGISTER(name, handler)                                            \
  static const ::jaxcomp::Registration JAXCOMP_CONCAT(jaxcomp_registration_, __LINE__)( \
      name, reinterpret_cast<void*>(&handler))
