// lily_py._core: the native core. Bindings read as a table of contents: one init_<area>
// per file as areas land (engine, ops, devices). For now: build information.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

namespace nb = nanobind;

namespace lily::bindings {
void init_ops(nb::module_& m);  // ops.cpp: lily_py._core.ops, .emu, kernel_table, EmulatorError
void init_engine(nb::module_& m);  // engine.cpp: lily_py._core.Engine (the whole model on a device)
void init_devices(nb::module_& m);  // devices.cpp: lily_py._core.registry (the device registry)
}

#ifndef LILY_VERSION
#define LILY_VERSION "unknown"
#endif

static std::vector<std::string> available_devices() {
  std::vector<std::string> devices{"emu"};
#if defined(LILY_HAVE_METAL)
  devices.push_back("metal");
#endif
  return devices;
}

NB_MODULE(_core, m) {
  m.doc() = "lily_py native core (devices, engine, kernels)";
  m.def("version", [] { return std::string(LILY_VERSION); },
        "Version of the compiled core (must equal lily_py.__version__).");
  m.def("compiler", [] {
#if defined(__clang__)
    return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    return std::string("gcc ") + __VERSION__;
#else
    return std::string("unknown");
#endif
  }, "Compiler that built the core.");
  m.def("devices", &available_devices,
        "Devices compiled into this build (\"metal\" on macOS builds with LILY_METAL).");
  m.attr("has_metal") =
#if defined(LILY_HAVE_METAL)
      true;
#else
      false;
#endif
  lily::bindings::init_ops(m);
  lily::bindings::init_engine(m);
  lily::bindings::init_devices(m);
}
