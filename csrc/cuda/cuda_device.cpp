// The "cuda" device (csrc/cuda/cuda_device.h). Contract (docs/gpu.md, "The device"):
//  * Every buffer is plain device memory (cuMemAlloc; never managed memory), poisoned with 0xFF
//    bytes (NaN as bf16 and fp32) when allocated. The host reaches it only through Buffer::write,
//    read and fill: writes and fills are queued on the device's stream (after the work committed
//    before them, before the work committed after); a read first waits for the writes queued
//    before it, then copies on a second stream that does not wait for later steps, so a step in
//    flight keeps running while the host reads the one before it.
//  * An encoder records its dispatches as a CUDA graph, the analogue of one Metal command buffer:
//    each dispatch is a kernel node that depends on every node of the level before it (a barrier
//    starts a new level), so dispatches between two barriers run concurrently as on Metal.
//    commit() launches the graph (updating a cached executable graph of the same topology, else
//    instantiating one) and records an event; wait() waits for that event, so two steps can be in
//    flight. LILY_CUDA_GRAPHS=0 launches each dispatch at once on the stream instead (serial).
//  * Kernels: the cubins of nvrtc_build.py (their manifest.txt: cubin, entry, host name), from
//    $LILY_CUDA_KERNELS or the folder cuda_kernels next to the extension module; tools.cubin adds
//    the timing tools' own kernels (an empty one, a streaming read).
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

// ---- the driver API, declared here (no cuda.h needed to build; layouts as in CUDA 12-13) ------
using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUgraph = struct CUgraph_st*;
using CUgraphNode = struct CUgraphNode_st*;
using CUgraphExec = struct CUgraphExec_st*;
using CUdeviceptr = unsigned long long;

struct KernelNodeParams {  // CUDA_KERNEL_NODE_PARAMS_v2
  CUfunction func;
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void** kernelParams;
  void** extra;
  void* kern;
  CUcontext ctx;
};
struct GraphExecUpdateResultInfo {  // CUgraphExecUpdateResultInfo_v1
  int result;
  CUgraphNode errorNode, errorFromNode;
};

constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventDisableTiming = 2;

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
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemGetInfo)(size_t*, size_t*) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**) = nullptr;
  CUresult (*cuGraphCreate)(CUgraph*, unsigned) = nullptr;
  CUresult (*cuGraphDestroy)(CUgraph) = nullptr;
  CUresult (*cuGraphAddKernelNode)(CUgraphNode*, CUgraph, const CUgraphNode*, size_t, const KernelNodeParams*) = nullptr;
  CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;
  CUresult (*cuGraphExecUpdate)(CUgraphExec, CUgraph, GraphExecUpdateResultInfo*) = nullptr;
  CUresult (*cuGraphExecDestroy)(CUgraphExec) = nullptr;
  CUresult (*cuGraphLaunch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;

  template <class F>
  bool get(F& f, const char* name, const char* fallback = nullptr) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    if (!f && fallback) f = reinterpret_cast<F>(dlsym(lib, fallback));
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
              get(cuFuncGetAttribute, "cuFuncGetAttribute") && get(cuMemAlloc, "cuMemAlloc_v2") &&
              get(cuMemFree, "cuMemFree_v2") && get(cuMemGetInfo, "cuMemGetInfo_v2") &&
              get(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2") && get(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2") &&
              get(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2") && get(cuMemsetD8Async, "cuMemsetD8Async") &&
              get(cuStreamCreate, "cuStreamCreate") && get(cuStreamSynchronize, "cuStreamSynchronize") &&
              get(cuStreamWaitEvent, "cuStreamWaitEvent") && get(cuEventCreate, "cuEventCreate") &&
              get(cuEventRecord, "cuEventRecord") && get(cuEventSynchronize, "cuEventSynchronize") &&
              get(cuEventDestroy, "cuEventDestroy_v2") &&
              get(cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime") &&
              get(cuLaunchKernel, "cuLaunchKernel") && get(cuGraphCreate, "cuGraphCreate") &&
              get(cuGraphDestroy, "cuGraphDestroy") && get(cuGraphAddKernelNode, "cuGraphAddKernelNode_v2") &&
              get(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags") &&
              get(cuGraphExecUpdate, "cuGraphExecUpdate_v2") && get(cuGraphExecDestroy, "cuGraphExecDestroy") &&
              get(cuGraphLaunch, "cuGraphLaunch") && get(cuGetErrorString, "cuGetErrorString");
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

bool graphs_on() {
  const char* e = std::getenv("LILY_CUDA_GRAPHS");
  return !(e && std::string(e) == "0");
}

struct Buffers {  // csrc/cuda/metal_cuda_entry.h lily_cuda::Buffers
  void* p[gpu::kMaxBuffers];
};

class CudaDevice;

class CudaBuffer final : public gpu::Buffer {
 public:
  CudaBuffer(CudaDevice& dev, CUdeviceptr p, size_t bytes) : dev_(dev), p_(p), bytes_(bytes) {}
  ~CudaBuffer() override;
  void* contents() override { return nullptr; }  // device memory: the host copies (write / read)
  size_t size() const override { return bytes_; }
  bool has_storage() override { return true; }
  void write(size_t offset, const void* src, size_t n) override;
  void read(size_t offset, void* dst, size_t n) override;
  void fill(size_t offset, int byte, size_t n) override;
  void copy_from(gpu::Buffer& src, size_t src_offset, size_t offset, size_t n) override;
  CUdeviceptr address() const { return p_; }

 private:
  CudaDevice& dev_;
  CUdeviceptr p_;
  size_t bytes_;
};

// One dispatch as launched: the function, its grid, and the parameter block it is launched with.
struct Launch {
  CUfunction f = nullptr;
  gpu::Size3 groups, threads;
  alignas(16) unsigned char args[gpu::kMaxArgsBytes] = {};
  Buffers buffers{};
  uint64_t level = 0;
  void* params[2] = {nullptr, nullptr};
  void fix() {  // the parameter pointers into this object (after it is placed)
    params[0] = args;
    params[1] = &buffers;
  }
  KernelNodeParams node() {
    fix();
    KernelNodeParams k{};
    k.func = f;
    k.gridDimX = groups.x, k.gridDimY = groups.y, k.gridDimZ = groups.z;
    k.blockDimX = threads.x, k.blockDimY = threads.y, k.blockDimZ = threads.z;
    k.kernelParams = params;
    return k;
  }
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
    d.check(d.cuStreamCreate(&io_, kStreamNonBlocking), "cuStreamCreate");
    d.check(d.cuEventCreate(&written_, kEventDisableTiming), "cuEventCreate");
    char name[256] = {};
    d.cuDeviceGetName(name, sizeof name, dev_);
    name_ = name;
    std::string err;
    dir_ = module_dir();
    manifest_ = read_manifest(dir_, &err);
    if (!err.empty()) throw std::runtime_error("cuda: " + err);
  }
  ~CudaDevice() override {
    bind();
    driver().cuStreamSynchronize(stream_);
    for (auto& [key, g] : graphs_)
      for (CUgraphExec e : g.exec)
        if (e) driver().cuGraphExecDestroy(e);
    driver().cuEventDestroy(written_);
  }
  std::string_view name() const override { return "cuda"; }
  std::unique_ptr<gpu::Buffer> new_buffer(size_t bytes) override {
    bind();
    CUdeviceptr p = 0;
    const size_t n = std::max<size_t>(bytes, 16);
    driver().check(driver().cuMemAlloc(&p, n), "cuMemAlloc(" + std::to_string(bytes) + " bytes)");
    auto b = std::make_unique<CudaBuffer>(*this, p, bytes);
    fill(p, 0xFF, n);  // poison: unwritten bf16 / fp32 elements read NaN
    return b;
  }
  std::unique_ptr<gpu::Encoder> new_encoder() override;
  std::unique_ptr<gpu::Encoder> new_timing_encoder(const gpu::TimingOptions& options, gpu::StepTiming* out) override;
  gpu::DeviceInfo info() const override {
    gpu::DeviceInfo i;
    i.name = "cuda";
    i.device_name = name_;
    int major = 0, minor = 0;
    driver().cuDeviceGetAttribute(&major, 75, dev_);  // COMPUTE_CAPABILITY_MAJOR
    driver().cuDeviceGetAttribute(&minor, 76, dev_);
    i.gpu_family = "sm_" + std::to_string(major) + std::to_string(minor);
    bind();
    size_t free_b = 0, total = 0;
    if (driver().cuMemGetInfo(&free_b, &total) == 0) i.working_set_bytes = free_b;
    i.library_path = dir_;
    i.library_source = "cubin";
    i.build_target = "linux";
    i.math_mode = std::string("nvrtc -default-device -fmad=false; ") +
                  (graphs_on() ? "one CUDA graph per command buffer" : "stream launches (LILY_CUDA_GRAPHS=0)");
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
    auto it = functions_.find(kernel);
    if (it != functions_.end()) return it->second;
    CUfunction f = load(std::string(gpu::kernel_info(kernel).name));
    functions_[kernel] = f;
    return f;
  }
  CUfunction tool(const std::string& entry) {  // tools.cubin: "lily_cuda_empty", "lily_cuda_stream_read"
    std::lock_guard<std::mutex> lock(mu_);
    return load("__" + entry);
  }
  void bind() const { driver().cuCtxSetCurrent(ctx_); }
  CUstream stream() const { return stream_; }

  // Host copies (CudaBuffer): writes queued on the stream; reads after the queued writes, on io_.
  void write(CUdeviceptr dst, const void* src, size_t n) {
    bind();
    driver().check(driver().cuMemcpyHtoDAsync(dst, src, n, stream_), "host-to-device copy");
    written();
  }
  void fill(CUdeviceptr dst, int byte, size_t n) {
    bind();
    driver().check(driver().cuMemsetD8Async(dst, static_cast<unsigned char>(byte), n, stream_), "fill");
    written();
  }
  void copy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    bind();
    driver().check(driver().cuMemcpyDtoDAsync(dst, src, n, stream_), "device-to-device copy");
    written();
  }
  void read(void* dst, CUdeviceptr src, size_t n) {
    bind();
    std::lock_guard<std::mutex> lock(io_mu_);
    driver().check(driver().cuStreamWaitEvent(io_, written_, 0), "cuStreamWaitEvent");
    driver().check(driver().cuMemcpyDtoHAsync(dst, src, n, io_), "device-to-host copy");
    driver().check(driver().cuStreamSynchronize(io_), "device-to-host copy");
  }

  // The executable graphs of recent topologies: two per topology, used in turn, so that updating
  // one never touches the graph of the step still in flight.
  struct Cached {
    CUgraphExec exec[2] = {nullptr, nullptr};
    int next = 0;
  };
  Cached& cached(const std::string& topology) {
    if (graphs_.size() > 64 && !graphs_.count(topology)) {  // many shapes (kernel tests): start over
      driver().cuStreamSynchronize(stream_);
      for (auto& [key, g] : graphs_)
        for (CUgraphExec e : g.exec)
          if (e) driver().cuGraphExecDestroy(e);
      graphs_.clear();
    }
    return graphs_[topology];
  }
  uint64_t instantiations = 0, updates = 0;

 private:
  void written() { driver().check(driver().cuEventRecord(written_, stream_), "cuEventRecord"); }
  CUfunction load(const std::string& host) {
    bind();
    auto row = manifest_.find(host);
    if (row == manifest_.end())
      throw std::runtime_error("cuda: kernel '" + host + "' is not in " + dir_ + "/manifest.txt (rebuild with LILY_CUDA=ON)");
    CUmodule& m = modules_[row->second.cubin];
    if (!m) driver().check(driver().cuModuleLoad(&m, row->second.cubin.c_str()), "cuModuleLoad " + row->second.cubin);
    CUfunction f = nullptr;
    driver().check(driver().cuModuleGetFunction(&f, m, row->second.entry.c_str()), "cuModuleGetFunction " + host);
    return f;
  }

  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  CUstream stream_ = nullptr, io_ = nullptr;
  CUevent written_ = nullptr;
  std::string name_, dir_;
  std::map<std::string, ManifestRow> manifest_;
  std::map<std::string, CUmodule> modules_;
  std::map<gpu::KernelId, CUfunction> functions_;
  std::map<std::string, Cached> graphs_;
  std::mutex mu_, io_mu_;
};

CudaBuffer::~CudaBuffer() {
  if (p_) {
    dev_.bind();
    driver().cuStreamSynchronize(dev_.stream());  // no kernel still reads it
    driver().cuMemFree(p_);
  }
}
void CudaBuffer::write(size_t offset, const void* src, size_t n) {
  check_range(offset, n, "write");
  if (n) dev_.write(p_ + offset, src, n);
}
void CudaBuffer::read(size_t offset, void* dst, size_t n) {
  check_range(offset, n, "read");
  if (n) dev_.read(dst, p_ + offset, n);
}
void CudaBuffer::fill(size_t offset, int byte, size_t n) {
  check_range(offset, n, "fill");
  if (n) dev_.fill(p_ + offset, byte, n);
}

void CudaBuffer::copy_from(gpu::Buffer& src, size_t src_offset, size_t offset, size_t n) {
  auto* cs = dynamic_cast<CudaBuffer*>(&src);
  if (!cs || &cs->dev_ != &dev_) return gpu::Buffer::copy_from(src, src_offset, offset, n);
  cs->check_range(src_offset, n, "copy_from (source)");
  check_range(offset, n, "copy_from");
  if (n) dev_.copy(p_ + offset, cs->p_ + src_offset, n);
}

CUdeviceptr address_of(const gpu::Binding& b) {
  if (!b.buffer) return 0;
  auto* cb = dynamic_cast<CudaBuffer*>(b.buffer);
  if (!cb) throw gpu::EncodeError("cuda: a buffer from another device is bound");
  return cb->address() + b.offset;
}

// Records the dispatches of one command buffer: launched at commit as one graph (or at once on the
// stream with LILY_CUDA_GRAPHS=0).
class CudaEncoder : public gpu::Encoder {
 public:
  explicit CudaEncoder(CudaDevice& dev) : dev_(dev), graphs_(graphs_on()) {
    dev_.bind();
    driver().check(driver().cuEventCreate(&done_, kEventDisableTiming), "cuEventCreate");
  }
  ~CudaEncoder() override {
    if (committed_) driver().cuEventSynchronize(done_);
    driver().cuEventDestroy(done_);
  }
  void commit() override {
    dev_.bind();
    if (graphs_ && !launches_.empty()) launch_graph();
    launches_.clear();
    level_ = 0;
    driver().check(driver().cuEventRecord(done_, dev_.stream()), "cuEventRecord");
    committed_ = true;
  }
  void wait() override {
    if (!committed_) return;
    dev_.bind();
    driver().check(driver().cuEventSynchronize(done_), "kernel execution (cuEventSynchronize)");
  }
  uint32_t thread_limit(gpu::KernelId kernel) const override {
    int threads = 0;
    driver().check(driver().cuFuncGetAttribute(&threads, 0, dev_.function(kernel)), "cuFuncGetAttribute");
    return std::min<uint32_t>(uint32_t(threads), gpu::kMaxThreadsPerGroup);
  }
  bool tensor_ops() const override { return CudaDevice::tensor_ops(); }
  bool tensor_int8() const override { return CudaDevice::tensor_int8(); }

 protected:
  Launch make_launch(const gpu::Dispatch& d) {
    Launch l;
    l.f = dev_.function(d.kernel);
    l.groups = d.groups;
    l.threads = d.threads;
    std::memcpy(l.args, d.args, d.args_size);
    for (uint32_t i = 1; i <= d.num_buffers; ++i)
      l.buffers.p[i - 1] = reinterpret_cast<void*>(address_of(d.buffers[i]));
    l.level = level_;
    return l;
  }
  void encode_dispatch(const gpu::Dispatch& d) override {
    Launch l = make_launch(d);
    if (!graphs_) {
      l.fix();
      dev_.bind();
      driver().check(driver().cuLaunchKernel(l.f, l.groups.x, l.groups.y, l.groups.z, l.threads.x, l.threads.y,
                                             l.threads.z, 0, dev_.stream(), l.params, nullptr),
                     "launch " + std::string(gpu::kernel_info(d.kernel).name));
      return;
    }
    launches_.push_back(l);
    new_level_ = false;
  }
  void encode_barrier() override {
    if (!new_level_) ++level_;  // a barrier with nothing after the last one starts no new level
    new_level_ = true;
  }

  // A graph of `launches` whose nodes depend on every node of the level before theirs.
  static CUgraph build(std::vector<Launch>& launches, std::string* topology) {
    CUgraph g = nullptr;
    driver().check(driver().cuGraphCreate(&g, 0), "cuGraphCreate");
    std::vector<CUgraphNode> prev, cur;
    uint64_t level = launches.empty() ? 0 : launches.front().level;
    for (Launch& l : launches) {
      if (l.level != level) {
        prev.swap(cur);
        cur.clear();
        level = l.level;
      }
      KernelNodeParams k = l.node();
      CUgraphNode n = nullptr;
      const CUresult r = driver().cuGraphAddKernelNode(&n, g, prev.data(), prev.size(), &k);
      if (r != 0) {
        driver().cuGraphDestroy(g);
        driver().check(r, "cuGraphAddKernelNode");
      }
      cur.push_back(n);
      if (topology) {
        topology->append(reinterpret_cast<const char*>(&l.f), sizeof l.f);
        topology->append(reinterpret_cast<const char*>(&l.level), sizeof l.level);
      }
    }
    return g;
  }
  static CUgraphExec instantiate(CUgraph g) {
    CUgraphExec e = nullptr;
    const CUresult r = driver().cuGraphInstantiateWithFlags(&e, g, 0);
    if (r != 0) {
      driver().cuGraphDestroy(g);
      driver().check(r, "cuGraphInstantiate");
    }
    return e;
  }
  void launch_graph() {
    std::string topology;
    CUgraph g = build(launches_, &topology);
    CudaDevice::Cached& c = dev_.cached(topology);
    CUgraphExec& e = c.exec[c.next];
    c.next ^= 1;
    if (e) {
      GraphExecUpdateResultInfo info{};
      if (driver().cuGraphExecUpdate(e, g, &info) == 0) {
        ++dev_.updates;
      } else {
        driver().cuGraphExecDestroy(e);
        e = nullptr;
      }
    }
    if (!e) {
      e = instantiate(g);
      ++dev_.instantiations;
    }
    const CUresult r = driver().cuGraphLaunch(e, dev_.stream());
    driver().cuGraphDestroy(g);
    driver().check(r, "cuGraphLaunch");
  }

  CudaDevice& dev_;
  bool graphs_;
  std::vector<Launch> launches_;
  uint64_t level_ = 0;
  bool new_level_ = true;
  CUevent done_ = nullptr;
  bool committed_ = false;
};

std::unique_ptr<gpu::Encoder> CudaDevice::new_encoder() {
  bind();
  return std::make_unique<CudaEncoder>(*this);
}

// The timing encoder (Device::new_timing_encoder): records like CudaEncoder, and at commit times
// every dispatch alone, the whole graph, the empty graph of the same levels and the references.
class TimingEncoder final : public CudaEncoder {
 public:
  TimingEncoder(CudaDevice& dev, const gpu::TimingOptions& o, gpu::StepTiming* out)
      : CudaEncoder(dev), o_(o), out_(out) {
    graphs_ = true;  // recorded, whatever LILY_CUDA_GRAPHS says
    record = &records_;
    *out_ = gpu::StepTiming{};
    driver().check(driver().cuEventCreate(&t0_, 0), "cuEventCreate");
    driver().check(driver().cuEventCreate(&t1_, 0), "cuEventCreate");
  }
  ~TimingEncoder() override {
    driver().cuEventDestroy(t0_);
    driver().cuEventDestroy(t1_);
  }
  void commit() override {
    dev_.bind();
    gpu::StepTiming& t = *out_;  // a step committed in parts (host waits inside it) adds up its parts
    if (launches_.empty()) return;
    const uint32_t trials = std::max(1u, o_.trials), repeats = std::max(1u, o_.repeats);
    // The whole step: one graph as commit() launches it, replayed.
    const Times step = time_graph(launches_, trials, 2, 1);
    t.step_us += step.median, t.step_us_min += step.lo, t.step_us_max += step.hi;
    t.nodes += launches_.size();
    t.levels += launches_.back().level - launches_.front().level + 1;
    // The empty graph of the same levels and node counts.
    std::vector<Launch> empty = launches_;
    for (Launch& l : empty) {
      l.f = dev_.tool("lily_cuda_empty");
      l.groups = {1, 1, 1};
      l.threads = {32, 1, 1};
    }
    t.empty_us += time_graph(empty, trials, 1, 1).median;
    // References: 1 GiB, and the bytes of every dispatch.
    const uint64_t gib = 1ull << 30;
    t.copy_gbps = double(gib) / (copy_us(gib) * 1e3);  // copy_us(b) moves b / 2 bytes: b touched
    t.read_gbps = double(gib) / (read_us(gib) * 1e3);
    if (o_.per_dispatch) {
      for (size_t i = 0; i < launches_.size(); ++i) {
        gpu::DispatchTime d;
        d.record = records_.at(records_done_ + i);
        std::vector<Launch> chain(repeats, launches_[i]);
        for (uint32_t r = 0; r < repeats; ++r) chain[r].level = r;  // one after another
        const Times one = time_graph(chain, trials, 1, repeats);
        d.us = one.median, d.us_min = one.lo, d.us_max = one.hi;
        d.copy_us = copy_us(d.record.bytes_touched);
        d.read_us = read_us(d.record.bytes_touched);
        t.dispatches.push_back(d);
      }
    }
    driver().check(driver().cuStreamSynchronize(dev_.stream()), "timing");
    records_done_ += launches_.size();
    launches_.clear();
    level_ = 0;
  }
  void wait() override {}

 private:
  void launch(CUgraphExec e) { driver().check(driver().cuGraphLaunch(e, dev_.stream()), "cuGraphLaunch"); }
  template <class F>
  double timed(F f) {  // µs of what f queues
    driver().check(driver().cuEventRecord(t0_, dev_.stream()), "cuEventRecord");
    f();
    driver().check(driver().cuEventRecord(t1_, dev_.stream()), "cuEventRecord");
    driver().check(driver().cuEventSynchronize(t1_), "timing (cuEventSynchronize)");
    float ms = 0;
    driver().check(driver().cuEventElapsedTime(&ms, t0_, t1_), "cuEventElapsedTime");
    return double(ms) * 1e3;
  }
  struct Times {
    double median = 0, lo = 0, hi = 0;  // µs
  };
  // `warm` untimed runs of what `queue` queues, then `trials` timed ones, each divided by `per`.
  template <class F>
  Times measure(F queue, uint32_t trials, uint32_t warm, double per) {
    for (uint32_t i = 0; i < warm; ++i) queue();
    std::vector<double> us;
    for (uint32_t i = 0; i < trials; ++i) us.push_back(timed(queue) / per);
    std::sort(us.begin(), us.end());
    return {us[us.size() / 2], us.front(), us.back()};
  }
  // The graph of `launches` (levels as CudaEncoder builds them), instantiated once and measured.
  Times time_graph(std::vector<Launch>& launches, uint32_t trials, uint32_t warm, double per) {
    CUgraph g = build(launches, nullptr);
    CUgraphExec e = instantiate(g);
    driver().cuGraphDestroy(g);
    const Times t = measure([&] { launch(e); }, trials, warm, per);
    driver().cuGraphExecDestroy(e);
    return t;
  }
  void scratch(uint64_t bytes) {
    if (scratch_ && scratch_->size() >= bytes) return;
    scratch_.reset();
    scratch_ = dev_.new_buffer(std::max<uint64_t>(bytes, 1 << 20));
    sink_ = dev_.new_buffer(16);
  }
  double copy_us(uint64_t bytes) {  // a device copy touching `bytes` (half read, half written)
    auto hit = copies_.find(bytes);
    if (hit != copies_.end()) return hit->second;
    const uint64_t half = std::max<uint64_t>(bytes / 2, 16) & ~uint64_t(15);
    scratch(2 * half);
    const CUdeviceptr a = static_cast<CudaBuffer*>(scratch_.get())->address();
    auto copy = [&] { driver().check(driver().cuMemcpyDtoDAsync(a + half, a, half, dev_.stream()), "cuMemcpyDtoD"); };
    return copies_[bytes] = measure(copy, std::max(3u, o_.trials), 1, 1).median;
  }
  double read_us(uint64_t bytes) {  // the streaming read kernel over `bytes`
    auto hit = reads_.find(bytes);
    if (hit != reads_.end()) return hit->second;
    const uint64_t n = std::max<uint64_t>(bytes, 16) & ~uint64_t(15);
    scratch(n);
    CUfunction f = dev_.tool("lily_cuda_stream_read");
    CUdeviceptr p = static_cast<CudaBuffer*>(scratch_.get())->address();
    CUdeviceptr s = static_cast<CudaBuffer*>(sink_.get())->address();
    unsigned long long n16 = n / 16;
    unsigned never = 0x9E3779B9u;
    void* params[4] = {&p, &n16, &never, &s};
    const unsigned threads = 256;
    const unsigned groups = unsigned(std::min<uint64_t>(132 * 8, std::max<uint64_t>(1, (n16 + threads * 4 - 1) / (threads * 4))));
    auto run = [&] {
      driver().check(driver().cuLaunchKernel(f, groups, 1, 1, threads, 1, 1, 0, dev_.stream(), params, nullptr),
                     "launch lily_cuda_stream_read");
    };
    return reads_[bytes] = measure(run, std::max(3u, o_.trials), 1, 1).median;
  }

  gpu::TimingOptions o_;
  gpu::StepTiming* out_;
  std::vector<gpu::DispatchRecord> records_;
  size_t records_done_ = 0;
  CUevent t0_ = nullptr, t1_ = nullptr;
  std::unique_ptr<gpu::Buffer> scratch_, sink_;
  std::map<uint64_t, double> copies_, reads_;
};

std::unique_ptr<gpu::Encoder> CudaDevice::new_timing_encoder(const gpu::TimingOptions& options, gpu::StepTiming* out) {
  bind();
  if (!out) throw std::invalid_argument("cuda: new_timing_encoder needs somewhere to put the timings");
  return std::make_unique<TimingEncoder>(*this, options, out);
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
