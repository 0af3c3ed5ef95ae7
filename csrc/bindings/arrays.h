// NumPy <-> device buffer helpers for the kernel bindings (ops.cpp, emu.cpp).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/encoder.h"

namespace lily::bindings {

namespace nb = nanobind;

// Any C-contiguous CPU array (bfloat16 arrives as a uint16 view: see lily_py/ops.py).
using InArray = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
using InOutArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

inline size_t nbytes(const InArray& a) { return a.nbytes(); }

// A device buffer holding a copy of `a`.
inline std::unique_ptr<gpu::Buffer> upload(gpu::Device& dev, const void* data, size_t bytes) {
  auto b = dev.new_buffer(bytes);
  b->write(0, data, bytes);
  return b;
}

// A new NumPy array of `shape` owning a copy of `src`.
template <class T>
nb::ndarray<nb::numpy, T> download(const void* src, std::vector<size_t> shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  T* data = new T[n];
  std::memcpy(data, src, n * sizeof(T));
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(data, shape.size(), shape.data(), owner);
}

// A new NumPy array of `shape` owning a copy of `buffer`'s bytes from `offset` (read through the
// buffer: device memory on cuda has no host pointer).
template <class T>
nb::ndarray<nb::numpy, T> download(gpu::Buffer& buffer, size_t offset, std::vector<size_t> shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  std::vector<T> tmp(n);
  buffer.read(offset, tmp.data(), n * sizeof(T));
  return download<T>(tmp.data(), std::move(shape));
}

inline void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

// require() whose message is built only when the check fails (prefer it: a std::string argument
// to require() is constructed on every call).
#define LILY_REQUIRE(ok, ...)                                         \
  do {                                                                \
    if (!(ok)) [[unlikely]] throw std::invalid_argument(__VA_ARGS__); \
  } while (0)

}  // namespace lily::bindings
