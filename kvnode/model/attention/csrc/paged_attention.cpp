// CPU paged attention: reads K/V blocks in place through the block table.
//
// Cache layout per layer: [num_blocks, block_size, num_kv_heads, head_size], dtype fp32,
// fp16, bf16, fp8 e4m3fn or fp8 e5m2. Compute is fp32 throughout; narrow caches are
// converted row by row as a block is reached.
//
// Work is split into items: (sequence, kv heads, tile of up to 16 new tokens, context
// partition). An item walks its context range block by block with an online softmax
// (running max and sum), so no gathered copy of the context is ever made. All query heads
// that share a kv head are processed together, so each K/V row is loaded once per group;
// when there are enough items, one item also takes several kv heads, so a block's rows
// (contiguous across kv heads) are read in one visit. When there are too few items to keep
// every thread busy (small decode batches) the context is split into partitions
// (flash-decoding) and a second pass merges the partial results. Items are scheduled
// dynamically, longest first.
//
// Scores are kept in the log2 domain (scale * k_scale * log2(e) is folded into the query),
// so the softmax needs only 2^x, computed with a branch-free polynomial. Two code paths:
// the portable one is plain loops the compiler vectorises; the AVX-512 one (compiled when
// the build targets AVX-512) handles 4 query rows per K/V row load and reduces 16 dot
// products at once. Blocks sit anywhere in the pool, so each block prefetches the next.

#include <torch/extension.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <omp.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// New tokens of one sequence handled by one work item (prefill chunks): large enough that a
// K/V block is reused across many query rows, small enough to give several items.
constexpr int32_t kQueryTile = 16;
// A context partition is never shorter than this, so the merge pass stays cheap.
constexpr int32_t kMinSplitTokens = 256;

// 2^x for x <= 0, relative error ~1e-7. Branch free so that loops over it vectorise; inputs
// below -126 are clamped (their weight is < 2^-126 of the running maximum's).
inline float exp2_neg(float x) {
  x = std::max(x, -126.0f);
  // Adding 1.5 * 2^23 rounds x to the nearest integer and leaves it in the low mantissa bits.
  constexpr float kShifter = 12582912.0f;
  const float t = x + kShifter;
  const float n = t - kShifter;
  const float f = x - n;  // in [-0.5, 0.5]
  // Taylor series of 2^f = e^(f ln2) to degree 7: error < 5e-9 on [-0.5, 0.5].
  float p = 1.5252733804059840e-05f;
  p = p * f + 1.5403530393381608e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  int32_t ti;
  std::memcpy(&ti, &t, sizeof(ti));
  const int32_t e = (ti - 0x4B400000 + 127) << 23;  // 2^n as float bits
  float s;
  std::memcpy(&s, &e, sizeof(s));
  return p * s;
}

// ---------------------------------------------------------------------------------------
// Converting cache rows to fp32. Scales are not applied here: k_scale is folded into the
// query and v_scale into the final normalisation.

template <typename T>
struct RowLoader;

template <>
struct RowLoader<c10::Half> {
  void operator()(const c10::Half* src, float* dst, int64_t n) const {
    int64_t i = 0;
#if defined(__AVX512F__) || defined(__F16C__)
    const auto* s = reinterpret_cast<const uint16_t*>(src);
#endif
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
    }
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
};

template <>
struct RowLoader<c10::BFloat16> {
  void operator()(const c10::BFloat16* src, float* dst, int64_t n) const {
    // bf16 is the top half of an fp32: a shift, which vectorises.
    const auto* s = reinterpret_cast<const uint16_t*>(src);
    auto* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
  }
};

// fp8 goes through fp16, whose hardware conversion the Half loader uses. e5m2 is the top
// byte of an fp16, so that step is exact. e4m3fn's sign and 7 magnitude bits placed at fp16
// bit 15 and bits 13..7 give exactly value / 256 for every finite value, subnormals
// included (same mantissa, exponent bias 15 instead of 7); e4m3fn has no infinities and
// its NaN (magnitude 0x7F) is restored explicitly.
template <bool kE4M3>
inline void fp8_to_float(const uint8_t* src, float* dst, int64_t n) {
  constexpr int64_t kChunk = 256;
  alignas(64) uint16_t h[kChunk];
  const RowLoader<c10::Half> half;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t m = std::min(kChunk, n - c0);
    const uint8_t* s = src + c0;
    float* d = dst + c0;
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t b = s[i];
      h[i] = kE4M3 ? static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7))
                   : static_cast<uint16_t>(b << 8);
    }
    half(reinterpret_cast<const c10::Half*>(h), d, m);
    if constexpr (kE4M3) {
      constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) d[i] = (s[i] & 0x7Fu) == 0x7Fu ? kNaN : d[i] * 256.0f;
    }
  }
}

template <>
struct RowLoader<c10::Float8_e4m3fn> {
  void operator()(const c10::Float8_e4m3fn* src, float* dst, int64_t n) const {
    fp8_to_float<true>(reinterpret_cast<const uint8_t*>(src), dst, n);
  }
};

template <>
struct RowLoader<c10::Float8_e5m2> {
  void operator()(const c10::Float8_e5m2* src, float* dst, int64_t n) const {
    fp8_to_float<false>(reinterpret_cast<const uint8_t*>(src), dst, n);
  }
};

template <>
struct RowLoader<float> {};  // fp32 rows are read in place, never converted

// ---------------------------------------------------------------------------------------

struct Problem {
  const float* q;
  int64_t q_stride_tok, q_stride_head;
  const void* k_cache;
  const void* v_cache;
  int64_t k_stride_blk, k_stride_pos, k_stride_head;
  int64_t v_stride_blk, v_stride_pos, v_stride_head;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  float* out;        // [num_tokens, num_heads, head_size], contiguous
  float* part_acc;   // [num_tokens, num_heads, num_splits, head_size] when num_splits > 1
  float* part_ml;    // [num_tokens, num_heads, num_splits, 2] (max, sum)
  int64_t num_heads, group, head_size, block_size, num_splits;
  float qk_scale;    // scale * k_scale * log2(e)
  float v_scale;
};

// New tokens [tok0, tok0 + ntok) of sequence seq, kv heads [kv_head, kv_head + num_kv),
// context positions [ctx_begin, ctx_end) (partition part of num_splits).
struct WorkItem {
  int32_t seq, kv_head, num_kv, tok0, ntok, part, ctx_begin, ctx_end;
  int64_t cost;
};

// Per-thread buffers, sized once per call.
struct Scratch {
  std::vector<float> q, acc, m, l, s, k, v;
  Scratch(int64_t rows, int64_t head_size, int64_t block_size)
      : q(rows * head_size), acc(rows * head_size), m(rows), l(rows),
        s(4 * ((block_size + 15) / 16 * 16)),
        k(block_size * head_size), v(block_size * head_size) {}
};

// One query row against n consecutive positions of a block: scores, online softmax update,
// weighted sum of V. DC is the head size when known at compile time (0: runtime D).
template <int DC>
inline void row_update(const float* __restrict q, const float* __restrict krows,
                       int64_t k_stride, const float* __restrict vrows, int64_t v_stride,
                       int64_t n, int64_t head_size, float* __restrict acc, float& m, float& l,
                       float* __restrict s) {
  const int64_t D = DC > 0 ? DC : head_size;
  float mx = kNegInf;
  for (int64_t i = 0; i < n; ++i) {
    const float* __restrict k = krows + i * k_stride;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += q[d] * k[d];
    s[i] = dot;
    mx = std::max(mx, dot);
  }
  const float m_new = std::max(m, mx);
  const float alpha = m == kNegInf ? 0.0f : exp2_neg(m - m_new);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float p = exp2_neg(s[i] - m_new);
    s[i] = p;
    sum += p;
  }
  l = l * alpha + sum;
  m = m_new;
  if constexpr (DC > 0) {
    // Accumulator in a local array so it stays in registers across the positions.
    float a[DC];
#pragma omp simd
    for (int64_t d = 0; d < DC; ++d) a[d] = acc[d] * alpha;
    for (int64_t i = 0; i < n; ++i) {
      const float p = s[i];
      const float* __restrict v = vrows + i * v_stride;
#pragma omp simd
      for (int64_t d = 0; d < DC; ++d) a[d] += p * v[d];
    }
#pragma omp simd
    for (int64_t d = 0; d < DC; ++d) acc[d] = a[d];
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
    for (int64_t i = 0; i < n; ++i) {
      const float p = s[i];
      const float* __restrict v = vrows + i * v_stride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
    }
  }
}

#if defined(__AVX512F__)
#define PAGEKV_HAVE_AVX512 1
// ---------------------------------------------------------------------------------------
// AVX-512 path. The portable row_update computes one dot product at a time and pays a
// horizontal sum per (position, head); here up to 4 query rows share every K/V row load,
// 16 dot products are reduced together with one transpose-add tree, and the softmax runs on
// 16 positions per instruction. NV = head_size / 16.
namespace avx512 {

constexpr int kRowTile = 4;

inline __m512 exp2_neg_v(__m512 x) {
  // Same method as the scalar exp2_neg above.
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_add_ps(x, shifter);
  const __m512 f = _mm512_sub_ps(x, _mm512_sub_ps(t, shifter));
  __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i n = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// Lane i of the result = sum of the 16 lanes of v[i]. 15 adds and 30 shuffles for 16 dot
// products, instead of ~8 dependent operations for each one.
inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4];
  for (int j = 0; j < 8; ++j) {
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                         _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(a[2 * j]);
    const __m512d y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Each b[j] holds, per 128-bit lane, partial sums of positions 4j..4j+3.
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// Rows of the next block to request while this one is computed (null: none).
struct Prefetch {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;
};

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1u);
}

// acc[r][v0 .. v0+CW) = alpha[r] * acc + sum_i p[r][i] * V[i]  (CW vectors of 16 floats).
template <int R, int CW>
inline void accumulate_v(int v0, const float* __restrict vrows, int64_t vst, int64_t n,
                         const float* __restrict p, int64_t p_stride, const float* alpha,
                         float* const* acc) {
  __m512 a[R][CW];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int w = 0; w < CW; ++w) a[r][w] = _mm512_mul_ps(al, _mm512_loadu_ps(acc[r] + 16 * (v0 + w)));
  }
  for (int64_t i = 0; i < n; ++i) {
    const float* v = vrows + i * vst + 16 * v0;
    __m512 vv[CW];
    for (int w = 0; w < CW; ++w) vv[w] = _mm512_loadu_ps(v + 16 * w);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * p_stride + i]);
      for (int w = 0; w < CW; ++w) a[r][w] = _mm512_fmadd_ps(pr, vv[w], a[r][w]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int w = 0; w < CW; ++w) _mm512_storeu_ps(acc[r] + 16 * (v0 + w), a[r][w]);
  }
}

// R query rows (sharing one kv head) against positions [0, n_max) of a block; row r sees
// only its first n[r] positions (causal). s is scratch of R * s_stride floats, s_stride a
// multiple of 16 that is >= n_max.
template <int NV, int R>
void block_update(const float* const* q, const float* __restrict krows, int64_t kst,
                  const float* __restrict vrows, int64_t vst, const int64_t* n, int64_t n_max,
                  float* const* acc, float* m, float* l, float* __restrict s,
                  int64_t s_stride, const Prefetch& pf) {
  // Scores: each K row is loaded once for all R rows.
  __m512 part[R][16];
  for (int64_t c = 0; c < n_max; c += 16) {
    const int64_t cn = std::min<int64_t>(16, n_max - c);
    for (int64_t i = 0; i < cn; ++i) {
      if (pf.k != nullptr) {
        for (int v = 0; v < NV; ++v) {
          _mm_prefetch(reinterpret_cast<const char*>(pf.k + (c + i) * pf.k_stride + 16 * v),
                       _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(pf.v + (c + i) * pf.v_stride + 16 * v),
                       _MM_HINT_T0);
        }
      }
      const float* k = krows + (c + i) * kst;
      __m512 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = _mm512_loadu_ps(k + 16 * v);
      for (int r = 0; r < R; ++r) {
        __m512 d = _mm512_mul_ps(kv[0], _mm512_loadu_ps(q[r]));
        for (int v = 1; v < NV; ++v) d = _mm512_fmadd_ps(kv[v], _mm512_loadu_ps(q[r] + 16 * v), d);
        part[r][i] = d;
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int64_t i = cn; i < 16; ++i) part[r][i] = _mm512_setzero_ps();
      _mm512_storeu_ps(s + r * s_stride + c, reduce16(part[r]));
    }
  }
  // Online softmax per row; masked positions get weight 0.
  float alpha[R];
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * s_stride;
    if (n[r] <= 0) {
      alpha[r] = 1.0f;
      for (int64_t c = 0; c < n_max; c += 16) _mm512_storeu_ps(sr + c, _mm512_setzero_ps());
      continue;
    }
    __m512 vmax = _mm512_set1_ps(kNegInf);
    for (int64_t c = 0; c < n[r]; c += 16) {
      vmax = _mm512_mask_max_ps(vmax, first_lanes(n[r] - c), vmax, _mm512_loadu_ps(sr + c));
    }
    const float m_new = std::max(m[r], _mm512_reduce_max_ps(vmax));
    alpha[r] = m[r] == kNegInf ? 0.0f : exp2_neg(m[r] - m_new);
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t c = 0; c < n_max; c += 16) {
      const __m512 e = exp2_neg_v(_mm512_sub_ps(_mm512_loadu_ps(sr + c), mv));
      const __m512 pv = _mm512_maskz_mov_ps(first_lanes(n[r] - c), e);
      _mm512_storeu_ps(sr + c, pv);
      vsum = _mm512_add_ps(vsum, pv);
    }
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(vsum);
    m[r] = m_new;
  }
  // P.V, in chunks of up to 4 vectors so R x 4 accumulators stay in registers.
  int v0 = 0;
  for (; v0 + 4 <= NV; v0 += 4) accumulate_v<R, 4>(v0, vrows, vst, n_max, s, s_stride, alpha, acc);
  if constexpr (NV % 4 == 1) accumulate_v<R, 1>(v0, vrows, vst, n_max, s, s_stride, alpha, acc);
  if constexpr (NV % 4 == 2) accumulate_v<R, 2>(v0, vrows, vst, n_max, s, s_stride, alpha, acc);
  if constexpr (NV % 4 == 3) accumulate_v<R, 3>(v0, vrows, vst, n_max, s, s_stride, alpha, acc);
}

template <int NV>
inline void block_update_rows(int rows, const float* const* q, const float* krows, int64_t kst,
                              const float* vrows, int64_t vst, const int64_t* n, int64_t n_max,
                              float* const* acc, float* m, float* l, float* s, int64_t s_stride,
                              const Prefetch& pf) {
  switch (rows) {
    case 1:
      return block_update<NV, 1>(q, krows, kst, vrows, vst, n, n_max, acc, m, l, s, s_stride, pf);
    case 2:
      return block_update<NV, 2>(q, krows, kst, vrows, vst, n, n_max, acc, m, l, s, s_stride, pf);
    case 3:
      return block_update<NV, 3>(q, krows, kst, vrows, vst, n, n_max, acc, m, l, s, s_stride, pf);
    default:
      return block_update<NV, 4>(q, krows, kst, vrows, vst, n, n_max, acc, m, l, s, s_stride, pf);
  }
}

}  // namespace avx512
#endif  // __AVX512F__

// Blocks sit at random places in the pool, so the hardware prefetcher cannot follow a
// sequence from one block to the next. Each position processed requests the same row of
// the next block: the requests are spread over the block instead of bursting (a burst fills
// the miss buffers and stalls the core), and the next block is in cache when it is reached.
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  if (row == nullptr) return;
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Rows of one item: r = (kv head within the item) * ntok * G + token * G + query head in group.
template <typename T, int NV, int DC>
void process_item(const Problem& P, const WorkItem& w, Scratch& S, const RowLoader<T>& load) {
  const int64_t D = NV > 0 ? 16 * NV : DC > 0 ? DC : P.head_size;
  const int64_t G = P.group;
  const int64_t head_rows = static_cast<int64_t>(w.ntok) * G;
  const int64_t rows = head_rows * w.num_kv;
  const int32_t ctx = P.seq_lens[w.seq];
  const int32_t qlen = P.query_start_loc[w.seq + 1] - P.query_start_loc[w.seq];
  const int32_t first_pos = ctx - qlen + w.tok0;  // absolute position of the tile's first token
  const int64_t tok_base = static_cast<int64_t>(P.query_start_loc[w.seq]) + w.tok0;

  float* qs = S.q.data();
  float* acc = S.acc.data();
  float* m = S.m.data();
  float* l = S.l.data();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = (w.kv_head + r / head_rows) * G + r % G;
    const int64_t t = (r % head_rows) / G;
    const float* src = P.q + (tok_base + t) * P.q_stride_tok + h * P.q_stride_head;
    float* dst = qs + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * P.qk_scale;
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);

  const int32_t bs = static_cast<int32_t>(P.block_size);
  // The tile's last token sees positions < first_pos + ntok; nothing beyond is read.
  const int32_t end = std::min(w.ctx_end, first_pos + w.ntok);
  const int32_t* table = P.block_tables + w.seq * P.bt_stride;
  const T* kc = static_cast<const T*>(P.k_cache);
  const T* vc = static_cast<const T*>(P.v_cache);
  for (int32_t blk = w.ctx_begin / bs; blk * bs < end; ++blk) {
    const int32_t b0 = std::max(blk * bs, w.ctx_begin);
    const int32_t b1 = std::min(blk * bs + bs, end);
    const int64_t i0 = b0 - blk * bs;
    const int64_t n_all = b1 - b0;
    const int64_t bid = table[blk];
    const bool has_next = (blk + 1) * bs < end;
    const int64_t next_bid = has_next ? table[blk + 1] : 0;
    for (int64_t hl = 0; hl < w.num_kv; ++hl) {
      const int64_t kvh = w.kv_head + hl;
      const T* kb = kc + bid * P.k_stride_blk + i0 * P.k_stride_pos + kvh * P.k_stride_head;
      const T* vb = vc + bid * P.v_stride_blk + i0 * P.v_stride_pos + kvh * P.v_stride_head;
      // Row i of this block prefetches row i of the next block (same kv head).
      const T* kn = has_next ? kc + next_bid * P.k_stride_blk + kvh * P.k_stride_head : nullptr;
      const T* vn = has_next ? vc + next_bid * P.v_stride_blk + kvh * P.v_stride_head : nullptr;
      const float* krows;
      const float* vrows;
      int64_t kst, vst;
      if constexpr (std::is_same_v<T, float>) {
        krows = kb;
        vrows = vb;
        kst = P.k_stride_pos;
        vst = P.v_stride_pos;
      } else {
        // Convert this block's rows once; every query row of the item reuses them.
        for (int64_t i = 0; i < n_all; ++i) {
          if (has_next) {
            prefetch_row(kn + (i0 + i) * P.k_stride_pos, D);
            prefetch_row(vn + (i0 + i) * P.v_stride_pos, D);
          }
          load(kb + i * P.k_stride_pos, S.k.data() + i * D, D);
          load(vb + i * P.v_stride_pos, S.v.data() + i * D, D);
        }
        krows = S.k.data();
        vrows = S.v.data();
        kst = vst = D;
        kn = vn = nullptr;  // already requested
      }
      const int64_t rbase = hl * head_rows;
#if defined(PAGEKV_HAVE_AVX512)
      if constexpr (NV > 0) {
        // Tiles of up to 4 rows (heads of one token first, then following tokens).
        const int64_t s_stride = (n_all + 15) / 16 * 16;
        for (int64_t r0 = 0; r0 < head_rows; r0 += avx512::kRowTile) {
          const int nr = static_cast<int>(std::min<int64_t>(avx512::kRowTile, head_rows - r0));
          const float* qp[avx512::kRowTile];
          float* ap[avx512::kRowTile];
          int64_t n[avx512::kRowTile];
          int64_t n_max = 0;
          for (int j = 0; j < nr; ++j) {
            const int64_t r = r0 + j;
            qp[j] = qs + (rbase + r) * D;
            ap[j] = acc + (rbase + r) * D;
            // Causal: token r / G sees positions <= first_pos + r / G.
            n[j] = std::clamp<int64_t>(first_pos + r / G + 1 - b0, 0, n_all);
            n_max = std::max(n_max, n[j]);
          }
          if (n_max == 0) continue;
          avx512::Prefetch pf;
          if constexpr (std::is_same_v<T, float>) {
            if (kn != nullptr && r0 == 0) {
              pf = {kn + i0 * P.k_stride_pos, vn + i0 * P.v_stride_pos, kst, vst};
            }
          }
          avx512::block_update_rows<NV>(nr, qp, krows, kst, vrows, vst, n, n_max, ap,
                                        m + rbase + r0, l + rbase + r0, S.s.data(), s_stride,
                                        pf);
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < n_all && kn != nullptr; ++i) {
        prefetch_row(kn + (i0 + i) * P.k_stride_pos, D);
        prefetch_row(vn + (i0 + i) * P.v_stride_pos, D);
      }
      for (int64_t t = 0; t < w.ntok; ++t) {
        // Causal: token t sees positions <= first_pos + t.
        const int64_t n = std::min<int64_t>(b1, first_pos + t + 1) - b0;
        if (n <= 0) continue;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = rbase + t * G + g;
          row_update<DC>(qs + r * D, krows, kst, vrows, vst, n, D, acc + r * D, m[r], l[r],
                         S.s.data());
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = (w.kv_head + r / head_rows) * G + r % G;
    const int64_t t = (r % head_rows) / G;
    const int64_t th = (tok_base + t) * P.num_heads + h;
    const float* a = acc + r * D;
    if (P.num_splits == 1) {
      const float inv = l[r] > 0.0f ? P.v_scale / l[r] : 0.0f;
      float* o = P.out + th * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
    } else {
      const int64_t slot = th * P.num_splits + w.part;
      std::memcpy(P.part_acc + slot * D, a, sizeof(float) * D);
      P.part_ml[slot * 2] = m[r];
      P.part_ml[slot * 2 + 1] = l[r];
    }
  }
}

// Merge the context partitions of one (token, head) row.
void merge_row(const Problem& P, int64_t th) {
  const int64_t D = P.head_size;
  const int64_t ns = P.num_splits;
  const float* ml = P.part_ml + th * ns * 2;
  float mx = kNegInf;
  for (int64_t p = 0; p < ns; ++p) mx = std::max(mx, ml[p * 2]);
  float* o = P.out + th * D;
  std::fill(o, o + D, 0.0f);
  if (mx == kNegInf) return;
  float total = 0.0f;
  for (int64_t p = 0; p < ns; ++p) {
    if (ml[p * 2] == kNegInf) continue;  // empty partition
    const float w = exp2_neg(ml[p * 2] - mx);
    total += ml[p * 2 + 1] * w;
    const float* a = P.part_acc + (th * ns + p) * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
  }
  const float inv = total > 0.0f ? P.v_scale / total : 0.0f;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

template <typename T, int NV, int DC>
void run(const Problem& P, const std::vector<WorkItem>& items, int64_t max_rows,
         int nthreads) {
  static const RowLoader<T> loader;
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && n > 1)
  {
    Scratch scratch(max_rows, P.head_size, P.block_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) process_item<T, NV, DC>(P, items[i], scratch, loader);
  }
}

template <typename T>
void run_dispatch_head(const Problem& P, const std::vector<WorkItem>& items, int64_t max_rows,
                       int nthreads, bool portable) {
  (void)portable;  // only meaningful when the AVX-512 path is compiled in
#if defined(PAGEKV_HAVE_AVX512)
  if (!portable) {
    switch (P.head_size) {
      case 64:
        return run<T, 4, 0>(P, items, max_rows, nthreads);
      case 80:
        return run<T, 5, 0>(P, items, max_rows, nthreads);
      case 96:
        return run<T, 6, 0>(P, items, max_rows, nthreads);
      case 128:
        return run<T, 8, 0>(P, items, max_rows, nthreads);
      case 256:
        return run<T, 16, 0>(P, items, max_rows, nthreads);
      default:
        break;
    }
  }
#endif
  switch (P.head_size) {
    case 64:
      return run<T, 0, 64>(P, items, max_rows, nthreads);
    case 128:
      return run<T, 0, 128>(P, items, max_rows, nthreads);
    default:
      return run<T, 0, 0>(P, items, max_rows, nthreads);
  }
}

torch::Tensor as_int32(const torch::Tensor& t) {
  auto r = t.scalar_type() == torch::kInt ? t : t.to(torch::kInt);
  return r.is_contiguous() ? r : r.contiguous();
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache,
                              torch::Tensor value_cache, torch::Tensor block_tables,
                              torch::Tensor seq_lens, torch::Tensor query_start_loc,
                              double scale, double k_scale, double v_scale,
                              int64_t num_splits, bool portable) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu() &&
                  value_cache.device().is_cpu(),
              "paged_attention (cpp): tensors must be on the CPU");
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_size], got ",
              query.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
              "key/value cache must be [num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value cache shapes differ: ",
              key_cache.sizes(), " vs ", value_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(),
              "key and value cache dtypes differ");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "key/value cache rows (head_size) must be contiguous");
  if (query.scalar_type() != torch::kFloat) query = query.to(torch::kFloat);
  if (query.stride(2) != 1) query = query.contiguous();

  const int64_t num_tokens = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t num_blocks = key_cache.size(0);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_size, "cache head_size ", key_cache.size(3),
              " != query head_size ", head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", num_kv_heads);
  TORCH_CHECK(block_size > 0 && head_size > 0, "empty block_size or head_size");

  auto bt = block_tables.scalar_type() == torch::kInt ? block_tables
                                                     : block_tables.to(torch::kInt);
  if (bt.dim() != 2 || bt.stride(1) != 1) bt = bt.contiguous();
  TORCH_CHECK(bt.dim() == 2, "block_tables must be [num_seqs, max_blocks]");
  const auto sl = as_int32(seq_lens);
  const auto qsl = as_int32(query_start_loc);
  const int64_t num_seqs = sl.numel();
  TORCH_CHECK(qsl.numel() == num_seqs + 1, "query_start_loc must have num_seqs + 1 entries");
  TORCH_CHECK(bt.size(0) >= num_seqs, "block_tables has fewer rows than sequences");

  auto out = torch::empty({num_tokens, num_heads, head_size}, query.options());
  if (num_tokens == 0) return out;

  const int32_t* slp = sl.data_ptr<int32_t>();
  const int32_t* qslp = qsl.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t max_blocks = bt.size(1);
  TORCH_CHECK(qslp[0] == 0 && qslp[num_seqs] == num_tokens,
              "query_start_loc must start at 0 and end at num_tokens (", num_tokens, ")");

  // Validate everything the kernel will dereference before any thread starts: a bad block
  // id must be an error, never an out-of-bounds read.
  int64_t tiles = 0;
  int32_t max_ctx = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t qlen = qslp[s + 1] - qslp[s];
    const int32_t ctx = slp[s];
    TORCH_CHECK(qlen >= 0, "query_start_loc must be non-decreasing (sequence ", s, ")");
    if (qlen == 0) continue;
    TORCH_CHECK(ctx >= qlen, "sequence ", s, ": seq_len ", ctx, " < query_len ", qlen);
    const int64_t nblk = (ctx + block_size - 1) / block_size;
    TORCH_CHECK(nblk <= max_blocks, "sequence ", s, " needs ", nblk,
                " blocks but block_tables has ", max_blocks, " columns");
    for (int64_t b = 0; b < nblk; ++b) {
      const int32_t bid = btp[s * bt.stride(0) + b];
      TORCH_CHECK(bid >= 0 && bid < num_blocks, "sequence ", s, ": block_tables[", b,
                  "] = ", bid, " is outside the cache (", num_blocks, " blocks)");
    }
    tiles += (qlen + kQueryTile - 1) / kQueryTile;
    max_ctx = std::max(max_ctx, ctx);
  }

  const int nthreads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  const int64_t min_items = 2 * static_cast<int64_t>(nthreads);
  // Keep as many kv heads together as parallelism allows: one visit to a block then reads
  // its rows for all those heads, which are contiguous in memory.
  int64_t kv_per_item = 1;
  for (int64_t d = num_kv_heads; d > 1; --d) {
    if (num_kv_heads % d == 0 && tiles * (num_kv_heads / d) >= min_items) {
      kv_per_item = d;
      break;
    }
  }
  const int64_t base_items = tiles * (num_kv_heads / kv_per_item);
  int64_t splits = num_splits;
  if (splits <= 0) {
    // Split the context only when the natural items cannot keep every thread busy.
    splits = 1;
    if (nthreads > 1 && base_items < min_items && base_items > 0) {
      const int64_t want = (2 * min_items + base_items - 1) / base_items;
      splits = std::clamp<int64_t>(want, 1, std::max(1, max_ctx / kMinSplitTokens));
    }
  }

  const int64_t G = num_heads / num_kv_heads;
  std::vector<WorkItem> items;
  items.reserve(base_items * splits);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t qlen = qslp[s + 1] - qslp[s];
    if (qlen == 0) continue;
    const int32_t ctx = slp[s];
    for (int32_t t0 = 0; t0 < qlen; t0 += kQueryTile) {
      const int32_t nt = std::min(kQueryTile, qlen - t0);
      const int32_t visible = ctx - qlen + t0 + nt;  // context the tile's last token sees
      // Partitions are whole blocks so that no block is split between two items.
      const int64_t nblk = (visible + block_size - 1) / block_size;
      const int64_t per = (nblk + splits - 1) / splits;
      for (int64_t p = 0; p < splits; ++p) {
        const int64_t c0 = std::min<int64_t>(p * per * block_size, visible);
        const int64_t c1 = std::min<int64_t>((p + 1) * per * block_size, visible);
        for (int64_t h = 0; h < num_kv_heads; h += kv_per_item) {
          items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h),
                           static_cast<int32_t>(kv_per_item), t0, nt, static_cast<int32_t>(p),
                           static_cast<int32_t>(c0), static_cast<int32_t>(c1),
                           (c1 - c0) * nt * kv_per_item});
        }
      }
    }
  }
  // Longest first: dynamic scheduling then balances the tail.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  torch::Tensor part_acc, part_ml;
  Problem P{};
  P.q = query.data_ptr<float>();
  P.q_stride_tok = query.stride(0);
  P.q_stride_head = query.stride(1);
  P.k_cache = key_cache.data_ptr();
  P.v_cache = value_cache.data_ptr();
  P.k_stride_blk = key_cache.stride(0);
  P.k_stride_pos = key_cache.stride(1);
  P.k_stride_head = key_cache.stride(2);
  P.v_stride_blk = value_cache.stride(0);
  P.v_stride_pos = value_cache.stride(1);
  P.v_stride_head = value_cache.stride(2);
  P.block_tables = btp;
  P.bt_stride = bt.stride(0);
  P.seq_lens = slp;
  P.query_start_loc = qslp;
  P.out = out.data_ptr<float>();
  P.num_heads = num_heads;
  P.group = G;
  P.head_size = head_size;
  P.block_size = block_size;
  P.num_splits = splits;
  P.qk_scale = static_cast<float>(scale * k_scale) * kLog2e;
  P.v_scale = static_cast<float>(v_scale);
  if (splits > 1) {
    part_acc = torch::empty({num_tokens * num_heads * splits * head_size}, query.options());
    part_ml = torch::empty({num_tokens * num_heads * splits * 2}, query.options());
    P.part_acc = part_acc.data_ptr<float>();
    P.part_ml = part_ml.data_ptr<float>();
  }

  const int64_t max_rows = std::min<int64_t>(kQueryTile, num_tokens) * G * kv_per_item;
  switch (key_cache.scalar_type()) {
    case torch::kFloat:
      run_dispatch_head<float>(P, items, max_rows, nthreads, portable);
      break;
    case torch::kHalf:
      run_dispatch_head<c10::Half>(P, items, max_rows, nthreads, portable);
      break;
    case torch::kBFloat16:
      run_dispatch_head<c10::BFloat16>(P, items, max_rows, nthreads, portable);
      break;
    case torch::kFloat8_e4m3fn:
      run_dispatch_head<c10::Float8_e4m3fn>(P, items, max_rows, nthreads, portable);
      break;
    case torch::kFloat8_e5m2:
      run_dispatch_head<c10::Float8_e5m2>(P, items, max_rows, nthreads, portable);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", key_cache.scalar_type());
  }

  if (splits > 1) {
    const int64_t rows = num_tokens * num_heads;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 16)
    for (int64_t th = 0; th < rows; ++th) merge_row(P, th);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "PageKV CPU paged attention (reads K/V blocks in place through the block table)";
  m.def("paged_attention", &paged_attention, "Paged attention over a block-table KV cache",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"),
        py::arg("scale"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
        py::arg("num_splits") = 0, py::arg("portable") = false,
        // Pure C++/ATen inside: let other Python threads (gRPC handlers) run meanwhile.
        py::call_guard<py::gil_scoped_release>());
  m.def("has_avx512_path", [] {
#if defined(PAGEKV_HAVE_AVX512)
    return true;
#else
    return false;
#endif
  });
}
