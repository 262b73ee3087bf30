// The FFI targets and the one list of them a module exposes. Each family's
// header declares its targets (Target: the name, typed once for C++, and the
// attributes); each family file registers its handlers for them where it
// defines them, with JAXCOMP_REGISTER (../../handler.h) at namespace scope;
// the nanobind module of the build (_jaxcomp_cpu, _jaxcomp_cuda) turns the
// list into its registrations() dict. So adding a family adds files and
// touches no list. Plain C++: the host compiler and nvcc both include it.
//
// The registrations run as static initializers when the module is loaded,
// which needs every family's object file linked into the module: they are
// sources of the module target (a static library would drop the ones nothing
// references).
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace jaxcomp {

// An FFI target: the name it is registered under (the codec's Python module
// spells it once more) and the names of its attributes, in the order its
// handlers take them. One per target, in the family's header, e.g.
//   inline constexpr Target kInt8Encode{"jaxcomp_int8_encode", "bucket_size"};
template <size_t N>
struct Target {
  const char* name;
  std::array<const char*, N> attributes = {};
};

template <typename... A>
Target(const char*, A...) -> Target<sizeof...(A)>;

// One registered target: its registered name and the handler symbol's address.
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

// For JAXCOMP_REGISTER (../../handler.h): one name per registration.
#define JAXCOMP_CONCAT_IMPL(a, b) a##b
#define JAXCOMP_CONCAT(a, b) JAXCOMP_CONCAT_IMPL(a, b)
