// memplan runtime, CPU backend: a c10::Allocator for DeviceType::CPU that asks the C core first.
//
// mpr_cpu_install(malloc_fn, free_any_fn, arena) keeps the current CPU allocator and sets this one
// (c10::SetAllocator, priority 0, the priority of c10's default CPU allocator); mpr_cpu_uninstall()
// puts the kept one back. Every DataPtr this allocator returns carries its own deleter
// (mpr_free_any, context = the pointer), so a tensor allocated on the arena is freed by the arena
// whenever it dies, and a tensor allocated before (or by the kept allocator) is freed by its own
// deleter. When the core gives NULL (closed, arena not allocatable, or its memory exhausted), the
// kept allocator serves the request.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <cstring>

namespace {

using MallocFn = void* (*)(void*, uint64_t, int64_t);
using FreeFn = void (*)(void*);

FreeFn g_free_any = nullptr;

void free_planned(void* ptr) {
  g_free_any(ptr);
}

struct PlannedCPUAllocator final : c10::Allocator {
  MallocFn malloc_fn = nullptr;
  void* arena = nullptr;
  c10::Allocator* kept = nullptr;

  c10::DataPtr allocate(size_t n) override {
    if (n != 0 && arena != nullptr) {
      void* p = malloc_fn(arena, static_cast<uint64_t>(n), 0);
      if (p != nullptr) {
        return {p, p, &free_planned, c10::Device(c10::DeviceType::CPU)};
      }
    }
    return kept->allocate(n);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &free_planned;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PlannedCPUAllocator g_allocator;

}  // namespace

extern "C" int mpr_cpu_install(void* malloc_fn, void* free_any_fn, void* arena) {
  if (g_allocator.arena != nullptr) {
    return 1;  // already installed
  }
  c10::Allocator* current = c10::GetAllocator(c10::DeviceType::CPU);
  g_allocator.kept = current;
  g_allocator.malloc_fn = reinterpret_cast<MallocFn>(malloc_fn);
  g_free_any = reinterpret_cast<FreeFn>(free_any_fn);
  g_allocator.arena = arena;
  c10::SetAllocator(c10::DeviceType::CPU, &g_allocator, 0);
  if (c10::GetAllocator(c10::DeviceType::CPU) != &g_allocator) {
    g_allocator.arena = nullptr;
    return 2;  // a higher-priority CPU allocator is registered
  }
  return 0;
}

extern "C" int mpr_cpu_uninstall() {
  if (g_allocator.arena == nullptr) {
    return 1;
  }
  c10::SetAllocator(c10::DeviceType::CPU, g_allocator.kept, 0);
  g_allocator.arena = nullptr;
  return c10::GetAllocator(c10::DeviceType::CPU) == g_allocator.kept ? 0 : 2;
}
