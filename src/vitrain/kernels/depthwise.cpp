// The locality FFNs' kernels on channels-last bf16 images: the depthwise 3x3 convolution's backward
// (stride 1, zero padding 1) and the concatenation with h-swish after it (depthwise_conv3x3_backward,
// cat_hardswish; called by the ops of vitrain/kernels/depthwise.py).
//
// oneDNN's bf16 depthwise backward took 19.8 ms a call for a (32, 1536, 14, 14) image in a locality
// ViT-S step, 4.4 times its forward (which stays oneDNN's: ours was slower). Here one work item is one
// image and up to 256 channels: its output gradient and its input are converted once into
// zero-bordered float32 tiles, (H + 2) x (W + 2) x channels, that stay in L2 while the nine taps sweep
// them without bounds checks; the weight and bias gradients accumulate in registers, one vector of
// channels at a time, and the input gradient is gathered (no scatter, so items never write the same
// element).

#include "common.h"
#include "kernels.h"

#include <algorithm>
#include <optional>
#include <vector>

using namespace vitrain_kernels;

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
