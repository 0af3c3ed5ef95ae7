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

namespace lily::metal {

namespace {

// Oldest Apple GPU family the kernels run on: simdgroup matrices (common/mma.h) and simd
// reductions need Apple7 (A14 / M1) or newer.
constexpr int kMinAppleFamily = 7;

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
int apple_family(id<MTLDevice> d) {
  for (int n = 20; n >= 1; --n)
    if ([d supportsFamily:static_cast<MTLGPUFamily>(static_cast<NSInteger>(MTLGPUFamilyApple1) + n - 1)]) return n;
  return 0;
}

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
  const Info& info() const { return info_; }
  id<MTLLibrary> library() const { return library_; }

  // Throws (std::runtime_error) when the device cannot run the kernels.
  void require_supported() const {
    if (info_.supported) return;
    throw std::runtime_error("Metal device '" + info_.name + "' (GPU family " + info_.family +
                             ") cannot run lily_py's kernels: they need simdgroup matrices, GPU family apple" +
                             std::to_string(kMinAppleFamily) +
                             " (M1) or newer (virtual machines expose an 'Apple Paravirtual device' without them)");
  }

  // (The parameter must not be called `id`: that would hide Objective-C's `id` type below.)
  id<MTLComputePipelineState> pipeline(gpu::KernelId kernel) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t i = static_cast<size_t>(kernel);
    if (pipelines_[i] != nil) return pipelines_[i];
    const std::string name(gpu::kernel_info(kernel).name);
    std::string error;
    @autoreleasepool {
      id<MTLFunction> fn = [library_ newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
      if (fn == nil) {
        error = "Metal library " + info_.library + " has no kernel '" + name + "'";
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
        info_.name = utf8([device_ name]);
        const int fam = apple_family(device_);
        info_.family = fam > 0 ? "apple" + std::to_string(fam) : std::string("none (not an Apple GPU)");
        info_.supported = fam >= kMinAppleFamily;
        if (queue_ == nil) error = "Metal device " + info_.name + ": newCommandQueue failed";
        else error = load_library();
      }
    }
    if (!error.empty()) throw std::runtime_error(error);
  }

  // Returns "" or the error. Prefers lily.metallib; falls back to compiling the shipped source
  // when the metallib is missing or cannot be loaded (e.g. built for a newer macOS).
  std::string load_library() {
    const std::string dir = module_dir();
    const std::string lib = dir + "/lily.metallib";
    std::string lib_error;
    NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:lib.c_str()]];
    if ([[NSFileManager defaultManager] fileExistsAtPath:[url path]]) {
      NSError* err = nil;
      library_ = [device_ newLibraryWithURL:url error:&err];
      if (library_ != nil) {
        info_.library = lib;
        return "";
      }
      lib_error = "cannot load " + lib + ": " + describe(err) + "; ";
    }
    // Compile the amalgamated sources at run time: fast math off (precise exp/log/rsqrt, no
    // reassociation), MSL 3.1 for bfloat (macOS 14).
    const std::string src_path = dir + "/lily_shaders.metal";
    std::ifstream in(src_path);
    if (!in) return lib_error + "neither " + lib + " nor " + src_path + " is usable";
    std::stringstream ss;
    ss << in.rdbuf();
    NSString* source = [NSString stringWithUTF8String:ss.str().c_str()];
    if (source == nil) return lib_error + src_path + " is not UTF-8";
    MTLCompileOptions* opts = [[MTLCompileOptions alloc] init];
    opts.fastMathEnabled = NO;  // documented: NO sets mathMode = safe (macOS 15 renamed the property)
    opts.languageVersion = MTLLanguageVersion3_1;
    NSError* err = nil;
    library_ = [device_ newLibraryWithSource:source options:opts error:&err];
    if (library_ == nil) return lib_error + "compiling " + src_path + ": " + describe(err);
    info_.library = src_path;
    return "";
  }

  id<MTLDevice> device_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  id<MTLLibrary> library_ = nil;
  Info info_;
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
  std::string_view name() const override { return "metal"; }
  std::unique_ptr<gpu::Buffer> new_buffer(size_t bytes) override {
    id<MTLBuffer> b = nil;
    @autoreleasepool {
      b = [ctx_.device() newBufferWithLength:(bytes ? bytes : 1) options:MTLResourceStorageModeShared];
    }
    if (b == nil) throw std::bad_alloc();
    return std::make_unique<MetalBuffer>(b);
  }
  std::unique_ptr<gpu::Encoder> new_encoder() override { return std::make_unique<MetalEncoder>(ctx_); }

 private:
  Context& ctx_;
};

}  // namespace

bool available() {
  @autoreleasepool {
    id<MTLDevice> d = system_device();
    return d != nil && apple_family(d) >= kMinAppleFamily;
  }
}

Info info() { return Context::get().info(); }

std::unique_ptr<gpu::Device> create_device() {
  Context& ctx = Context::get();
  ctx.require_supported();
  return std::make_unique<MetalDevice>(ctx);
}

std::vector<std::string> library_functions() {
  Context& ctx = Context::get();
  std::vector<std::string> out;
  @autoreleasepool {
    for (NSString* n in [ctx.library() functionNames]) out.push_back(utf8(n));
  }
  return out;
}

}  // namespace lily::metal
