// AMX tiles for the kernels that multiply small blocks (attention.cpp, weight_gradient.cpp): the tile backends
// (AMX, and the same arithmetic in plain C++ for CPUs without it, used by the tests), products of a row
// or a column of tiles, packing of B operands, 16 x 16 transposes, float32 -> bf16 rounding, scratch.
//
// AMX multiplies tiles: C (16 x 16 float32) += A (16 x 32 bf16) B (32 x 16 bf16), B held as 16 rows of
// 16 pairs, row r = (B[2r][n], B[2r+1][n]) for n = 0..15. A is read row-major (16 rows of 64 bytes at
// any stride); B is packed into such tiles of 1 KiB.
#pragma once

#include "common.h"
#include "kernels.h"  // amx_available (defined in tiles.cpp)

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

namespace vitrain_kernels {

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
  template <int t>  // operands, or accumulators to add to (weight_gradient.cpp)
  static void load(const void* p, int64_t stride) {
    static_assert(t >= 0 && t < 8, "tiles are 0-7");
    if constexpr (t == 0) _tile_loadd(0, p, stride);
    if constexpr (t == 1) _tile_loadd(1, p, stride);
    if constexpr (t == 2) _tile_loadd(2, p, stride);
    if constexpr (t == 3) _tile_loadd(3, p, stride);
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
    // weight_gradient.cpp's 2 x 2 products: A tiles 4, 5 down, B tiles 6, 7 across
    constexpr bool grid = (c == 0 && a == 4 && b == 6) || (c == 1 && a == 4 && b == 7) || (c == 2 && a == 5 && b == 6) ||
                          (c == 3 && a == 5 && b == 7);
    static_assert(row || column || grid, "the products row_product, column_product and weight_gradient.cpp make");
    if constexpr (grid && c == 0) _tile_dpbf16ps(0, 4, 6);
    if constexpr (grid && c == 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (grid && c == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (grid && c == 3) _tile_dpbf16ps(3, 5, 7);
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

// Where a run of operand tiles lies: the first at `base`, rows `stride` bytes apart, the next depth
// step `step` bytes on, the next of the (up to four) operands `next` bytes on.
struct Tiles {
  const uint8_t* base;
  int64_t stride, step, next;
  const void* at(int64_t s, int64_t k) const { return base + s * step + k * next; }
};

// Up to four products over `depth` steps sharing one operand tile (loaded once a step into tile 4):
// accumulator k = shared x others_k when the shared operand is A (a row of C tiles), others_k x shared
// when it is B (a column). Accumulator k is stored at c + k * c_next floats, rows c_stride bytes apart.
template <class T, bool shared_is_a>
void shared_products(int64_t n, int64_t depth, const Tiles& shared, const Tiles& others, float* c, int64_t c_next,
                     int64_t c_stride) {
  constexpr int a5 = shared_is_a ? 4 : 5, a6 = shared_is_a ? 4 : 6, a7 = shared_is_a ? 4 : 7;
  constexpr int b5 = shared_is_a ? 5 : 4, b6 = shared_is_a ? 6 : 4, b7 = shared_is_a ? 7 : 4;
  T::template zero<0>();
  if (n > 1) T::template zero<1>();
  if (n > 2) T::template zero<2>();
  if (n > 3) T::template zero<3>();
  for (int64_t s = 0; s < depth; ++s) {
    T::template load<4>(shared.at(s, 0), shared.stride);
    T::template load<5>(others.at(s, 0), others.stride);
    T::template dot<0, a5, b5>();
    if (n > 1) {
      T::template load<6>(others.at(s, 1), others.stride);
      T::template dot<1, a6, b6>();
    }
    if (n > 2) {
      T::template load<7>(others.at(s, 2), others.stride);
      T::template dot<2, a7, b7>();
    }
    if (n > 3) {
      T::template load<5>(others.at(s, 3), others.stride);
      T::template dot<3, a5, b5>();
    }
  }
  T::template store<0>(c, c_stride);
  if (n > 1) T::template store<1>(c + c_next, c_stride);
  if (n > 2) T::template store<2>(c + 2 * c_next, c_stride);
  if (n > 3) T::template store<3>(c + 3 * c_next, c_stride);
}

inline const uint8_t* bytes_of(const void* p) { return static_cast<const uint8_t*>(p); }

// C (16 rows x 16 * blocks float32, row stride ldc) = A (16 rows x 32 * depth bf16, row stride lda)
// times B, packed as tiles [depth][blocks]. Up to four accumulators at a time, sharing A's tile.
template <class T>
void row_product(const BF* a, int64_t lda, const uint32_t* b, int64_t depth, int64_t blocks, float* c, int64_t ldc) {
  constexpr int64_t tile_bytes = kTileWords * sizeof(uint32_t);
  const Tiles shared{bytes_of(a), lda * static_cast<int64_t>(sizeof(BF)), kRowBytes, 0};
  for (int64_t j = 0; j < blocks; j += 4) {
    const Tiles others{bytes_of(b + j * kTileWords), kRowBytes, blocks * tile_bytes, tile_bytes};
    shared_products<T, true>(std::min<int64_t>(4, blocks - j), depth, shared, others, c + j * kTile, kTile,
                             ldc * static_cast<int64_t>(sizeof(float)));
  }
}

// C (16 * row_tiles rows x 16 float32, row stride 16) = A (16 * row_tiles rows x 32 * depth bf16, row
// stride lda) times B, one column of tiles [depth]. Up to four accumulators at a time, sharing B's tile.
template <class T>
void column_product(const BF* a, int64_t lda, int64_t row_tiles, const uint32_t* b, int64_t depth, float* c) {
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(BF));
  const Tiles shared{bytes_of(b), kRowBytes, kTileWords * sizeof(uint32_t), 0};
  for (int64_t j = 0; j < row_tiles; j += 4) {
    const Tiles others{bytes_of(a + j * kTile * lda), a_stride, kRowBytes, kTile * a_stride};
    shared_products<T, false>(std::min<int64_t>(4, row_tiles - j), depth, shared, others, c + j * kTileWords,
                              kTileWords, kTile * sizeof(float));
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
inline void pack_transposed(const BF* src, int64_t ld, int64_t rows, int64_t depth, int64_t stride, uint32_t* out) {
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
inline void pack_pairs(const BF* src, int64_t ld, int64_t rows, int64_t depth, int64_t blocks, uint32_t* out) {
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

inline void check_backend(bool emulate, const char* name) {
  TORCH_CHECK(emulate || amx_available(), name,
              ": this CPU (or this build) has no AMX-BF16; use PyTorch's ops, or emulate=True in tests");
}


}  // namespace vitrain_kernels
