// A linear layer's weight gradient on AMX tiles, from the token-major tensors autograd holds:
// dW (out x in) = g^T x, summed over every token, for g (tokens x out) the output gradient and x
// (tokens x in) the layer's input, with the bias gradient (g's column sums) on the way.
//
// Why: oneDNN runs g^T x at about half speed from a transposed view, so the layers copied one operand
// feature-major first (transpose_rows) and summed the bias gradient in another pass: in a ViT-Ti/4
// O2 step (batch 128) the products took 74 ms, the copies 28 ms and the sums 9 ms. Here the reduction
// runs over the tokens as they lie: each thread takes a run of tokens and packs them a chunk at a time
// into tiles that stay in L2 (x's rows in pairs, which is what a B tile is; g's rows in pairs with
// each 16 x 16 block of 32-bit pairs transposed, which is what an A tile is), then adds their
// products into its own float32 copy of dW, two A tiles by two B tiles at a time. The threads' copies
// are summed and rounded to bf16 once at the end.

#include "kernels.h"
#include "tiles.h"

#include <vector>

using namespace vitrain_kernels;

namespace {

struct Shape {
  int64_t tokens, out, in, chunk;  // chunk: tokens packed at a time, a multiple of 32
  int64_t steps() const { return chunk / kDepth; }
  int64_t out_tiles() const { return out / kTile; }
  int64_t in_tiles() const { return in / kTile; }
};

// A tiles [out / 16][steps] of a chunk of g: tile (o, s) row m holds the pairs (g[32 s + 2 j][16 o + m],
// g[32 s + 2 j + 1][16 o + m]) for j = 0..15; rows from `rows` on are zero. Adds the rows to `sums`.
void pack_gradient(const BF* g, int64_t rows, const Shape& p, uint32_t* a, float* sums, uint32_t* pairs) {
  const int64_t steps = p.steps(), out = p.out;
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t o = 0; o < p.out_tiles(); ++o) {
      for (int64_t j = 0; j < kTile; ++j) {
        const int64_t r = s * kDepth + 2 * j;
        const auto* low = r < rows ? reinterpret_cast<const uint16_t*>(g + r * out + o * kTile) : nullptr;
        const auto* high = r + 1 < rows ? reinterpret_cast<const uint16_t*>(g + (r + 1) * out + o * kTile) : nullptr;
        store_pairs(low, high, pairs + j * kTile);
      }
      transpose16(reinterpret_cast<const float*>(pairs), kTile, kTile,
                  reinterpret_cast<float*>(a + (o * steps + s) * kTileWords), kTile);
    }
  }
  if (sums != nullptr) add_rows(g, rows, out, sums);
}

// Memory to bring into L2 while the tiles multiply: the next chunk's rows of each operand.
struct Prefetch {
  const char* start[3];
  int64_t bytes[3];
  void line(int64_t i) const {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    int64_t at = i * 64;
    for (int k = 0; k < 3; ++k) {
      if (at < bytes[k]) {
        _mm_prefetch(start[k] + at, _MM_HINT_T1);
        return;
      }
      at -= bytes[k];
    }
#else
    (void)i;
#endif
  }
  int64_t lines() const { return (bytes[0] + bytes[1] + bytes[2] + 63) / 64; }
};

// c (out x in float32, row stride in) += the products of a chunk's tiles, two by two (c = them, its
// old contents ignored, for a thread's first chunk), spreading the prefetches of the next chunk over
// the blocks (the packing reads it; in a training step the operands come from memory: step 4-6 ms
// faster, docs/benchmarks.md).
template <class T>
void add_products(const uint32_t* a, const uint32_t* b, const Shape& p, float* c, bool fresh, const Prefetch& next) {
  const int64_t blocks = p.out_tiles() / 2 * (p.in_tiles() / 2);
  const int64_t per_block = (next.lines() + blocks - 1) / blocks;
  int64_t line = 0;
  const int64_t steps = p.steps(), in_tiles = p.in_tiles(), stride = p.in * static_cast<int64_t>(sizeof(float));
  for (int64_t o = 0; o < p.out_tiles(); o += 2) {
    for (int64_t i = 0; i < in_tiles; i += 2) {
      float* c00 = c + o * kTile * p.in + i * kTile;
      float* c10 = c00 + kTile * p.in;
      if (fresh) {
        T::template zero<0>();
        T::template zero<1>();
        T::template zero<2>();
        T::template zero<3>();
      } else {
        T::template load<0>(c00, stride);
        T::template load<1>(c00 + kTile, stride);
        T::template load<2>(c10, stride);
        T::template load<3>(c10 + kTile, stride);
      }
      for (int64_t k = 0; k < per_block; ++k) next.line(line++);
      const uint32_t* a0 = a + o * steps * kTileWords;
      const uint32_t* b0 = b + i * kTileWords;
      for (int64_t s = 0; s < steps; ++s) {
        T::template load<4>(a0 + s * kTileWords, kRowBytes);
        T::template load<5>(a0 + (steps + s) * kTileWords, kRowBytes);
        T::template load<6>(b0 + s * in_tiles * kTileWords, kRowBytes);
        T::template load<7>(b0 + (s * in_tiles + 1) * kTileWords, kRowBytes);
        T::template dot<0, 4, 6>();
        T::template dot<1, 4, 7>();
        T::template dot<2, 5, 6>();
        T::template dot<3, 5, 7>();
      }
      T::template store<0>(c00, stride);
      T::template store<1>(c00 + kTile, stride);
      T::template store<2>(c10, stride);
      T::template store<3>(c10 + kTile, stride);
    }
  }
}

// The layer's tensors: g (or, with `gelu_input`, the gradient at the GELU's output, g then being
// written to `g_out`) and x.
struct Operands {
  const BF *g, *x, *gelu_input;
  BF* g_out;
};

// Each thread's float32 copy of dW (and of the bias sums) is written by its first chunk; `used` marks
// the threads that had any, the copies the caller sums.
template <class T>
void weight_gradient_all(const Shape& p, const Operands& t, float* partial, float* partial_sums, char* used) {
  const int64_t chunks = (p.tokens + p.chunk - 1) / p.chunk, steps = p.steps();
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t thread = at::get_thread_num();
    float* c = partial + thread * p.out * p.in;
    float* sums = partial_sums == nullptr ? nullptr : partial_sums + thread * p.out;
    bool fresh = !used[thread];  // c and sums not yet written
    used[thread] = 1;
    if (fresh && sums != nullptr) std::fill(sums, sums + p.out, 0.f);
    Arena arena;
    uint32_t *a = nullptr, *b = nullptr, *pairs = nullptr;
    for (int pass = 0; pass < 2; ++pass) {  // measure, then allocate and take (tiles.h)
      if (pass == 1) arena.allocate();
      a = arena.take<uint32_t>(p.out_tiles() * steps * kTileWords);
      b = arena.take<uint32_t>(steps * p.in_tiles() * kTileWords);
      pairs = arena.take<uint32_t>(kTileWords);
    }
    T::configure();
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t first = chunk * p.chunk, rows = std::min(p.chunk, p.tokens - first);
      const BF* g = t.g + first * p.out;
      if (t.gelu_input != nullptr) {
        gelu_backward_rows(g, t.gelu_input + first * p.out, rows, p.out, t.g_out + first * p.out, sums);
        pack_gradient(t.g_out + first * p.out, rows, p, a, nullptr, pairs);
      } else {
        pack_gradient(g, rows, p, a, sums, pairs);
      }
      pack_pairs(t.x + first * p.in, p.in, rows, steps, p.in_tiles(), b);
      const int64_t next_rows = std::clamp<int64_t>(p.tokens - first - p.chunk, 0, p.chunk);
      const int64_t g_bytes = next_rows * p.out * 2;
      const Prefetch next{{reinterpret_cast<const char*>(g + rows * p.out),
                           reinterpret_cast<const char*>(t.x + (first + rows) * p.in),
                           t.gelu_input == nullptr ? nullptr
                                                   : reinterpret_cast<const char*>(t.gelu_input + (first + rows) * p.out)},
                          {g_bytes, next_rows * p.in * 2, t.gelu_input != nullptr ? g_bytes : 0}};
      add_products<T>(a, b, p, c, fresh, next);
      fresh = false;
    }
    T::release();
  });
}

}  // namespace

// g (tokens, out) and x (tokens, in): contiguous bf16, out and in multiples of 32. Returns dW = g^T x
// (out, in) in bf16, summed in float32 and rounded once, and if `bias`, g's column sums in float32
// (undefined otherwise). With `gelu_input` h (tokens, out), the layer is followed by the exact GELU and
// g is the gradient at its output: the gradient at the layer's output, g * GELU'(h) rounded to bf16,
// is formed chunk by chunk and returned third (its sums taken before rounding, as gelu_backward's).
// chunk: tokens packed at a time (a multiple of 32; 0 for the default). emulate: the plain C++ tile
// arithmetic.
std::vector<at::Tensor> weight_gradient(const at::Tensor& g, const at::Tensor& x, bool bias, int64_t chunk,
                                        bool emulate, const c10::optional<at::Tensor>& gelu_input) {
  check_rows(g, "weight_gradient: g");
  check_rows(x, "weight_gradient: x");
  TORCH_CHECK(g.dim() == 2 && x.dim() == 2 && g.size(0) == x.size(0),
              "weight_gradient: g (tokens, out) and x (tokens, in) must be 2-d with as many rows, got ", g.sizes(),
              " and ", x.sizes());
  TORCH_CHECK(g.size(1) % 32 == 0 && x.size(1) % 32 == 0,
              "weight_gradient: out and in features must be multiples of 32, got ", g.size(1), " and ", x.size(1));
  chunk = chunk == 0 ? 128 : chunk;  // 128-256 measured alike in a step; 128 fastest alone (docs/benchmarks.md)
  TORCH_CHECK(chunk > 0 && chunk % kDepth == 0, "weight_gradient: chunk must be a positive multiple of 32, got ", chunk);
  at::Tensor g_out;
  if (gelu_input.has_value()) {
    check_rows(*gelu_input, "weight_gradient: gelu_input");
    TORCH_CHECK(gelu_input->sizes() == g.sizes(), "weight_gradient: gelu_input and g differ in shape");
    g_out = at::empty_like(g);
  }
  check_backend(emulate, "weight_gradient");
  const Shape p{g.size(0), g.size(1), x.size(1), chunk};
  const int64_t threads = at::get_num_threads();
  auto partial = at::empty({threads, p.out, p.in}, g.options().dtype(at::kFloat));
  std::vector<float> partial_sums(bias ? threads * p.out : 0);
  std::vector<char> used(threads, 0);
  float* sums = bias ? partial_sums.data() : nullptr;
  const Operands operands{g.data_ptr<BF>(), x.data_ptr<BF>(),
                          gelu_input.has_value() ? gelu_input->data_ptr<BF>() : nullptr,
                          gelu_input.has_value() ? g_out.data_ptr<BF>() : nullptr};
#if VITRAIN_AMX
  if (!emulate) {
    weight_gradient_all<AmxTiles>(p, operands, partial.data_ptr<float>(), sums, used.data());
  } else {
    weight_gradient_all<EmulatedTiles>(p, operands, partial.data_ptr<float>(), sums, used.data());
  }
#else
  weight_gradient_all<EmulatedTiles>(p, operands, partial.data_ptr<float>(), sums, used.data());
#endif
  std::vector<const float*> copies;  // the threads' copies of dW, and of the sums
  std::vector<const float*> sum_copies;
  for (int64_t t = 0; t < threads; ++t) {
    if (!used[t]) continue;
    copies.push_back(partial.data_ptr<float>() + t * p.out * p.in);
    if (bias) sum_copies.push_back(partial_sums.data() + t * p.out);
  }
  auto dweight = at::empty({p.out, p.in}, g.options());
  BF* dw = dweight.data_ptr<BF>();
  at::parallel_for(0, p.out * p.in / kF, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      fVec total(0.f);
      for (const float* copy : copies) total = total + fVec::loadu(copy + v * kF);
      store_bf16(dw + v * kF, total, kF);
    }
  });
  at::Tensor dbias;
  if (bias) {
    dbias = at::zeros({p.out}, g.options().dtype(at::kFloat));
    float* out = dbias.data_ptr<float>();
    for (const float* copy : sum_copies) {
      for (int64_t o = 0; o < p.out; ++o) out[o] += copy[o];
    }
  }
  return {dweight, dbias, g_out};
}
