// Part of gguf_linear.cpp (included inside its namespace, after gguf_vnni.h): steps of many rows
// in llama.cpp's arithmetic mode on CPUs with AMX, as bfloat16 tile products.
//
// AMX multiplies 16x32 bfloat16 tiles into 16x16 float32 sums (tdpbf16ps, 512 products a cycle per
// core, ~4x the int8 vpdpbusd of gguf_vnni.h) and sums over the whole row in the tile: no per-block
// scale after each 32 elements as int8 products of GGUF blocks would need. So here the weight's rows
// are decoded (the reference's roundings) and rounded to bfloat16, 32 rows and a chunk of K at a
// time into a per-thread buffer that every group of 32 activation rows reads, and x is rounded to
// bfloat16 once per step: products of two bfloat16 are exact in float32, so the result is the
// float32 sum of bf16(w) * bf16(x), whatever the summation order.
//
// Tiles: A = 16 weight rows x 32 elements as decoded (row-major); B = 32 elements x 16 activation
// rows, as pairs of consecutive elements (the layout tdpbf16ps reads); C[n][m] = 16 weight rows x
// 16 activation rows. Two of each of A and B meet in four C tiles: all 8 tile registers.

#if SERVELM_GGUF_AVX2 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__) && defined(__AVX512BW__)
#define SERVELM_GGUF_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SERVELM_GGUF_AMX 0
#endif

// Fewest rows a step must have to take the AMX tiles (-1: the default below), so tests reach every
// path; and whether this process may use AMX at all (Linux grants the tile state on request).
std::atomic<int64_t> amx_rows_override{-1};

#if SERVELM_GGUF_AMX
// Below 16 rows most of each B tile would be padding, and the few-row kernels read the weight once.
constexpr int64_t kAmxMinRows = 24;
constexpr int64_t kAmxChunk = 2304;  // elements of K decoded at a time: 32 rows' bf16 in 144 KB of L2

inline bool amx_granted() {
  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): the kernel refuses the tile registers to a
  // process that has not asked (SIGILL on first use).
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

inline int64_t amx_min_rows() {
  const int64_t o = amx_rows_override.load(std::memory_order_relaxed);
  return o >= 0 ? o : kAmxMinRows;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes.
inline void amx_configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// 32 integer quants v (int8 lanes) as bfloat16 weights s * q (+ m) at dst, the lower 16 with s0 and
// the upper with s1 (Q6_K's scales are per 16): the reference's multiply, then add, then one rounding.
template <bool kMin>
inline void emit32(__m256i v, float s0, float s1, float m, uint16_t* dst) {
  __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), _mm512_set1_ps(s0));
  __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))), _mm512_set1_ps(s1));
  if (kMin) {
    lo = _mm512_add_ps(lo, _mm512_set1_ps(m));
    hi = _mm512_add_ps(hi, _mm512_set1_ps(m));
  }
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// 32 quants of at most 5 bits (idx, unsigned lanes) as bfloat16 (q + off) * s (+ m) at dst, through a
// table: the 16 or 32 values a block's quants can take are computed (the same multiply, add and
// rounding as emit32) and vpermw picks each element's. At 32 rows the decode, not the tiles, took
// ~60% of the kernel; this is ~4 vector ops a 32 where emit32's widen-convert-scale is ~12 (-13%
// of the kernel's time on Q4_K). Q6_K's 64 values a 16 would cost more to tabulate than to convert.
template <int kEntries, bool kMin>
inline void lut32(__m256i idx, float s, float m, float off, uint16_t* dst) {
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 lo = _mm512_mul_ps(_mm512_add_ps(iota, _mm512_set1_ps(off)), _mm512_set1_ps(s));
  if (kMin) lo = _mm512_add_ps(lo, _mm512_set1_ps(m));
  __m512i table;
  if constexpr (kEntries == 16) {
    table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lo));
  } else {
    __m512 hi = _mm512_mul_ps(_mm512_add_ps(iota, _mm512_set1_ps(off + 16.0f)), _mm512_set1_ps(s));
    if (kMin) hi = _mm512_add_ps(hi, _mm512_set1_ps(m));
    table = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), table));
}

// One block of format Q as bfloat16, element 32i + e at dst[i * step + e]: bit-equal to rounding decode_block's floats, with the
// quants taken 32 at a time in registers (decode_block's round trip through floats in memory cost
// more than the tiles' products at 32 rows).
template <int Q> struct BlockBF;  // every quantized format below
template <> struct BlockBF<Q4_0> {
  static void decode(const uint8_t* b, uint16_t* dst, int64_t step) { lut32<16, false>(nibbles32(b + 2), f16(b), 0.0f, -8.0f, dst); }
};
template <> struct BlockBF<Q4_1> {
  static void decode(const uint8_t* b, uint16_t* dst, int64_t step) { lut32<16, true>(nibbles32(b + 4), f16(b), f16(b + 2), 0.0f, dst); }
};
template <> struct BlockBF<Q5_0> {
  static void decode(const uint8_t* b, uint16_t* dst, int64_t step) {
    lut32<32, false>(_mm256_or_si256(nibbles32(b + 6), fifth_bits(u32(b + 2))), f16(b), 0.0f, -16.0f, dst);
  }
};
template <> struct BlockBF<Q5_1> {
  static void decode(const uint8_t* b, uint16_t* dst, int64_t step) {
    lut32<32, true>(_mm256_or_si256(nibbles32(b + 8), fifth_bits(u32(b + 4))), f16(b), f16(b + 2), 0.0f, dst);
  }
};
template <> struct BlockBF<Q8_0> {
  static void decode(const uint8_t* b, uint16_t* dst, int64_t step) {
    const float d = f16(b);
    emit32<false>(load256(b + 2), d, d, 0.0f, dst);
  }
};
template <bool kHigh>
struct BlockBFK45 {
  static void decode(const uint8_t* b, uint16_t* dst, int64_t step) {
    float s[8], m[8];
    k45_scales(b, s, m);
    const uint8_t* qs = b + (kHigh ? 48 : 16);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = load256(qs + 32 * c);
      __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      if (kHigh) {
        const __m256i h = load256(b + 16), one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c)), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * c + 1)), one), 4));
      }
      constexpr int kEntries = kHigh ? 32 : 16;
      lut32<kEntries, true>(lo, s[2 * c], m[2 * c], 0.0f, dst + 2 * c * step);
      lut32<kEntries, true>(hi, s[2 * c + 1], m[2 * c + 1], 0.0f, dst + (2 * c + 1) * step);
    }
  }
};
template <> struct BlockBF<Q4_K> : BlockBFK45<false> {};
template <> struct BlockBF<Q5_K> : BlockBFK45<true> {};
template <> struct BlockBF<Q6_K> {
  static void decode(const uint8_t* b, uint16_t* dst, int64_t step) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const float d = f16(b + 208);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i A = load256(ql + 64 * h), B = load256(ql + 64 * h + 32), H = load256(qh + 32 * h);
      const __m256i low[4] = {_mm256_and_si256(A, m4), _mm256_and_si256(B, m4),
                              _mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(_mm256_srli_epi16(B, 4), m4)};
      for (int p = 0; p < 4; ++p) {
        const __m256i high = _mm256_and_si256(_mm256_srl_epi16(H, _mm_cvtsi32_si128(2 * p)), m2);
        const __m256i v = _mm256_sub_epi8(_mm256_or_si256(low[p], _mm256_slli_epi16(high, 4)), off);
        const int j = 8 * h + 2 * p;  // the scale of elements 16j..16j+15
        emit32<false>(v, d * float(int8_t(b[192 + j])), d * float(int8_t(b[193 + j])), 0.0f, dst + (4 * h + p) * step);
      }
    }
  }
};

// x [M, K] as bfloat16 B tiles: [G][K / 32][16 pairs][16 rows][2], G groups of 16 rows (an even
// number, rows past M zero).
struct PackedBF {
  int64_t groups = 0, K = 0;
  std::vector<uint16_t> v;
  const uint16_t* tile(int64_t g, int64_t kb) const { return v.data() + (g * (K / 32) + kb) * 512; }
};

// 16 vectors of 16 32-bit lanes transposed in place (r[i] lane j <-> r[j] lane i).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Now r[4a + b] holds, in 128-bit lane l, element b of rows 4l .. 4l+3 ... of the 4-row group a:
  // swap 128-bit lanes across groups.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

void pack_bf16(const float* x, int64_t M, int64_t K, PackedBF& out) {
  out.groups = (M + 31) / 32 * 2;
  out.K = K;
  out.v.resize(size_t(out.groups) * K * 16);
  const int64_t nkb = K / 32;
  at::parallel_for(0, out.groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t kb = 0; kb < nkb; ++kb) {
        // Row t's 32 elements as 16 bf16 pairs in r[t]; transposed, r[p] is pair p of the 16 rows.
        __m512i r[16];
        for (int t = 0; t < 16; ++t) {
          const int64_t m = g * 16 + t;
          r[t] = m < M ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * K + kb * 32 + 16),
                                                     _mm512_loadu_ps(x + m * K + kb * 32))
                       : _mm512_setzero_si512();
        }
        transpose16(r);
        uint16_t* tile = out.v.data() + (g * nkb + kb) * 512;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + 32 * p, r[p]);
      }
  });
}

// Output rows [n0, n1) of a quantized format for every row of px (the step's M rows).
template <int Q>
void amx_rows(const LinearArgs& a, const PackedBF& px, int64_t n0, int64_t n1) {
  using F = Format<Q>;
  const int64_t K = a.K;
  const int64_t chunk = std::min<int64_t>(K, std::max<int64_t>(F::elems, kAmxChunk / F::elems * F::elems));
  // The weight tile's rows as bfloat16 in the A tiles' order, [chunk / 32][32 rows][32]: the tiles of
  // successive steps lie end to end, a stream the hardware prefetches.
  thread_local std::vector<uint16_t> wb;
  thread_local std::vector<float> sums;
  wb.resize(size_t(32) * chunk);
  sums.resize(size_t(px.groups) * 16 * 32);  // [G / 2][2 (A)][2 (B)][16][16]: the C tiles between chunks
  amx_configure();
  for (int64_t n = n0; n < n1; n += 32) {
    const int64_t rows = std::min<int64_t>(32, n1 - n);
    for (int64_t c0 = 0; c0 < K; c0 += chunk) {
      const int64_t kn = std::min(chunk, K - c0);
      for (int64_t r = 0; r < 32; ++r) {
        uint16_t* dst = wb.data() + r * 32;
        if (r >= rows) {
          for (int64_t k = 0; k < kn; k += 32) std::memset(dst + k * 32, 0, 64);
          continue;
        }
        const uint8_t* row = a.w + (n + r) * a.ldw + c0 / F::elems * F::bytes;
        // Row r + 2's blocks into L1 while this one decodes: the decode waited on the weight's loads
        // (-8 to -13% of the kernel's time at 32 rows on Q4_K and Q6_K).
        for (int64_t o = 0; o < kn / F::elems * F::bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(row + 2 * a.ldw + o), _MM_HINT_T0);
        for (int64_t k = 0; k < kn; k += F::elems) BlockBF<Q>::decode(row + k / F::elems * F::bytes, dst + k * 32, 1024);
      }
      const uint16_t* a0 = wb.data();
      const uint16_t* a1 = a0 + 512;
      for (int64_t g = 0; g < px.groups; g += 2) {
        float* c = sums.data() + g * 16 * 32;
        if (c0 == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          _tile_loadd(0, c, 64);
          _tile_loadd(1, c + 256, 64);
          _tile_loadd(2, c + 512, 64);
          _tile_loadd(3, c + 768, 64);
        }
        const uint16_t* b0 = px.tile(g, c0 / 32);
        const uint16_t* b1 = px.tile(g + 1, c0 / 32);
        for (int64_t kb = 0; kb < kn / 32; ++kb) {
          // The next step's B tiles into L1 (up to ~15% on Q6_K 1536x8960; level on Q4_K's shapes).
          for (int l = 0; l < 16; ++l) {
            _mm_prefetch(reinterpret_cast<const char*>(b0 + (kb + 1) * 512 + 32 * l), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(b1 + (kb + 1) * 512 + 32 * l), _MM_HINT_T0);
          }
          _tile_loadd(4, a0 + kb * 1024, 64);
          _tile_loadd(6, b0 + kb * 512, 64);
          _tile_loadd(5, a1 + kb * 1024, 64);
          _tile_loadd(7, b1 + kb * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
      }
    }
    // C[i][j][r][t] is weight row n + 16i + r against activation row 16(g + j) + t: column t of a C
    // tile, gathered, is 16 consecutive outputs of row m.
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int i = 0; i < 2; ++i) {
      const int valid = int(std::min<int64_t>(16, std::max<int64_t>(0, rows - 16 * i)));
      if (valid == 0) break;
      const __mmask16 keep = __mmask16((1u << valid) - 1);
      const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(keep, a.bias + n + 16 * i) : _mm512_setzero_ps();
      for (int64_t g = 0; g < px.groups; g += 2)
        for (int j = 0; j < 2; ++j)
          for (int t = 0; t < 16; ++t) {
            const int64_t m = (g + j) * 16 + t;
            if (m >= a.M) break;
            const float* c = sums.data() + g * 16 * 32 + (2 * i + j) * 256 + t;
            _mm512_mask_storeu_ps(a.out + m * a.ldo + n + 16 * i, keep,
                                  _mm512_add_ps(_mm512_i32gather_ps(column, c, 4), bias));
          }
    }
  }
  _tile_release();
}
#endif
