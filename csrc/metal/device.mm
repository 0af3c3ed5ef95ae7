// Metal device: thin layer over Apple's documented Metal API (MTLDevice, MTLLibrary,
// MTLComputePipelineState, MTLBuffer, MTLCommandBuffer, MTLComputeCommandEncoder).
// Compiled with ARC (-fobjc-arc). Everything that is not Metal-specific lives in csrc/gpu/.
//
// Autorelease pools: the callers are plain C++ threads (Python's, GIL released) with no pool of
// their own, so every entry point that calls Objective-C wraps that work in @autoreleasepool;
// otherwise autoreleased objects (command buffers, encoders, strings) and the buffers a
// command buffer retains would be kept until the thread exits. C++ exceptions are thrown after
// the pool block, not through it (a pool left by an exception is not drained).
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>

#include <array>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>

#include "gpu/kernel_ids.h"
#include "metal/metal_device.h"

#if !__has_feature(objc_arc)
#error "csrc/metal/device.mm must be compiled with -fobjc-arc (see CMakeLists.txt)"
#endif

// APIs newer than the oldest SDK the project builds with (macOS 14.2): compiled only when the SDK
// declares them (its Availability.h defines __MAC_15_0), used only where @available says the OS
// has them.
#if defined(__MAC_15_0) && __MAC_OS_X_VERSION_MAX_ALLOWED >= __MAC_15_0
#define LILY_SDK_MACOS15 1
#else
#define LILY_SDK_MACOS15 0
#endif
// The flags CMake compiled each metallib with (CMakeLists.txt; absent when it built none).
#if defined(LILY_METALLIB_FLAGS)
#define LILY_METALLIB_FLAGS_OR_NULL LILY_METALLIB_FLAGS
#else
#define LILY_METALLIB_FLAGS_OR_NULL nullptr
#endif
#if defined(LILY_METALLIB_M5_FLAGS)
#define LILY_METALLIB_M5_FLAGS_OR_NULL LILY_METALLIB_M5_FLAGS
#else
#define LILY_METALLIB_M5_FLAGS_OR_NULL nullptr
#endif

namespace lily::metal {

namespace {

// Oldest Apple GPU family the kernels run on: simdgroup matrices (common/mma.h) and simd
// reductions need Apple7 (A14 / M1) or newer.
constexpr int kMinAppleFamily = 7;
// The M5 routes (Metal 4 tensor ops, mpp::tensor_ops::matmul2d) are taken from Apple GPU family
// 10 (M5: neural accelerators in every GPU core). Older families would run the same tensor ops
// without those accelerators, where the simdgroup-matrix kernels are the measured path.
constexpr int kTensorOpsAppleFamily = 10;
// MTLLanguageVersion4_0 = (4 << 16) + 0 = 262144 (MTLLibrary.h of the macOS 26 SDK; the same value
// as LanguageVersion4_0 in Apple's metal-cpp, Metal/MTLLibrary.hpp). The macOS 14.2 and 15 SDK
// headers this file also compiles against do not declare it, hence the raw value; it is used only
// where macos26_or_later() holds. The tensor-op shaders need it: Metal 4 defines
// __METAL_VERSION__ 400 and __HAVE_TENSOR__, which shaders/common/tensor_ops.h requires.
constexpr NSUInteger kMTLLanguageVersion4_0 = (4u << 16) + 0u;

std::string module_dir() {
  Dl_info dl{};
  if (dladdr(reinterpret_cast<const void*>(&available), &dl) == 0 || dl.dli_fname == nullptr) return ".";
  std::string path(dl.dli_fname);
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string utf8(NSString* s) {
  const char* c = s ? [s UTF8String] : nullptr;
  return c ? std::string(c) : std::string();
}

std::string describe(NSError* err) {
  return err ? utf8([err localizedDescription]) : std::string("unknown error");
}

// The default GPU. MTLCreateSystemDefaultDevice returns nil in processes that do not link
// CoreGraphics (Apple's documentation; CMakeLists.txt links it); MTLCopyAllDevices is the fallback.
id<MTLDevice> system_device() {
  id<MTLDevice> d = MTLCreateSystemDefaultDevice();
  if (d == nil) {
    NSArray<id<MTLDevice>>* all = MTLCopyAllDevices();
    if ([all count] > 0) d = all[0];
  }
  return d;
}

// Highest Apple GPU family N the device supports (0: none). Probed with raw enum values
// (MTLGPUFamilyApple1 + N - 1) so families newer than the SDK's enum are reported too.
std::string macos_version(long v) {  // 140200 -> "14.2"
  return std::to_string(v / 10000) + "." + std::to_string((v / 100) % 100);
}

int apple_family(id<MTLDevice> d) {
  for (int n = 20; n >= 1; --n)
    if ([d supportsFamily:static_cast<MTLGPUFamily>(static_cast<NSInteger>(MTLGPUFamilyApple1) + n - 1)]) return n;
  return 0;
}

// macOS 26 or newer, whatever SDK this module and the process were built with. A process whose
// executable was linked against a macOS 15 or older SDK may be told macOS 26 is "16.0" (Apple's
// version compatibility, as macOS 11 was 10.16 to old binaries); no other macOS is 16.x. Nothing
// here calls an API newer than macOS 14: the checks gate the Metal 4 language at run time.
bool macos26_or_later() {
  if (@available(macOS 26.0, *)) return true;
  if (@available(macOS 16.0, *)) return true;
  return false;
}

// One shader library as the device found it: the prebuilt metallib, else the installed
// amalgamated source compiled at run time; lib == nil when neither worked (error says why).
struct LoadedLibrary {
  id<MTLLibrary> lib = nil;
  std::string path;             // the metallib or the source file in use ("" when none)
  std::string source;           // "metallib" | "source" | ""
  bool metallib_installed = false;
  std::string metallib_error;   // why an installed metallib was not used ("" when it was / none)
  std::string error;            // why there is no library ("" when lib != nil)
  std::string math_mode;        // how its math was compiled
};

// One per process: device, queue, library and the pipeline cache (keyed by kernel id).
// Deliberately never destroyed: releasing Metal objects from static destructors at interpreter
// exit races the framework's own teardown.
class Context {
 public:
  static Context& get() {
    static Context* ctx = new Context();  // a throwing constructor is retried on the next call
    return *ctx;
  }

  id<MTLDevice> device() const { return device_; }
  id<MTLCommandQueue> queue() const { return queue_; }
  const gpu::DeviceInfo& info() const { return info_; }
  id<MTLLibrary> library() const { return library_; }
  id<MTLLibrary> library_m5() const { return library_m5_; }

  // "" when the kernels can run here: an Apple7+ GPU and a loaded library.
  std::string unsupported_reason() const {
    if (!supported_)
      return "Metal device '" + info_.device_name + "' (GPU family " + info_.gpu_family +
             ") cannot run lily_py's kernels: they need simdgroup matrices, GPU family apple" +
             std::to_string(kMinAppleFamily) +
             " (M1) or newer (virtual machines expose an 'Apple Paravirtual device' without them)";
    if (library_ == nil) return "Metal library: " + library_error_;
    return "";
  }
  // Throws (std::runtime_error) when the device cannot run the kernels.
  void require_supported() const {
    const std::string why = unsupported_reason();
    if (!why.empty()) throw std::runtime_error(why);
  }

  // (The parameter must not be called `id`: that would hide Objective-C's `id` type below.)
  id<MTLComputePipelineState> pipeline(gpu::KernelId kernel) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t i = static_cast<size_t>(kernel);
    if (pipelines_[i] != nil) return pipelines_[i];
    const std::string name(gpu::kernel_info(kernel).name);
    std::string error;
    const bool m5 = gpu::kernel_needs_tensor_ops(kernel);
    id<MTLLibrary> lib = m5 ? library_m5_ : library_;
    @autoreleasepool {
      id<MTLFunction> fn = [lib newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
      if (m5 && lib == nil) {
        error = "kernel '" + name + "' needs Metal 4 tensor ops: " + info_.tensor_ops_reason;
      } else if (lib == nil) {
        error = "no Metal library: " + library_error_;
      } else if (fn == nil) {
        error = "Metal library " + (m5 ? m5_path_ : info_.library_path) + " has no kernel '" + name + "'";
      } else {
        NSError* err = nil;
        id<MTLComputePipelineState> pso = [device_ newComputePipelineStateWithFunction:fn error:&err];
        if (pso == nil) error = "pipeline for '" + name + "': " + describe(err);
        else pipelines_[i] = pso;
      }
    }
    if (!error.empty()) throw std::runtime_error(error);
    return pipelines_[i];
  }

 private:
  Context() {
    std::string error;
    @autoreleasepool {
      device_ = system_device();
      if (device_ == nil) {
        error = "no Metal device on this machine";
      } else {
        queue_ = [device_ newCommandQueue];
        info_.name = "metal";
        info_.device_name = utf8([device_ name]);
        const int fam = apple_family(device_);
        info_.gpu_family = fam > 0 ? "apple" + std::to_string(fam) : std::string("none (not an Apple GPU)");
        supported_ = fam >= kMinAppleFamily;
        info_.working_set_bytes = [device_ recommendedMaxWorkingSetSize];
        info_.max_buffer_bytes = [device_ maxBufferLength];
        info_.build_target = "macOS " + macos_version(__MAC_OS_X_VERSION_MIN_REQUIRED);
        info_.build_sdk = "macOS SDK " + macos_version(__MAC_OS_X_VERSION_MAX_ALLOWED);
        if (queue_ == nil) error = "Metal device " + info_.device_name + ": newCommandQueue failed";
        else library_error_ = load_library();  // kept: info() and unsupported_reason() report it
        if (library_ != nil) load_library_m5(fam);
      }
    }
    if (!error.empty()) throw std::runtime_error(error);
  }

  // `metallib` if it is installed and loads; else the amalgamated source `source_path` (installed
  // beside it, csrc/metal/amalgamate.py) compiled at run time in language `version` (`lang` names
  // it), math mode explicit as in the metallibs (precise exp/log/rsqrt, no reassociation or
  // contraction). An installed metallib that does not load (e.g. built for a newer macOS) is kept
  // in metallib_error either way.
  LoadedLibrary load_library_file(const std::string& metallib, const char* metallib_flags,
                                  const std::string& source_path, MTLLanguageVersion version, const char* lang) {
    LoadedLibrary r;
    NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:metallib.c_str()]];
    if ([[NSFileManager defaultManager] fileExistsAtPath:[url path]]) {
      r.metallib_installed = true;
      NSError* err = nil;
      r.lib = [device_ newLibraryWithURL:url error:&err];
      if (r.lib != nil) {
        r.path = metallib;
        r.source = "metallib";
        r.math_mode = metallib_flags != nullptr ? std::string("metallib compiled with: ") + metallib_flags
                                                : std::string("metallib (compile flags not recorded)");
        return r;
      }
      r.metallib_error = "cannot load " + metallib + ": " + describe(err);
    }
    const std::string why_not_metallib = r.metallib_error.empty() ? "" : r.metallib_error + "; ";
    std::ifstream in(source_path);
    if (!in) {
      r.error = why_not_metallib + "neither " + metallib + " nor " + source_path + " is usable";
      return r;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    NSString* source = [NSString stringWithUTF8String:ss.str().c_str()];
    if (source == nil) {
      r.error = why_not_metallib + source_path + " is not UTF-8";
      return r;
    }
    MTLCompileOptions* opts = [[MTLCompileOptions alloc] init];
    const std::string math = set_math_mode(opts);
    opts.languageVersion = version;
    NSError* err = nil;
    r.lib = [device_ newLibraryWithSource:source options:opts error:&err];
    if (r.lib == nil) {
      r.error = why_not_metallib + "compiling " + source_path + " (" + lang + ") at run time: " + describe(err);
      return r;
    }
    r.path = source_path;
    r.source = "source";
    r.math_mode = std::string(lang) + ", " + math;
    return r;
  }

  // The base library: lily.metallib, else lily_shaders.metal compiled at run time as MSL 3.1
  // (bfloat, macOS 14). Returns "" or the error.
  std::string load_library() {
    const std::string dir = module_dir();
    LoadedLibrary r = load_library_file(dir + "/lily.metallib", LILY_METALLIB_FLAGS_OR_NULL,
                                        dir + "/lily_shaders.metal", MTLLanguageVersion3_1, "MSL 3.1");
    info_.metallib_built = r.metallib_installed;
    info_.metallib_error = r.metallib_error;
    if (r.lib == nil) return r.error;
    library_ = r.lib;
    info_.library_path = r.path;
    info_.library_source = r.source;
    info_.math_mode = r.math_mode;
    return "";
  }

  // The tensor-op kernels (shaders/m5/), on an Apple10+ GPU under macOS 26+ only:
  // lily_m5.metallib (built only by a macOS 26 SDK's Metal toolchain), else lily_shaders_m5.metal
  // compiled at run time as MSL 4.0. Sets info_.tensor_ops and appends " + <path>" to
  // info_.library_path (a path ending in .metallib: prebuilt; .metal: compiled at run time), or
  // sets info_.tensor_ops_reason to why not. An installed lily_m5.metallib that does not load is
  // appended to info_.metallib_error.
  void load_library_m5(int fam) {
    if (fam < kTensorOpsAppleFamily) {
      info_.tensor_ops_reason = "GPU family apple" + std::to_string(fam) + " < apple" +
                                std::to_string(kTensorOpsAppleFamily) + " (M5): the simdgroup-matrix kernels are used";
      return;
    }
    if (!macos26_or_later()) {
      info_.tensor_ops_reason = "Metal 4 tensor ops need macOS 26";
      return;
    }
    const std::string dir = module_dir();
    LoadedLibrary r = load_library_file(dir + "/lily_m5.metallib", LILY_METALLIB_M5_FLAGS_OR_NULL,
                                        dir + "/lily_shaders_m5.metal",
                                        static_cast<MTLLanguageVersion>(kMTLLanguageVersion4_0), "MSL 4.0");
    if (!r.metallib_error.empty())
      info_.metallib_error += (info_.metallib_error.empty() ? "" : "; ") + r.metallib_error;
    if (r.lib == nil) {
      info_.tensor_ops_reason = r.error;
      return;
    }
    library_m5_ = r.lib;
    m5_path_ = r.path;
    info_.tensor_ops = true;
    // int8 activations on the tensor ops (qmm_m5i8, moe_*_m5i8) only on request: estimated
    // faster than the half kernels, but they exceed mlx-lm's bf16 error on one of the oracle
    // checkpoints (docs/int8.md). (The int8 cache's prefill attention has int8 scores on every M5.)
    const char* i8 = std::getenv("LILY_TENSOR_INT8");
    info_.tensor_int8 = i8 != nullptr && std::string(i8) == "1";
    info_.library_path += " + " + r.path;
    info_.math_mode += "; lily_m5: " + r.math_mode;
  }

  // macOS 15+: mathMode = safe and precise math functions (the properties that replaced
  // fastMathEnabled); before that fastMathEnabled = NO (documented to mean the same safe mode).
  // Returns what it set.
  static std::string set_math_mode(MTLCompileOptions* opts) {
#if LILY_SDK_MACOS15
    if (@available(macOS 15.0, *)) {
      opts.mathMode = MTLMathModeSafe;
      opts.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
      return "mathMode=safe, mathFloatingPointFunctions=precise";
    }
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"
#endif
    opts.fastMathEnabled = NO;
#if LILY_SDK_MACOS15
#pragma clang diagnostic pop
#endif
    return "fastMathEnabled=NO";
  }

  id<MTLDevice> device_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  id<MTLLibrary> library_ = nil;
  id<MTLLibrary> library_m5_ = nil;  // the tensor-op library, when info_.tensor_ops
  std::string m5_path_;              // its metallib or source file
  gpu::DeviceInfo info_;
  bool supported_ = false;
  std::string library_error_;  // why no library loaded ("" when one did)
  std::mutex mu_;
  std::array<id<MTLComputePipelineState>, gpu::kNumKernels> pipelines_{};
};

class MetalBuffer final : public gpu::Buffer {
 public:
  explicit MetalBuffer(id<MTLBuffer> b) : buf_(b) {}
  void* contents() override { return [buf_ contents]; }
  size_t size() const override { return [buf_ length]; }
  id<MTLBuffer> handle() const { return buf_; }

 private:
  id<MTLBuffer> buf_;
};

class MetalEncoder final : public gpu::Encoder {
 public:
  explicit MetalEncoder(Context& ctx) : ctx_(ctx) {
    @autoreleasepool {
      cb_ = [ctx.queue() commandBuffer];
      enc_ = [cb_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
    }
    if (cb_ == nil || enc_ == nil) throw std::runtime_error("Metal: cannot create a command buffer / compute encoder");
  }
  // An encoder must see endEncoding before it is released (Metal asserts otherwise), also when
  // encoding stopped on an exception; the command buffer is then dropped uncommitted.
  ~MetalEncoder() override {
    if (!ended_) {
      @autoreleasepool {
        [enc_ endEncoding];
      }
    }
  }
  void commit() override {
    if (committed_) return;
    @autoreleasepool {
      [enc_ endEncoding];
      ended_ = true;
      [cb_ commit];
    }
    committed_ = true;
  }
  void wait() override {
    commit();
    std::string error;
    @autoreleasepool {
      [cb_ waitUntilCompleted];
      if ([cb_ status] == MTLCommandBufferStatusError)
        error = "Metal command buffer failed: " + describe([cb_ error]);
    }
    if (!error.empty()) throw std::runtime_error(error);
  }
  uint32_t thread_limit(gpu::KernelId kernel) const override {
    return static_cast<uint32_t>([ctx_.pipeline(kernel) maxTotalThreadsPerThreadgroup]);
  }
  bool tensor_ops() const override { return ctx_.info().tensor_ops; }
  bool tensor_int8() const override { return ctx_.info().tensor_int8; }

 protected:
  void encode_dispatch(const gpu::Dispatch& d) override {
    if (committed_) throw gpu::EncodeError("dispatch after commit: use a new encoder");
    id<MTLComputePipelineState> pso = ctx_.pipeline(d.kernel);
    const std::string kname(gpu::kernel_info(d.kernel).name);
    const NSUInteger max_threads = [pso maxTotalThreadsPerThreadgroup];
    if (d.threads.count() > max_threads)
      throw gpu::EncodeError(kname + ": " + std::to_string(d.threads.count()) +
                             " threads per threadgroup exceed this pipeline's limit of " + std::to_string(max_threads));
    // The kernels hard-code 32-lane simdgroups (lane / simd_id arithmetic, simd_sum trees).
    if ([pso threadExecutionWidth] != 32)
      throw gpu::EncodeError(kname + ": SIMD width " + std::to_string([pso threadExecutionWidth]) +
                             ", the kernels assume 32");
    std::string error;
    @autoreleasepool {
      [enc_ setComputePipelineState:pso];
      [enc_ setBytes:d.args length:d.args_size atIndex:0];  // <= kMaxArgsBytes (256), under the 4 KB limit
      for (uint32_t i = 1; i <= d.num_buffers; ++i) {
        auto* mb = dynamic_cast<MetalBuffer*>(d.buffers[i].buffer);
        if (mb == nullptr) {
          error = kname + " buffer(" + std::to_string(i) + ") is not a Metal buffer";
          break;
        }
        [enc_ setBuffer:mb->handle() offset:d.buffers[i].offset atIndex:i];
      }
      if (error.empty())
        [enc_ dispatchThreadgroups:MTLSizeMake(d.groups.x, d.groups.y, d.groups.z)
             threadsPerThreadgroup:MTLSizeMake(d.threads.x, d.threads.y, d.threads.z)];
    }
    if (!error.empty()) throw gpu::EncodeError(error);
  }
  // The encoder is concurrent (MTLDispatchTypeConcurrent): dispatches are ordered only by these.
  void encode_barrier() override {
    @autoreleasepool {
      [enc_ memoryBarrierWithScope:MTLBarrierScopeBuffers];
    }
  }

 private:
  Context& ctx_;
  id<MTLCommandBuffer> cb_ = nil;
  id<MTLComputeCommandEncoder> enc_ = nil;
  bool ended_ = false;
  bool committed_ = false;
};

class MetalDevice final : public gpu::Device {
 public:
  explicit MetalDevice(Context& ctx) : ctx_(ctx) {}
  ~MetalDevice() override { release_residency(); }
  std::string_view name() const override { return "metal"; }
  std::unique_ptr<gpu::Buffer> new_buffer(size_t bytes) override {
    const uint64_t max_len = ctx_.info().max_buffer_bytes;
    if (max_len && bytes > max_len)
      throw std::runtime_error("Metal: a buffer of " + std::to_string(bytes) + " bytes exceeds this device's maxBufferLength (" +
                               std::to_string(max_len) + " bytes)");
    id<MTLBuffer> b = nil;
    @autoreleasepool {
      b = [ctx_.device() newBufferWithLength:(bytes ? bytes : 1) options:MTLResourceStorageModeShared];
    }
    if (b == nil) throw std::bad_alloc();
    return std::make_unique<MetalBuffer>(b);
  }
  // The checkpoint's pages as a buffer (shared storage, no copy): the caller keeps the mapping
  // alive; nullptr (the caller copies) over maxBufferLength or when Metal refuses the range.
  std::unique_ptr<gpu::Buffer> wrap_host_memory(const void* ptr, size_t bytes) override {
    const uint64_t max_len = ctx_.info().max_buffer_bytes;
    if (bytes == 0 || (max_len && bytes > max_len)) return nullptr;
    id<MTLBuffer> b = nil;
    @autoreleasepool {
      b = [ctx_.device() newBufferWithBytesNoCopy:const_cast<void*>(ptr)
                                           length:bytes
                                          options:MTLResourceStorageModeShared
                                      deallocator:nil];
    }
    if (b == nil) return nullptr;
    return std::make_unique<MetalBuffer>(b);
  }
  std::unique_ptr<gpu::Encoder> new_encoder() override { return std::make_unique<MetalEncoder>(ctx_); }

  gpu::DeviceInfo info() const override {
    gpu::DeviceInfo i = ctx_.info();
    i.residency_set = resident_;
    return i;
  }

  gpu::PipelineInfo pipeline_info(gpu::KernelId kernel) override {
    id<MTLComputePipelineState> pso = ctx_.pipeline(kernel);  // creates it (throws on failure)
    gpu::PipelineInfo p;
    p.max_threads = static_cast<uint32_t>([pso maxTotalThreadsPerThreadgroup]);
    p.static_threadgroup_bytes = static_cast<int64_t>([pso staticThreadgroupMemoryLength]);
    p.simd_width = static_cast<uint32_t>([pso threadExecutionWidth]);
    return p;
  }

  // macOS 15+: one MTLResidencySet holding `buffers`, attached to the queue, so the GPU keeps them
  // resident across command buffers. Compiled only against an SDK that declares residency sets.
  void make_resident(const std::vector<gpu::Buffer*>& buffers) override {
#if LILY_SDK_MACOS15
    if (@available(macOS 15.0, *)) {
      release_residency();
      @autoreleasepool {
        MTLResidencySetDescriptor* desc = [[MTLResidencySetDescriptor alloc] init];
        desc.label = @"lily_py weights and state";
        desc.initialCapacity = buffers.size();
        NSError* err = nil;
        id<MTLResidencySet> set = [ctx_.device() newResidencySetWithDescriptor:desc error:&err];
        if (set == nil) return;  // an optimisation only: buffers stay usable without it
        for (gpu::Buffer* b : buffers)
          if (auto* mb = dynamic_cast<MetalBuffer*>(b)) [set addAllocation:mb->handle()];
        [set commit];
        [set requestResidency];
        [ctx_.queue() addResidencySet:set];
        residency_ = set;
        resident_ = true;
      }
    }
#else
    (void)buffers;
#endif
  }

 private:
  void release_residency() {
#if LILY_SDK_MACOS15
    if (@available(macOS 15.0, *)) {
      if (residency_ != nil) {
        @autoreleasepool {
          id<MTLResidencySet> set = residency_;
          [ctx_.queue() removeResidencySet:set];
          [set endResidency];
        }
        residency_ = nil;
        resident_ = false;
      }
    }
#endif
  }

  Context& ctx_;
  bool resident_ = false;
#if LILY_SDK_MACOS15
  id residency_ = nil;  // id<MTLResidencySet> (a plain id: the protocol is macOS 15+)
#endif
};

}  // namespace

bool available() {
  @autoreleasepool {
    id<MTLDevice> d = system_device();
    return d != nil && apple_family(d) >= kMinAppleFamily;
  }
}

std::string unavailable_reason() {
  try {
    return Context::get().unsupported_reason();
  } catch (const std::exception& e) {
    return e.what();
  }
}

gpu::DeviceInfo info() { return Context::get().info(); }

std::unique_ptr<gpu::Device> create_device() {
  Context& ctx = Context::get();
  ctx.require_supported();
  return std::make_unique<MetalDevice>(ctx);
}

std::vector<std::string> library_functions() {
  Context& ctx = Context::get();
  std::vector<std::string> out;
  if (ctx.library() == nil) return out;
  @autoreleasepool {
    for (NSString* n in [ctx.library() functionNames]) out.push_back(utf8(n));
    if (ctx.library_m5() != nil)
      for (NSString* n in [ctx.library_m5() functionNames]) out.push_back(utf8(n));
  }
  return out;
}

std::vector<PipelineReport> pipeline_report() {
  Context& ctx = Context::get();
  std::vector<PipelineReport> out;
  for (const gpu::KernelInfo& k : gpu::kKernelTable) {
    if (gpu::kernel_needs_tensor_ops(k.id) && !ctx.info().tensor_ops) continue;  // not in a loaded library
    PipelineReport r;
    r.kernel = std::string(k.name);
    try {
      id<MTLComputePipelineState> pso = ctx.pipeline(k.id);
      r.info.max_threads = static_cast<uint32_t>([pso maxTotalThreadsPerThreadgroup]);
      r.info.static_threadgroup_bytes = static_cast<int64_t>([pso staticThreadgroupMemoryLength]);
      r.info.simd_width = static_cast<uint32_t>([pso threadExecutionWidth]);
    } catch (const std::exception& e) {
      r.error = e.what();
    }
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace lily::metal
