// The instruction set that the CPU kernels built once per instruction set run with (the
// quantized decode kernels, quantized/quantized_cpu_<isa>.cpp): the widest this CPU has, or
// the one the environment variable FASTLLM_CPU_ISA names (amx, avx512, avx2 or scalar), read
// once, at first use. Those kernels are compiled with their own flags whatever the build
// targets, so one build serves every x86-64 CPU, and tests run every variant on one machine.
// AMX runs the AVX-512 kernels, but prefill rows go to oneDNN's bfloat16 GEMM, which runs on
// AMX tiles (quantized/quantized_cpu.cpp).
#pragma once

#include <string>
#include <vector>

namespace fastllm {

enum class CpuIsa { kScalar, kAvx2, kAvx512, kAmx };

// As FASTLLM_CPU_ISA spells it: "amx" (avx512's, AVX512-BF16 and AMX-BF16), "avx512"
// (AVX-512 F/BW/VL/VNNI with FMA and F16C), "avx2" (AVX2, FMA, F16C) or "scalar" (plain C++).
const char* cpu_isa_name(CpuIsa isa);
// The name's ISA; ValueError naming it if there is none.
CpuIsa parse_cpu_isa(const std::string& name);
// The ISAs this CPU runs, widest first (scalar always).
std::vector<CpuIsa> supported_cpu_isas();

// The ISA in use; ValueError if FASTLLM_CPU_ISA names one this CPU lacks, or none.
CpuIsa cpu_isa();
// Uses `isa` from now on, on every thread; returns the previous one. ValueError if this CPU
// lacks it.
CpuIsa set_cpu_isa(CpuIsa isa);

// Whether the CPU has AVX512-BF16: bfloat16 dot products at twice float32's multiply rate, which
// oneDNN's bfloat16 GEMM (ATen's bfloat16 matmul) uses.
bool cpu_has_avx512_bf16();

}  // namespace fastllm
