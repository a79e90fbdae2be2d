// Fused CPU kernels for bf16 training (vitrain.kernels builds this file with torch's JIT extension
// loader on first use, for the host's vector ISA; see vitrain/kernels/__init__.py).
//
// LayerNorm: PyTorch's bf16 CPU backward takes about three times as long as one pass over its
// operands needs, hands its row statistics over in bf16, and sums the weight and bias gradients with
// bf16 round-off (off by 7-12 % of the largest value over 8320 rows of 192). Here every row is
// normalized, and every gradient accumulated, in float32, with bf16 only at the edges.
//
// Depthwise 3x3 convolution backward (the locality FFNs): see its section below.
//
// Layout: activations are bf16; LayerNorm takes contiguous rows of width C (the normalized
// dimension), row statistics are float32; per-column sums are accumulated per thread in float32 and
// reduced at the end.

#include "common.h"

#include <algorithm>
#include <optional>
#include <cmath>
#include <vector>

using namespace vitrain_kernels;

namespace {

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

inline fVec load_param(const float* p, int64_t n) { return load_f32(p, n); }
inline fVec load_param(const BF* p, int64_t n) { return load_bf16(p, n); }

void check_param(const at::Tensor& t, int64_t columns, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == columns &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
              name, " must be a contiguous float32 or bf16 CPU tensor of ", columns, " elements");
}

// With `branch`, the rows normalized are x + branch, rounded to bf16 and written to `sum` first (a
// residual connection followed by a pre-norm, as the separate add would round it).
template <typename W>
void layer_norm_forward_rows(const BF* xp, const BF* branch, BF* sum, const W* wp, const W* bp, BF* yp, float* mp,
                             float* rp, int64_t R, int64_t C, float eps) {
  const float inv_c = 1.0f / static_cast<float>(C);
  at::parallel_for(0, R, 32, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF* row = xp + r * C;
      if (branch != nullptr) {
        for (int64_t c = 0; c < C; c += kF) {
          const int64_t n = std::min(kF, C - c);
          store_bf16(sum + r * C + c, load_bf16(row + c, n) + load_bf16(branch + r * C + c, n), n);
        }
        row = sum + r * C;
      }
      fVec acc(0.f);
      for (int64_t c = 0; c < C; c += kF) acc = acc + load_bf16(row + c, std::min(kF, C - c));
      const float m = horizontal_sum(acc) * inv_c;
      const fVec mv(m);
      fVec sq(0.f);
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        fVec d = load_bf16(row + c, n) - mv;
        if (n < kF) d = fVec::set(fVec(0.f), d, n);  // masked lanes load 0 and would add m^2 each
        sq = sq + d * d;
      }
      const float s = 1.0f / std::sqrt(horizontal_sum(sq) * inv_c + eps);
      mp[r] = m;
      rp[r] = s;
      const fVec sv(s);
      BF* out = yp + r * C;
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        const fVec xhat = (load_bf16(row + c, n) - mv) * sv;
        store_bf16(out + c, xhat * load_param(wp + c, n) + load_param(bp + c, n), n);
      }
    }
  });
}

// With `residual`, dx is the LayerNorm's input gradient plus `residual` (the gradient that reaches a
// residual connection's sum past the norm), each rounded as the separate backward and add round them:
// the same bits.
template <typename W>
void layer_norm_backward_rows(const BF* gp, const BF* xp, const float* mp, const float* rp, const W* wp,
                              const BF* residual, BF* dxp, ColumnSums& sums, int64_t R, int64_t C) {
  const float inv_c = 1.0f / static_cast<float>(C);
  at::parallel_for(0, R, 32, [&](int64_t begin, int64_t end) {
    float* dw = sums.block(0);
    float* db = sums.block(1);
    for (int64_t r = begin; r < end; ++r) {
      const BF *g = gp + r * C, *row = xp + r * C;
      const fVec mv(mp[r]), sv(rp[r]);
      fVec sum_gw(0.f), sum_gw_xhat(0.f);
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        const fVec gv = load_bf16(g + c, n), xhat = (load_bf16(row + c, n) - mv) * sv;
        const fVec gw = gv * load_param(wp + c, n);  // masked lanes: g = 0, so gw = 0
        sum_gw = sum_gw + gw;
        sum_gw_xhat = sum_gw_xhat + gw * xhat;
        store_f32(dw + c, load_f32(dw + c, n) + gv * xhat, n);
        store_f32(db + c, load_f32(db + c, n) + gv, n);
      }
      const fVec a(horizontal_sum(sum_gw) * inv_c), b(horizontal_sum(sum_gw_xhat) * inv_c);
      BF* out = dxp + r * C;
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        const fVec gv = load_bf16(g + c, n), xhat = (load_bf16(row + c, n) - mv) * sv;
        fVec dx = sv * (gv * load_param(wp + c, n) - a - xhat * b);
        if (residual != nullptr) dx = round_bf16(dx) + load_bf16(residual + r * C + c, n);
        store_bf16(out + c, dx, n);
      }
    }
  });
}

}  // namespace

// y = (x - mean) * rstd * weight + bias over the last dimension (weight and bias float32 or bf16).
// Returns y (bf16) and the row mean and 1/sqrt(var + eps) in float32, for the backward. Given a
// `branch` of x's shape, the rows normalized are s = x + branch (rounded to bf16), returned fourth:
// the residual connection and the pre-norm after it in one pass.
std::vector<at::Tensor> layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                           double eps, const c10::optional<at::Tensor>& branch) {
  check_rows(x, "layer_norm_forward: x");
  const int64_t C = x.size(-1), R = x.numel() / C;
  check_param(weight, C, "layer_norm_forward: weight");
  check_param(bias, C, "layer_norm_forward: bias");
  TORCH_CHECK(weight.scalar_type() == bias.scalar_type(), "layer_norm_forward: weight and bias differ in dtype");
  at::Tensor sum;
  if (branch.has_value()) {
    check_rows(*branch, "layer_norm_forward: branch");
    TORCH_CHECK(branch->sizes() == x.sizes(), "layer_norm_forward: branch and x differ in shape");
    sum = at::empty_like(x);
  }
  auto y = at::empty_like(x);
  auto stats_shape = x.sizes().vec();
  stats_shape.back() = 1;
  auto mean = at::empty(stats_shape, x.options().dtype(at::kFloat));
  auto rstd = at::empty(stats_shape, x.options().dtype(at::kFloat));
  const BF* xp = x.data_ptr<BF>();
  const BF* bp = branch.has_value() ? branch->data_ptr<BF>() : nullptr;
  BF* sp = branch.has_value() ? sum.data_ptr<BF>() : nullptr;
  BF* yp = y.data_ptr<BF>();
  float *mp = mean.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  if (weight.scalar_type() == at::kFloat) {
    layer_norm_forward_rows(xp, bp, sp, weight.data_ptr<float>(), bias.data_ptr<float>(), yp, mp, rp, R, C, eps);
  } else {
    layer_norm_forward_rows(xp, bp, sp, weight.data_ptr<BF>(), bias.data_ptr<BF>(), yp, mp, rp, R, C, eps);
  }
  return {y, mean, rstd, sum};
}

// Gradients of layer_norm_forward: dx (bf16) and the weight and bias gradients (weight's dtype),
// the latter summed in float32. Given `residual` (of x's shape), dx has it added: the gradient at a
// residual sum that feeds both the next residual and this norm.
std::vector<at::Tensor> layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& mean,
                                            const at::Tensor& rstd, const at::Tensor& weight,
                                            const c10::optional<at::Tensor>& residual) {
  check_rows(grad_out, "layer_norm_backward: grad_out");
  check_rows(x, "layer_norm_backward: x");
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "layer_norm_backward: grad_out and x differ in shape");
  const int64_t C = x.size(-1), R = x.numel() / C;
  check_param(weight, C, "layer_norm_backward: weight");
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat && mean.is_contiguous() &&
                  rstd.is_contiguous() && mean.numel() == R && rstd.numel() == R,
              "layer_norm_backward: mean and rstd must be contiguous float32 with one value per row "
              "(as layer_norm_forward returns them)");
  if (residual.has_value()) {
    check_rows(*residual, "layer_norm_backward: residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "layer_norm_backward: residual and x differ in shape");
  }
  auto dx = at::empty_like(x);
  ColumnSums sums(C, 2);
  const BF *gp = grad_out.data_ptr<BF>(), *xp = x.data_ptr<BF>();
  const BF* res = residual.has_value() ? residual->data_ptr<BF>() : nullptr;
  const float *mp = mean.data_ptr<float>(), *rp = rstd.data_ptr<float>();
  if (weight.scalar_type() == at::kFloat) {
    layer_norm_backward_rows(gp, xp, mp, rp, weight.data_ptr<float>(), res, dx.data_ptr<BF>(), sums, R, C);
  } else {
    layer_norm_backward_rows(gp, xp, mp, rp, weight.data_ptr<BF>(), res, dx.data_ptr<BF>(), sums, R, C);
  }
  return {dx, sums.reduce(0, weight.scalar_type()), sums.reduce(1, weight.scalar_type())};
}

// ---- Depthwise 3x3 convolution, stride 1, zero padding 1, on channels-last bf16 images ------------
//
// oneDNN's bf16 depthwise backward took 19.8 ms a call for a (32, 1536, 14, 14) image in a locality
// ViT-S step, 4.4 times its forward (which stays oneDNN's: ours was slower). Here one work item is one
// image and up to 256 channels: its output gradient and its input are converted once into
// zero-bordered float32 tiles, (H + 2) x (W + 2) x channels, that stay in L2 while the nine taps sweep
// them without bounds checks; the weight and bias gradients accumulate in registers, one vector of
// channels at a time, and the input gradient is gathered (no scatter, so items never write the same
// element).

namespace {

constexpr int64_t kDwChunk = 2 * kF;  // tiles hold whole chunks of channels (32 with AVX-512)

// h-swish(z) = z * relu6(z + 3) / 6 and its derivative as PyTorch's vectorized CPU kernel takes it:
// 0 up to -3, z / 3 + 1/2 strictly between -3 and 3, 1 from 3 on (the ends take the outer pieces).
inline fVec hardswish(const fVec& z) {
  return z * minimum(maximum(z + fVec(3.f), fVec(0.f)), fVec(6.f)) / fVec(6.f);
}

inline fVec hardswish_derivative(const fVec& z) {
  const fVec middle = fmadd(z, fVec(1.f / 3.f), fVec(0.5f));  // within an ulp of z / 3 + 1/2, no division
  return fVec::blendv(fVec::blendv(middle, fVec(0.f), z <= fVec(-3.f)), fVec(1.f), z >= fVec(3.f));
}

struct Image {  // a (B, C, H, W) tensor with channels-last strides inside each image
  const BF* data;
  int64_t batch_stride, H, W, C;
  const BF* at(int64_t b, int64_t h, int64_t w) const { return data + b * batch_stride + (h * W + w) * C; }
};

Image channels_last_image(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name,
              " must be a 4-d bf16 CPU tensor");
  const int64_t C = t.size(1), H = t.size(2), W = t.size(3);
  TORCH_CHECK(t.stride(1) == 1 && (W == 1 || t.stride(3) == C) && (H == 1 || t.stride(2) == W * C), name,
              " must be channels_last within each image (strides (*, 1, W*C, C)); got ", t.strides());
  return {t.data_ptr<BF>(), t.stride(0), H, W, C};
}

// weight (C, 1, 3, 3) as float, tap-major: taps[k * C + c] with k = 3 * (dh + 1) + (dw + 1)
std::vector<float> taps_of(const at::Tensor& weight, int64_t C) {
  TORCH_CHECK(weight.numel() == 9 * C && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "depthwise_conv3x3: weight must be a contiguous (", C, ", 1, 3, 3) float32 or bf16 tensor");
  auto w = weight.to(at::kFloat).reshape({C, 9});
  std::vector<float> taps(9 * C);
  const float* wp = w.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c)
    for (int64_t k = 0; k < 9; ++k) taps[k * C + c] = wp[c * 9 + k];
  return taps;
}

// A work item: image b, channels [c, c + n) in whole chunks of kDwChunk, as float32 in a zero-bordered
// tile of (H + 2) x (W + 2) pixels of `width` floats (lanes past n are zero). The pixels are read in
// order, `n` contiguous bf16 each: whole cache lines the hardware prefetcher follows (a tile per
// 32-channel chunk read one line per pixel, 3 KiB apart, and stalled on every load).
// A tile reads n channels of each pixel, and the next pixel's lie C channels on (3 KiB for 1536): the
// hardware prefetchers do not follow that, so the fill asks for pixels 8 ahead itself, into L2.
// 32 x 1536 x 14 x 14 with the h-swish: 17.5 ms without, 14.8 with (medians of 12, alternating with
// distances 4-16 and L1/L2/L3 hints, all within 0.5 ms of each other); on another host of the kind, 64 MB
// flushed before each call: 10.9-13.3 ms without, 8.8-9.4 with.
constexpr int64_t kPrefetchPixels = 8;

inline void prefetch(const BF* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < n * static_cast<int64_t>(sizeof(BF)); offset += 64) {
    __builtin_prefetch(bytes + offset, 0, 2);
  }
}

// Floats from one pixel's `width` lanes to the next pixel's. A power of two (1 KiB at 256 channels) put
// one vector's lane of all pixels into 4 of L1's 64 sets, and the loops that sweep the pixels for one
// vector of channels ran 3-6 times slower than their instructions: one vector of padding spreads them.
inline int64_t padded_stride(int64_t width) { return width + kDwChunk / 2; }

struct Tile {
  int64_t H, W, width, stride;  // lanes a pixel, and floats from one pixel to the next
  std::vector<float> data;
  float* pixel(int64_t h, int64_t w) { return data.data() + ((h + 1) * (W + 2) + (w + 1)) * stride; }
  // With `act` (the h-swish's input, same shape): the gradient is taken through the h-swish first.
  void fill(const Image& img, int64_t b, int64_t c, int64_t n, const Image* act = nullptr) {
    H = img.H;
    W = img.W;
    width = (n + kDwChunk - 1) / kDwChunk * kDwChunk;
    stride = padded_stride(width);
    data.resize((H + 2) * (W + 2) * stride);
    const int64_t row = (W + 2) * stride;  // only the border is zeroed: the pixels are all written below
    std::fill(data.begin(), data.begin() + row, 0.f);
    std::fill(data.end() - row, data.end(), 0.f);
    for (int64_t h = 0; h < H; ++h) {
      std::fill_n(pixel(h, -1), width, 0.f);
      std::fill_n(pixel(h, W), width, 0.f);
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t w = 0; w < W; ++w) {
        const BF* src = img.at(b, h, w) + c;
        const BF* z = act != nullptr ? act->at(b, h, w) + c : nullptr;
        const int64_t ahead = h * W + w + kPrefetchPixels;
        if (ahead < H * W) {
          prefetch(img.at(b, ahead / W, ahead % W) + c, n);
          if (act != nullptr) prefetch(act->at(b, ahead / W, ahead % W) + c, n);
        }
        float* dst = pixel(h, w);
        for (int64_t j = 0; j < width; j += kF) {  // lanes past n are zero
          const int64_t m = std::clamp<int64_t>(n - j, 0, kF);
          fVec v = m > 0 ? load_bf16(src + j, m) : fVec(0.f);
          if (z != nullptr && m > 0) v = v * hardswish_derivative(load_bf16(z + j, m));
          v.store(dst + j);
        }
      }
    }
  }
};

// Items of up to ~256 KiB of tile: 8 chunks (256 channels) at 14 x 14.
int64_t channels_per_item(int64_t H, int64_t W, int64_t C) {
  const int64_t chunk_bytes = (H + 2) * (W + 2) * kDwChunk * static_cast<int64_t>(sizeof(float));
  const int64_t chunks = std::max<int64_t>(1, (256 << 10) / chunk_bytes);
  return std::min(C, chunks * kDwChunk);
}

// The input gradient of image b, channels [c, c + n), from the output gradient's tile: the
// transposed convolution, dx(h, w) = sum over taps k of weight(8 - k) * grad(h + dh, w + dw). One
// vector of channels at a time, as the weight gradient: its nine taps stay in registers and its column
// of the tile (a line a pixel) in L1. The item's dx is staged in float32 (`staged`, H * W x n) and
// written a pixel at a time, whole lines: written a vector at a time, 32 bytes into lines 3 KiB apart,
// every store missed (the input gradient was 40 % of the kernel).
void input_gradient(Tile& grad_tile, const float* taps, int64_t C, int64_t c, int64_t n, BF* dx_image,
                    float* sums, std::vector<float>& staged) {
  const int64_t H = grad_tile.H, W = grad_tile.W, row = (W + 2) * grad_tile.stride;
  int64_t offsets[9];
  for (int64_t k = 0; k < 9; ++k) offsets[k] = (k / 3 - 1) * row + (k % 3 - 1) * grad_tile.stride;
  const int64_t width = grad_tile.stride;  // staged pixels padded alike
  staged.resize(H * W * width);
  for (int64_t j = 0; j < n; j += kF) {
    const int64_t m = std::min(kF, n - j);
    fVec tap[9], sum(0.f);
    for (int64_t k = 0; k < 9; ++k) tap[k] = load_f32(taps + (8 - k) * C + c + j, m);
    for (int64_t p = 0; p < H * W; ++p) {
      const float* centre = grad_tile.pixel(p / W, p % W) + j;
      fVec acc(0.f);
      for (int64_t k = 0; k < 9; ++k) acc = fmadd(fVec::loadu(centre + offsets[k]), tap[k], acc);
      acc.store(staged.data() + p * width + j);
      sum = sum + acc;
    }
    if (sums != nullptr) store_f32(sums + c + j, load_f32(sums + c + j, m) + sum, m);
  }
  for (int64_t p = 0; p < H * W; ++p) {
    for (int64_t j = 0; j < n; j += kF) {
      store_bf16(dx_image + p * C + c + j, fVec::loadu(staged.data() + p * width + j), std::min(kF, n - j));
    }
  }
}

at::Tensor empty_channels_last(int64_t B, int64_t C, int64_t H, int64_t W) {
  return at::empty({B, C, H, W}, at::TensorOptions().dtype(at::kBFloat16).memory_format(at::MemoryFormat::ChannelsLast));
}

}  // namespace

// Gradients of a depthwise 3x3 convolution (groups = channels, stride 1, zero padding 1; the forward
// is oneDNN's): x and grad_out (B, C, H, W) bf16, channels-last within each image (the batch stride is
// free: a view that skips CLS rows works), weight (C, 1, 3, 3) float32 or bf16. Returns
// dx (channels_last bf16; undefined unless need_input_grad),
// dweight ((C, 1, 3, 3), weight's dtype) and dbias (weight's dtype; undefined unless has_bias), the
// latter two summed in float32, and the float32 sums of dx over batch and pixels (undefined unless
// dx_sums).
//
// act_input (optional; the convolution's output, grad_out's shape): grad_out is the gradient of
// h-swish(output), taken through the h-swish on the way into the tile. dx_out (optional; x's shape,
// channels-last within each image, any batch stride): where dx is written, e.g. the patch rows of a
// (B, 1 + H*W, C) token gradient whose CLS rows the caller fills.
std::vector<at::Tensor> depthwise_conv3x3_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                   const at::Tensor& weight, bool has_bias, bool need_input_grad,
                                                   const std::optional<at::Tensor>& act_input,
                                                   const std::optional<at::Tensor>& dx_out, bool dx_sums) {
  const Image in = channels_last_image(x, "depthwise_conv3x3_backward: x");
  const Image g = channels_last_image(grad_out, "depthwise_conv3x3_backward: grad_out");
  TORCH_CHECK(grad_out.sizes() == x.sizes(), "depthwise_conv3x3_backward: grad_out and x differ in shape");
  const int64_t B = x.size(0), C = in.C, H = in.H, W = in.W;
  Image act{};
  if (act_input.has_value()) {
    act = channels_last_image(*act_input, "depthwise_conv3x3_backward: act_input");
    TORCH_CHECK(act_input->sizes() == x.sizes(), "depthwise_conv3x3_backward: act_input and x differ in shape");
  }
  const std::vector<float> taps = taps_of(weight, C);
  at::Tensor dx;
  if (need_input_grad) {
    dx = dx_out.has_value() ? *dx_out : empty_channels_last(B, C, H, W);
    channels_last_image(dx, "depthwise_conv3x3_backward: dx_out");
    TORCH_CHECK(dx.sizes() == x.sizes(), "depthwise_conv3x3_backward: dx_out and x differ in shape");
  }
  BF* dxp = need_input_grad ? dx.data_ptr<BF>() : nullptr;
  const int64_t dx_batch_stride = need_input_grad ? dx.stride(0) : 0;
  ColumnSums sums(C, 10);  // nine taps, then the bias
  ColumnSums input_sums(dx_sums && need_input_grad ? C : 0, 1);
  const int64_t per_item = channels_per_item(H, W, C), groups = (C + per_item - 1) / per_item;
  at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
    Tile x_tile, g_tile;
    std::vector<float> staged;
    float* dx_acc = dx_sums && need_input_grad ? input_sums.block(0) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / groups, c0 = (item % groups) * per_item, n_item = std::min(per_item, C - c0);
      g_tile.fill(g, b, c0, n_item, act_input.has_value() ? &act : nullptr);
      if (need_input_grad) input_gradient(g_tile, taps.data(), C, c0, n_item, dxp + b * dx_batch_stride, dx_acc, staged);
      x_tile.fill(in, b, c0, n_item);
      const int64_t row = (W + 2) * x_tile.stride;
      for (int64_t j = 0; j < n_item; j += kF) {  // one vector of channels at a time, sums in registers
        const int64_t m = std::min(kF, n_item - j);
        fVec dw[9], db(0.f);
        for (int64_t k = 0; k < 9; ++k) dw[k] = fVec(0.f);
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t w = 0; w < W; ++w) {
            const fVec gv = fVec::loadu(g_tile.pixel(h, w) + j);
            const float* centre = x_tile.pixel(h, w) + j;
            db = db + gv;
            for (int64_t k = 0; k < 9; ++k) {  // the zero border stands in for the padding
              dw[k] = fmadd(gv, fVec::loadu(centre + (k / 3 - 1) * row + (k % 3 - 1) * x_tile.stride), dw[k]);
            }
          }
        }
        for (int64_t k = 0; k <= 9; ++k) {
          float* acc = sums.block(k) + c0 + j;
          store_f32(acc, load_f32(acc, m) + (k < 9 ? dw[k] : db), m);
        }
      }
    }
  });
  auto dweight = at::empty({C, 1, 3, 3}, at::TensorOptions().dtype(at::kFloat));
  float* dwp = dweight.data_ptr<float>();
  for (int64_t k = 0; k < 9; ++k) {  // tap-major sums back to the weight's (C, 1, 3, 3) layout
    const at::Tensor tap = sums.reduce(k, at::kFloat);
    const float* tp = tap.data_ptr<float>();
    for (int64_t c = 0; c < C; ++c) dwp[c * 9 + k] = tp[c];
  }
  return {dx, dweight.to(weight.scalar_type()), has_bias ? sums.reduce(9, weight.scalar_type()) : at::Tensor(),
          dx_sums && need_input_grad ? input_sums.reduce(0, at::kFloat) : at::Tensor()};
}

// The locality FFN's activation: tokens u (B, N, C) bf16 contiguous, of which the first `prefix` rows
// of each image bypass the convolution, and the convolution's output over the rest, conv_out (B, C,
// H, W) channels-last with H * W = N - prefix. Returns h-swish(cat(u prefix rows, conv_out tokens)),
// (B, N, C) bf16: the concatenation and the activation in one pass.
at::Tensor cat_hardswish(const at::Tensor& u, const at::Tensor& conv_out, int64_t prefix) {
  check_rows(u, "cat_hardswish: u");
  TORCH_CHECK(u.dim() == 3, "cat_hardswish: u must be (B, N, C)");
  const Image conv = channels_last_image(conv_out, "cat_hardswish: conv_out");
  const int64_t B = u.size(0), N = u.size(1), C = u.size(2);
  TORCH_CHECK(conv_out.size(0) == B && conv.C == C && prefix >= 0 && conv.H * conv.W + prefix == N,
              "cat_hardswish: conv_out must be (B, C, H, W) with H * W = N - prefix; got ", conv_out.sizes(),
              " for u ", u.sizes(), " and prefix ", prefix);
  auto a = at::empty_like(u);
  const BF* up = u.data_ptr<BF>();
  BF* ap = a.data_ptr<BF>();
  at::parallel_for(0, B * N, std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / N, t = r % N;
      const BF* src = t < prefix ? up + r * C : conv.at(b, (t - prefix) / conv.W, (t - prefix) % conv.W);
      for (int64_t c = 0; c < C; c += kF) {
        const int64_t n = std::min(kF, C - c);
        store_bf16(ap + r * C + c, hardswish(load_bf16(src + c, n)), n);
      }
    }
  });
  return a;
}

// ---- Feature-major copies for weight gradients ---------------------------------------------------
//
// A linear layer's weight gradient is g^T x over all tokens. oneDNN's AMX matmul runs that product
// at about half speed when its left operand is a transposed view (6.8 against 3.5 ms for 6304 tokens,
// 384 x 1536), and PyTorch's transposing copy is slower still for wide rows (2.2 ns an element). This
// copies g (M rows of N) into its feature-major (N, M) layout in 32 x 32 blocks (one cache line of
// each output row per block), and sums its columns (the bias gradient) in float32 on the way.

// g (M, N) bf16 contiguous -> (gT (N, M) bf16 contiguous, column sums of g (N) float32, undefined
// unless column_sums).
std::vector<at::Tensor> transpose_rows(const at::Tensor& g, bool column_sums) {
  check_rows(g, "transpose_rows: g");
  TORCH_CHECK(g.dim() == 2, "transpose_rows: g must be 2-d, got ", g.dim(), " dimensions");
  const int64_t M = g.size(0), N = g.size(1);
  auto out = at::empty({N, M}, g.options());
  constexpr int64_t kBlock = 32, kRows = 256;  // 32 x 32 transposes; 512 contiguous bytes per output row
  ColumnSums sums(column_sums ? N : 0, 1);
  const BF* src = g.data_ptr<BF>();
  BF* dst = out.data_ptr<BF>();
  at::parallel_for(0, (M + kRows - 1) / kRows, 1, [&](int64_t begin, int64_t end) {
    float* acc = column_sums ? sums.block(0) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = item * kRows, last = std::min(M, first + kRows);
      for (int64_t c0 = 0; c0 < N; c0 += kBlock) {
        const int cols = static_cast<int>(std::min(kBlock, N - c0));
        for (int64_t r0 = first; r0 < last; r0 += kBlock) {
          const int rows = static_cast<int>(std::min(kBlock, last - r0));
          at::vec::transpose_mxn<BF>(src + r0 * N + c0, N, dst + c0 * M + r0, M, rows, cols);
        }
      }
      if (acc != nullptr) add_rows(src + first * N, last - first, N, acc);
    }
  });
  return {out, column_sums ? sums.reduce(0, at::kFloat) : at::Tensor()};
}

// Column sums of a contiguous bf16 matrix (M, N) in float32: the bias gradient of a layer whose
// output gradient is not copied (an expanding layer copies its input instead).
at::Tensor column_sums(const at::Tensor& g) {
  check_rows(g, "column_sums: g");
  TORCH_CHECK(g.dim() == 2, "column_sums: g must be 2-d, got ", g.dim(), " dimensions");
  const int64_t M = g.size(0), N = g.size(1);
  ColumnSums sums(N, 1);
  const BF* src = g.data_ptr<BF>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [&](int64_t begin, int64_t end) {
    add_rows(src + begin * N, end - begin, N, sums.block(0));
  });
  return sums.reduce(0, at::kFloat);
}

// ---- GELU forward and backward by table ---------------------------------------------------------
//
// A bf16 activation has 65536 possible values, so the exact (erf) GELU and its derivative are two
// tables of 65536 floats (256 KiB each, L2-resident), computed once in double precision: the forward
// is a gather, the backward a gather and a multiply. PyTorch's bf16 kernels evaluate erf and two
// exponentials per element (its backward took 2.3 ms for 8320 x 768, this 1.0 ms), and round each
// result once from float; these round once from the double-precision value. NaN stays NaN, and the
// infinities map to GELU's limits (0 and x; derivatives 0 and 1). The tables are in common.h.

// The exact GELU of a contiguous bf16 tensor.
at::Tensor gelu_forward(const at::Tensor& h) {
  check_rows(h, "gelu_forward: h");
  const float* table = gelu_tables().value.data();
  auto y = at::empty_like(h);
  const BF* hp = h.data_ptr<BF>();
  BF* out = y.data_ptr<BF>();
  at::parallel_for(0, h.numel(), 16384, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += kF) {
      const int64_t n = std::min(kF, end - i);
      store_bf16(out + i, gather(table, hp + i, n), n);
    }
  });
  return y;
}

// grad_out and h (the GELU's input) bf16, contiguous, of one shape -> the gradient at h (bf16) and,
// if column_sums, its sums over all but the last dimension in float32 (the bias gradient of the
// linear layer that produced h; undefined otherwise).
std::vector<at::Tensor> gelu_backward(const at::Tensor& grad_out, const at::Tensor& h, bool column_sums) {
  check_rows(grad_out, "gelu_backward: grad_out");
  check_rows(h, "gelu_backward: h");
  TORCH_CHECK(grad_out.sizes() == h.sizes(), "gelu_backward: grad_out and h differ in shape");
  auto dh = at::empty_like(h);
  const int64_t C = h.dim() > 0 ? h.size(-1) : 1, R = C > 0 ? h.numel() / C : 0;
  ColumnSums sums(column_sums ? C : 0, 1);
  const BF *gp = grad_out.data_ptr<BF>(), *hp = h.data_ptr<BF>();
  BF* out = dh.data_ptr<BF>();
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1)), [&](int64_t begin, int64_t end) {
    gelu_backward_rows(gp + begin * C, hp + begin * C, end - begin, C, out + begin * C,
                       column_sums ? sums.block(0) : nullptr);
  });
  return {dh, column_sums ? sums.reduce(0, at::kFloat) : at::Tensor()};
}

namespace vitrain_kernels {
bool amx_available();  // attention.cpp
}  // namespace vitrain_kernels

// attention.cpp
std::vector<at::Tensor> attention_forward(const at::Tensor& qkv, int64_t heads, double scale, bool emulate);
at::Tensor attention_backward(const at::Tensor& grad_out, const at::Tensor& qkv, const at::Tensor& stats,
                              int64_t heads, double scale, bool emulate);

// weight_gradient.cpp
std::vector<at::Tensor> weight_gradient(const at::Tensor& g, const at::Tensor& x, bool bias, int64_t chunk,
                                        bool emulate, const c10::optional<at::Tensor>& gelu_input);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("layer_norm_forward", &layer_norm_forward, "LayerNorm over the last dimension, bf16 in and out",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"), py::arg("branch") = py::none());
  m.def("layer_norm_backward", &layer_norm_backward, "LayerNorm backward with float32 accumulation",
        py::arg("grad_out"), py::arg("x"), py::arg("mean"), py::arg("rstd"), py::arg("weight"),
        py::arg("residual") = py::none());
  m.def("column_sums", &column_sums, "column sums of a bf16 matrix in float32");
  m.def("transpose_rows", &transpose_rows, "feature-major copy of a bf16 matrix and its column sums");
  m.def("gelu_forward", &gelu_forward, "the exact GELU of bf16 values, by table");
  m.def("gelu_backward", &gelu_backward, "the exact GELU's backward for bf16 values, by table");
  m.def("depthwise_conv3x3_backward", &depthwise_conv3x3_backward, "its input, weight and bias gradients");
  m.def("cat_hardswish", &cat_hardswish, "the locality FFN's concatenation and h-swish in one pass");
  m.def("amx_available", &vitrain_kernels::amx_available, "whether the AMX tile kernels can run here");
  m.def("attention_forward", &attention_forward, "softmax(scale q k^T) v per image and head, from fused qkv");
  m.def("weight_gradient", &weight_gradient, "a linear layer's weight and bias gradients from token-major g and x",
        py::arg("g"), py::arg("x"), py::arg("bias"), py::arg("chunk") = 0, py::arg("emulate") = false,
        py::arg("gelu_input") = py::none());
  m.def("attention_backward", &attention_backward, "the gradient at qkv of attention_forward");
}
