// One op call from Python (shared by csrc/bindings/ops*.cpp): a device, its buffers (copies of
// the NumPy inputs, fresh outputs), one encoder committed once, and the kernels it encoded.
#pragma once
#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bindings/arrays.h"
#include "bindings/device.h"
#include "gpu/dtype.h"
#include "gpu/encoder.h"
#include "gpu/kernel_ids.h"

namespace lily::bindings {

namespace nb = nanobind;

struct OpRun {
  std::unique_ptr<gpu::Device> device;
  std::vector<std::unique_ptr<gpu::Buffer>> buffers;
  std::unique_ptr<gpu::Encoder> enc;
  nb::list kernels;

  OpRun(const std::string& name, const std::string& order, uint64_t seed, bool fp_traps)
      : device(make_device(name, order, seed, fp_traps)), enc(device->new_encoder()) {}

  gpu::Binding input(const InArray& a) { return keep(upload(*device, a.data(), a.nbytes())); }
  gpu::Binding input(const std::vector<float>& v) {
    return keep(upload(*device, v.data(), v.size() * sizeof(float)));
  }
  // Poisoned on the emulator: unwritten elements read NaN. A zero-byte output still gets a buffer.
  gpu::Binding output(size_t bytes) {
    buffers.push_back(device->new_buffer(bytes ? bytes : 4));
    return {buffers.back().get(), 0, bytes};
  }

  // Encodes with `f`, commits and waits with the GIL released; returns the encoder's counters.
  template <class F>
  nb::dict run(F f) {
    {
      nb::gil_scoped_release release;
      f(*enc);
      enc->commit();
      enc->wait();
    }
    return counters();
  }
  void note(gpu::KernelId k) { kernels.append(std::string(gpu::kernel_info(k).name)); }
  template <class F>
  void encode(gpu::KernelId k, F f) {
    run(f);
    note(k);
  }

  nb::object download(const gpu::Binding& b, gpu::DType t, std::vector<size_t> shape) {
    if (t == gpu::DType::f32) return nb::cast(bindings::download<float>(*b.buffer, b.offset, shape));
    return nb::cast(bindings::download<uint16_t>(*b.buffer, b.offset, shape));
  }
  nb::dict counters() const {
    const gpu::Counters& c = enc->counters();
    nb::dict d;
    d["dispatches"] = c.dispatches;
    d["barriers"] = c.barriers;
    d["bytes_bound"] = c.bytes_bound;
    d["threads"] = c.threads;
    d["flops_executed"] = c.flops_executed;
    d["flops_useful"] = c.flops_useful;
    return d;
  }
  // counters() plus the names of the kernels noted.
  nb::dict stats() const {
    nb::dict d = counters();
    d["kernels"] = kernels;
    return d;
  }

 private:
  gpu::Binding keep(std::unique_ptr<gpu::Buffer> b) {
    buffers.push_back(std::move(b));
    return {buffers.back().get(), 0, buffers.back()->size()};
  }
};

}  // namespace lily::bindings
