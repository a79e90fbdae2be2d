// Helpers shared by the kernel sources (layer_norm.cpp, gelu.cpp, linear.cpp, depthwise.cpp,
// attention.cpp, weight_gradient.cpp): bf16 <-> float32 vector loads and stores with ATen's vector
// types, for whichever ISA the extension is built for; the GELU tables and the GELU's backward on rows;
// column sums (add_rows, and ColumnSums across threads); the check of contiguous bf16 operands.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <vector>
#include <cstdint>

namespace vitrain_kernels {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
using BF = c10::BFloat16;
constexpr int64_t kF = fVec::size();

inline fVec load_bf16(const BF* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256i raw = n == kF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                        : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  __m512 out;
  at::vec::cvtbf16_fp32(raw, out);
  return fVec(out);
#else
  float buf[kF] = {0};
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
  return fVec::loadu(buf);
#endif
}

// Round to nearest even, as PyTorch's own bf16 conversions do.
inline void store_bf16(BF* p, const fVec& v, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  __m256i raw = at::vec::cvtfp32_bf16(__m512(v));
  if (n == kF) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), raw);
  } else {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), raw);
  }
#else
  float buf[kF];
  v.store(buf);
  for (int64_t i = 0; i < n; ++i) p[i] = BF(buf[i]);
#endif
}

// v rounded to bf16 (round to nearest even) and back to float32.
inline fVec round_bf16(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 out;
  at::vec::cvtbf16_fp32(at::vec::cvtfp32_bf16(__m512(v)), out);
  return fVec(out);
#else
  float buf[kF];
  v.store(buf);
  for (int64_t i = 0; i < kF; ++i) buf[i] = static_cast<float>(BF(buf[i]));
  return fVec::loadu(buf);
#endif
}

inline fVec load_f32(const float* p, int64_t n) { return n == kF ? fVec::loadu(p) : fVec::loadu(p, n); }

inline void store_f32(float* p, const fVec& v, int64_t n) {
  if (n == kF) {
    v.store(p);
  } else {
    v.store(p, n);
  }
}

inline float horizontal_sum(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);  // a tree of shuffles: short rows pay the reduction on every row
#else
  float buf[kF];
  v.store(buf);
  float sum = 0.f;
  for (int64_t i = 0; i < kF; ++i) sum += buf[i];
  return sum;
#endif
}

// The exact (erf) GELU and its derivative at every bf16 value, 65536 floats each, in double precision
// rounded once (the GELU kernels of gelu.cpp, and weight_gradient.cpp's GELU backward).
struct GeluTables {
  std::vector<float> value, derivative;
  GeluTables() : value(1 << 16), derivative(1 << 16) {
    for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
      const double x = static_cast<float>(c10::BFloat16(static_cast<uint16_t>(bits), c10::BFloat16::from_bits()));
      double y, dy;
      if (std::isnan(x)) {
        y = dy = x;
      } else if (std::isinf(x)) {
        y = x > 0 ? x : 0.0;
        dy = x > 0 ? 1.0 : 0.0;
      } else {
        const double cdf = 0.5 * std::erfc(-x * M_SQRT1_2), pdf = std::exp(-0.5 * x * x) * 0.5 * M_2_SQRTPI * M_SQRT1_2;
        y = x * cdf;
        dy = cdf + x * pdf;
      }
      value[bits] = static_cast<float>(y);
      derivative[bits] = static_cast<float>(dy);
    }
  }
};

inline const GeluTables& gelu_tables() {
  static const GeluTables tables;  // built on first use; thread-safe initialization
  return tables;
}

// table[bits of p[0..n)] as floats (lanes past n are zero)
inline fVec gather(const float* table, const BF* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i raw = n == kF ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                              : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return fVec(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), static_cast<__mmask16>((1u << n) - 1),
                                       _mm512_cvtepu16_epi32(raw), table, 4));
#else
  float buf[kF] = {0};
  for (int64_t i = 0; i < n; ++i) buf[i] = table[p[i].x];
  return fVec::loadu(buf);
#endif
}

// The GELU's backward on `rows` contiguous rows of `width`: dh = g * GELU'(h), rounded to bf16 into
// `dh`, its float32 values (before rounding) added to `sums` if given (gelu.cpp's gelu_backward, and
// weight_gradient.cpp's chunks).
inline void gelu_backward_rows(const BF* g, const BF* h, int64_t rows, int64_t width, BF* dh, float* sums) {
  const float* table = gelu_tables().derivative.data();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; c += kF) {
      const int64_t n = std::min(kF, width - c), i = r * width + c;
      const fVec d = load_bf16(g + i, n) * gather(table, h + i, n);
      store_bf16(dh + i, d, n);
      if (sums != nullptr) store_f32(sums + c, load_f32(sums + c, n) + d, n);  // before rounding
    }
  }
}

// sums[c] += rows[r][c] in float32 for `count` contiguous bf16 rows of `width`: column sums, the bias
// gradients of linear layers.
inline void add_rows(const BF* rows, int64_t count, int64_t width, float* sums) {
  for (int64_t r = 0; r < count; ++r) {
    for (int64_t c = 0; c < width; c += kF) {
      const int64_t n = std::min(kF, width - c);
      store_f32(sums + c, load_f32(sums + c, n) + load_bf16(rows + r * width + c, n), n);
    }
  }
}

// Column sums accumulated per thread in float32 (one block of `columns` per thread and sum), then
// reduced into `out` (float32 or bf16, rounded once). No ATen ops: nothing for autograd to record.
struct ColumnSums {
  int64_t columns, sums, threads;
  std::vector<float> partial;
  ColumnSums(int64_t columns, int64_t sums)
      : columns(columns), sums(sums), threads(at::get_num_threads()), partial(threads * sums * columns, 0.f) {}
  float* block(int64_t sum) { return partial.data() + (at::get_thread_num() * sums + sum) * columns; }
  at::Tensor reduce(int64_t sum, at::ScalarType dtype) const {
    std::vector<float> total(columns, 0.f);
    for (int64_t t = 0; t < threads; ++t) {
      const float* p = partial.data() + (t * sums + sum) * columns;
      for (int64_t c = 0; c < columns; ++c) total[c] += p[c];
    }
    auto out = at::empty({columns}, at::TensorOptions().dtype(dtype));
    if (dtype == at::kFloat) {
      std::copy(total.begin(), total.end(), out.data_ptr<float>());
    } else {
      BF* o = out.data_ptr<BF>();
      for (int64_t c = 0; c < columns; ++c) o[c] = BF(total[c]);
    }
    return out;
  }
};

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), name,
              " must be a contiguous bf16 CPU tensor, got ", t.scalar_type(), " ", t.device(),
              t.is_contiguous() ? "" : " (non-contiguous)");
}

}  // namespace vitrain_kernels
