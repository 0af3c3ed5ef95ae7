// The "cuda" device (csrc/cuda/cuda_device.h). Contract (docs/gpu.md):
//  * Every buffer is CUDA managed memory (cuMemAllocManaged): contents() is a host pointer the
//    engine writes weights and inputs through and reads outputs from after wait(); the pages
//    migrate to the GPU when kernels touch them, so weights, state and scratch live in device
//    memory during the steps.
//  * An encoder launches each dispatch at once on the device's one stream, in encoding order. A
//    stream runs its kernels one after another, which orders every pair of dispatches: stronger
//    than the plan's barriers (counted, nothing to encode). commit() submits nothing more;
//    wait() synchronises the stream and turns a launch or kernel fault into an exception.
//  * Kernels: the cubins of nvrtc_build.py (their manifest.txt: cubin, entry, host name), from
//    $LILY_CUDA_KERNELS or the folder cuda_kernels next to the extension module.
#include "cuda/cuda_device.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace lily::cuda {
namespace {

// ---- the driver API, declared here (no cuda.h needed to build) ------------------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUdeviceptr = unsigned long long;

struct Driver {
  void* lib = nullptr;
  std::string error;
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuModuleLoad)(CUmodule*, const char*) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuFuncGetAttribute)(int*, int, CUfunction) = nullptr;
  CUresult (*cuMemAllocManaged)(CUdeviceptr*, size_t, unsigned) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuCtxSynchronize)() = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;

  template <class F>
  bool get(F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    if (!f) error = std::string("libcuda.so.1 has no ") + name;
    return f != nullptr;
  }
  Driver() {
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      error = std::string("no NVIDIA driver (dlopen libcuda.so.1: ") + (e ? e : "failed") + ")";
      return;
    }
    bool ok = get(cuInit, "cuInit") && get(cuDeviceGetCount, "cuDeviceGetCount") && get(cuDeviceGet, "cuDeviceGet") &&
              get(cuDeviceGetName, "cuDeviceGetName") && get(cuDeviceGetAttribute, "cuDeviceGetAttribute") &&
              get(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") && get(cuCtxSetCurrent, "cuCtxSetCurrent") &&
              get(cuModuleLoad, "cuModuleLoad") && get(cuModuleGetFunction, "cuModuleGetFunction") &&
              get(cuFuncGetAttribute, "cuFuncGetAttribute") && get(cuMemAllocManaged, "cuMemAllocManaged") &&
              get(cuMemFree, "cuMemFree_v2") && get(cuMemGetInfo, "cuMemGetInfo_v2") &&
              get(cuStreamCreate, "cuStreamCreate") && get(cuStreamSynchronize, "cuStreamSynchronize") &&
              get(cuCtxSynchronize, "cuCtxSynchronize") && get(cuLaunchKernel, "cuLaunchKernel") &&
              get(cuGetErrorString, "cuGetErrorString");
    if (!ok) return;
    if (CUresult r = cuInit(0)) {
      error = "cuInit failed: " + message(r);
      return;
    }
    int n = 0;
    if (cuDeviceGetCount(&n) != 0 || n == 0) error = "the NVIDIA driver sees no GPU";
  }
  std::string message(CUresult r) const {
    const char* s = nullptr;
    if (cuGetErrorString) cuGetErrorString(r, &s);
    return std::string(s ? s : "unknown error") + " (" + std::to_string(r) + ")";
  }
  void check(CUresult r, const std::string& what) const {
    if (r != 0) throw std::runtime_error("cuda: " + what + ": " + message(r));
  }
};

Driver& driver() {
  static Driver d;
  return d;
}

std::string module_dir() {
  if (const char* e = std::getenv("LILY_CUDA_KERNELS")) return e;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&module_dir), &info) && info.dli_fname) {
    std::string p = info.dli_fname;
    const size_t slash = p.rfind('/');
    return (slash == std::string::npos ? std::string(".") : p.substr(0, slash)) + "/cuda_kernels";
  }
  return "cuda_kernels";
}

struct ManifestRow {
  std::string cubin, entry;
};
std::map<std::string, ManifestRow> read_manifest(const std::string& dir, std::string* error) {
  std::map<std::string, ManifestRow> rows;
  std::ifstream in(dir + "/manifest.txt");
  if (!in) {
    *error = "no kernel modules (" + dir + "/manifest.txt missing: build with -DLILY_CUDA=ON)";
    return rows;
  }
  std::string cubin, entry, host;
  while (in >> cubin >> entry >> host) rows[host] = {dir + "/" + cubin, entry};
  return rows;
}

class CudaBuffer final : public gpu::Buffer {
 public:
  CudaBuffer(CUdeviceptr p, size_t bytes) : p_(p), bytes_(bytes) {}
  ~CudaBuffer() override {
    if (p_) driver().cuMemFree(p_);
  }
  void* contents() override { return reinterpret_cast<void*>(p_); }
  size_t size() const override { return bytes_; }

 private:
  CUdeviceptr p_;
  size_t bytes_;
};

struct Buffers {  // csrc/cuda/metal_cuda.h lily_cuda::Buffers
  void* p[15];
};

class CudaDevice;

class CudaEncoder final : public gpu::Encoder {
 public:
  explicit CudaEncoder(CudaDevice& dev) : dev_(dev) {}
  void commit() override {}
  void wait() override;
  uint32_t thread_limit(gpu::KernelId kernel) const override;
  bool tensor_ops() const override;
  bool tensor_int8() const override;

 protected:
  void encode_dispatch(const gpu::Dispatch& d) override;
  void encode_barrier() override {}  // one stream: every dispatch already follows the previous

 private:
  CudaDevice& dev_;
};

class CudaDevice final : public gpu::Device {
 public:
  CudaDevice() {
    Driver& d = driver();
    if (!d.error.empty()) throw std::runtime_error("cuda: " + d.error);
    d.check(d.cuDeviceGet(&dev_, 0), "cuDeviceGet");
    d.check(d.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    d.check(d.cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
    d.check(d.cuStreamCreate(&stream_, 0), "cuStreamCreate");
    char name[256] = {};
    d.cuDeviceGetName(name, sizeof name, dev_);
    name_ = name;
    std::string err;
    dir_ = module_dir();
    manifest_ = read_manifest(dir_, &err);
    if (!err.empty()) throw std::runtime_error("cuda: " + err);
  }
  std::string_view name() const override { return "cuda"; }
  std::unique_ptr<gpu::Buffer> new_buffer(size_t bytes) override {
    bind();
    CUdeviceptr p = 0;
    driver().check(driver().cuMemAllocManaged(&p, std::max<size_t>(bytes, 16), 1 /* ATTACH_GLOBAL */),
                   "cuMemAllocManaged(" + std::to_string(bytes) + " bytes)");
    return std::make_unique<CudaBuffer>(p, bytes);
  }
  std::unique_ptr<gpu::Encoder> new_encoder() override {
    bind();
    return std::make_unique<CudaEncoder>(*this);
  }
  gpu::DeviceInfo info() const override {
    gpu::DeviceInfo i;
    i.name = "cuda";
    i.device_name = name_;
    int major = 0, minor = 0;
    driver().cuDeviceGetAttribute(&major, 75, dev_);  // COMPUTE_CAPABILITY_MAJOR
    driver().cuDeviceGetAttribute(&minor, 76, dev_);
    i.gpu_family = "sm_" + std::to_string(major) + std::to_string(minor);
    size_t free_b = 0, total = 0;
    if (driver().cuMemGetInfo(&free_b, &total) == 0) i.working_set_bytes = free_b;
    i.library_path = dir_;
    i.library_source = "cubin";
    i.build_target = "linux";
    i.math_mode = "nvrtc -default-device (no fast math)";
    i.tensor_ops = tensor_ops();
    i.tensor_int8 = tensor_int8();
    if (!i.tensor_ops)
      i.tensor_ops_reason = "off (LILY_CUDA_TENSOR_OPS=1 or =int8 takes the M5 routes, through matmul2d's emulated semantics)";
    return i;
  }
  gpu::PipelineInfo pipeline_info(gpu::KernelId kernel) override {
    CUfunction f = function(kernel);
    int threads = 0, shared = 0;
    driver().check(driver().cuFuncGetAttribute(&threads, 0, f), "cuFuncGetAttribute");
    driver().check(driver().cuFuncGetAttribute(&shared, 1, f), "cuFuncGetAttribute");
    gpu::PipelineInfo p;
    p.max_threads = std::min<uint32_t>(uint32_t(threads), gpu::kMaxThreadsPerGroup);
    p.static_threadgroup_bytes = shared;
    if (uint64_t(shared) > gpu::kMaxThreadgroupMemory)
      throw std::runtime_error("cuda: kernel '" + std::string(gpu::kernel_info(kernel).name) + "' has " +
                               std::to_string(shared) + " bytes of static threadgroup memory (Apple's limit: 32 KiB)");
    return p;
  }

  // The M5 routes (Metal 4 matmul2d, run with the emulator's semantics): LILY_CUDA_TENSOR_OPS=1,
  // and =int8 for their int8 activations too.
  static bool tensor_ops() {
    const char* e = std::getenv("LILY_CUDA_TENSOR_OPS");
    return e && (std::string(e) == "1" || std::string(e) == "int8");
  }
  static bool tensor_int8() {
    const char* e = std::getenv("LILY_CUDA_TENSOR_OPS");
    return e && std::string(e) == "int8";
  }

  CUfunction function(gpu::KernelId kernel) {
    std::lock_guard<std::mutex> lock(mu_);
    bind();
    auto it = functions_.find(kernel);
    if (it != functions_.end()) return it->second;
    const std::string host(gpu::kernel_info(kernel).name);
    auto row = manifest_.find(host);
    if (row == manifest_.end())
      throw std::runtime_error("cuda: kernel '" + host + "' is in the kernel table but not in " + dir_ + "/manifest.txt");
    CUmodule& m = modules_[row->second.cubin];
    if (!m) driver().check(driver().cuModuleLoad(&m, row->second.cubin.c_str()), "cuModuleLoad " + row->second.cubin);
    CUfunction f = nullptr;
    driver().check(driver().cuModuleGetFunction(&f, m, row->second.entry.c_str()), "cuModuleGetFunction " + host);
    functions_[kernel] = f;
    return f;
  }
  void bind() const { driver().cuCtxSetCurrent(ctx_); }
  CUstream stream() const { return stream_; }

 private:
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr;
  std::string name_, dir_;
  std::map<std::string, ManifestRow> manifest_;
  std::map<std::string, CUmodule> modules_;
  std::map<gpu::KernelId, CUfunction> functions_;
  std::mutex mu_;
};

void CudaEncoder::encode_dispatch(const gpu::Dispatch& d) {
  CUfunction f = dev_.function(d.kernel);
  Buffers b{};
  for (uint32_t i = 1; i <= d.num_buffers; ++i) {
    const gpu::Binding& bind = d.buffers[i];
    b.p[i - 1] = bind.buffer ? static_cast<unsigned char*>(bind.buffer->contents()) + bind.offset : nullptr;
  }
  alignas(16) unsigned char args[gpu::kMaxArgsBytes];
  std::memcpy(args, d.args, d.args_size);
  void* params[2] = {args, &b};
  dev_.bind();
  driver().check(driver().cuLaunchKernel(f, d.groups.x, d.groups.y, d.groups.z, d.threads.x, d.threads.y,
                                         d.threads.z, 0, dev_.stream(), params, nullptr),
                 "launch " + std::string(gpu::kernel_info(d.kernel).name));
}

void CudaEncoder::wait() {
  dev_.bind();
  driver().check(driver().cuStreamSynchronize(dev_.stream()), "kernel execution (cuStreamSynchronize)");
}

bool CudaEncoder::tensor_ops() const { return CudaDevice::tensor_ops(); }
bool CudaEncoder::tensor_int8() const { return CudaDevice::tensor_int8(); }

uint32_t CudaEncoder::thread_limit(gpu::KernelId kernel) const {
  int threads = 0;
  driver().check(driver().cuFuncGetAttribute(&threads, 0, dev_.function(kernel)), "cuFuncGetAttribute");
  return std::min<uint32_t>(uint32_t(threads), gpu::kMaxThreadsPerGroup);
}

}  // namespace

std::string unavailable_reason() {
  const Driver& d = driver();
  if (!d.error.empty()) return d.error;
  std::string err;
  read_manifest(module_dir(), &err);
  return err;
}

std::unique_ptr<gpu::Device> create_device() { return std::make_unique<CudaDevice>(); }

}  // namespace lily::cuda
