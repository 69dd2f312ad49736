// W8A8 INT8 GEMM for x86 CPUs with AVX2 but no VNNI, on a weight packed once per sync.
//
// Why: without VNNI, oneDNN's int8 GEMM packs the weight on every call and its int8 GEMV path
// needs AVX-512, so at decode batch sizes an INT8 linear is slower than BF16 (bench/INT8_BATCH1.md).
//
// Exactness: vpmaddubsw multiplies u8 x s8 and adds each pair into a saturating int16. With
// |a| (as u8, <= 128) against sign(a) * w (|w| <= 127) every product is <= 128 * 127 = 16256 and
// every pair <= 32512 < 32767, so nothing saturates and the int32 accumulators equal the exact
// integer dot product of the W8A8 codes (weight codes must lie in [-127, 127]; activation codes
// may use all of [-128, 127]). The float epilogue is acc * a_scale[m] * w_scale[n] (+ bias[n]).
//
// Packed weight layout: [ceil(N / 4), ceil(K / 32), 4, 32] int8, zero padded, so that one block
// of 4 output rows streams through memory contiguously.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kRows = 4;    // weight rows per packed block
constexpr int64_t kChunk = 32;  // int8 lanes per AVX2 register

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// acc[i][j] = sum_k a[i, k] * w[j, k] for MR activation rows and the 4 rows of one packed block.
template <int MR>
inline void dot_block(const int8_t* a, int64_t lda, const int8_t* block, int64_t k, int32_t (*acc)[kRows]) {
  const int64_t chunks = k / kChunk;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sum[MR][kRows];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kRows; ++j) sum[i][j] = _mm256_setzero_si256();
  for (int64_t c = 0; c < chunks; ++c) {
    const int8_t* wc = block + c * kRows * kChunk;
    for (int i = 0; i < MR; ++i) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i * lda + c * kChunk));
      const __m256i ux = _mm256_sign_epi8(x, x);  // |x| read as u8: -128 -> 128
      for (int j = 0; j < kRows; ++j) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + j * kChunk));
        const __m256i pairs = _mm256_maddubs_epi16(ux, _mm256_sign_epi8(w, x));
        sum[i][j] = _mm256_add_epi32(sum[i][j], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kRows; ++j) acc[i][j] = hsum_epi32(sum[i][j]);
  // K tail (K not a multiple of 32): the packed block is zero padded, so read it at the tail chunk.
  const int8_t* tail = block + chunks * kRows * kChunk;
  for (int64_t kk = chunks * kChunk; kk < k; ++kk)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < kRows; ++j)
        acc[i][j] += int32_t(a[i * lda + kk]) * int32_t(tail[j * kChunk + (kk - chunks * kChunk)]);
}

template <typename out_t, int MR>
inline void store_tile(const int32_t (*acc)[kRows], int64_t m0, int64_t n0, int64_t n, const float* a_scale,
                       const float* w_scale, const float* bias, out_t* out) {
  for (int i = 0; i < MR; ++i) {
    const float sa = a_scale[m0 + i];
    for (int j = 0; j < kRows && n0 + j < n; ++j) {
      float y = float(acc[i][j]) * sa * w_scale[n0 + j];
      if (bias) y += bias[n0 + j];
      out[(m0 + i) * n + n0 + j] = static_cast<out_t>(y);
    }
  }
}

template <typename out_t>
void gemm(const int8_t* a, const float* a_scale, const int8_t* packed, const float* w_scale, const float* bias,
          int64_t m, int64_t n, int64_t k, out_t* out) {
  const int64_t blocks = (n + kRows - 1) / kRows;
  const int64_t block_bytes = ((k + kChunk - 1) / kChunk) * kRows * kChunk;
  // ~64 KiB of weight per task keeps the threads' shares even at decode sizes.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(block_bytes, 1));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    int32_t acc[3][kRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int8_t* block = packed + b * block_bytes;
      int64_t i = 0;
      for (; i + 3 <= m; i += 3) {
        dot_block<3>(a + i * k, k, block, k, acc);
        store_tile<out_t, 3>(acc, i, b * kRows, n, a_scale, w_scale, bias, out);
      }
      for (; i < m; ++i) {
        dot_block<1>(a + i * k, k, block, k, acc);
        store_tile<out_t, 1>(acc, i, b * kRows, n, a_scale, w_scale, bias, out);
      }
    }
  });
}

at::Tensor int8_gemm(const at::Tensor& a_codes, const at::Tensor& a_scale, const at::Tensor& packed,
                     const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias, int64_t n,
                     at::ScalarType out_dtype) {
  TORCH_CHECK(a_codes.dim() == 2 && a_codes.scalar_type() == at::kChar && a_codes.is_contiguous(),
              "a_codes must be a contiguous int8 [M, K] tensor");
  const int64_t m = a_codes.size(0), k = a_codes.size(1);
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const int64_t blocks = (n + kRows - 1) / kRows;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.numel() == blocks * chunks * kRows * kChunk,
              "packed weight does not match N=", n, ", K=", k);
  TORCH_CHECK(a_scale.scalar_type() == at::kFloat && a_scale.is_contiguous() && a_scale.numel() == m,
              "a_scale must be float32 with one value per row");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == n,
              "w_scale must be float32 with one value per output channel");
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias must have N values");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bias_p = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({m, n}, a_codes.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  const auto* ap = a_codes.data_ptr<int8_t>();
  const auto* wp = packed.data_ptr<int8_t>();
  const auto* sa = a_scale.data_ptr<float>();
  const auto* sw = w_scale.data_ptr<float>();
  switch (out_dtype) {
    case at::kFloat: gemm<float>(ap, sa, wp, sw, bias_p, m, n, k, out.data_ptr<float>()); break;
    case at::kBFloat16: gemm<at::BFloat16>(ap, sa, wp, sw, bias_p, m, n, k, out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: gemm<at::Half>(ap, sa, wp, sw, bias_p, m, n, k, out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "unsupported output dtype ", out_dtype);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(qurl_cpu, m) {
  m.def("int8_gemm_avx2(Tensor a_codes, Tensor a_scale, Tensor packed, Tensor w_scale, Tensor? bias, int n, "
        "ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(qurl_cpu, CPU, m) { m.impl("int8_gemm_avx2", &int8_gemm); }
