// The CUDA simulator's runtime: grids of cooperative fibers, the CUDA runtime calls the host files
// make, the simulated device's limits, and the ops tests use to steer it (fastllm_sim::configure,
// set_trusted_inputs, launch_log).
#include <sys/mman.h>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common/trusted_inputs.h"
#include "cuda_sim.h"
#include "cuda_sim_torch.h"

namespace cuda_sim {
namespace {

// The simulated device: an H100/H200's limits (sm_90).
constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultDynamicSmem = 48 << 10;   // without cudaFuncSetAttribute
constexpr size_t kMaxDynamicSmemOptin = 232448;    // 227 KiB
constexpr size_t kSmemPerSm = 233472;              // 228 KiB
constexpr size_t kSmemReservedPerBlock = 1024;
constexpr int kMaxThreadsPerSm = 2048;
constexpr int kMaxBlocksPerSm = 32;
constexpr size_t kStackBytes = 256 << 10;

// A fiber's saved context, and switching between two: the running one's saved, the other's
// resumed. On x86-64 a stack pointer, the callee-saved registers pushed on the stack it points
// to: glibc's swapcontext also saves and restores the signal mask, a system call per switch that
// was most of a simulated launch's time. Elsewhere, ucontext.
#if defined(__x86_64__)
extern "C" void cuda_sim_switch_fiber(void** save_sp, void* resume_sp);
asm(R"(
    .text
    .p2align 4
    .globl cuda_sim_switch_fiber
    .hidden cuda_sim_switch_fiber
    .type cuda_sim_switch_fiber, @function
cuda_sim_switch_fiber:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw (%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    fldcw (%rsp)
    ldmxcsr 8(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_sim_switch_fiber, .-cuda_sim_switch_fiber
)");

struct FiberContext {
  void* sp = nullptr;
};

// A context that starts `entry` (which must never return) on the stack [base, base + bytes):
// the frame cuda_sim_switch_fiber pops, returning into `entry` as if it had been called.
void start_context(FiberContext& c, char* base, size_t bytes, void (*entry)()) {
  const uintptr_t top = reinterpret_cast<uintptr_t>(base + bytes) & ~uintptr_t(15);
  auto* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                   // entry's return address
  *--sp = reinterpret_cast<uint64_t>(entry);   // where the switch returns to
  for (int i = 0; i < 6; ++i) *--sp = 0;       // rbp, rbx, r12-r15
  sp -= 2;                                     // the x87 control word, then MXCSR: this thread's
  asm volatile("fnstcw %0" : "=m"(*reinterpret_cast<uint16_t*>(sp)));
  asm volatile("stmxcsr %0" : "=m"(*reinterpret_cast<uint32_t*>(sp + 1)));
  c.sp = sp;
}

void switch_context(FiberContext& save, FiberContext& resume) {
  cuda_sim_switch_fiber(&save.sp, resume.sp);
}
#else
struct FiberContext {
  ucontext_t context;
};

void start_context(FiberContext& c, char* base, size_t bytes, void (*entry)()) {
  getcontext(&c.context);
  c.context.uc_stack.ss_sp = base;
  c.context.uc_stack.ss_size = bytes;
  c.context.uc_link = nullptr;
  makecontext(&c.context, entry, 0);
}

void switch_context(FiberContext& save, FiberContext& resume) {
  swapcontext(&save.context, &resume.context);
}
#endif

struct Settings {
  int sm_count = 132;
  bool reverse_order = false;  // run a block's threads last to first
  bool capturing = false;
};

struct AsyncCopy {
  uint32_t dst;
  const void* src;
  bool fill;
};

enum class Wait { kNone, kBlock, kWarp };

struct Fiber {
  FiberContext context;
  ThreadPosition position;
  int linear = 0;
  bool done = false;
  Wait wait = Wait::kNone;
  uint64_t wait_generation = 0;
  std::vector<AsyncCopy> uncommitted;
  std::deque<std::vector<AsyncCopy>> committed;
};

struct Barrier {
  int arrived = 0;
  uint64_t generation = 0;
};

struct Warp {
  Barrier barrier;
  unsigned mask = 0;
  const char* op = nullptr;
  unsigned exited = 0;
  alignas(16) unsigned char values[32 * kLaneBytes];
};

// One launch at a time (the simulator is not reentrant; tests call it from one thread).
struct Launch {
  const std::function<void()>* body = nullptr;
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  Barrier block_barrier;
  int live = 0;
  Fiber* running = nullptr;
  FiberContext scheduler;
  std::vector<unsigned char> shared;
  std::string error;
};

std::mutex launch_mutex;
Settings settings;
std::map<const void*, int> max_dynamic_smem;  // cudaFuncSetAttribute, per kernel
std::vector<std::array<int64_t, 7>> launch_log;
Launch* current = nullptr;
char* stacks = nullptr;  // kMaxThreadsPerBlock stacks, mapped once, reused by every block

Fiber& running() {
  if (current == nullptr || current->running == nullptr)
    throw std::logic_error("cuda sim: device code called outside a simulated thread");
  return *current->running;
}

void yield(Fiber& f) { switch_context(f.context, current->scheduler); }

[[noreturn]] void stop(Fiber& f) {
  switch_context(f.context, current->scheduler);  // never resumed
  __builtin_unreachable();
}

void perform(const AsyncCopy& copy) {
  unsigned char* dst = current->shared.data() + copy.dst;
  if (copy.fill)
    std::memcpy(dst, copy.src, 16);
  else
    std::memset(dst, 0, 16);
}

void release_block_barrier_if_complete() {
  Barrier& b = current->block_barrier;
  if (b.arrived > 0 && b.arrived == current->live) {
    b.arrived = 0;
    ++b.generation;
  }
}

void fiber_entry() {
  Fiber& f = running();
  (*current->body)();
  f.done = true;
  --current->live;
  Warp& warp = current->warps[f.linear / 32];
  const unsigned bit = 1u << (f.linear % 32);
  warp.exited |= bit;
  if (warp.barrier.arrived > 0 && (warp.mask & bit)) {
    current->error = std::string("a thread exited while its warp waited for it at ") + warp.op;
  }
  release_block_barrier_if_complete();
  stop(f);
}

bool runnable(const Fiber& f) {
  switch (f.wait) {
    case Wait::kNone:
      return true;
    case Wait::kBlock:
      return current->block_barrier.generation != f.wait_generation;
    case Wait::kWarp:
      return current->warps[f.linear / 32].barrier.generation != f.wait_generation;
  }
  return false;
}

std::string describe_deadlock() {
  std::ostringstream out;
  out << "deadlock: " << current->block_barrier.arrived << " of " << current->live
      << " live threads wait at __syncthreads";
  for (size_t w = 0; w < current->warps.size(); ++w) {
    const Warp& warp = current->warps[w];
    if (warp.barrier.arrived > 0)
      out << "; warp " << w << ": " << warp.barrier.arrived << " lanes wait at " << warp.op;
  }
  return out.str();
}

void run_block(const uint3& block_idx, const dim3& grid, const dim3& block) {
  Launch& l = *current;
  const int n = int(block.x * block.y * block.z);
  std::fill(l.shared.begin(), l.shared.end(), 0xff);  // NaN in every float type
  l.fibers.assign(n, Fiber{});
  l.warps.assign((n + 31) / 32, Warp{});
  for (int w = 0; w < int(l.warps.size()); ++w) {
    const int lanes = std::min(32, n - 32 * w);  // a partial last warp's missing lanes "exited"
    l.warps[w].exited = lanes == 32 ? 0u : ~((1u << lanes) - 1u);
  }
  l.block_barrier = Barrier{};
  l.live = n;
  for (int i = 0; i < n; ++i) {
    Fiber& f = l.fibers[i];
    f.linear = i;
    f.position.thread_idx = {unsigned(i) % block.x, (unsigned(i) / block.x) % block.y,
                             unsigned(i) / (block.x * block.y)};
    f.position.block_idx = block_idx;
    f.position.block_dim = block;
    f.position.grid_dim = grid;
    start_context(f.context, stacks + size_t(i) * kStackBytes, kStackBytes, fiber_entry);
  }
  int finished = 0;
  while (finished < n) {
    bool progressed = false;
    for (int k = 0; k < n && l.error.empty(); ++k) {
      Fiber& f = l.fibers[settings.reverse_order ? n - 1 - k : k];
      if (f.done || !runnable(f)) continue;
      f.wait = Wait::kNone;
      l.running = &f;
      switch_context(l.scheduler, f.context);
      l.running = nullptr;
      progressed = true;
      if (f.done) ++finished;
    }
    if (!l.error.empty()) break;
    if (!progressed) l.error = describe_deadlock();
    if (!l.error.empty()) break;
  }
  if (!l.error.empty()) {
    std::ostringstream where;
    where << "cuda sim: block (" << block_idx.x << ", " << block_idx.y << ", " << block_idx.z
          << "): " << l.error;
    l.error = where.str();
  }
}

void warp_barrier(unsigned mask, const char* op) {
  Fiber& f = running();
  Warp& warp = current->warps[f.linear / 32];
  const unsigned bit = 1u << (f.linear % 32);
  if (!(mask & bit)) fail("a lane calls a warp collective whose mask leaves it out");
  if (mask & warp.exited) fail("a warp collective's mask names a lane that has exited");
  if (warp.barrier.arrived == 0) {
    warp.mask = mask;
    warp.op = op;
  } else if (warp.mask != mask || std::strcmp(warp.op, op) != 0) {
    std::string what = std::string("lanes of a warp meet at different collectives: ") + op +
                       " and " + warp.op;
    current->error = what;
    stop(f);
  }
  if (++warp.barrier.arrived == std::popcount(mask)) {
    warp.barrier.arrived = 0;
    ++warp.barrier.generation;
    return;
  }
  f.wait = Wait::kWarp;
  f.wait_generation = warp.barrier.generation;
  yield(f);
}

void configure(int64_t sm_count, bool reverse_order, bool capturing) {
  TORCH_CHECK_VALUE(sm_count >= 1, "cuda sim: sm_count must be >= 1, got ", sm_count);
  const std::lock_guard<std::mutex> lock(launch_mutex);
  settings = Settings{int(sm_count), reverse_order, capturing};
}

bool set_trusted(bool trusted) { return fastllm::set_trusted_inputs(trusted); }

// [launches, 7]: grid x, y, z, block x, y, z, dynamic shared memory bytes.
at::Tensor take_launch_log() {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  at::Tensor log = at::empty({int64_t(launch_log.size()), 7}, at::kLong);
  for (size_t i = 0; i < launch_log.size(); ++i)
    for (int j = 0; j < 7; ++j) log[int64_t(i)][j] = launch_log[i][j];
  launch_log.clear();
  return log;
}

torch::Library& schemas() {
  static torch::Library library(torch::Library::FRAGMENT, "fastllm_sim", std::nullopt, __FILE__,
                                __LINE__);
  return library;
}

// cuBLAS's product of 16-bit matrices into float32 (aten::mm.dtype, which ATen runs on CUDA
// only) for the host files' calls on the simulator's CPU tensors: the inputs converted exactly,
// the product accumulated in float32.
at::Tensor mm_into_dtype(const at::Tensor& self, const at::Tensor& mat2,
                         at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kFloat && self.scalar_type() == mat2.scalar_type(),
              "cuda sim: mm.dtype of ", self.scalar_type(), " into ", out_dtype, " is not simulated");
  return at::mm(self.to(at::kFloat), mat2.to(at::kFloat));
}

const bool mm_into_dtype_registered = [] {
  const auto mm = c10::Dispatcher::singleton().findSchema({"aten::mm", "dtype"});
  if (mm.has_value() && mm->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return false;
  static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__,
                                __LINE__);
  library.impl("mm.dtype", &mm_into_dtype);
  return true;
}();

const bool control_ops_defined = [] {
  schemas().def("configure(int sm_count, bool reverse_order, bool capturing) -> ()", &configure);
  schemas().def("set_trusted_inputs(bool trusted) -> bool", &set_trusted);
  schemas().def("take_launch_log() -> Tensor", &take_launch_log);
  return true;
}();

}  // namespace

const ThreadPosition& position() { return running().position; }
int lane() { return running().linear % 32; }
bool capturing() { return settings.capturing; }

void fail(const char* what) {
  Fiber& f = running();
  if (current->error.empty()) current->error = what;
  stop(f);
}

void sync_block() {
  Fiber& f = running();
  Barrier& b = current->block_barrier;
  if (++b.arrived == current->live) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  f.wait = Wait::kBlock;
  f.wait_generation = b.generation;
  yield(f);
}

const unsigned char* warp_exchange(unsigned mask, const void* value, size_t bytes,
                                   const char* op) {
  Fiber& f = running();
  Warp& warp = current->warps[f.linear / 32];
  if (bytes > 0) std::memcpy(warp.values + size_t(f.linear % 32) * kLaneBytes, value, bytes);
  warp_barrier(mask, op);
  return warp.values;
}

void warp_done(unsigned mask) { warp_barrier(mask, "the end of a warp collective"); }

unsigned char* dynamic_shared_memory() { return running(), current->shared.data(); }
size_t dynamic_shared_memory_bytes() { return current == nullptr ? 0 : current->shared.size(); }

void cp_async_16(uint32_t dst, const void* src, bool fill) {
  Fiber& f = running();
  if (dst % 16 != 0 || dst + 16 > current->shared.size())
    fail("cp.async to shared memory outside the launch's dynamic shared memory or misaligned");
  if (fill && reinterpret_cast<uintptr_t>(src) % 16 != 0)
    fail("cp.async of 16 bytes from a global address not 16-byte aligned");
  f.uncommitted.push_back({dst, src, fill});
}

void cp_async_commit() {
  Fiber& f = running();
  f.committed.push_back(std::move(f.uncommitted));
  f.uncommitted.clear();
}

void cp_async_wait(int pending) {
  Fiber& f = running();
  while (int(f.committed.size()) > std::max(pending, 0)) {
    for (const AsyncCopy& copy : f.committed.front()) perform(copy);
    f.committed.pop_front();
  }
  if (pending < 0) {  // wait_all: the uncommitted copies too
    for (const AsyncCopy& copy : f.uncommitted) perform(copy);
    f.uncommitted.clear();
  }
}

void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes,
            const std::function<void()>& body) {
  const std::lock_guard<std::mutex> lock(launch_mutex);
  const int64_t threads = int64_t(block.x) * block.y * block.z;
  TORCH_CHECK(threads >= 1 && threads <= kMaxThreadsPerBlock && block.z <= 64,
              "cuda sim: invalid block (", block.x, ", ", block.y, ", ", block.z, ")");
  TORCH_CHECK(grid.x >= 1 && grid.x <= 0x7fffffffu && grid.y >= 1 && grid.y <= 65535 &&
                  grid.z >= 1 && grid.z <= 65535,
              "cuda sim: invalid grid (", grid.x, ", ", grid.y, ", ", grid.z, ")");
  const auto attribute = max_dynamic_smem.find(kernel);
  const size_t allowed = attribute == max_dynamic_smem.end()
                             ? kDefaultDynamicSmem
                             : std::max<size_t>(kDefaultDynamicSmem, attribute->second);
  TORCH_CHECK(smem_bytes <= allowed, "cuda sim: launch asks ", smem_bytes,
              " bytes of dynamic shared memory; the kernel is allowed ", allowed,
              " (cudaFuncSetAttribute raises the 48 KiB default)");
  launch_log.push_back({int64_t(grid.x), int64_t(grid.y), int64_t(grid.z), int64_t(block.x),
                        int64_t(block.y), int64_t(block.z), int64_t(smem_bytes)});
  if (stacks == nullptr) {
    void* map = mmap(nullptr, kMaxThreadsPerBlock * kStackBytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TORCH_CHECK(map != MAP_FAILED, "cuda sim: cannot map the fiber stacks");
    stacks = static_cast<char*>(map);
  }
  Launch l;
  l.body = &body;
  l.shared.resize(smem_bytes);
  current = &l;
  for (unsigned z = 0; z < grid.z && l.error.empty(); ++z)
    for (unsigned y = 0; y < grid.y && l.error.empty(); ++y)
      for (unsigned x = 0; x < grid.x && l.error.empty(); ++x) run_block({x, y, z}, grid, block);
  current = nullptr;
  TORCH_CHECK(l.error.empty(), l.error);
}

void define_like_fastllm(const char* name) {
  static std::set<std::string> defined;
  if (!defined.insert(name).second) return;
  const auto handle =
      c10::Dispatcher::singleton().findSchema({std::string("fastllm::") + name, ""});
  TORCH_CHECK(handle.has_value(), "cuda sim: fastllm::", name,
              " is not registered; import fastllm before loading the simulator");
  std::string schema = c10::toString(handle->schema());
  schema.erase(0, std::strlen("fastllm::"));
  schemas().def(schema.c_str());
}

torch::Library& cpu_implementations() {
  static torch::Library library(torch::Library::IMPL, "fastllm_sim", c10::DispatchKey::CPU,
                                __FILE__, __LINE__);
  return library;
}

}  // namespace cuda_sim

// The CUDA runtime calls the host files make, answered for the simulated device.
extern "C" {

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  // -1: the host files ask by tensor, and the simulator's tensors are CPU tensors.
  if (device != 0 && device != -1) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = int(cuda_sim::kMaxDynamicSmemOptin);
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = cuda_sim::settings.sm_count;
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;  // an attribute the simulator was not taught
  }
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      size_t(value) > cuda_sim::kMaxDynamicSmemOptin)
    return cudaErrorInvalidValue;
  const std::lock_guard<std::mutex> lock(cuda_sim::launch_mutex);
  cuda_sim::max_dynamic_smem[func] = value;
  return cudaSuccess;
}

// Threads and shared memory limit the blocks per SM; registers are not simulated.
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, const void* func,
                                                          int block_size,
                                                          size_t dynamic_smem_bytes) {
  (void)func;
  if (block_size < 1 || block_size > cuda_sim::kMaxThreadsPerBlock) return cudaErrorInvalidValue;
  int blocks = std::min(cuda_sim::kMaxThreadsPerSm / ((block_size + 31) / 32 * 32),
                        cuda_sim::kMaxBlocksPerSm);
  blocks = std::min<int>(blocks, int(cuda_sim::kSmemPerSm / (dynamic_smem_bytes +
                                                             cuda_sim::kSmemReservedPerBlock)));
  *num_blocks = blocks;
  return cudaSuccess;
}

}  // extern "C"
