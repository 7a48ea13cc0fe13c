// y[M, N] = x[M, K] @ W.T (+ bias) for few rows M, on a weight packed once into column blocks
// (stree/kernels/cpu/gemm.py builds and calls this; see its docstring for why it exists).
//
// W [N, K] is packed as [ceil(N / NB)][K][NB]: a block's NB columns for every k lie in one
// contiguous run, so a block streams from memory in order. For each block the register tile
// holds MR rows x NB columns of y (MR x 2 vector accumulators) over the whole of K: each k loads
// the block's two vectors of W once and multiplies them into every row, so the weight is read
// once per call however many rows there are (up to MRMAX; more rows are split into near-equal
// chunks, the block then re-read from the caches). Blocks are split over the threads.
//
// A half (float16, bfloat16) weight may also be packed in its own dtype, the same layout at half the
// bytes, each vector widened (exactly) as it is loaded: a product of a row or two streams its weight
// from memory, and the shipped target's head of 4 MB as float32 took about 42 us a row on the 2-core
// EPYC, 24 as float16; a product of 4 rows or more, bound by its multiply-adds, gains nothing so, and
// the widening costs one of 8 rows about a tenth.
#include <immintrin.h>
#include <stdint.h>

// the vector operations of one instruction set, by its intrinsics' prefix
#define VECTOR_OPS(P, ZERO)                                                        \
  static inline vec vload(const float* p) { return P##_loadu_ps(p); }             \
  static inline void vstore(float* p, vec v) { P##_storeu_ps(p, v); }             \
  static inline vec vset1(float x) { return P##_set1_ps(x); }                     \
  static inline vec vfma(vec a, vec b, vec c) { return P##_fmadd_ps(a, b, c); }   \
  static inline vec vadd(vec a, vec b) { return P##_add_ps(a, b); }               \
  static inline vec vzero() { return ZERO(); }

#if defined(__AVX512F__)
typedef __m512 vec;
#define VW 16
// 14 rows x 2 accumulators + 2 weight vectors + 1 broadcast: 31 of the 32 vector registers
#define MRMAX 14
VECTOR_OPS(_mm512, _mm512_setzero_ps)
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
typedef __m256 vec;
#define VW 8
// 6 rows x 2 accumulators + 2 weight vectors + 1 broadcast: 15 of the 16 vector registers
#define MRMAX 6
VECTOR_OPS(_mm256, _mm256_setzero_ps)
#else
#error "the tiled product needs AVX-512F, or AVX2 with FMA and F16C"
#endif

#define NB (2 * VW)
// how many k ahead the block's next weights are asked for: without asking, a tree's rows waited
// on memory (docs/kernels.md)
#define AHEAD 16

// A packed weight's element type: float32, or a half model's float16 or bfloat16 (mamba_step.cpp's
// Sizes::rounding codes)
enum { W_F32 = -1, W_F16 = 0, W_BF16 = 1 };

// VW weights from element i of a packed weight of type WT, as float32 (a half's value exactly)
template <int WT>
static inline vec wload(const void* w, long i) {
  if constexpr (WT == W_F32) {
    return vload((const float*)w + i);
  } else {
    const uint16_t* h = (const uint16_t*)w + i;
#if defined(__AVX512F__)
    __m256i bits = _mm256_loadu_si256((const __m256i*)h);
    if constexpr (WT == W_F16) return _mm512_cvtph_ps(bits);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
    __m128i bits = _mm_loadu_si128((const __m128i*)h);
    if constexpr (WT == W_F16) return _mm256_cvtph_ps(bits);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#endif
  }
}

// MR rows of one full block: y[r, 0:NB] = x[r, :] . W_block (+ bias[0:NB]), the block of type WT
template <int MR, int WT>
static inline void tile(const float* x, long ldx, const void* wp, long K, float* y, long ldy, const float* bias) {
  vec a0[MR], a1[MR];
  const char* ahead = (const char*)wp + AHEAD * NB * (WT == W_F32 ? 4 : 2);  // (bytes: a half block's are two)
#pragma GCC unroll 16
  for (int r = 0; r < MR; r++) {
    a0[r] = vzero();
    a1[r] = vzero();
  }
  for (long k = 0; k < K; k++) {
    vec w0 = wload<WT>(wp, k * NB), w1 = wload<WT>(wp, k * NB + VW);
    // (held in registers: GCC otherwise folds the loads into the FMAs where MR is small, each row then loading
    // the block's two vectors again, and a tile of 3 or 4 rows waited on the load ports: on the 2-core EPYC
    // the model's products of 4 rows took 210 us against 153, of 8 rows (two tiles of 4) 388 against 259)
    asm("" : "+v"(w0), "+v"(w1));
    if constexpr (WT == W_F32) {
      __builtin_prefetch(ahead + k * NB * 4);
      __builtin_prefetch(ahead + k * NB * 4 + VW * 4);
    } else {  // (a half block's NB weights of a k: one line of 64 bytes with AVX-512, half of one with AVX2)
      __builtin_prefetch(ahead + k * NB * 2);
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++) {
      vec xb = vset1(x[r * ldx + k]);
      a0[r] = vfma(xb, w0, a0[r]);
      a1[r] = vfma(xb, w1, a1[r]);
    }
  }
  vec b0 = bias ? vload(bias) : vzero(), b1 = bias ? vload(bias + VW) : vzero();
#pragma GCC unroll 16
  for (int r = 0; r < MR; r++) {
    vstore(y + r * ldy, vadd(a0[r], b0));
    vstore(y + r * ldy + VW, vadd(a1[r], b1));
  }
}

// MR rows of a block of nc <= NB columns (the last block of N not a multiple of NB: its padded
// columns are computed into a scratch tile, and only the real ones written)
template <int MR, int WT = W_F32>
static void block(const float* x, long ldx, const void* wp, long K, float* y, long ldy, const float* bias, int nc) {
  if (nc == NB) {
    tile<MR, WT>(x, ldx, wp, K, y, ldy, bias);
    return;
  }
  float scratch[MR * NB];
  tile<MR, WT>(x, ldx, wp, K, scratch, NB, nullptr);
  for (int r = 0; r < MR; r++)
    for (int j = 0; j < nc; j++) y[r * ldy + j] = scratch[r * NB + j] + (bias ? bias[j] : 0.f);
}

template <int WT = W_F32>
static void rows(const float* x, long m, long ldx, const void* wp, long K, float* y, long ldy, const float* bias,
                 int nc) {
  switch (m) {
#define ROWS(n) \
  case n: block<n, WT>(x, ldx, wp, K, y, ldy, bias, nc); break;
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6)
#if MRMAX > 6
    ROWS(7) ROWS(8) ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14)
#endif
    default: break;
  }
}

extern "C" int stree_gemm_block(void) { return NB; }

extern "C" int stree_gemm_rows(void) { return MRMAX; }

// 8 x 8 floats, rows src, src + lds, ..., written transposed to dst, dst + ldd, ... (in registers:
// packed element by element, a 13-node tree scan's state term took a quarter longer, timed alone)
static inline void transpose8(const float* src, long lds, float* dst, long ldd) {
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// nc <= NB rows of w (row stride ldw, K columns) packed as one block [K][NB], the columns past nc zero
static void pack_block(const float* w, long ldw, long K, int nc, float* wp) {
  long k8 = nc == NB ? K - K % 8 : 0;
  for (int j = 0; j < NB; j += 8)
    for (long k = 0; k < k8; k += 8) transpose8(w + j * ldw + k, ldw, wp + k * NB + j, NB);
  for (long k = k8; k < K; k++)
    for (int j = 0; j < NB; j++) wp[k * NB + j] = j < nc ? w[j * ldw + k] : 0.f;
}

// w [N, K] row-major (nn.Linear's weight) -> wp [ceil(N / NB)][K][NB], padded with zeros
extern "C" void stree_gemm_pack(const float* w, long N, long K, float* wp) {
  for (long b = 0; b * NB < N; b++)
    pack_block(w + b * NB * K, K, K, (int)(N - b * NB < NB ? N - b * NB : NB), wp + b * K * NB);
}

// y = x [M, K] @ w.T for a w [N, K] (row stride ldw) read as it lies, K <= KMAX: each block of w
// packed on the fly into a scratch that stays in L1 for the tile (a matrix multiplied once, as a
// tree scan's state is, costs a packing anyway: done per block, it is read from memory once)
#define KMAX 256
static void product_unpacked(const float* x, long M, long K, long ldx, const float* w, long ldw, long N, float* y,
                             long ldy) {
  alignas(64) float wp[KMAX * NB];
  long chunks = (M + MRMAX - 1) / MRMAX;
  for (long b = 0; b * NB < N; b++) {
    int nc = (int)(N - b * NB < NB ? N - b * NB : NB);
    pack_block(w + b * NB * ldw, ldw, K, nc, wp);
    for (long c = 0, r = 0; c < chunks; c++) {
      long m = (M - r) / (chunks - c);
      rows(x + r * ldx, m, ldx, wp, K, y + r * ldy + b * NB, ldy, nullptr, nc);
      r += m;
    }
  }
}

extern "C" int stree_state_kmax(void) { return KMAX; }

// The tree scan's state term before its decay, out[b, i, h, p] = C[b, i, g, :] . x0[b, h, p, :]
// for head h of group g (heads / groups heads a group), as one product per row and group: C's
// nodes [n, K] (node stride ldc, row stride ldr, group g at g * K) by the group's rows of the
// state [heads / groups * headdim, K]. The products, each cut into column parts where there are
// fewer of them than threads, are split over the threads.
extern "C" void stree_state_term(const float* C, long batch, long n, long groups, long K, long ldc, long ldr,
                                 const float* x0, long heads, long headdim, float* out, int threads) {
  long width = heads / groups * headdim, hp = heads * headdim, products = batch * groups;
  long parts = threads > products ? (threads + products - 1) / products : 1;
  long part = ((width + parts - 1) / parts + NB - 1) / NB * NB;  // (whole blocks)
  parts = (width + part - 1) / part;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && products * parts > 1)
  for (long t = 0; t < products * parts; t++) {
    long b = t / (groups * parts), g = t / parts % groups, j = t % parts * part;
    long cols = width - j < part ? width - j : part;
    product_unpacked(C + b * ldr + g * K, n, K, ldc, x0 + (b * hp + g * width + j) * K, K, cols,
                     out + b * n * hp + g * width + j, hp);
  }
}

// stree_state_term's arguments as one array of 12 int64 (see stree_gemm_args)
extern "C" void stree_state_term_args(const int64_t* a) {
  stree_state_term((const float*)a[0], a[1], a[2], a[3], a[4], a[5], a[6], (const float*)a[7], a[8], a[9],
                   (float*)a[10], (int)a[11]);
}

template <int WT>
static void product(const float* x, long M, long K, long ldx, const void* wp, long N, float* y, long ldy,
                    const float* bias, int threads) {
  long blocks = (N + NB - 1) / NB, chunks = (M + MRMAX - 1) / MRMAX, size = K * NB * (WT == W_F32 ? 4 : 2);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long b = 0; b < blocks; b++) {
    int nc = (int)(N - b * NB < NB ? N - b * NB : NB);
    for (long c = 0, r = 0; c < chunks; c++) {
      long m = (M - r) / (chunks - c);  // near-equal chunks: 16 rows as 8 + 8, not 14 + 2
      rows<WT>(x + r * ldx, m, ldx, (const char*)wp + b * size, K, y + r * ldy + b * NB, ldy,
               bias ? bias + b * NB : nullptr, nc);
      r += m;
    }
  }
}

// x [M, K] (row stride ldx, unit column stride), wp packed, y [M, N] (row stride ldy), bias [N] or null
extern "C" void stree_gemm(const float* x, long M, long K, long ldx, const float* wp, long N, float* y, long ldy,
                           const float* bias, int threads) {
  product<W_F32>(x, M, K, ldx, wp, N, y, ldy, bias, threads);
}

// stree_gemm for a weight packed in type wt (W_F32, W_F16, W_BF16): the same sums, term for term (a half's
// weights widened exactly)
extern "C" void stree_gemm_typed(const float* x, long M, long K, long ldx, const void* wp, long N, float* y,
                                 long ldy, const float* bias, int threads, long wt) {
  if (wt == W_F16)
    product<W_F16>(x, M, K, ldx, wp, N, y, ldy, bias, threads);
  else if (wt == W_BF16)
    product<W_BF16>(x, M, K, ldx, wp, N, y, ldy, bias, threads);
  else
    product<W_F32>(x, M, K, ldx, wp, N, y, ldy, bias, threads);
}

// w [N, K] of 16-bit elements (a half weight's bits) packed as stree_gemm_pack packs floats
extern "C" void stree_gemm_pack_half(const uint16_t* w, long N, long K, uint16_t* wp) {
  for (long b = 0; b * NB < N; b++)
    for (long k = 0; k < K; k++)
      for (long j = 0; j < NB; j++) wp[(b * K + k) * NB + j] = b * NB + j < N ? w[(b * NB + j) * K + k] : 0;
}

// stree_gemm_typed's arguments as one array of 11 int64 (x, M, K, ldx, wp, N, y, ldy, bias or 0, threads,
// wt): ctypes converts each argument of a call, and ten of them took longer than a small product
extern "C" void stree_gemm_args(const int64_t* a) {
  stree_gemm_typed((const float*)a[0], a[1], a[2], a[3], (const void*)a[4], a[5], (float*)a[6], a[7],
                   (const float*)a[8], (int)a[9], a[10]);
}
