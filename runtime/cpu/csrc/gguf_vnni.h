// Part of gguf_linear.cpp (included inside its namespace, after the int8-activation kernels): steps
// of many rows with int8 activations on CPUs with AVX-512 VNNI (vpdpbusd: four u8 x s8 products and
// their sum added to an int32 lane, one instruction where AVX2 takes maddubs and madd).
//
// The activation rows are vectorised instead of the weight's elements: x' is packed 16 rows at a time
// so that one 64-byte vector holds the same four consecutive quants of 16 rows, and four of a weight
// row's quants, broadcast, meet all 16 rows in one vpdpbusd. A block's lanes are then the 16 rows'
// whole dot products: no horizontal sums, where the 8-row tile folds 8 vectors per block. Weights stay
// as stored; a tile of kTileN weight rows is unpacked once into a per-thread buffer of unsigned codes
// (Q8_0 with its sign bit flipped: w + 128) and every group of 16 rows reads it there.

#if SERVELM_GGUF_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SERVELM_GGUF_VNNI 1
#else
#define SERVELM_GGUF_VNNI 0
#endif

// Fewest rows a step must have to take the packed path: with fewer, most of each vector's 16 rows are
// padding and the AVX2 tiles are quicker (their K-quant kernels up to ~8 rows, the others ~5).
// vnni_rows_override (-1: none) replaces both, so tests reach either path.
std::atomic<int64_t> vnni_rows_override{-1};
inline int64_t vnni_min_rows(int blk) {
  const int64_t o = vnni_rows_override.load(std::memory_order_relaxed);
  return o >= 0 ? o : blk == 256 ? 8 : 6;
}

#if SERVELM_GGUF_VNNI
constexpr int kLanes = 16;  // activation rows in one vector
constexpr int kTileN = 8;  // weight rows sharing each load of packed x

// x' in groups of 16 rows; rows past M are zero in every field.
struct PackedX {
  int64_t groups = 0;
  std::vector<int8_t> q;     // [G][K / 4][16][4]: quants 4j..4j+3 of the group's 16 rows
  std::vector<float> d;      // [G][K / blk][16]: each row's scale of each block
  // x' per 32: [G][K / 32][16] d * (sum of the row's quants in the block), and the sum itself.
  std::vector<float> dsum;
  std::vector<int32_t> qsum;
  // x' per 256 (the K-quants): the sums of each 16 quants as int16 pairs, [G][K / 32][16] (sums 2i and
  // 2i + 1), and of each 32, [G][K / 64][16]: what vpdpwssd meets the sub-blocks' scales or minimums with.
  std::vector<int32_t> pairs16, pairs32;
};

// Two int16 in one int32 lane, lo first: a vpdpwssd operand.
inline int32_t int16_pair(int lo, int hi) {
  return int32_t(uint32_t(uint16_t(int16_t(lo))) | (uint32_t(uint16_t(int16_t(hi))) << 16));
}

void pack_x(const QuantX& xq, int64_t M, int64_t K, PackedX& out) {
  const int64_t G = (M + kLanes - 1) / kLanes, words = K / 4, nb = K / xq.blk, n32 = K / 32, n64 = K / 64;
  const bool k256 = xq.blk == 256;
  out.groups = G;
  out.q.resize(size_t(G * K * kLanes));
  out.d.resize(size_t(G * nb * kLanes));
  out.dsum.resize(k256 ? 0 : size_t(G * n32 * kLanes));
  out.qsum.resize(out.dsum.size());
  out.pairs16.resize(k256 ? size_t(G * n32 * kLanes) : 0);
  out.pairs32.resize(k256 ? size_t(G * n64 * kLanes) : 0);
  at::parallel_for(0, G * kLanes, std::max<int64_t>(kLanes, row_grain(K)), [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      const int64_t g = m / kLanes, lane = m % kLanes;
      const bool pad = m >= M;
      int32_t* dst = reinterpret_cast<int32_t*>(out.q.data()) + g * words * kLanes + lane;
      const int8_t* src = pad ? nullptr : xq.q.data() + m * K;
      for (int64_t j = 0; j < words; ++j) {
        if (pad) dst[j * kLanes] = 0;
        else std::memcpy(dst + j * kLanes, src + 4 * j, 4);
      }
      for (int64_t b = 0; b < nb; ++b) out.d[size_t((g * nb + b) * kLanes + lane)] = pad ? 0.0f : xq.d[size_t(m * nb + b)];
      const int16_t* s16 = pad ? nullptr : xq.sum16.data() + m * K / 16;
      auto sum16 = [&](int64_t i) { return pad ? 0 : int(s16[i]); };
      if (!k256) {
        for (int64_t b = 0; b < n32; ++b) {
          const size_t at = size_t((g * n32 + b) * kLanes + lane);
          out.dsum[at] = pad ? 0.0f : xq.dsum32[size_t(m * n32 + b)];
          out.qsum[at] = sum16(2 * b) + sum16(2 * b + 1);
        }
        continue;
      }
      for (int64_t b = 0; b < n32; ++b) out.pairs16[size_t((g * n32 + b) * kLanes + lane)] = int16_pair(sum16(2 * b), sum16(2 * b + 1));
      for (int64_t b = 0; b < n64; ++b)
        out.pairs32[size_t((g * n64 + b) * kLanes + lane)] =
            int16_pair(sum16(4 * b) + sum16(4 * b + 1), sum16(4 * b + 2) + sum16(4 * b + 3));
    }
  });
}

// Weight rows [n, n + T) of a 32-element format as unsigned codes [T][K] with, per block, the scale
// d_w and (the formats with one) the minimum.
template <int Q, int T>
inline void unpack_rows32(const LinearArgs& a, int64_t n, uint8_t* codes, float* dw, float* mins) {
  using F = Format<Q>;
  using B = Bytes32<Q>;
  const int64_t nblk = a.K / 32;
  for (int t = 0; t < T; ++t) {
    const uint8_t* row = a.w + (n + t) * a.ldw;
    for (int64_t blk = 0; blk < nblk; ++blk) {
      __m256i w = B::get(row + blk * F::bytes);
      if (B::kSigned) w = _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + t * a.K + blk * 32), w);
    }
    // The scales eight blocks at a time (one gather and one conversion), the rest one by one.
    int64_t blk = 0;
    for (; blk + 8 <= nblk; blk += 8) {
      __m256 wmin = _mm256_setzero_ps();
      _mm256_storeu_ps(dw + t * nblk + blk, scales8<Q>(row + blk * F::bytes, wmin));
      _mm256_storeu_ps(mins + t * nblk + blk, wmin);
    }
    for (; blk < nblk; ++blk) {
      float wmin = 0.0f;
      dw[t * nblk + blk] = scale_min32<F::has_min>(row + blk * F::bytes, wmin);
      mins[t * nblk + blk] = wmin;
    }
  }
}

// Rows [m0, m0 + 16) (those under M) of out's columns [n, n + T) from acc[t] (+ bias): four columns
// at a time as whole 16-byte rows, transposed in registers, where one float at a time was 64 scattered
// stores a tile.
template <int T>
inline void store_tile(const LinearArgs& a, const __m512 (&acc)[T], int64_t n, int64_t m0) {
  const int64_t rows = std::min<int64_t>(kLanes, a.M - m0);
  int c = 0;
  for (; c + 4 <= T; c += 4) {
    const __m512 t0 = _mm512_unpacklo_ps(acc[c], acc[c + 1]), t1 = _mm512_unpackhi_ps(acc[c], acc[c + 1]);
    const __m512 t2 = _mm512_unpacklo_ps(acc[c + 2], acc[c + 3]), t3 = _mm512_unpackhi_ps(acc[c + 2], acc[c + 3]);
    // u[i], 128-bit lane l: row 4l + i's four columns.
    const __m512 u[4] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
                         _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE)};
    const __m128 bias = a.bias ? _mm_loadu_ps(a.bias + n + c) : _mm_setzero_ps();
    alignas(64) float rowsv[kLanes][4];
    for (int i = 0; i < 4; ++i) {
      _mm_store_ps(rowsv[i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 0), bias));
      _mm_store_ps(rowsv[4 + i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 1), bias));
      _mm_store_ps(rowsv[8 + i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 2), bias));
      _mm_store_ps(rowsv[12 + i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 3), bias));
    }
    for (int64_t r = 0; r < rows; ++r) _mm_storeu_ps(a.out + (m0 + r) * a.ldo + n + c, _mm_load_ps(rowsv[r]));
  }
  for (; c < T; ++c) {
    alignas(64) float tot[kLanes];
    _mm512_store_ps(tot, acc[c]);
    const float bias = a.bias ? a.bias[n + c] : 0.0f;
    for (int64_t r = 0; r < rows; ++r) a.out[(m0 + r) * a.ldo + n + c] = tot[r] + bias;
  }
}

// out's rows of group g (16 rows) for weight rows [n, n + T), from their unpacked codes. Per four
// quants, T broadcasts meet one load of x in T vpdpbusd; 8 x 1 keeps the block sums, the running
// totals and the operands in 18 of the 32 vector registers (4 x 2 and 4 x 3 tiles were slower).
template <int Q, int T>
inline void vnni_tile32(const LinearArgs& a, const PackedX& px, int64_t n, int64_t g, const uint8_t* codes,
                        const float* dw, const float* mins) {
  constexpr int kOffset = kDotOffset<Q>;
  static_assert(kOffset == 0 || kOffset == 8 || kOffset == 16 || kOffset == 128, "a power of two: a shift");
  constexpr int kShift = kOffset == 128 ? 7 : kOffset == 16 ? 4 : 3;
  const int64_t nblk = a.K / 32;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int8_t* xp = px.q.data() + (g * nblk + blk) * 32 * kLanes;
    const size_t at = size_t((g * nblk + blk) * kLanes);
    // Each sum starts at minus the offset times x's block sum, so it ends as the sum over w = code - offset.
    __m512i start = _mm512_setzero_si512();
    if constexpr (kOffset != 0)
      start = _mm512_sub_epi32(start, _mm512_slli_epi32(_mm512_loadu_si512(px.qsum.data() + at), kShift));
    __m512i s[T];
    for (int t = 0; t < T; ++t) s[t] = start;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i xv = _mm512_loadu_si512(xp + 64 * j);
      for (int t = 0; t < T; ++t) {
        int32_t w4;
        std::memcpy(&w4, codes + t * a.K + blk * 32 + 4 * j, 4);
        s[t] = _mm512_dpbusd_epi32(s[t], _mm512_set1_epi32(w4), xv);
      }
    }
    const __m512 dx = _mm512_loadu_ps(px.d.data() + at);
    for (int t = 0; t < T; ++t) {
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(dx, _mm512_set1_ps(dw[t * nblk + blk])), acc[t]);
      if constexpr (Format<Q>::has_min)
        acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(mins[t * nblk + blk]), _mm512_loadu_ps(px.dsum.data() + at), acc[t]);
    }
  }
  store_tile<T>(a, acc, n, g * kLanes);
}

// Output rows [n0, n1) of a 32-element format against packed x'.
template <int Q>
void vnni_rows32(const LinearArgs& a, const PackedX& px, int64_t n0, int64_t n1) {
  const int64_t nblk = a.K / 32;
  // Per thread, kept between calls (each worker's own).
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> scales;
  codes.resize(size_t(kTileN * a.K));
  scales.resize(size_t(2 * kTileN * nblk));
  float* dw = scales.data();
  float* mins = dw + kTileN * nblk;
  auto tile = [&](auto tt, int64_t n) {
    constexpr int T = decltype(tt)::value;
    unpack_rows32<Q, T>(a, n, codes.data(), dw, mins);
    for (int64_t g = 0; g < px.groups; ++g) vnni_tile32<Q, T>(a, px, n, g, codes.data(), dw, mins);
  };
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) tile(std::integral_constant<int, kTileN>{}, n);
  for (; n + 4 <= n1; n += 4) tile(std::integral_constant<int, 4>{}, n);
  for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, n);
}
// Weight rows [n, n + T) of a K-quant as unsigned codes [T][K] with, per sub-block, its integer scale
// ([T][K / 256][subs]) and, per pair of sub-blocks, the int16 pair that vpdpwssd meets x's pair sums
// with: the two minimums (Q4_K, Q5_K) or the two scales (Q6_K, whose codes are offset by 32)
// ([T][K / 256][subs / 2]); per block, d and dmin ([T][K / 256]).
template <int Q, int T>
inline void unpack_rowsK(const LinearArgs& a, int64_t n, uint8_t* codes, int32_t* scales, int32_t* pairs, float* d,
                         float* dmin) {
  constexpr bool k6 = Q == Q6_K;
  constexpr int kSubs = k6 ? 16 : 8;
  const int64_t nblk = a.K / 256;
  for (int t = 0; t < T; ++t) {
    const uint8_t* row = a.w + (n + t) * a.ldw;
    for (int64_t blk = 0; blk < nblk; ++blk) {
      const uint8_t* b = row + blk * Format<Q>::bytes;
      uint8_t* c = codes + t * a.K + blk * 256;
      int32_t* sc = scales + (t * nblk + blk) * kSubs;
      int32_t* pr = pairs + (t * nblk + blk) * kSubs / 2;
      if constexpr (k6) {
        for (int h = 0; h < 2; ++h)
          for (int p = 0; p < 4; ++p)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 128 * h + 32 * p), KBlock<Q6_K>::codes(b, h, p));
        const int8_t* s8 = reinterpret_cast<const int8_t*>(b + 192);
        for (int j = 0; j < 16; ++j) sc[j] = s8[j];
        for (int i = 0; i < 8; ++i) pr[i] = int16_pair(s8[2 * i], s8[2 * i + 1]);
      } else {
        for (int q = 0; q < 4; ++q) {
          __m256i lo, hi;
          KBlock<Q>::codes(b, q, lo, hi);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * q), lo);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + 64 * q + 32), hi);
        }
        uint32_t words[4];
        scales_mins_k4(b + 4, words);
        uint8_t sm[16];  // scales 0-7, then minimums 0-7
        std::memcpy(sm, words, 16);
        for (int j = 0; j < 8; ++j) sc[j] = sm[j];
        for (int i = 0; i < 4; ++i) pr[i] = int16_pair(sm[8 + 2 * i], sm[9 + 2 * i]);
      }
      d[t * nblk + blk] = KBlock<Q>::d(b);
      dmin[t * nblk + blk] = KBlock<Q>::dmin(b);
    }
  }
}

// out's rows of group g for weight rows [n, n + T) of a K-quant, from their unpacked codes: each
// sub-block's sums (vpdpbusd) times its scale (one multiply per sub-block and weight row) add up to
// the block's integer sum, which meets d_w * d_x once; the minimums (or Q6_K's offset) meet x's sums
// per sub-block in a few vpdpwssd per block.
template <int Q, int T>
inline void vnni_tileK(const LinearArgs& a, const PackedX& px, int64_t n, int64_t g, const uint8_t* codes,
                       const int32_t* scales, const int32_t* pairs, const float* d, const float* dmin) {
  constexpr bool k6 = Q == Q6_K;
  constexpr int kSubs = k6 ? 16 : 8, kWords = 256 / kSubs / 4, kPairs = kSubs / 2;
  const int64_t nblk = a.K / 256;
  const int32_t* xpairs = (k6 ? px.pairs16.data() : px.pairs32.data()) + g * nblk * kPairs * kLanes;
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int8_t* xp = px.q.data() + (g * a.K / 4 + blk * 64) * 64;
    __m512i sum[T];
    for (int t = 0; t < T; ++t) sum[t] = _mm512_setzero_si512();
    for (int j = 0; j < kSubs; ++j) {
      __m512i s[T];
      for (int t = 0; t < T; ++t) s[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int w = 0; w < kWords; ++w) {
        const int kg = j * kWords + w;
        const __m512i xv = _mm512_loadu_si512(xp + 64 * kg);
        for (int t = 0; t < T; ++t) {
          int32_t w4;
          std::memcpy(&w4, codes + t * a.K + blk * 256 + 4 * kg, 4);
          s[t] = _mm512_dpbusd_epi32(s[t], _mm512_set1_epi32(w4), xv);
        }
      }
      for (int t = 0; t < T; ++t)
        sum[t] = _mm512_add_epi32(sum[t], _mm512_mullo_epi32(s[t], _mm512_set1_epi32(scales[(t * nblk + blk) * kSubs + j])));
    }
    const __m512 dx = _mm512_loadu_ps(px.d.data() + (g * nblk + blk) * kLanes);
    const int32_t* xpr = xpairs + blk * kPairs * kLanes;
    for (int t = 0; t < T; ++t) {
      __m512i other = _mm512_setzero_si512();
      for (int i = 0; i < kPairs; ++i)
        other = _mm512_dpwssd_epi32(other, _mm512_set1_epi32(pairs[(t * nblk + blk) * kPairs + i]), _mm512_loadu_si512(xpr + i * kLanes));
      const int64_t at = t * nblk + blk;
      if constexpr (k6) {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[t], _mm512_slli_epi32(other, 5))),
                                 _mm512_mul_ps(dx, _mm512_set1_ps(d[at])), acc[t]);
      } else {
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(dx, _mm512_set1_ps(d[at])), acc[t]);
        acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(other), _mm512_mul_ps(dx, _mm512_set1_ps(dmin[at])), acc[t]);
      }
    }
  }
  store_tile<T>(a, acc, n, g * kLanes);
}

// Output rows [n0, n1) of a K-quant against packed x'.
template <int Q>
void vnni_rowsK(const LinearArgs& a, const PackedX& px, int64_t n0, int64_t n1) {
  constexpr int kSubs = Q == Q6_K ? 16 : 8;
  const int64_t nblk = a.K / 256;
  // Per thread, kept between calls (each worker's own).
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<int32_t> ints;
  thread_local std::vector<float> floats;
  codes.resize(size_t(kTileN * a.K));
  ints.resize(size_t(kTileN * nblk * (kSubs + kSubs / 2)));
  floats.resize(size_t(2 * kTileN * nblk));
  int32_t* scales = ints.data();
  int32_t* pairs = scales + kTileN * nblk * kSubs;
  float* d = floats.data();
  float* dmin = d + kTileN * nblk;
  auto tile = [&](auto tt, int64_t n) {
    constexpr int T = decltype(tt)::value;
    unpack_rowsK<Q, T>(a, n, codes.data(), scales, pairs, d, dmin);
    for (int64_t g = 0; g < px.groups; ++g) vnni_tileK<Q, T>(a, px, n, g, codes.data(), scales, pairs, d, dmin);
  };
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) tile(std::integral_constant<int, kTileN>{}, n);
  for (; n + 4 <= n1; n += 4) tile(std::integral_constant<int, 4>{}, n);
  for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, n);
}
#endif
