// Attention over short sequences on AMX tiles: softmax(scale q k^T) v for every (image, head),
// forward and backward, read straight from the fused qkv projection's output and written straight to
// the token-major output (and to the qkv gradient), with no head-major copies.
//
// Why: oneDNN's batched matmuls ran the per-head products (65 x 65 x 64 at ViT-Ti/4, 197 x 197 x 64 at
// ViT-S/16) at 0.14-0.26 TFLOP/s on a 2-core AMX Xeon, with head-major copies of q, k, v and a bf16
// score tensor going through memory between them: the attention core took 10 ms a layer at ViT-Ti/4
// (batch 128) and 32 ms at ViT-S/16 (batch 32), forward and backward. Here one (image, head) is one
// work item whose operands (tens of KiB) stay in L1/L2; scores live in float32 (the accumulators),
// the softmax runs on rows of 16 queries, and the backward recomputes the scores instead of keeping
// the probabilities.
//
// AMX multiplies tiles: C (16 x 16 float32) += A (16 x 32 bf16) B (32 x 16 bf16), B held as 16 rows of
// 16 pairs, row r = (B[2r][n], B[2r+1][n]) for n = 0..15. Every product is C = A B with A read
// row-major and B packed into such tiles. Queries go 16 at a time.
//   forward:  S = Q K^T (A: the query rows as they lie in qkv; B: K's bf16 pairs as 32-bit words,
//             transposed, once an item), then O = P V (B: V's rows in pairs, once an item): no
//             transposition per tile, and O's rows are stored where they belong;
//   backward: the scores transposed, keys down and the tile's 16 queries across, so that the
//             softmax and rowsum(P dP) reduce down the keys in whole vectors: S^T = K Q^T,
//             dP^T = V dO^T, dQ^T = K^T dS^T (B: the tile's Q and dO words transposed, and dS^T's
//             key rows in pairs), then over all queries dK = dS^T Q and dV = P^T dO (A: dS^T and
//             P^T as the query tiles left them; B: Q's and dO's rows in pairs), stored untransposed.
// Only N x D operands are ever transposed, never the N x N ones. Token counts are padded with zeros:
// to 16 where tokens are rows or columns of a product, to 32 where they are its reduction.
//
// A second backend does the same tile arithmetic in plain C++ (float32 sums of bf16 products), so the
// algorithm is tested on CPUs without AMX; it is slow, and only for the tests.

#include "common.h"

#include <cstring>
#include <limits>
#include <memory>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VITRAIN_AMX 1
#endif

using namespace vitrain_kernels;

namespace {

constexpr int64_t kTile = 16;                  // rows of a tile, and the float32 columns of an accumulator
constexpr int64_t kDepth = 32;                 // bf16 of the reduction dimension in a row of an A tile
constexpr int64_t kTileWords = kTile * kTile;  // a packed B tile: 16 rows of 16 pairs (1 KiB)
constexpr int64_t kRowBytes = 64;              // bytes in a row of any tile

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Float32 to bf16 (round to nearest even) for the probabilities and score gradients, the largest
// conversions here: ATen's portable sequence (about eight instructions per 16 floats), or on AMX CPUs,
// which all have AVX512-BF16, one vcvtne2ps2bf16 per 32 floats.
struct PortableRounding {
  // B tiles [depth] of a (32 * depth) x 16 matrix given as `rows` float32 rows of 16 (the rest zero):
  // tile s row r holds the pairs (M[32 s + 2 r][n], M[32 s + 2 r + 1][n]).
  static void pack_float_pairs(const float* m, int64_t rows, int64_t depth, uint32_t* out) {
    for (int64_t pair = 0; pair < depth * kTile; ++pair) {
      for (int64_t n = 0; n < kTile; ++n) {
        const uint32_t low = 2 * pair < rows ? BF(m[2 * pair * kTile + n]).x : 0u;
        const uint32_t high = 2 * pair + 1 < rows ? BF(m[(2 * pair + 1) * kTile + n]).x : 0u;
        out[pair * kTile + n] = low | (high << 16);
      }
    }
  }
  // `rows` float32 rows of `width` (a multiple of 16; stride ld_src) into bf16 rows (stride ld_dst).
  static void convert_rows(const float* src, int64_t ld_src, int64_t width, int64_t rows, BF* dst, int64_t ld_dst) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < width; c += kF) store_bf16(dst + r * ld_dst + c, fVec::loadu(src + r * ld_src + c), kF);
    }
  }
};

#if VITRAIN_AMX
struct NativeRounding {
  __attribute__((target("avx512bf16"))) static void pack_float_pairs(const float* m, int64_t rows, int64_t depth,
                                                                      uint32_t* out) {
    // vcvtne2ps2bf16(high, low) gives low[0..15] then high[0..15]; the permutation interleaves them
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t pair = 0; pair < depth * kTile; ++pair) {
      const __m512 low = 2 * pair < rows ? _mm512_loadu_ps(m + 2 * pair * kTile) : _mm512_setzero_ps();
      const __m512 high = 2 * pair + 1 < rows ? _mm512_loadu_ps(m + (2 * pair + 1) * kTile) : _mm512_setzero_ps();
      const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
      _mm512_storeu_si512(out + pair * kTile, _mm512_permutexvar_epi16(interleave, both));
    }
  }
  __attribute__((target("avx512bf16"))) static void convert_rows(const float* src, int64_t ld_src, int64_t width,
                                                                  int64_t rows, BF* dst, int64_t ld_dst) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* in = src + r * ld_src;
      auto* out = reinterpret_cast<__m256i*>(dst + r * ld_dst);
      for (int64_t c = 0; c < width; c += kTile) {
        _mm256_storeu_si256(out + c / kTile, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(in + c))));
      }
    }
  }
};
#endif

struct EmulatedTiles {
  using Rounding = PortableRounding;
  struct alignas(64) Registers {
    uint8_t bytes[8][kTile * kRowBytes];
  };
  static Registers& registers() {
    static thread_local Registers r;
    return r;
  }
  static void configure() {}
  static void release() {}
  template <int t>
  static void zero() {
    std::memset(registers().bytes[t], 0, sizeof(registers().bytes[t]));
  }
  template <int t>
  static void load(const void* p, int64_t stride) {
    for (int64_t r = 0; r < kTile; ++r) {
      std::memcpy(registers().bytes[t] + r * kRowBytes, static_cast<const uint8_t*>(p) + r * stride, kRowBytes);
    }
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    for (int64_t r = 0; r < kTile; ++r) {
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, registers().bytes[t] + r * kRowBytes, kRowBytes);
    }
  }
  template <int c, int a, int b>
  static void dot() {
    float* C = reinterpret_cast<float*>(registers().bytes[c]);
    const BF* A = reinterpret_cast<const BF*>(registers().bytes[a]);
    const BF* B = reinterpret_cast<const BF*>(registers().bytes[b]);
    for (int64_t m = 0; m < kTile; ++m) {
      for (int64_t n = 0; n < kTile; ++n) {
        float acc = C[m * kTile + n];
        for (int64_t k = 0; k < kDepth; ++k) {
          acc += static_cast<float>(A[m * kDepth + k]) * static_cast<float>(B[(k / 2) * kDepth + 2 * n + k % 2]);
        }
        C[m * kTile + n] = acc;
      }
    }
  }
};

#if VITRAIN_AMX
struct AmxTiles {
  using Rounding = NativeRounding;
  static void configure() {  // every tile 16 rows of 64 bytes (palette 1)
    struct alignas(64) Config {
      uint8_t palette, start_row, reserved[14];
      uint16_t bytes_per_row[16];
      uint8_t rows[16];
    } config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
      config.bytes_per_row[t] = kRowBytes;
      config.rows[t] = kTile;
    }
    _tile_loadconfig(&config);
  }
  static void release() { _tile_release(); }
  // GCC's tile intrinsics paste their register numbers into the assembly text: literals only, hence the
  // branches. Accumulators are tiles 0-3; the operand shared by four products is tile 4, the others
  // tiles 5-7 (row_product: A shared; column_product: B shared).
  template <int t>
  static void zero() {
    static_assert(t >= 0 && t < 4, "accumulators are tiles 0-3");
    if constexpr (t == 0) _tile_zero(0);
    if constexpr (t == 1) _tile_zero(1);
    if constexpr (t == 2) _tile_zero(2);
    if constexpr (t == 3) _tile_zero(3);
  }
  template <int t>
  static void load(const void* p, int64_t stride) {
    static_assert(t >= 4 && t < 8, "operands are tiles 4-7");
    if constexpr (t == 4) _tile_loadd(4, p, stride);
    if constexpr (t == 5) _tile_loadd(5, p, stride);
    if constexpr (t == 6) _tile_loadd(6, p, stride);
    if constexpr (t == 7) _tile_loadd(7, p, stride);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    static_assert(t >= 0 && t < 4, "accumulators are tiles 0-3");
    if constexpr (t == 0) _tile_stored(0, p, stride);
    if constexpr (t == 1) _tile_stored(1, p, stride);
    if constexpr (t == 2) _tile_stored(2, p, stride);
    if constexpr (t == 3) _tile_stored(3, p, stride);
  }
  template <int c, int a, int b>
  static void dot() {
    constexpr bool row = a == 4 && ((c == 0 && b == 5) || (c == 1 && b == 6) || (c == 2 && b == 7) || (c == 3 && b == 5));
    constexpr bool column = b == 4 && ((c == 0 && a == 5) || (c == 1 && a == 6) || (c == 2 && a == 7) || (c == 3 && a == 5));
    static_assert(row || column, "the products row_product and column_product make");
    if constexpr (row && c == 0) _tile_dpbf16ps(0, 4, 5);
    if constexpr (row && c == 1) _tile_dpbf16ps(1, 4, 6);
    if constexpr (row && c == 2) _tile_dpbf16ps(2, 4, 7);
    if constexpr (row && c == 3) _tile_dpbf16ps(3, 4, 5);
    if constexpr (column && c == 0) _tile_dpbf16ps(0, 5, 4);
    if constexpr (column && c == 1) _tile_dpbf16ps(1, 6, 4);
    if constexpr (column && c == 2) _tile_dpbf16ps(2, 7, 4);
    if constexpr (column && c == 3) _tile_dpbf16ps(3, 5, 4);
  }
};
#endif

// C (16 rows x 16 * blocks float32, row stride ldc) = A (16 rows x 32 * depth bf16, row stride lda)
// times B, packed as tiles [depth][blocks]. Up to four accumulators at a time, sharing A's tile.
template <class T>
void row_product(const BF* a, int64_t lda, const uint32_t* b, int64_t depth, int64_t blocks, float* c, int64_t ldc) {
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(BF)), c_stride = ldc * static_cast<int64_t>(sizeof(float));
  for (int64_t j = 0; j < blocks; j += 4) {
    const int64_t n = std::min<int64_t>(4, blocks - j);
    T::template zero<0>();
    if (n > 1) T::template zero<1>();
    if (n > 2) T::template zero<2>();
    if (n > 3) T::template zero<3>();
    for (int64_t s = 0; s < depth; ++s) {
      const uint32_t* tile = b + (s * blocks + j) * kTileWords;
      T::template load<4>(a + s * kDepth, a_stride);
      T::template load<5>(tile, kRowBytes);
      T::template dot<0, 4, 5>();
      if (n > 1) {
        T::template load<6>(tile + kTileWords, kRowBytes);
        T::template dot<1, 4, 6>();
      }
      if (n > 2) {
        T::template load<7>(tile + 2 * kTileWords, kRowBytes);
        T::template dot<2, 4, 7>();
      }
      if (n > 3) {
        T::template load<5>(tile + 3 * kTileWords, kRowBytes);
        T::template dot<3, 4, 5>();
      }
    }
    T::template store<0>(c + j * kTile, c_stride);
    if (n > 1) T::template store<1>(c + (j + 1) * kTile, c_stride);
    if (n > 2) T::template store<2>(c + (j + 2) * kTile, c_stride);
    if (n > 3) T::template store<3>(c + (j + 3) * kTile, c_stride);
  }
}

// C (16 * row_tiles rows x 16 float32, row stride 16) = A (16 * row_tiles rows x 32 * depth bf16, row
// stride lda) times B, one column of tiles [depth]. Up to four accumulators at a time, sharing B's tile.
template <class T>
void column_product(const BF* a, int64_t lda, int64_t row_tiles, const uint32_t* b, int64_t depth, float* c) {
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(BF)), tile_rows = kTile * lda;
  constexpr int64_t c_stride = kTile * sizeof(float);
  for (int64_t j = 0; j < row_tiles; j += 4) {
    const int64_t n = std::min<int64_t>(4, row_tiles - j);
    T::template zero<0>();
    if (n > 1) T::template zero<1>();
    if (n > 2) T::template zero<2>();
    if (n > 3) T::template zero<3>();
    for (int64_t s = 0; s < depth; ++s) {
      const BF* tile = a + j * tile_rows + s * kDepth;
      T::template load<4>(b + s * kTileWords, kRowBytes);
      T::template load<5>(tile, a_stride);
      T::template dot<0, 5, 4>();
      if (n > 1) {
        T::template load<6>(tile + tile_rows, a_stride);
        T::template dot<1, 6, 4>();
      }
      if (n > 2) {
        T::template load<7>(tile + 2 * tile_rows, a_stride);
        T::template dot<2, 7, 4>();
      }
      if (n > 3) {
        T::template load<5>(tile + 3 * tile_rows, a_stride);
        T::template dot<3, 5, 4>();
      }
    }
    T::template store<0>(c + j * kTileWords, c_stride);
    if (n > 1) T::template store<1>(c + (j + 1) * kTileWords, c_stride);
    if (n > 2) T::template store<2>(c + (j + 2) * kTileWords, c_stride);
    if (n > 3) T::template store<3>(c + (j + 3) * kTileWords, c_stride);
  }
}

// dst (16 rows of 16 floats, stride ld_dst) = the transpose of `rows` rows of 16 floats (stride ld_src),
// rows from `rows` on taken as zero. 32-bit lanes are moved by shuffles only, so any bit pattern
// (bf16 pairs among them) survives. With AVX-512: 16 loads, 64 shuffles, 16 stores, against about four
// times the cycles for ATen's masked transpose_mxn.
inline void transpose16(const float* src, int64_t ld_src, int64_t rows, float* dst, int64_t ld_dst) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r[16], t[16];
  for (int64_t i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_ps(src + i * ld_src) : _mm512_setzero_ps();
  for (int64_t i = 0; i < 16; i += 2) {  // 2 x 2 blocks of lanes
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int64_t i = 0; i < 16; i += 4) {  // 4 x 4
    for (int64_t j = 0; j < 2; ++j) {
      r[i + j] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
      r[i + j + 2] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + j]), _mm512_castps_pd(t[i + j + 2])));
    }
  }
  for (int64_t i = 0; i < 16; i += 8) {  // 128-bit lanes: 8 x 8
    for (int64_t j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  }
  for (int64_t j = 0; j < 8; ++j) {  // 16 x 16
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
  // r[k] now holds a column; the order of columns is a fixed permutation of k
  static constexpr int kColumn[16] = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
  for (int64_t k = 0; k < 16; ++k) _mm512_storeu_ps(dst + kColumn[k] * ld_dst, r[k]);
#else
  for (int64_t c = 0; c < kTile; ++c) {
    for (int64_t i = 0; i < kTile; ++i) dst[c * ld_dst + i] = i < rows ? src[i * ld_src + c] : 0.f;
  }
#endif
}

// B tiles [depth] (`stride` tiles apart) of the transpose of 16 rows of bf16 (32 * depth wide, stride
// ld; rows from `rows` on zero), for a product X rows^T: tile s row r holds word 16 s + r (a bf16 pair)
// of each row, a 16 x 16 transposition of 32-bit words.
void pack_transposed(const BF* src, int64_t ld, int64_t rows, int64_t depth, int64_t stride, uint32_t* out) {
  for (int64_t s = 0; s < depth; ++s) {
    transpose16(reinterpret_cast<const float*>(src + s * kDepth), ld / 2, rows,
                reinterpret_cast<float*>(out + s * stride * kTileWords), kTile);
  }
}

// One B tile row: the pairs (low[n], high[n]) of 16 bf16 columns (nullptr: zeros).
inline void store_pairs(const uint16_t* low, const uint16_t* high, uint32_t* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i lo = low ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low)) : _mm256_setzero_si256();
  const __m256i hi = high ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high)) : _mm256_setzero_si256();
  _mm512_storeu_si512(dst, _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16)));
#else
  for (int64_t n = 0; n < kTile; ++n) {
    dst[n] = (low ? low[n] : 0u) | ((high ? static_cast<uint32_t>(high[n]) : 0u) << 16);
  }
#endif
}

// B tiles [32 * depth / 32][blocks] of a (32 * depth) x (16 * blocks) bf16 matrix, `rows` of which are
// given (stride ld; the rest zero), for a product X M: tile (s, t) row r holds the pairs
// (M[32 s + 2 r][16 t + n], M[32 s + 2 r + 1][16 t + n]).
void pack_pairs(const BF* src, int64_t ld, int64_t rows, int64_t depth, int64_t blocks, uint32_t* out) {
  for (int64_t pair = 0; pair < depth * kTile; ++pair) {
    const int64_t s = pair / kTile, r = pair % kTile;
    const auto* low = 2 * pair < rows ? reinterpret_cast<const uint16_t*>(src + 2 * pair * ld) : nullptr;
    const auto* high = 2 * pair + 1 < rows ? reinterpret_cast<const uint16_t*>(src + (2 * pair + 1) * ld) : nullptr;
    for (int64_t t = 0; t < blocks; ++t) {
      store_pairs(low ? low + t * kTile : nullptr, high ? high + t * kTile : nullptr,
                  out + (s * blocks + t) * kTileWords + r * kTile);
    }
  }
}

// dst (D rows x width bf16) = src^T for src `rows` x D (stride ld); columns from `rows` on are zero.
void transpose_into(const BF* src, int64_t ld, int64_t rows, int64_t D, BF* dst, int64_t width) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    for (int64_t c0 = 0; c0 < D; c0 += 32) {
      at::vec::transpose_mxn<BF>(src + r0 * ld + c0, ld, dst + c0 * width + r0, width,
                                 static_cast<int>(std::min<int64_t>(32, rows - r0)),
                                 static_cast<int>(std::min<int64_t>(32, D - c0)));
    }
  }
  for (int64_t d = 0; d < D; ++d) std::fill(dst + d * width + rows, dst + (d + 1) * width, BF(0.f));
}

// The first `rows` (<= 16) rows of the transpose of c (D x 16 float32) into bf16 rows of D (stride
// ld), through `staging` (16 x D floats).
template <class T>
void store_transposed(const float* c, int64_t D, int64_t rows, BF* dst, int64_t ld, float* staging) {
  for (int64_t d0 = 0; d0 < D; d0 += kTile) {
    transpose16(c + d0 * kTile, kTile, kTile, staging + d0, D);
  }
  T::Rounding::convert_rows(staging, D, D, rows, dst, ld);
}

// `rows` rows of D bf16 (stride ld) into `total` contiguous rows, the rest zero.
void copy_rows(const BF* src, int64_t ld, int64_t rows, int64_t total, int64_t D, BF* dst) {
  for (int64_t m = 0; m < rows; ++m) std::memcpy(dst + m * D, src + m * ld, D * sizeof(BF));
  std::fill(dst + rows * D, dst + total * D, BF(0.f));
}

// 2^t for the softmax. Probabilities end in bf16 (8 bits), so ATen's exp_u20 (about 17 instructions,
// a third of the forward's time) is more than they need: 2^t = 2^floor(t) * q(t - floor(t)) with q a
// degree-4 least-squares fit of 2^f on [0, 1), within 2.7e-6 of it (relative).
inline fVec exp2_for_softmax(const fVec& t) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = t;
  const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, whole);
  __m512 q = _mm512_fmadd_ps(_mm512_set1_ps(0.013520603f), f, _mm512_set1_ps(0.052037429f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.241427496f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(0.693006635f));
  q = _mm512_fmadd_ps(q, f, _mm512_set1_ps(1.000002503f));
  return fVec(_mm512_scalef_ps(q, whole));
#else
  return (t * fVec(static_cast<float>(M_LN2))).exp_u20();
#endif
}

inline float horizontal_max(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(v);
#else
  float buf[kF];
  v.store(buf);
  float top = buf[0];
  for (int64_t i = 1; i < kF; ++i) top = std::max(top, buf[i]);
  return top;
#endif
}

// 16 rows of scores (stride width, a multiple of 16; columns from `valid` on ignored) -> the softmax's
// numerators e = exp(scale (s - max of the row)) in place, zero from column `valid` on, and their row
// sums into `sums` (16 floats). The normalization is left to the caller: it scales the output rows
// (16 x D), not the probabilities (16 x N).
void softmax_rows(float* s, int64_t width, int64_t valid, float scale, float* sums) {
  const fVec lowest(-std::numeric_limits<float>::infinity()), zero(0.f);
  const fVec factor(scale * static_cast<float>(M_LOG2E));  // exp(scale x) = 2^(x scale log2 e)
  for (int64_t m = 0; m < kTile; ++m) {
    float* row = s + m * width;
    fVec top = lowest;
    for (int64_t c = 0; c < valid; c += kF) {
      const fVec v = fVec::loadu(row + c);
      top = maximum(top, valid - c < kF ? fVec::set(lowest, v, valid - c) : v);
    }
    const fVec shift = fVec(horizontal_max(top)) * factor;
    fVec sum = zero;
    for (int64_t c = 0; c < width; c += kF) {
      fVec e = exp2_for_softmax(fmsub(fVec::loadu(row + c), factor, shift));
      if (valid - c < kF) e = valid > c ? fVec::set(zero, e, valid - c) : zero;
      sum = sum + e;
      e.store(row + c);
    }
    sums[m] = horizontal_sum(sum);
  }
}

// Transposed scores of a query tile, `padded` rows (keys) of 16 float32 lanes (queries): the softmax
// down the rows of each lane -> numerators e = exp(scale (s - max over the first `valid` rows)) in
// place, zero from row `valid` on, and their sums per lane into `sums` (16 floats). The normalization is
// left to the caller: the forward scales its output (D x 16), not the probabilities (N x 16).
void softmax_columns(float* s, int64_t padded, int64_t valid, float scale, float* sums) {
  const fVec lowest(-std::numeric_limits<float>::infinity()), zero(0.f);
  const fVec factor(scale * static_cast<float>(M_LOG2E));  // exp(scale x) = 2^(x scale log2 e)
  for (int64_t v = 0; v < kTile; v += kF) {
    fVec top[2] = {lowest, lowest}, sum[2] = {zero, zero};  // two chains: latency, not throughput, binds one
    for (int64_t r = 0; r < valid; ++r) top[r & 1] = maximum(top[r & 1], fVec::loadu(s + r * kTile + v));
    const fVec shift = maximum(top[0], top[1]) * factor;
    for (int64_t r = 0; r < valid; ++r) {
      float* row = s + r * kTile + v;
      const fVec e = exp2_for_softmax(fmsub(fVec::loadu(row), factor, shift));
      sum[r & 1] = sum[r & 1] + e;
      e.store(row);
    }
    for (int64_t r = valid; r < padded; ++r) zero.store(s + r * kTile + v);
    (sum[0] + sum[1]).store(sums + v);
  }
}

struct Problem {
  int64_t B, N, H, D;
  float scale;
  int64_t tiles;      // 16-token tiles
  int64_t padded;     // tokens padded to 16: rows and columns of products
  int64_t reduction;  // tokens padded to 32: the reduction of products over tokens
  int64_t ld_qkv() const { return 3 * H * D; }
  int64_t ld_out() const { return H * D; }
};

Problem problem_of(const at::Tensor& qkv, int64_t heads, double scale, const char* name) {
  check_rows(qkv, name);
  TORCH_CHECK(qkv.dim() == 3 && heads > 0 && qkv.size(2) % (3 * heads) == 0, name,
              " must be (B, N, 3 * heads * head_dim), got ", qkv.sizes(), " for ", heads, " heads");
  const int64_t N = qkv.size(1), D = qkv.size(2) / (3 * heads);
  TORCH_CHECK(D > 0 && D % kDepth == 0, name, ": head_dim must be a multiple of 32, got ", D);
  const int64_t tiles = (N + kTile - 1) / kTile;
  return {qkv.size(0), N, heads, D, static_cast<float>(scale), tiles, tiles * kTile, round_up(N, kDepth)};
}

// One thread's scratch: 64-byte aligned blocks of one allocation. A scratch struct takes its blocks in
// its constructor; run it once on an unallocated arena to measure, then allocate and run it again.
class Arena {
 public:
  template <class U>
  U* take(int64_t count) {
    const int64_t offset = used_;
    used_ += round_up(count * static_cast<int64_t>(sizeof(U)), 64);
    return base_ == nullptr ? nullptr : reinterpret_cast<U*>(base_ + offset);
  }
  void allocate() {
    storage_.reset(new uint8_t[used_ + 64]);
    base_ = reinterpret_cast<uint8_t*>(round_up(static_cast<int64_t>(reinterpret_cast<uintptr_t>(storage_.get())), 64));
    used_ = 0;
  }

 private:
  std::unique_ptr<uint8_t[]> storage_;
  uint8_t* base_ = nullptr;
  int64_t used_ = 0;
};

struct ForwardScratch {
  uint32_t* keys;    // K^T, K's words transposed: tiles [D / 32][tiles]
  uint32_t* values;  // V's rows in pairs: tiles [reduction / 32][D / 16]
  BF* query;         // the last query tile when it is partial, zero-padded: 16 x D
  float* scores;     // S of the tile, then the softmax's numerators: 16 x padded
  float* sums;       // their row sums: 16
  BF* probs;         // the numerators in bf16: 16 x reduction
  float* out;        // O of the tile: 16 x D

  ForwardScratch(Arena& a, const Problem& p)
      : keys(a.take<uint32_t>(p.D / 2 * p.padded)),
        values(a.take<uint32_t>(p.reduction / 2 * p.D)),
        query(a.take<BF>(kTile * p.D)),
        scores(a.take<float>(kTile * p.padded)),
        sums(a.take<float>(kTile)),
        probs(a.take<BF>(kTile * p.reduction)),
        out(a.take<float>(kTile * p.D)) {}
};

template <class T>
void forward_item(const Problem& p, const BF* qkv, BF* out, ForwardScratch& w) {
  const int64_t ld = p.ld_qkv(), D = p.D, N = p.N;
  const BF *q = qkv, *k = q + p.H * D, *v = k + p.H * D;
  for (int64_t j = 0; j < p.tiles; ++j) {
    pack_transposed(k + j * kTile * ld, ld, std::min(kTile, N - j * kTile), D / kDepth, p.tiles, w.keys + j * kTileWords);
  }
  pack_pairs(v, ld, N, p.reduction / kDepth, D / kTile, w.values);
  for (int64_t m = 0; m < kTile; ++m) std::fill(w.probs + m * p.reduction + p.padded, w.probs + (m + 1) * p.reduction, BF(0.f));
  for (int64_t i = 0; i < p.tiles; ++i) {
    const int64_t first = i * kTile, rows = std::min(kTile, N - first);
    const BF* a = q + first * ld;
    int64_t lda = ld;
    if (rows < kTile) {  // a tile load reads 16 rows
      copy_rows(a, ld, rows, kTile, D, w.query);
      a = w.query;
      lda = D;
    }
    row_product<T>(a, lda, w.keys, D / kDepth, p.tiles, w.scores, p.padded);
    softmax_rows(w.scores, p.padded, N, p.scale, w.sums);
    T::Rounding::convert_rows(w.scores, p.padded, p.padded, kTile, w.probs, p.reduction);
    row_product<T>(w.probs, p.reduction, w.values, p.reduction / kDepth, D / kTile, w.out, D);
    for (int64_t m = 0; m < rows; ++m) {
      const fVec inverse(1.f / w.sums[m]);
      for (int64_t d = 0; d < D; d += kF) (fVec::loadu(w.out + m * D + d) * inverse).store(w.out + m * D + d);
    }
    T::Rounding::convert_rows(w.out, D, D, rows, out + first * p.ld_out(), p.ld_out());
  }
}

struct BackwardScratch {
  BF *keys, *values;                   // K and V, zero-padded: padded x D
  BF* keys_t;                          // K^T: D x reduction
  uint32_t *query_pairs, *grad_pairs;  // Q's and dO's rows in pairs: [reduction / 32][D / 16]
  BF *probs_t, *dscores_t;             // P^T and dS^T over all queries: padded x reduction
  uint32_t *queries, *grads;           // the tile's Q and dO rows, transposed as B tiles: [D / 32]
  float *scores, *dprobs;              // the tile's S^T (then P^T) and dP^T (then dS^T): padded x 16
  float* sums;                         // the softmax's sums: 16
  uint32_t* dscores;                   // the tile's dS^T, key rows in pairs: [reduction / 32]
  float* acc;                          // dQ^T (D x 16), or 16 rows of dK or dV (16 x D)
  float* staging;                      // 16 x D

  BackwardScratch(Arena& a, const Problem& p)
      : keys(a.take<BF>(p.padded * p.D)),
        values(a.take<BF>(p.padded * p.D)),
        keys_t(a.take<BF>(p.D * p.reduction)),
        query_pairs(a.take<uint32_t>(p.reduction / 2 * p.D)),
        grad_pairs(a.take<uint32_t>(p.reduction / 2 * p.D)),
        probs_t(a.take<BF>(p.padded * p.reduction)),
        dscores_t(a.take<BF>(p.padded * p.reduction)),
        queries(a.take<uint32_t>(p.D / kDepth * kTileWords)),
        grads(a.take<uint32_t>(p.D / kDepth * kTileWords)),
        scores(a.take<float>(p.padded * kTile)),
        dprobs(a.take<float>(p.padded * kTile)),
        sums(a.take<float>(kTile)),
        dscores(a.take<uint32_t>(p.reduction / kDepth * kTileWords)),
        acc(a.take<float>(kTile * p.D)),
        staging(a.take<float>(kTile * p.D)) {}
};

// A tile of 16 queries: its dQ, and its columns of P^T and dS^T for dK and dV.
template <class T>
void backward_query_tile(const Problem& p, const BF* q, const BF* grad, BF* dq, int64_t i, BackwardScratch& w) {
  const int64_t ld = p.ld_qkv(), D = p.D, first = i * kTile, rows = std::min(kTile, p.N - first);
  pack_transposed(q + first * ld, ld, rows, D / kDepth, 1, w.queries);
  pack_transposed(grad + first * p.ld_out(), p.ld_out(), rows, D / kDepth, 1, w.grads);
  column_product<T>(w.keys, D, p.tiles, w.queries, D / kDepth, w.scores);
  softmax_columns(w.scores, p.padded, p.N, p.scale, w.sums);
  column_product<T>(w.values, D, p.tiles, w.grads, D / kDepth, w.dprobs);
  const fVec scale(p.scale), zero(0.f);
  for (int64_t c = 0; c < kTile; c += kF) {
    // P = e / sum on the tile's queries, 0 on its padding (so that those add nothing to dK and dV)
    const int64_t real = std::clamp<int64_t>(rows - c, 0, kF);
    const fVec inverse = fVec::set(zero, fVec(1.f) / fVec::loadu(w.sums + c), real);
    fVec dot[2] = {zero, zero};
    for (int64_t r = 0; r < p.padded; ++r) {
      float* prob = w.scores + r * kTile + c;
      const fVec pv = fVec::loadu(prob) * inverse;
      pv.store(prob);
      dot[r & 1] = fmadd(pv, fVec::loadu(w.dprobs + r * kTile + c), dot[r & 1]);
    }
    const fVec rowsum = dot[0] + dot[1];  // rowsum(P dP) of each query
    for (int64_t r = 0; r < p.padded; ++r) {  // dS = P (dP - rowsum(P dP)) * scale
      float* dprob = w.dprobs + r * kTile + c;
      (fVec::loadu(w.scores + r * kTile + c) * (fVec::loadu(dprob) - rowsum) * scale).store(dprob);
    }
  }
  T::Rounding::convert_rows(w.scores, kTile, kTile, p.padded, w.probs_t + first, p.reduction);
  T::Rounding::convert_rows(w.dprobs, kTile, kTile, p.padded, w.dscores_t + first, p.reduction);
  T::Rounding::pack_float_pairs(w.dprobs, p.padded, p.reduction / kDepth, w.dscores);
  column_product<T>(w.keys_t, p.reduction, D / kTile, w.dscores, p.reduction / kDepth, w.acc);
  store_transposed<T>(w.acc, D, rows, dq + first * ld, ld, w.staging);
}

template <class T>
void backward_item(const Problem& p, const BF* qkv, const BF* grad, BF* dqkv, BackwardScratch& w) {
  const int64_t ld = p.ld_qkv(), D = p.D, N = p.N, offset = p.H * D;
  const BF *q = qkv, *k = q + offset, *v = k + offset;
  copy_rows(k, ld, N, p.padded, D, w.keys);
  copy_rows(v, ld, N, p.padded, D, w.values);
  transpose_into(k, ld, N, D, w.keys_t, p.reduction);
  pack_pairs(q, ld, N, p.reduction / kDepth, D / kTile, w.query_pairs);
  pack_pairs(grad, p.ld_out(), N, p.reduction / kDepth, D / kTile, w.grad_pairs);
  for (BF* t : {w.probs_t, w.dscores_t}) {  // query columns past the last tile, if any, stay zero
    for (int64_t r = 0; r < p.padded; ++r) std::fill(t + r * p.reduction + p.padded, t + (r + 1) * p.reduction, BF(0.f));
  }
  for (int64_t i = 0; i < p.tiles; ++i) backward_query_tile<T>(p, q, grad, dqkv, i, w);
  const struct {
    const BF* a;
    const uint32_t* b;
    BF* out;
  } products[] = {{w.dscores_t, w.query_pairs, dqkv + offset}, {w.probs_t, w.grad_pairs, dqkv + 2 * offset}};
  for (const auto& product : products) {  // dK = dS^T Q, dV = P^T dO, 16 keys at a time
    for (int64_t j = 0; j < p.tiles; ++j) {
      row_product<T>(product.a + j * kTile * p.reduction, p.reduction, product.b, p.reduction / kDepth, D / kTile,
                     w.acc, D);
      T::Rounding::convert_rows(w.acc, D, D, std::min(kTile, N - j * kTile), product.out + j * kTile * ld, ld);
    }
  }
}

// Every (image, head) of the batch in parallel; a thread configures its tiles once and runs its items
// one after another on one arena.
template <class T, class Scratch, class Item>
void for_each_head(const Problem& p, const Item& item) {
  at::parallel_for(0, p.B * p.H, 1, [&](int64_t begin, int64_t end) {
    Arena arena;
    Scratch{arena, p};  // measures
    arena.allocate();
    Scratch scratch(arena, p);
    T::configure();
    for (int64_t index = begin; index < end; ++index) item(index / p.H, index % p.H, scratch);
    T::release();
  });
}

template <class T>
void forward_all(const Problem& p, const BF* qkv, BF* out) {
  for_each_head<T, ForwardScratch>(p, [&](int64_t b, int64_t h, ForwardScratch& w) {
    forward_item<T>(p, qkv + b * p.N * p.ld_qkv() + h * p.D, out + b * p.N * p.ld_out() + h * p.D, w);
  });
}

template <class T>
void backward_all(const Problem& p, const BF* qkv, const BF* grad, BF* dqkv) {
  for_each_head<T, BackwardScratch>(p, [&](int64_t b, int64_t h, BackwardScratch& w) {
    const int64_t qkv_offset = b * p.N * p.ld_qkv() + h * p.D;
    backward_item<T>(p, qkv + qkv_offset, grad + b * p.N * p.ld_out() + h * p.D, dqkv + qkv_offset, w);
  });
}

}  // namespace

// Whether the AMX path can run: the CPU has AMX-TILE and AMX-BF16, the extension was built with them,
// and Linux granted this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once).
bool attention_amx_available() {
#if VITRAIN_AMX
  static const bool available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    if (!(edx & (1u << 22)) || !(edx & (1u << 24))) return false;                  // AMX-BF16, AMX-TILE
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return available;
#else
  return false;
#endif
}

namespace {

void check_backend(bool emulate, const char* name) {
  TORCH_CHECK(emulate || attention_amx_available(), name,
              ": this CPU (or this build) has no AMX-BF16; use the explicit attention, or emulate=True in tests");
}

}  // namespace

// softmax(scale q k^T) v per image and head: qkv (B, N, 3 * heads * head_dim) bf16 contiguous, laid out
// (3, heads, head_dim) along the last dimension as a fused projection gives it; head_dim a multiple of
// 32. Returns (B, N, heads * head_dim) bf16. emulate: the plain C++ tile arithmetic instead of AMX.
at::Tensor attention_forward(const at::Tensor& qkv, int64_t heads, double scale, bool emulate) {
  const Problem p = problem_of(qkv, heads, scale, "attention_forward: qkv");
  check_backend(emulate, "attention_forward");
  auto out = at::empty({p.B, p.N, p.H * p.D}, qkv.options());
  const BF* in = qkv.data_ptr<BF>();
  BF* o = out.data_ptr<BF>();
#if VITRAIN_AMX
  if (!emulate) {
    forward_all<AmxTiles>(p, in, o);
    return out;
  }
#endif
  forward_all<EmulatedTiles>(p, in, o);
  return out;
}

// The gradient at qkv of attention_forward, for grad_out (B, N, heads * head_dim) bf16 contiguous.
at::Tensor attention_backward(const at::Tensor& grad_out, const at::Tensor& qkv, int64_t heads, double scale,
                              bool emulate) {
  const Problem p = problem_of(qkv, heads, scale, "attention_backward: qkv");
  check_rows(grad_out, "attention_backward: grad_out");
  TORCH_CHECK(grad_out.dim() == 3 && grad_out.size(0) == p.B && grad_out.size(1) == p.N &&
                  grad_out.size(2) == p.H * p.D,
              "attention_backward: grad_out must be (B, N, heads * head_dim) = (", p.B, ", ", p.N, ", ", p.H * p.D,
              "), got ", grad_out.sizes());
  check_backend(emulate, "attention_backward");
  auto dqkv = at::empty_like(qkv);
  const BF *in = qkv.data_ptr<BF>(), *g = grad_out.data_ptr<BF>();
  BF* d = dqkv.data_ptr<BF>();
#if VITRAIN_AMX
  if (!emulate) {
    backward_all<AmxTiles>(p, in, g, d);
    return dqkv;
  }
#endif
  backward_all<EmulatedTiles>(p, in, g, d);
  return dqkv;
}
