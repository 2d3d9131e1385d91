// Part of gguf_linear.cpp (included inside its namespace, after the int8-activation kernels): steps
// of many rows with int8 activations, in packed tiles.
//
// The activation rows are vectorised instead of the weight's elements: x' is packed L rows at a time
// (16 with AVX-512 VNNI, 8 with AVX2) so that one vector holds the same four consecutive quants of L
// rows, and four of a weight row's quants, broadcast, meet all L rows at once: one vpdpbusd (four
// u8 x s8 products and their sum added to an int32 lane), or maddubs + madd + add with AVX2. A
// block's lanes are then the L rows' whole dot products: no horizontal sums, where a tile over the
// weight's elements folds 8 vectors per block. Weights stay as stored; a tile of kTileN weight rows is
// unpacked once into a per-thread buffer of codes and every group of L rows reads it there.

#if SERVELM_GGUF_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SERVELM_GGUF_VNNI 1
#else
#define SERVELM_GGUF_VNNI 0
#endif

// Fewest rows a step must have to take the packed tiles: with fewer, most of each vector's rows are
// padding and the few-row kernels are quicker (with VNNI, their K-quant kernels up to ~8 rows, the
// others ~5). packed_rows_override (-1: none) replaces these, and packed_lanes (0: the widest this
// build has) picks 8 or 16 rows a vector, so tests reach every path.
std::atomic<int64_t> packed_rows_override{-1};
std::atomic<int> packed_lanes{0};
inline int lanes_for_steps() {
  const int l = packed_lanes.load(std::memory_order_relaxed);
  return l != 0 ? l : SERVELM_GGUF_VNNI ? 16 : 8;
}
// 0 where steps of rows per block `blk` take no packed tiles (the K-quants without VNNI).
inline int64_t packed_min_rows(int blk, int lanes) {
  if (blk == 256 && lanes != 16) return 0;
  const int64_t o = packed_rows_override.load(std::memory_order_relaxed);
  return o >= 0 ? o : lanes == 8 ? 8 : blk == 256 ? 8 : 6;
}

#if SERVELM_GGUF_AVX2
constexpr int kTileN = 8;  // weight rows sharing each load of packed x

// The packed tiles' vector operations, 8 rows a vector (AVX2).
struct Lanes8 {
  using I = __m256i;
  using V = __m256;
  static constexpr int kLanes = 8;
  // Q8_0 is not read here: maddubs would saturate on codes w + 128, and moving a negative weight's sign
  // to x costs two instructions a dot (the 8-row tiles take it; gguf_linear.cpp's int8_linear_rows).
  static constexpr bool kFlipSigned = false;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I bcast(int32_t v) { return _mm256_set1_epi32(v); }
  // acc plus each lane's four products of the broadcast codes w and x (pairs summed in int16: no
  // saturation for codes under 32 against |x| <= 127).
  static I dot(I acc, I w, I x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones16())); }
  static I sub_shifted(I a, I b, int s) { return _mm256_sub_epi32(a, _mm256_sll_epi32(b, _mm_cvtsi32_si128(s))); }
  static V zerof() { return _mm256_setzero_ps(); }
  static V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static V set1f(float v) { return _mm256_set1_ps(v); }
  static V cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // rows[r] = the four columns acc[0..3] of row r (+ bias).
  static void rows4(const V* acc, __m128 bias, float (*rows)[4]) {
    const V t0 = _mm256_unpacklo_ps(acc[0], acc[1]), t1 = _mm256_unpackhi_ps(acc[0], acc[1]);
    const V t2 = _mm256_unpacklo_ps(acc[2], acc[3]), t3 = _mm256_unpackhi_ps(acc[2], acc[3]);
    // u[i], 128-bit lane l: row 4l + i's four columns.
    const V u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                    _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
    for (int i = 0; i < 4; ++i) {
      _mm_store_ps(rows[i], _mm_add_ps(_mm256_castps256_ps128(u[i]), bias));
      _mm_store_ps(rows[4 + i], _mm_add_ps(_mm256_extractf128_ps(u[i], 1), bias));
    }
  }
  static void store(float* p, V v) { _mm256_store_ps(p, v); }
};

#if SERVELM_GGUF_VNNI
// 16 rows a vector (AVX-512 VNNI): one vpdpbusd, Q8_0's quants read as unsigned codes w + 128.
struct Lanes16 {
  using I = __m512i;
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr bool kFlipSigned = true;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static I bcast(int32_t v) { return _mm512_set1_epi32(v); }
  static I dot(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
  static I sub_shifted(I a, I b, int s) { return _mm512_sub_epi32(a, _mm512_sll_epi32(b, _mm_cvtsi32_si128(s))); }
  static V zerof() { return _mm512_setzero_ps(); }
  static V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static V set1f(float v) { return _mm512_set1_ps(v); }
  static V cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void rows4(const V* acc, __m128 bias, float (*rows)[4]) {
    const V t0 = _mm512_unpacklo_ps(acc[0], acc[1]), t1 = _mm512_unpackhi_ps(acc[0], acc[1]);
    const V t2 = _mm512_unpacklo_ps(acc[2], acc[3]), t3 = _mm512_unpackhi_ps(acc[2], acc[3]);
    const V u[4] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
                    _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE)};
    for (int i = 0; i < 4; ++i) {
      _mm_store_ps(rows[i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 0), bias));
      _mm_store_ps(rows[4 + i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 1), bias));
      _mm_store_ps(rows[8 + i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 2), bias));
      _mm_store_ps(rows[12 + i], _mm_add_ps(_mm512_extractf32x4_ps(u[i], 3), bias));
    }
  }
  static void store(float* p, V v) { _mm512_store_ps(p, v); }
};
#endif

// x' in groups of `lanes` rows; rows past M are zero in every field.
struct PackedX {
  int64_t groups = 0;
  int lanes = 0;
  std::vector<int8_t> q;     // [G][K / 4][lanes][4]: quants 4j..4j+3 of the group's rows
  std::vector<float> d;      // [G][K / blk][lanes]: each row's scale of each block
  // x' per 32: [G][K / 32][lanes] d * (sum of the row's quants in the block), and the sum itself.
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

void pack_x(const QuantX& xq, int64_t M, int64_t K, int kLanes, PackedX& out) {
  const int64_t G = (M + kLanes - 1) / kLanes, words = K / 4, nb = K / xq.blk, n32 = K / 32, n64 = K / 64;
  const bool k256 = xq.blk == 256;
  out.groups = G;
  out.lanes = kLanes;
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

// The offset of a 32-element format's codes as the packed tiles read them (w = code - offset): Q8_0's
// signed quants are read as unsigned with their sign bit flipped (VNNI only).
template <int Q>
constexpr int kPackedOffset = Bytes32<Q>::kSigned ? 128 : Bytes32<Q>::kOffset;

// Weight rows [n, n + T) of a 32-element format as codes [T][K] with, per block, the scale d_w and
// (the formats with one) the minimum.
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

// Rows [m0, m0 + L) (those under M) of out's columns [n, n + T) from acc[t] (+ bias): four columns at
// a time as whole 16-byte rows, transposed in registers, where one float at a time was 4L scattered
// stores (with a vocabulary head's rows 1 MB apart, they cost more than the products).
template <class L, int T>
inline void store_tile(const LinearArgs& a, const typename L::V (&acc)[T], int64_t n, int64_t m0) {
  const int64_t rows = std::min<int64_t>(L::kLanes, a.M - m0);
  int c = 0;
  for (; c + 4 <= T; c += 4) {
    alignas(64) float rowsv[L::kLanes][4];
    L::rows4(acc + c, a.bias ? _mm_loadu_ps(a.bias + n + c) : _mm_setzero_ps(), rowsv);
    for (int64_t r = 0; r < rows; ++r) _mm_storeu_ps(a.out + (m0 + r) * a.ldo + n + c, _mm_load_ps(rowsv[r]));
  }
  for (; c < T; ++c) {
    alignas(64) float tot[L::kLanes];
    L::store(tot, acc[c]);
    const float bias = a.bias ? a.bias[n + c] : 0.0f;
    for (int64_t r = 0; r < rows; ++r) a.out[(m0 + r) * a.ldo + n + c] = tot[r] + bias;
  }
}

// out's rows of group g (L rows) for weight rows [n, n + T), from their unpacked codes. Per four
// quants, T broadcasts meet one load of x in T dots; with VNNI, 8 x 1 keeps the block sums, the
// running totals and the operands in 18 of the 32 vector registers (4 x 2 and 4 x 3 tiles were slower).
template <class L, int Q, int T>
inline void packed_tile32(const LinearArgs& a, const PackedX& px, int64_t n, int64_t g, const uint8_t* codes,
                          const float* dw, const float* mins) {
  constexpr int kOffset = kPackedOffset<Q>;
  static_assert(kOffset == 0 || kOffset == 8 || kOffset == 16 || kOffset == 128, "a power of two: a shift");
  constexpr int kShift = kOffset == 128 ? 7 : kOffset == 16 ? 4 : 3;
  static_assert(!Bytes32<Q>::kSigned || L::kFlipSigned, "signed quants only where the lanes read them as w + 128");
  const int64_t nblk = a.K / 32;
  typename L::V acc[T];
  for (int t = 0; t < T; ++t) acc[t] = L::zerof();
  for (int64_t blk = 0; blk < nblk; ++blk) {
    const int8_t* xp = px.q.data() + (g * nblk + blk) * 32 * L::kLanes;
    const size_t at = size_t((g * nblk + blk) * L::kLanes);
    // Each sum starts at minus the offset times x's block sum, so it ends as the sum over w = code - offset.
    typename L::I start = L::zero();
    if constexpr (kOffset != 0) start = L::sub_shifted(start, L::load(px.qsum.data() + at), kShift);
    typename L::I s[T];
    for (int t = 0; t < T; ++t) s[t] = start;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const typename L::I xv = L::load(xp + 4 * L::kLanes * j);
      for (int t = 0; t < T; ++t) {
        int32_t w4;
        std::memcpy(&w4, codes + t * a.K + blk * 32 + 4 * j, 4);
        s[t] = L::dot(s[t], L::bcast(w4), xv);
      }
    }
    const typename L::V dx = L::loadf(px.d.data() + at);
    for (int t = 0; t < T; ++t) {
      acc[t] = L::fmadd(L::cvt(s[t]), L::mul(dx, L::set1f(dw[t * nblk + blk])), acc[t]);
      if constexpr (Format<Q>::has_min) acc[t] = L::fmadd(L::set1f(mins[t * nblk + blk]), L::loadf(px.dsum.data() + at), acc[t]);
    }
  }
  store_tile<L, T>(a, acc, n, g * L::kLanes);
}

// Output rows [n0, n1) of a 32-element format against x' packed L rows a vector.
template <class L, int Q>
void packed_rows32(const LinearArgs& a, const PackedX& px, int64_t n0, int64_t n1) {
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
    for (int64_t g = 0; g < px.groups; ++g) packed_tile32<L, Q, T>(a, px, n, g, codes.data(), dw, mins);
  };
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) tile(std::integral_constant<int, kTileN>{}, n);
  for (; n + 4 <= n1; n += 4) tile(std::integral_constant<int, 4>{}, n);
  for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, n);
}

#if SERVELM_GGUF_VNNI
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
inline void packed_tileK(const LinearArgs& a, const PackedX& px, int64_t n, int64_t g, const uint8_t* codes,
                       const int32_t* scales, const int32_t* pairs, const float* d, const float* dmin) {
  constexpr bool k6 = Q == Q6_K;
  constexpr int kSubs = k6 ? 16 : 8, kWords = 256 / kSubs / 4, kPairs = kSubs / 2;
  const int64_t nblk = a.K / 256;
  const int32_t* xpairs = (k6 ? px.pairs16.data() : px.pairs32.data()) + g * nblk * kPairs * Lanes16::kLanes;
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
    const __m512 dx = _mm512_loadu_ps(px.d.data() + (g * nblk + blk) * Lanes16::kLanes);
    const int32_t* xpr = xpairs + blk * kPairs * Lanes16::kLanes;
    for (int t = 0; t < T; ++t) {
      __m512i other = _mm512_setzero_si512();
      for (int i = 0; i < kPairs; ++i)
        other = _mm512_dpwssd_epi32(other, _mm512_set1_epi32(pairs[(t * nblk + blk) * kPairs + i]), _mm512_loadu_si512(xpr + i * Lanes16::kLanes));
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
  store_tile<Lanes16, T>(a, acc, n, g * Lanes16::kLanes);
}

// Output rows [n0, n1) of a K-quant against packed x'.
template <int Q>
void packed_rowsK(const LinearArgs& a, const PackedX& px, int64_t n0, int64_t n1) {
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
    for (int64_t g = 0; g < px.groups; ++g) packed_tileK<Q, T>(a, px, n, g, codes.data(), scales, pairs, d, dmin);
  };
  int64_t n = n0;
  for (; n + kTileN <= n1; n += kTileN) tile(std::integral_constant<int, kTileN>{}, n);
  for (; n + 4 <= n1; n += 4) tile(std::integral_constant<int, 4>{}, n);
  for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, n);
}
#endif  // SERVELM_GGUF_VNNI
#endif  // SERVELM_GGUF_AVX2
