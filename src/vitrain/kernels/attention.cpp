// Attention over short sequences on AMX tiles: softmax(scale q k^T) v for every (image, head),
// forward and backward, read straight from the fused qkv projection's output and written straight to
// the token-major output (and to the qkv gradient), with no head-major copies.
//
// Why: oneDNN's batched matmuls ran the per-head products (65 x 65 x 64 at ViT-Ti/4, 197 x 197 x 64 at
// ViT-S/16) at 0.14-0.26 TFLOP/s on a 2-core AMX Xeon, with head-major copies of q, k, v and a bf16
// score tensor going through memory between them: the attention core took 10 ms a layer at ViT-Ti/4
// (batch 128) and 32 ms at ViT-S/16 (batch 32), forward and backward. Here one (image, head) is one
// work item whose operands (tens of KiB) stay in L1/L2; scores live in float32 (the accumulators),
// the softmax runs on rows of 16 queries, and the backward recomputes the probabilities from the
// scores and one float a query that the forward keeps (the log of its softmax denominator).
//
// Products are AMX tiles (tiles.h): C = A B with A read row-major and B packed in pairs of rows.
// Queries go 16 at a time.
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
// The tiles' plain C++ backend runs the same algorithm on CPUs without AMX, for the tests.
//

#include "kernels.h"
#include "tiles.h"

using namespace vitrain_kernels;

namespace {

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

// 2^t for the softmax. Probabilities end in bf16 (8 bits), so ATen's exp_u20 (about 17 instructions;
// the softmax was the forward's largest phase) is more than they need: 2^t = 2^floor(t) q(t - floor(t))
// with q a degree-4 least-squares fit of 2^f on [0, 1), within 2.7e-6 of it (relative).
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
// (16 x D), not the probabilities (16 x N). `stats` (the first `rows` of them) receive each row's
// log2 of its softmax denominator, scale * max * log2(e) + log2(sum), so that the backward gets the
// probabilities in one pass: P = 2^(scale s log2(e) - stat).
void softmax_rows(float* s, int64_t width, int64_t valid, float scale, float* sums, float* stats, int64_t rows) {
  const fVec lowest(-std::numeric_limits<float>::infinity()), zero(0.f);
  const fVec factor(scale * static_cast<float>(M_LOG2E));  // exp(scale x) = 2^(x scale log2 e)
  for (int64_t m = 0; m < kTile; ++m) {
    float* row = s + m * width;
    fVec top = lowest;
    for (int64_t c = 0; c < valid; c += kF) {
      const fVec v = fVec::loadu(row + c);
      top = maximum(top, valid - c < kF ? fVec::set(lowest, v, valid - c) : v);
    }
    const float shift = horizontal_max(top) * scale * static_cast<float>(M_LOG2E);
    fVec sum = zero;
    for (int64_t c = 0; c < width; c += kF) {
      fVec e = exp2_for_softmax(fmsub(fVec::loadu(row + c), factor, fVec(shift)));
      if (valid - c < kF) e = valid > c ? fVec::set(zero, e, valid - c) : zero;
      sum = sum + e;
      e.store(row + c);
    }
    sums[m] = horizontal_sum(sum);
    if (m < rows) stats[m] = shift + std::log2(sums[m]);
  }
}

// Transposed scores of a query tile, `padded` rows (keys) of 16 float32 lanes (queries) -> the
// probabilities P^T = 2^(scale s log2(e) - stat) in place, from the forward's `stats` of the tile's
// `queries` (lanes past them, padding, are zero), zero from key row `valid` on.
void probabilities_columns(float* s, int64_t padded, int64_t valid, float scale, const float* stats, int64_t queries) {
  const fVec zero(0.f), factor(scale * static_cast<float>(M_LOG2E));
  for (int64_t v = 0; v < kTile; v += kF) {
    const int64_t lanes = std::clamp<int64_t>(queries - v, 0, kF);
    const fVec stat = lanes == kF ? fVec::loadu(stats + v) : fVec::loadu(stats + v, lanes);
    for (int64_t r = 0; r < valid; ++r) {
      float* row = s + r * kTile + v;
      const fVec prob = exp2_for_softmax(fmsub(fVec::loadu(row), factor, stat));
      (lanes == kF ? prob : fVec::set(zero, prob, lanes)).store(row);
    }
    for (int64_t r = valid; r < padded; ++r) zero.store(s + r * kTile + v);
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
void forward_item(const Problem& p, const BF* qkv, BF* out, float* stats, ForwardScratch& w) {
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
    softmax_rows(w.scores, p.padded, N, p.scale, w.sums, stats + first, rows);
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
  BF *keys, *values;                   // the last 16 rows of K and V when partial, zero-padded: 16 x D
  BF* keys_t;                          // K^T: D x reduction
  uint32_t *query_pairs, *grad_pairs;  // Q's and dO's rows in pairs: [reduction / 32][D / 16]
  BF *probs_t, *dscores_t;             // P^T and dS^T over all queries: padded x reduction
  uint32_t *queries, *grads;           // the tile's Q and dO rows, transposed as B tiles: [D / 32]
  float *scores, *dprobs;              // the tile's S^T (then P^T) and dP^T (then dS^T): padded x 16
  uint32_t* dscores;                   // the tile's dS^T, key rows in pairs: [reduction / 32]
  float* acc;                          // dQ^T (D x 16), or 16 rows of dK or dV (16 x D)
  float* staging;                      // 16 x D

  BackwardScratch(Arena& a, const Problem& p)
      : keys(a.take<BF>(kTile * p.D)),
        values(a.take<BF>(kTile * p.D)),
        keys_t(a.take<BF>(p.D * p.reduction)),
        query_pairs(a.take<uint32_t>(p.reduction / 2 * p.D)),
        grad_pairs(a.take<uint32_t>(p.reduction / 2 * p.D)),
        probs_t(a.take<BF>(p.padded * p.reduction)),
        dscores_t(a.take<BF>(p.padded * p.reduction)),
        queries(a.take<uint32_t>(p.D / kDepth * kTileWords)),
        grads(a.take<uint32_t>(p.D / kDepth * kTileWords)),
        scores(a.take<float>(p.padded * kTile)),
        dprobs(a.take<float>(p.padded * kTile)),
        dscores(a.take<uint32_t>(p.reduction / kDepth * kTileWords)),
        acc(a.take<float>(kTile * p.D)),
        staging(a.take<float>(kTile * p.D)) {}
};

// C (padded x 16) = M X^T for the item's K or V rows M (stride ld; whole tiles read where they lie,
// the last partial one from its zero-padded copy) and a query tile's X packed transposed.
template <class T>
void keys_times(const Problem& p, const BF* rows, int64_t ld, const BF* last, const uint32_t* x, float* c) {
  const int64_t whole = p.N / kTile, depth = p.D / kDepth;
  if (whole > 0) column_product<T>(rows, ld, whole, x, depth, c);
  if (whole < p.tiles) column_product<T>(last, p.D, 1, x, depth, c + whole * kTileWords);
}

// A tile of 16 queries: its dQ, and its columns of P^T and dS^T for dK and dV.
template <class T>
void backward_query_tile(const Problem& p, const BF* qkv, const BF* grad, const float* stats, BF* dq, int64_t i,
                         BackwardScratch& w) {
  const int64_t ld = p.ld_qkv(), D = p.D, first = i * kTile, rows = std::min(kTile, p.N - first);
  const BF *q = qkv, *k = q + p.H * D, *v = k + p.H * D;
  pack_transposed(q + first * ld, ld, rows, D / kDepth, 1, w.queries);
  pack_transposed(grad + first * p.ld_out(), p.ld_out(), rows, D / kDepth, 1, w.grads);
  keys_times<T>(p, k, ld, w.keys, w.queries, w.scores);
  probabilities_columns(w.scores, p.padded, p.N, p.scale, stats + first, rows);
  keys_times<T>(p, v, ld, w.values, w.grads, w.dprobs);
  const fVec scale(p.scale), zero(0.f);
  for (int64_t c = 0; c < kTile; c += kF) {
    fVec dot[2] = {zero, zero};
    for (int64_t r = 0; r < p.padded; ++r) {
      dot[r & 1] = fmadd(fVec::loadu(w.scores + r * kTile + c), fVec::loadu(w.dprobs + r * kTile + c), dot[r & 1]);
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
void backward_item(const Problem& p, const BF* qkv, const BF* grad, const float* stats, BF* dqkv, BackwardScratch& w) {
  const int64_t ld = p.ld_qkv(), D = p.D, N = p.N, offset = p.H * D, last = (p.tiles - 1) * kTile;
  const BF *q = qkv, *k = q + offset, *v = k + offset;
  copy_rows(k + last * ld, ld, N - last, kTile, D, w.keys);
  copy_rows(v + last * ld, ld, N - last, kTile, D, w.values);
  transpose_into(k, ld, N, D, w.keys_t, p.reduction);
  pack_pairs(q, ld, N, p.reduction / kDepth, D / kTile, w.query_pairs);
  pack_pairs(grad, p.ld_out(), N, p.reduction / kDepth, D / kTile, w.grad_pairs);
  for (BF* t : {w.probs_t, w.dscores_t}) {  // query columns past the last tile, if any, stay zero
    for (int64_t r = 0; r < p.padded; ++r) std::fill(t + r * p.reduction + p.padded, t + (r + 1) * p.reduction, BF(0.f));
  }
  for (int64_t i = 0; i < p.tiles; ++i) backward_query_tile<T>(p, qkv, grad, stats, dqkv, i, w);
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

// stats: (B, heads, N) float32, one per query (softmax_rows).
template <class T>
void forward_all(const Problem& p, const BF* qkv, BF* out, float* stats) {
  for_each_head<T, ForwardScratch>(p, [&](int64_t b, int64_t h, ForwardScratch& w) {
    forward_item<T>(p, qkv + b * p.N * p.ld_qkv() + h * p.D, out + b * p.N * p.ld_out() + h * p.D,
                    stats + (b * p.H + h) * p.N, w);
  });
}

template <class T>
void backward_all(const Problem& p, const BF* qkv, const BF* grad, const float* stats, BF* dqkv) {
  for_each_head<T, BackwardScratch>(p, [&](int64_t b, int64_t h, BackwardScratch& w) {
    const int64_t qkv_offset = b * p.N * p.ld_qkv() + h * p.D;
    backward_item<T>(p, qkv + qkv_offset, grad + b * p.N * p.ld_out() + h * p.D, stats + (b * p.H + h) * p.N,
                     dqkv + qkv_offset, w);
  });
}

}  // namespace

// softmax(scale q k^T) v per image and head: qkv (B, N, 3 * heads * head_dim) bf16 contiguous, laid out
// (3, heads, head_dim) along the last dimension as a fused projection gives it; head_dim a multiple of
// 32. Returns the output, (B, N, heads * head_dim) bf16, and per query the log2 of its softmax
// denominator, (B, heads, N) float32, for the backward. emulate: the plain C++ tile arithmetic.
std::vector<at::Tensor> attention_forward(const at::Tensor& qkv, int64_t heads, double scale, bool emulate) {
  const Problem p = problem_of(qkv, heads, scale, "attention_forward: qkv");
  check_backend(emulate, "attention_forward");
  auto out = at::empty({p.B, p.N, p.H * p.D}, qkv.options());
  auto stats = at::empty({p.B, p.H, p.N}, qkv.options().dtype(at::kFloat));
  const BF* in = qkv.data_ptr<BF>();
  BF* o = out.data_ptr<BF>();
  float* st = stats.data_ptr<float>();
#if VITRAIN_AMX
  if (!emulate) {
    forward_all<AmxTiles>(p, in, o, st);
    return {out, stats};
  }
#endif
  forward_all<EmulatedTiles>(p, in, o, st);
  return {out, stats};
}

// The gradient at qkv of attention_forward, for grad_out (B, N, heads * head_dim) bf16 contiguous and
// the forward's stats.
at::Tensor attention_backward(const at::Tensor& grad_out, const at::Tensor& qkv, const at::Tensor& stats,
                              int64_t heads, double scale, bool emulate) {
  const Problem p = problem_of(qkv, heads, scale, "attention_backward: qkv");
  check_rows(grad_out, "attention_backward: grad_out");
  TORCH_CHECK(grad_out.dim() == 3 && grad_out.size(0) == p.B && grad_out.size(1) == p.N &&
                  grad_out.size(2) == p.H * p.D,
              "attention_backward: grad_out must be (B, N, heads * head_dim) = (", p.B, ", ", p.N, ", ", p.H * p.D,
              "), got ", grad_out.sizes());
  TORCH_CHECK(stats.device().is_cpu() && stats.scalar_type() == at::kFloat && stats.is_contiguous() &&
                  stats.sizes() == at::IntArrayRef({p.B, p.H, p.N}),
              "attention_backward: stats must be the forward's contiguous float32 (B, heads, N) = (", p.B, ", ", p.H,
              ", ", p.N, "), got ", stats.sizes());
  check_backend(emulate, "attention_backward");
  auto dqkv = at::empty_like(qkv);
  const BF *in = qkv.data_ptr<BF>(), *g = grad_out.data_ptr<BF>();
  const float* st = stats.data_ptr<float>();
  BF* d = dqkv.data_ptr<BF>();
#if VITRAIN_AMX
  if (!emulate) {
    backward_all<AmxTiles>(p, in, g, st, d);
    return dqkv;
  }
#endif
  backward_all<EmulatedTiles>(p, in, g, st, d);
  return dqkv;
}
