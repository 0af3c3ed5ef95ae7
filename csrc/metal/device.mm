// Metal device: thin layer over Apple's documented Metal API (MTLDevice, MTLLibrary,
// MTLComputePipelineState, MTLBuffer, MTLCommandBuffer, MTLComputeCommandEncoder).
// Compiled with ARC (-fobjc-arc). Everything that is not Metal-specific lives in csrc/gpu/.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>

#include <array>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>

#include "gpu/kernel_ids.h"
#include "metal/metal_device.h"

namespace lily::metal {

namespace {

std::string module_dir() {
  Dl_info dl{};
  if (dladdr(reinterpret_cast<const void*>(&available), &dl) == 0 || dl.dli_fname == nullptr) return ".";
  std::string path(dl.dli_fname);
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string describe(NSError* err) {
  return err ? std::string([[err localizedDescription] UTF8String]) : std::string("unknown error");
}

// One per process: device, queue, library and the pipeline cache (keyed by kernel id).
class Context {
 public:
  static Context& get() {
    static Context ctx;
    return ctx;
  }

  id<MTLDevice> device() const { return device_; }
  id<MTLCommandQueue> queue() const { return queue_; }
  const Info& info() const { return info_; }
  id<MTLLibrary> library() const { return library_; }

  id<MTLComputePipelineState> pipeline(gpu::KernelId id) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t i = static_cast<size_t>(id);
    if (pipelines_[i] == nil) {
      const std::string name(gpu::kernel_info(id).name);
      id<MTLFunction> fn = [library_ newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
      if (fn == nil) throw std::runtime_error("Metal library " + info_.library + " has no kernel '" + name + "'");
      NSError* err = nil;
      id<MTLComputePipelineState> pso = [device_ newComputePipelineStateWithFunction:fn error:&err];
      if (pso == nil) throw std::runtime_error("pipeline for '" + name + "': " + describe(err));
      pipelines_[i] = pso;
    }
    return pipelines_[i];
  }

 private:
  Context() {
    device_ = MTLCreateSystemDefaultDevice();
    if (device_ == nil) throw std::runtime_error("no Metal device on this machine");
    queue_ = [device_ newCommandQueue];
    info_.name = [[device_ name] UTF8String];
    info_.family = [device_ supportsFamily:MTLGPUFamilyApple9]   ? "apple9"
                   : [device_ supportsFamily:MTLGPUFamilyApple8] ? "apple8"
                   : [device_ supportsFamily:MTLGPUFamilyApple7] ? "apple7"
                                                                 : "older than apple7";
    if (![device_ supportsFamily:MTLGPUFamilyApple7])
      throw std::runtime_error("Metal device " + info_.name + " lacks simdgroup matrices (needs Apple7 / M1 or newer)");
    load_library();
  }

  void load_library() {
    const std::string dir = module_dir();
    NSError* err = nil;
    const std::string lib = dir + "/lily.metallib";
    NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:lib.c_str()]];
    if ([[NSFileManager defaultManager] fileExistsAtPath:[url path]]) {
      library_ = [device_ newLibraryWithURL:url error:&err];
      if (library_ == nil) throw std::runtime_error("cannot load " + lib + ": " + describe(err));
      info_.library = lib;
      return;
    }
    // No prebuilt library: compile the shipped amalgamated sources (fast math off, MSL 3.1 for bfloat).
    const std::string src_path = dir + "/lily_shaders.metal";
    std::ifstream in(src_path);
    if (!in) throw std::runtime_error("neither " + lib + " nor " + src_path + " is installed");
    std::stringstream ss;
    ss << in.rdbuf();
    MTLCompileOptions* opts = [[MTLCompileOptions alloc] init];
    opts.fastMathEnabled = NO;
    opts.languageVersion = MTLLanguageVersion3_1;
    library_ = [device_ newLibraryWithSource:[NSString stringWithUTF8String:ss.str().c_str()]
                                     options:opts
                                       error:&err];
    if (library_ == nil) throw std::runtime_error("compiling " + src_path + ": " + describe(err));
    info_.library = src_path;
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
    cb_ = [ctx.queue() commandBuffer];
    enc_ = [cb_ computeCommandEncoderWithDispatchType:MTLDispatchTypeConcurrent];
  }
  void commit() override {
    if (committed_) return;
    [enc_ endEncoding];
    [cb_ commit];
    committed_ = true;
  }
  void wait() override {
    commit();
    [cb_ waitUntilCompleted];
    if ([cb_ status] == MTLCommandBufferStatusError)
      throw std::runtime_error("Metal command buffer failed: " + describe([cb_ error]));
  }

 protected:
  void encode_dispatch(const gpu::Dispatch& d) override {
    id<MTLComputePipelineState> pso = ctx_.pipeline(d.kernel);
    if (d.threads.count() > [pso maxTotalThreadsPerThreadgroup])
      throw gpu::EncodeError(std::string(gpu::kernel_info(d.kernel).name) + ": " +
                             std::to_string(d.threads.count()) + " threads exceed the pipeline's limit of " +
                             std::to_string([pso maxTotalThreadsPerThreadgroup]));
    [enc_ setComputePipelineState:pso];
    [enc_ setBytes:d.args length:d.args_size atIndex:0];
    for (uint32_t i = 1; i <= d.num_buffers; ++i) {
      auto* mb = dynamic_cast<MetalBuffer*>(d.buffers[i].buffer);
      if (mb == nullptr) throw gpu::EncodeError("buffer(" + std::to_string(i) + ") is not a Metal buffer");
      [enc_ setBuffer:mb->handle() offset:d.buffers[i].offset atIndex:i];
    }
    [enc_ dispatchThreadgroups:MTLSizeMake(d.groups.x, d.groups.y, d.groups.z)
         threadsPerThreadgroup:MTLSizeMake(d.threads.x, d.threads.y, d.threads.z)];
  }
  void encode_barrier() override { [enc_ memoryBarrierWithScope:MTLBarrierScopeBuffers]; }

 private:
  Context& ctx_;
  id<MTLCommandBuffer> cb_ = nil;
  id<MTLComputeCommandEncoder> enc_ = nil;
  bool committed_ = false;
};

class MetalDevice final : public gpu::Device {
 public:
  explicit MetalDevice(Context& ctx) : ctx_(ctx) {}
  std::string_view name() const override { return "metal"; }
  std::unique_ptr<gpu::Buffer> new_buffer(size_t bytes) override {
    id<MTLBuffer> b = [ctx_.device() newBufferWithLength:(bytes ? bytes : 1) options:MTLResourceStorageModeShared];
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
    return MTLCreateSystemDefaultDevice() != nil;
  }
}

Info info() { return Context::get().info(); }

std::unique_ptr<gpu::Device> create_device() { return std::make_unique<MetalDevice>(Context::get()); }

std::vector<std::string> library_functions() {
  std::vector<std::string> out;
  @autoreleasepool {
    for (NSString* n in [Context::get().library() functionNames]) out.push_back([n UTF8String]);
  }
  return out;
}

}  // namespace lily::metal
