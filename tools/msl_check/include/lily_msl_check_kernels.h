// The MSL check's versions of two macros of shaders/common/lily_metal.h's Metal branch. The
// generated translation unit (tools/msl_check/msl_check.py) includes common/lily_metal.h (its
// Metal branch, against the stand-in <metal_stdlib>), then this header, then the shader, whose own
// #include of common/lily_metal.h is a no-op (#pragma once). Everything else of the Metal branch
// (LILY_KERNEL_TAIL with its attributes, `using namespace metal`) is compiled as written.
#pragma once

#if !defined(LILY_INSTANTIATE) || !defined(LILY_TG_ARRAY)
#error "include common/lily_metal.h (its Metal branch) before lily_msl_check_kernels.h"
#endif

// Metal: `template [[host_name(name)]] [[kernel]] decltype(f<T>) f<T>;`. Upstream clang rejects
// attributes on an explicit instantiation; without them it is the same explicit instantiation,
// which type-checks the kernel template's body with those arguments. The host name must be a
// string literal.
#undef LILY_INSTANTIATE
#define LILY_INSTANTIATE(name, ...)                                     \
  static_assert(sizeof(name "") > 1, "LILY_INSTANTIATE: a host name"); \
  template decltype(__VA_ARGS__) __VA_ARGS__;

// Metal: `alignas(16) threadgroup T name dims` at a kernel's scope. OpenCL allows __local variables
// only in OpenCL kernels, which cannot be templates; a reference to a threadgroup array gives the
// name the same type (threadgroup T (&)dims: subscripts, decay to a threadgroup pointer, sizeof).
// That threadgroup arrays sit in a kernel's own scope is the strict pass's check
// (csrc/emu/metal_strict.h).
namespace lily_msl_check {
template <class A>
threadgroup A& threadgroup_array();
}
#undef LILY_TG_ARRAY
#define LILY_TG_ARRAY(T, name, dims) threadgroup T(&name) dims = lily_msl_check::threadgroup_array<T dims>()
