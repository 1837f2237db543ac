#include "common/cpu_isa.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>

namespace fastllm {
namespace {

constexpr CpuIsa kIsas[] = {CpuIsa::kAmx, CpuIsa::kAvx512, CpuIsa::kAvx2, CpuIsa::kScalar};

bool cpu_has(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    // __builtin_cpu_supports also checks that the OS saves the registers.
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kAmx:
      return cpu_has(CpuIsa::kAvx512) && cpu_has_avx512_bf16() &&
             __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16");
#endif
    default: return false;
  }
}

std::string supported_names() {
  std::string names;
  for (CpuIsa isa : supported_cpu_isas())
    names += (names.empty() ? "" : ", ") + std::string(cpu_isa_name(isa));
  return names;
}

CpuIsa isa_from_environment() {
  const char* name = std::getenv("FASTLLM_CPU_ISA");
  if (name == nullptr || *name == '\0') return supported_cpu_isas().front();
  const CpuIsa isa = parse_cpu_isa(name);
  TORCH_CHECK_VALUE(cpu_has(isa), "FASTLLM_CPU_ISA=", name, " but this CPU lacks it; it runs ",
                    supported_names());
  return isa;
}

std::atomic<int> current{-1};  // an int of CpuIsa; -1 until first read

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAmx: return "amx";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kScalar: break;
  }
  return "scalar";
}

CpuIsa parse_cpu_isa(const std::string& name) {
  const auto* isa = std::find_if(std::begin(kIsas), std::end(kIsas),
                                 [&](CpuIsa isa) { return name == cpu_isa_name(isa); });
  TORCH_CHECK_VALUE(isa != std::end(kIsas), "unknown CPU instruction set '", name,
                    "'; expected amx, avx512, avx2 or scalar");
  return *isa;
}

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> isas;
  std::copy_if(std::begin(kIsas), std::end(kIsas), std::back_inserter(isas), cpu_has);
  return isas;
}

bool cpu_has_avx512_bf16() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

CpuIsa cpu_isa() {
  int isa = current.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = int(isa_from_environment());  // throws on a bad value: every call, until it is fixed
    int unset = -1;
    current.compare_exchange_strong(unset, isa, std::memory_order_relaxed);
    isa = current.load(std::memory_order_relaxed);
  }
  return CpuIsa(isa);
}

CpuIsa set_cpu_isa(CpuIsa isa) {
  TORCH_CHECK_VALUE(cpu_has(isa), "this CPU lacks ", cpu_isa_name(isa), "; it runs ",
                    supported_names());
  const CpuIsa previous = cpu_isa();
  current.store(int(isa), std::memory_order_relaxed);
  return previous;
}

}  // namespace fastllm
