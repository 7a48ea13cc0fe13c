// One decoding step of a whole Mamba2 language model in one call (stree/kernels/cpu/mamba_step.py
// calls this; see its docstring for why): embedding, every block (RMSNorm, in_proj, the conv of the
// new token with SiLU, the state update, the gated RMSNorm, out_proj, the residual add), the final
// norm and the head, float32, for a few rows; and a draft tree's pass. The products are stree_gemm's
// (gemm.cpp, the same library), the tree scan's state term stree_state_term's; the norms and the state
// update follow the numba kernels' arithmetic (step_jit.py, norm_jit.py, tree_jit.py) operation by
// operation: the norms' mean squares in double, the state update in float with replay's roundings.
// The convs sum in float as the tree conv does, and every SiLU takes a polynomial exp that vectorises
// (exp_poly). Built with -ffp-contract=off, so no multiply and add fuse where those kernels keep them
// apart (a step and a replay of the same token leave the same state).
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

// Where a greedy iteration's time goes, part by part (benchmarks/pass_parts.py builds the library with
// -DSTREE_PART_TIMERS and reads stree_part_times): PART(i) adds the wall time since the last mark to part
// i (the calling thread's; the parts' parallel loops end within them). Without the flag they are nothing.
#ifdef STREE_PART_TIMERS
#include <chrono>
enum { PART_IN, PART_CONV, PART_STATE, PART_SCAN, PART_OUT, PART_HEAD, PART_WALK, PART_REPLAY, PART_LAWS,
       PART_HEAD_ROWS, PART_CALLS, PARTS };
static double part_seconds[PARTS], part_mark;
static inline double part_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
#define PART_START() (part_mark = part_now())
#define PART(i)                            \
  do {                                     \
    double now_ = part_now();              \
    part_seconds[i] += now_ - part_mark;   \
    part_mark = now_;                      \
  } while (0)
#define PART_COUNT(i, k) (part_seconds[i] += (double)(k))
// the parts' seconds (and the head's rows, the iterations) since the last read, zeroed
extern "C" long stree_part_times(double* out) {
  for (int i = 0; i < PARTS; i++) out[i] = part_seconds[i], part_seconds[i] = 0;
  return PARTS;
}
#else
#define PART_START() ((void)0)
#define PART(i) ((void)0)
#define PART_COUNT(i, k) ((void)0)
#endif

extern "C" void stree_gemm(const float* x, long M, long K, long ldx, const float* wp, long N, float* y, long ldy,
                           const float* bias, int threads);
extern "C" void stree_gemm_typed(const float* x, long M, long K, long ldx, const void* wp, long N, float* y,
                                 long ldy, const float* bias, int threads, long wt);
extern "C" void stree_state_term(const float* C, long batch, long n, long groups, long K, long ldc, long ldr,
                                 const float* x0, long heads, long headdim, float* out, int threads);

namespace {

// The model, as mamba_step.py lays it out in one int64 array: the sizes, then per layer the
// addresses of its parameters (0 where a bias is absent). The products' weights are packed (gemm.cpp) as
// float32 (in_w, out_w, head_w) and, for a half model, also in its dtype (in_h, out_h, head_h; 0: none).
// rounding: -1 for a float32 model; a half model's (0 float16, 1 bfloat16), whose outputs round where its
// block-by-block path rounds them (round_half) and whose conv states are of its dtype; half_residual: its
// residual stream is of its dtype too (not float32), each add rounded. half_rows: the rows up to which a
// product takes its weight's half pack, where the model has one (product, below).
struct Sizes {
  int64_t layers, d_model, vocab, d_in_proj, d_inner, conv_dim, d_conv, heads, headdim, d_state, groups,
      norm_group, gate_first, rounding, half_residual, half_rows;
};
struct Layer {
  const float *norm_w, *in_w, *in_b, *conv_w, *conv_b, *A, *D, *dt_bias, *gnorm_w, *out_w, *out_b;
  const void *in_h, *out_h;
};
struct Doubles {
  double eps, gnorm_eps, final_eps, dt_lo, dt_hi;
};
struct Model {
  Sizes n;
  Doubles e;
  const float *embed, *final_w, *head_w;
  const void* head_h;
  Layer layer[1];  // n.layers of them (the array runs on past the struct)
};
constexpr long LAYER_WORDS = sizeof(Layer) / 8;

// e^x for the loops over a row (SiLU's), where libm's expf, a call per element, kept them scalar and
// took most of a tree pass's time outside the products: x = n ln2 + r, e^r by Cephes' degree-6
// polynomial (within 2 ulp of expf), times 2^n made in the exponent's bits. x is first held to
// [-87, 88], where 2^n stays a normal float; a NaN is returned as it came, as expf returns it.
inline float exp_poly(float x) {
  float t = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
  float n = (t * 1.44269504088896341f + 12582912.f) - 12582912.f;  // (rounded to an integer by 1.5 * 2^23)
  float r = t - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  float scale = __builtin_bit_cast(float, ((int32_t)n + 127) << 23);
  return (x == x ? p * scale : x);
}

// f rounded to float16's values (round_jit.round_half's rule: to nearest, ties to even; past 65504
// infinity; below 2^-14, float16's smallest normal, a fixed step of 2^-24, which float32 has at 0.5: the
// sum rounds to it, the difference is exact; a NaN made quiet), as float32. Branch-free: the loops over a
// row vectorise.
inline float round_f16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f), sign = u & 0x80000000u, mag = u & 0x7fffffffu;
  uint32_t r = (mag + 0x0fffu + ((mag >> 13) & 1u)) & 0xffffe000u;
  r = r >= 0x47800000u ? 0x7f800000u : r;
  uint32_t small = __builtin_bit_cast(uint32_t, (__builtin_fabsf(f) + 0.5f) - 0.5f);
  uint32_t out = mag > 0x7f800000u ? (u | 0x00400000u) : sign | (mag < 0x38800000u ? small : r);
  return __builtin_bit_cast(float, out);
}

// f rounded to bfloat16's values (float32's range: past its largest, infinity), as float32
inline float round_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f), mag = u & 0x7fffffffu;
  uint32_t r = (u & 0x80000000u) | ((mag + 0x7fffu + ((mag >> 16) & 1u)) & 0xffff0000u);
  return __builtin_bit_cast(float, mag > 0x7f800000u ? (u | 0x00400000u) : r);
}

// v [count] rounded in place to a half model's values (mode: Sizes::rounding; -1 leaves it): where its
// block-by-block path returns a half output that the next op reads widened again
void round_half(float* v, long count, int64_t mode) {
  if (mode == 0) {
    long i = 0;
#if defined(__F16C__)
    // (F16C's conversion there and back rounds by the same rule, a NaN staying a NaN with float16's payload:
    // two instructions a vector against the rule's dozen)
    for (; i + 8 <= count; i += 8)
      _mm256_storeu_ps(v + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT)));
#endif
#pragma omp simd
    for (long j = i; j < count; j++) v[j] = round_f16(v[j]);
  } else if (mode == 1) {
#pragma omp simd
    for (long i = 0; i < count; i++) v[i] = round_bf16(v[i]);
  }
}

// v * sigmoid(v) over a row, in place or into out
void silu_row(const float* v, long dim, float* out) {
#pragma omp simd
  for (long d = 0; d < dim; d++) out[d] = v[d] / (1.f + exp_poly(-v[d]));
}

// rms_norm_rows: x / sqrt(mean(x^2) + eps) * w, the mean square and products in double
void rms_norm(const float* x, long dim, const float* w, double eps, float* out) {
  double acc = 0.0;
  for (long d = 0; d < dim; d++) acc += (double)x[d] * (double)x[d];
  double scale = 1.0 / sqrt(acc / (double)dim + eps);
  for (long d = 0; d < dim; d++) out[d] = (float)((double)x[d] * scale * (double)w[d]);
}

// processed_dt: + bias, softplus (linear above 20), clamped
double processed_dt(float raw, float bias, double lo, double hi) {
  double d = (double)raw + (double)bias;
  if (d <= 20.0) d = log1p(exp(d));
  return fmin(fmax(d, lo), hi);
}

// A step's conv for one row: the window shifted left, x entering last; then the bias and the taps
// from the newest down, in float, and SiLU, as a tree's conv sums a root's (tree_conv_row). KK: the
// window's length where known when compiled (0: K), so that a channel's shift is a few moves (with K
// known only at run time each was a call to memmove: in perf, the step's body, mostly this conv, took 11% of
// both cores' time in a 1-layer drafter's steps, its products 24%)
template <long KK>
void conv_taps(const float* x, float* state, const float* w, const float* bias, long dim, long K, float* out) {
  const long k_len = KK ? KK : K;
  for (long d = 0; d < dim; d++) {
    float* s = state + d * k_len;
    const float* wd = w + d * k_len;
    for (long k = 0; k < k_len - 1; k++) s[k] = s[k + 1];
    s[k_len - 1] = x[d];
    float acc = bias ? bias[d] : 0.f;
    for (long k = k_len - 1; k >= 0; k--) acc += wd[k] * s[k];
    out[d] = acc;
  }
}

void conv_row(const float* x, float* state, const float* w, const float* bias, long dim, long K, float* out,
              int64_t rounding) {
  if (K == 4)  // (every Mamba2 checkpoint's d_conv so far)
    conv_taps<4>(x, state, w, bias, dim, K, out);
  else
    conv_taps<0>(x, state, w, bias, dim, K, out);
  silu_row(out, dim, out);
  round_half(out, dim, rounding);
}

// The state update's vectors: SW floats, by their intrinsics' prefix P, and their lanes' sum in a fixed
// order (ssum; SW 0: no vector path)
#define STATE_OPS(P)                                                         \
  inline svec sload(const float* p) { return P##_loadu_ps(p); }         \
  inline void sstore(float* p, svec v) { P##_storeu_ps(p, v); }         \
  inline svec sset1(float x) { return P##_set1_ps(x); }                 \
  inline svec smul(svec a, svec b) { return P##_mul_ps(a, b); }         \
  inline svec sadd(svec a, svec b) { return P##_add_ps(a, b); }
#if defined(__AVX512F__)
constexpr long SW = 16;
typedef __m512 svec;
STATE_OPS(_mm512)
inline float ssum(svec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__)
constexpr long SW = 8;
typedef __m256 svec;
STATE_OPS(_mm256)
inline float ssum(svec v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#else
constexpr long SW = 0;
#endif

// y's dot product C . state over one row of a head's state (dstate entries) as it is advanced: v = state *
// decay + dx * B (a multiply and an add each, as everywhere in the step), written back, and the sum of v * C.
// In vectors where dstate is a multiple of theirs, their lanes summed at the end in a fixed order: as an
// `omp simd` reduction each row's sum had ended in 16 dependent scalar adds, half of a batch-1 step's state
// update.
inline float advance_row(float* st, float decay, float dx, const float* B, const float* C, long dstate) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if (dstate % SW == 0) {
    svec vdec = sset1(decay), vdx = sset1(dx), sum = sset1(0.f);
    for (long s = 0; s < dstate; s += SW) {
      svec v = sadd(smul(sload(st + s), vdec), smul(vdx, sload(B + s)));
      sstore(st + s, v);
      sum = sadd(sum, smul(v, sload(C + s)));
    }
    return ssum(sum);
  }
#endif
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (long s = 0; s < dstate; s++) {
    float v = st[s] * decay + dx * B[s];
    st[s] = v;
    acc += v * C[s];
  }
  return acc;
}

// state_update_rows for one (row, head): state [p, s] advanced, y [p] = C . state + D x
void head_update(float* state, const float* x, float dt, float A, const float* B, const float* C, const float* D,
                 float dt_bias, double lo, double hi, long headdim, long dstate, float* y) {
  double d = processed_dt(dt, dt_bias, lo, hi);
  float decay = (float)exp(d * (double)A);
  for (long p = 0; p < headdim; p++) {
    float xv = x[p], dx = (float)(d * (double)xv);
    y[p] = advance_row(state + p * dstate, decay, dx, B, C, dstate) + D[p] * xv;
  }
}

// gated_rms_norm_rows for one group of one row; gate = silu(z)
void gated_norm(const float* y, const float* gate, const float* w, long group, double eps, bool gate_first,
                float* out) {
  double acc = 0.0;
  for (long d = 0; d < group; d++) {
    double v = gate_first ? (double)(y[d] * gate[d]) : (double)y[d];
    acc += v * v;
  }
  double scale = 1.0 / sqrt(acc / (double)group + eps);
  for (long d = 0; d < group; d++) {
    if (gate_first)
      out[d] = (float)((double)(y[d] * gate[d]) * scale * (double)w[d]);
    else
      out[d] = (float)((double)y[d] * scale * (double)w[d] * (double)gate[d]);
  }
}

// The weight's and the state's columns as rows ([K, dim] each), so that the tree conv's loops run along dim.
// KK: K where known when compiled (0: K), the stride of the columns' reads then a constant (a tree pass's
// conv part took 10-13 us against 11-16 with K known at run time alone: benchmarks/pass_parts.py, 2-core EPYC
// Zen 4).
template <long KK>
void conv_columns(const float* state, const float* w, long dim, long K, float* taps, float* past) {
  const long k_len = KK ? KK : K;
  for (long c = 0; c < dim; c++)
    for (long k = 0; k < k_len; k++) {
      taps[k * dim + c] = w[c * k_len + k];
      past[k * dim + c] = state[c * k_len + k];
    }
}

// One row's tree conv (tree_jit.conv_row's arithmetic) of its nodes i0 .. i1 - 1: node i's taps over its
// path, itself at tap K - 1, its parent at K - 2, ..., then the state's newest columns; + bias, then SiLU.
// xBC [., ldx] raw (the in_proj output's xBC), state [dim, K], parents [.]; out [., ldo]. Channels and
// nodes are independent: a part of either is the same call on their columns or its node range.
void tree_conv_row(const float* xBC, long ldx, const int64_t* parents, long i0, long i1, const float* state,
                   const float* w, const float* bias, long dim, long K, float* out, long ldo, int64_t rounding) {
  thread_local std::vector<float> cols;
  cols.resize((size_t)(2 * K * dim));
  float *taps = cols.data(), *past = taps + K * dim;
  if (K == 4)
    conv_columns<4>(state, w, dim, K, taps, past);
  else
    conv_columns<0>(state, w, dim, K, taps, past);
  for (long i = i0; i < i1; i++) {
    float* o = out + i * ldo;
    for (long c = 0; c < dim; c++) o[c] = bias ? bias[c] : 0.f;
    long pos = i;
    for (long k = K - 1; k >= 0; k--) {  // tap k reads the node K - 1 - k steps up the path
      const float *src = pos >= 0 ? xBC + pos * ldx : past + (K + pos) * dim, *tap = taps + k * dim;
      for (long c = 0; c < dim; c++) o[c] += tap[c] * src[c];
      pos = pos >= 0 ? parents[pos] : pos - 1;
    }
    silu_row(o, dim, o);
    round_half(o, dim, rounding);
  }
}

// One row's tree scan (tree_jit.scan_row's arithmetic), in two parts. tree_scan_decays: over nodes 0 .. n - 1
// (parents before children), from raw dt [n, ldt], each node's processed dt d, its cumulative log decay
// Atree along its path (at, doubles) and exp(Atree): work [n * heads doubles, then 2 * n * heads floats].
void tree_scan_decays(const float* dt, long ldt, const int64_t* parents, long n, const Layer& L, long H, double lo,
                      double hi, double* work) {
  double* at = work;
  float *d = (float*)(at + n * H), *decay = d + n * H;
  for (long i = 0; i < n; i++) {
    long q = parents[i];
    for (long h = 0; h < H; h++) {
      double v = processed_dt(dt[i * ldt + h], L.dt_bias[h], lo, hi);
      d[i * H + h] = (float)v;
      at[i * H + h] = v * (double)L.A[h] + (q >= 0 ? at[q * H + h] : 0.0);
      decay[i * H + h] = (float)exp(at[i * H + h]);
    }
  }
}

// tree_scan_nodes: nodes i0 .. i1 - 1's outputs from the conv's outputs conv [., dim] (x, B, C side by side),
// the state's term xs [., heads * headdim] (C_i . x0, by stree_state_term) and tree_scan_decays' work (made
// for at least nodes 0 .. i1 - 1): y [., heads * headdim] = exp(Atree_i) xs_i + the sum over i's
// ancestors-or-self j of exp(Atree_i - Atree_j) (C_i . B_j) dt_j x_j, + D x_i. A node's y is its own memory
// (its row of y, every head), so that a row's nodes split over the threads share no line they write (split
// by heads, two threads each wrote half of every node's row and of the shared work's lines: a 16-node
// chain's scan took longer on two threads than on one, 2-core Xeon)
void tree_scan_nodes(const float* conv, long dim, const int64_t* parents, long n, long i0, long i1, const float* xs,
                     const Layer& L, const Sizes& sz, float* y, const double* work) {
  long H = sz.heads, Pd = sz.headdim, S = sz.d_state, G = sz.groups, HP = H * Pd, per_group = H / G;
  const double* at = work;
  const float *d = (const float*)(at + n * H), *decay = d + n * H;
  float cb[64];
  for (long i = i0; i < i1; i++) {
    const float *x = conv + i * dim, *C = x + HP + G * S;
    float* acc = y + i * HP;
    for (long h = 0; h < H; h++) {
      const float *D = L.D + h * Pd, *xh = x + h * Pd, *made = xs + i * HP + h * Pd;
      float dec = decay[i * H + h], *a = acc + h * Pd;
      for (long p = 0; p < Pd; p++) a[p] = D[p] * xh[p] + dec * made[p];
    }
    for (long j = i; j >= 0; j = parents[j]) {
      const float *xj = conv + j * dim, *Bj = xj + HP;
      for (long g = 0; g < G; g++) {
        float s0 = 0.f;
#pragma omp simd reduction(+ : s0)
        for (long s = 0; s < S; s++) s0 += C[g * S + s] * Bj[g * S + s];
        cb[g] = s0;
      }
      for (long h = 0; h < H; h++) {
        float coef = (float)exp(at[i * H + h] - at[j * H + h]) * cb[h / per_group] * d[j * H + h];
        for (long p = 0; p < Pd; p++) acc[h * Pd + p] += coef * xj[h * Pd + p];
      }
    }
    round_half(acc, HP, sz.rounding);
  }
}

// A thread's scratch of at least ``count`` elements: grown where it is short, never shrunk. (std::vector's
// resize down and up again value-initialises every element it adds back: with tree passes of a few sizes in
// turn, a 16-node pass after a 4-node one zeroed some 0.4 MB of scratch that it then overwrote.)
template <class T>
T* scratch_of(std::vector<T>& v, long count) {
  if ((long)v.size() < count) v.resize((size_t)count);
  return v.data();
}

// Where part ``part`` of ``parts`` of a row's n nodes (parents [n], parents before children) starts, the
// scan's work (each node's ancestors-or-self) shared about equally: node i's share its depth + 1.
long node_split(const int64_t* parents, long n, long part, long parts) {
  if (part <= 0) return 0;
  if (part >= parts) return n;
  thread_local std::vector<long> depth;
  depth.resize((size_t)n);
  long total = 0;
  for (long i = 0; i < n; i++) total += depth[i] = parents[i] >= 0 ? depth[parents[i]] + 1 : 1;
  long acc = 0;
  for (long i = 0; i < n; i++) {
    if (acc * parts >= total * part) return i;
    acc += depth[i];
  }
  return n;
}

// Where part ``part`` of ``parts`` of ``dim`` channels starts: whole vectors of 16 floats, the last part
// taking the rest.
long channel_split(long dim, long part, long parts) {
  if (part >= parts) return dim;
  long at = dim * part / parts / 16 * 16;
  return at < dim ? at : dim;
}

// The embeddings of ``rows`` tokens into x [rows, d_model].
void embed_rows(const Model* m, const int64_t* tokens, long rows, float* x) {
  long D = m->n.d_model;
  for (long r = 0; r < rows; r++)
    for (long d = 0; d < D; d++) x[r * D + d] = m->embed[tokens[r] * D + d];
}

// Rows from which a block's row-wise work (its norms, SiLU, roundings and residual add) runs over the
// threads, a share of the rows each: a prefill's scalar norms in double, one row after another, had taken
// it longer than its products, and a tree pass of 8 nodes at batch 1 (the shipped target, float16) spent
// about a third of its time on one thread while the other waited, in this work and in its conv and scan
// (below); a parallel loop costs about half a microsecond to start on the 2-core EPYC, a row of that
// block's work a few
constexpr long ROWS_APART = 4;

// Elements (a tree's nodes times a head's state, in all) from which a tree pass's conv and scan split a row
// over the threads too, a part of its nodes each
constexpr long SPLIT_WORK = 2048;

// f(i) for each i < count: over the threads where ``apart`` (a static share each), else in this thread
// alone (a parallel loop whose `if` is false still starts a team of one, a third of a microsecond)
template <class F>
void for_each(long count, bool apart, int threads, F f) {
  if (apart) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long i = 0; i < count; i++) f(i);
  } else {
    for (long i = 0; i < count; i++) f(i);
  }
}

// v [rows, cols] rounded in place to a half model's values (round_half), rows over the threads from
// ROWS_APART
void round_rows(float* v, long rows, long cols, int64_t mode, int threads) {
  if (mode < 0) return;
  if (threads > 1 && rows >= ROWS_APART)
    for_each(rows, true, threads, [&](long r) { round_half(v + r * cols, cols, mode); });
  else
    round_half(v, rows * cols, mode);
}

// Rows up to which a product takes its weight's half pack (Sizes::half_rows, mamba_step.py's default 8; a
// decoding call measures it where it runs, fused_step.measure_half_rows). A few rows stream the
// weight from memory, which a half pack halves; many are bound by their multiply-adds, which the widening
// of each vector slows. In decoding the float32 packs come cold: the steps between trees read the half
// packs alone, so a tree's products of float32 weights stream twice the bytes from memory, not from the
// caches. Timed in turns with plain steps as decoding has them (benchmarks/pass_parts.py, shipped float16
// target, batch 1, 2-core EPYC Zen 4), a greedy iteration of 4 nodes took 1.85 steps with half packs against
// 2.45-2.79 with float32 ones, of 6 nodes 2.15-2.32 against 2.22-2.48, of 8 as long, of 13 and 16 nodes a
// tenth longer (there the multiply-adds bind). (Up to 3 rows, as first chosen from products timed back to
// back, warm, a 4-node tree cost about as much as a 6-node one.) On the 2-core Intel Xeon the other way:
// with half packs for every row count, a 16-node chain took 3.35 steps against 3.68, 13 nodes 2.78 against
// 2.95, and the plain steps between them 2-5% less (the float32 packs no longer pushed the half ones out).

// y [M, N] = x [M, K] @ W.T (+ bias) for a weight packed as wf (float32) and, where not null, wh (the
// model's half dtype): the same sums either way
inline void product(const Model* m, const float* x, long M, long K, long ldx, const float* wf, const void* wh,
                    long N, float* y, long ldy, const float* bias, int threads) {
  if (wh && M <= m->n.half_rows)
    stree_gemm_typed(x, M, K, ldx, wh, N, y, ldy, bias, threads, m->n.rounding);
  else
    stree_gemm(x, M, K, ldx, wf, N, y, ldy, bias, threads);
}

// A block's start for ``rows`` tokens: the RMSNorm of x into h, then in_proj into proj [rows, d_in_proj].
void block_in(const Model* m, const Layer& L, long rows, const float* x, float* h, float* proj, int threads) {
  long D = m->n.d_model, P = m->n.d_in_proj;
  for_each(rows, threads > 1 && rows >= ROWS_APART, threads, [&](long r) {
    rms_norm(x + r * D, D, L.norm_w, m->e.eps, h + r * D);
    round_half(h + r * D, D, m->n.rounding);
  });
  product(m, h, rows, D, D, L.in_w, L.in_h, P, proj, P, L.in_b, threads);
  round_rows(proj, rows, P, m->n.rounding, threads);
}

// A block's end for ``rows`` tokens: the gated norm of y [rows, d_inner] by silu(z) (z: the first
// d_inner of each in_proj output row, proj [rows, d_in_proj]), out_proj, and the residual add into x.
void block_out(const Model* m, const Layer& L, long rows, const float* proj, const float* y, float* gate,
               float* normed, float* out, float* x, int threads) {
  const Sizes& n = m->n;
  long D = n.d_model, P = n.d_in_proj, I = n.d_inner;
  bool apart = threads > 1 && rows >= ROWS_APART;
  for_each(rows, apart, threads, [&](long r) {
    const float* z = proj + r * P;
    silu_row(z, I, gate + r * I);
    for (long g0 = 0; g0 < I; g0 += n.norm_group)
      gated_norm(y + r * I + g0, gate + r * I + g0, L.gnorm_w + g0, n.norm_group, m->e.gnorm_eps, n.gate_first != 0,
                 normed + r * I + g0);
    round_half(normed + r * I, I, n.rounding);
  });
  product(m, normed, rows, I, I, L.out_w, L.out_h, D, out, D, L.out_b, threads);
  auto add = [&](float* o, float* xr, long count) {  // (the residual add of count entries)
    round_half(o, count, n.rounding);
    for (long i = 0; i < count; i++) xr[i] += o[i];
    if (n.half_residual) round_half(xr, count, n.rounding);
  };
  if (apart)
    for_each(rows, true, threads, [&](long r) { add(out + r * D, x + r * D, D); });
  else
    add(out, x, rows * D);
}

// The state update of b rows' tokens in one layer, (row, head) pairs over the threads where ``wide``: row
// r's tokens are rows start[r] .. start[r + 1] - 1 of proj [., d_in_proj] and conv [., conv_dim] (start
// null: one token a row, row r's at r), each advancing the row's SSM state in ss [b, heads, headdim,
// d_state] in turn, y [., d_inner] its output; the dt clamped to [lo, hi].
void update_states(const Model* m, const Layer& L, long b, const int64_t* start, const float* proj,
                   const float* conv, float* ss, double lo, double hi, float* y, int threads, bool wide) {
  const Sizes& n = m->n;
  long P = n.d_in_proj, I = n.d_inner, CD = n.conv_dim, S = n.d_state, H = n.heads;
  long HP = H * n.headdim, per_group = H / n.groups;
  for_each(b * H, wide, threads, [&](long t) {
    long r = t / H, hd = t % H;
    for (long row = start ? start[r] : r; row < (start ? start[r + 1] : r + 1); row++) {
      const float* c = conv + row * CD;  // x [heads, headdim], B and C [groups, d_state]
      const float* group_B = c + HP + hd / per_group * S;
      head_update(ss + t * n.headdim * S, c + hd * n.headdim, proj[row * P + I + CD + hd], L.A[hd], group_B,
                  group_B + n.groups * S, L.D + hd * n.headdim, L.dt_bias[hd], lo, hi, n.headdim, S,
                  y + row * I + hd * n.headdim);
    }
  });
}

// ``rows`` tokens, one a row, through every block: row i's conv window at conv_states + l * cstride + i *
// conv_dim * d_conv and SSM state at ssm_states + l * sstride + i * heads * headdim * d_state in layer l (a
// cache's rows, or a draft's node slots), advanced in place. Returns the rows' hidden states [rows,
// d_model] after the last block (the thread's scratch: read before its next call). Inlined, as the step's
// body was before the draft shared it.
__attribute__((always_inline)) inline float* step_rows(const Model* m, const int64_t* tokens, long rows,
                                                      float* conv_states, long cstride, float* ssm_states,
                                                      long sstride, int threads) {
  const Sizes& n = m->n;
  long D = n.d_model, P = n.d_in_proj, I = n.d_inner, CD = n.conv_dim, K = n.d_conv, S = n.d_state;
  long HP = n.heads * n.headdim;
  thread_local std::vector<float> scratch;  // (grown to the most rows a thread has stepped, never freed)
  float* x = scratch_of(scratch, rows * (3 * D + P + CD + 3 * I));
  float *h = x + rows * D, *out = h + rows * D, *proj = out + rows * D, *conv = proj + rows * P;
  float *y = conv + rows * CD, *gate = y + rows * I, *normed = gate + rows * I;
  // rows (and their heads) are independent: over the threads only where it is worth waking them (a step of
  // one row split its conv's channels and its heads over the threads too, as a tree pass once did: timed alone
  // it was no faster, and decoding at batch 1 measured 8% slower, benchmarks/speculation_ab.py)
  bool wide = rows * HP * S >= (1 << 16);
  embed_rows(m, tokens, rows, x);
  for (long l = 0; l < n.layers; l++) {
    const Layer& L = m->layer[l];
    block_in(m, L, rows, x, h, proj, threads);
    float* cs = conv_states + l * cstride;
    for_each(rows, wide, threads, [&](long r) {
      conv_row(proj + r * P + I, cs + r * CD * K, L.conv_w, L.conv_b, CD, K, conv + r * CD, n.rounding);
    });
    update_states(m, L, rows, nullptr, proj, conv, ssm_states + l * sstride, m->e.dt_lo, m->e.dt_hi, y, threads, wide);
    round_half(y, rows * I, n.rounding);
    block_out(m, L, rows, proj, y, gate, normed, out, x, threads);
  }
  return x;
}

// The final norm and a head of V rows (head_w, packed; head_h, its half pack or null) of rows at[j] (null: j)
// of x [., d_model], for j < k: logits [k, V].
__attribute__((always_inline)) inline void head_rows(const Model* m, const float* x, const int64_t* at, long k,
                                                    const float* head_w, const void* head_h, long V, float* logits,
                                                    int threads) {
  long D = m->n.d_model;
  thread_local std::vector<float> h;
  h.resize((size_t)(k * D));
  float* hd = h.data();
  for_each(k, threads > 1 && k >= ROWS_APART, threads, [&](long j) {
    rms_norm(x + (at ? at[j] : j) * D, D, m->final_w, m->e.final_eps, hd + j * D);
    round_half(hd + j * D, D, m->n.rounding);
  });
  if (k) product(m, hd, k, D, D, head_w, head_h, V, logits, V, nullptr, threads);
  round_rows(logits, k, V, m->n.rounding, threads);
}

// Each row's first counts[r] (>= 1) of tokens [b, T] fed into the conv and SSM states [layers, b, ...]
// (advanced in place), the dt clamped to [lo, hi], token after token with the step's arithmetic (its conv
// window and state update), the products over a block's tokens of every row at once: a product sums
// each entry in the same order whatever its rows, so the states are exactly those of counts[r] steps.
// Returns each row's hidden state after its last token [b, d_model] (the thread's scratch).
float* feed_rows(const Model* m, const int64_t* tokens, const int64_t* counts, long b, long T, float* conv_states,
                 float* ssm_states, double lo, double hi, int threads) {
  const Sizes& n = m->n;
  long D = n.d_model, P = n.d_in_proj, I = n.d_inner, CD = n.conv_dim, K = n.d_conv, S = n.d_state;
  long HP = n.heads * n.headdim;
  // a block of each row's tokens at a time: the scratch stays a block's (b * BLOCK rows), however long
  // the prompts
  constexpr long BLOCK = 64;
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> packed;
  scratch_of(packed, b * BLOCK + b + 1);
  long rows_max = b * BLOCK;
  float* x = scratch_of(scratch, b * BLOCK * (3 * D + P + CD + 3 * I) + b * D);
  float *h = x + rows_max * D, *out = h + rows_max * D, *proj = out + rows_max * D;
  float *conv = proj + rows_max * P, *y = conv + rows_max * CD, *gate = y + rows_max * I, *normed = gate + rows_max * I;
  float* last = normed + rows_max * I;  // each row's hidden state after its last token
  int64_t *tok = packed.data(), *start = tok + rows_max;  // the block's tokens, row r's from start[r]
  // a row's conv over its channels in parts where rows are fewer than threads (the window of each channel is
  // its own), its state update over (row, head) pairs
  long parts = b < threads ? threads / b : 1;
  int64_t chain[BLOCK];  // a chain's parents
  for (long i = 0; i < BLOCK; i++) chain[i] = i - 1;
  for (long t0 = 0; t0 < T; t0 += BLOCK) {
    long N = 0;
    for (long r = 0; r < b; r++) {
      start[r] = N;
      long len = counts[r] - t0 < BLOCK ? counts[r] - t0 : BLOCK;
      for (long j = 0; j < len; j++) tok[N + j] = tokens[r * T + t0 + j];
      N += len > 0 ? len : 0;
    }
    start[b] = N;
    if (!N) break;
    bool wide = N * HP * S >= (1 << 16);
    embed_rows(m, tok, N, x);
    for (long l = 0; l < n.layers; l++) {
      const Layer& L = m->layer[l];
      block_in(m, L, N, x, h, proj, threads);
      float* cs = conv_states + l * b * CD * K;  // (the layer's windows; its SSM states below)
      for_each(b * parts, wide, threads, [&](long t) {
        long r = t / parts, c0 = channel_split(CD, t % parts, parts), c1 = channel_split(CD, t % parts + 1, parts);
        long len = start[r + 1] - start[r];
        if (!len) return;
        // the block's tokens as a chain (the tree conv's loops run along the channels, the step's conv
        // one channel at a time; each output sums the same products in the same order), then the window
        // moved past them: slot j holds the token len - K + j, or, before them, the old slot j + len
        const float* raw = proj + start[r] * P + I;
        float* window = cs + r * CD * K;
        tree_conv_row(raw + c0, P, chain, 0, len, window + c0 * K, L.conv_w + c0 * K, L.conv_b ? L.conv_b + c0 : nullptr,
                      c1 - c0, K, conv + start[r] * CD + c0, CD, n.rounding);
        for (long c = c0; c < c1; c++)
          for (long j = 0; j < K; j++) {
            long q = len - K + j;
            window[c * K + j] = q >= 0 ? raw[q * P + c] : window[c * K + j + len];
          }
      });
      update_states(m, L, b, start, proj, conv, ssm_states + l * b * HP * S, lo, hi, y, threads, wide);
      round_half(y, N * I, n.rounding);
      block_out(m, L, N, proj, y, gate, normed, out, x, threads);
    }
    for (long r = 0; r < b; r++)
      if (counts[r] > t0 && counts[r] <= t0 + BLOCK)
        for (long d = 0; d < D; d++) last[r * D + d] = x[(start[r] + counts[r] - t0 - 1) * D + d];
  }
  return last;
}

// A call's conv states [count] as float32: the array itself for a float32 model; a half model's (of its
// dtype, half values, which float32 holds exactly) widened into a buffer of the thread's (``buf``: one
// per array a call holds at once) and, where the call writes them (``written``), narrowed back as it ends.
class ConvStates {
 public:
  ConvStates(void* at, long count, int64_t rounding, bool written, std::vector<float>& buf)
      : at_(at), count_(count), rounding_(rounding), written_(written) {
    if (rounding < 0 || !at) {
      data = (float*)at;
      return;
    }
    buf.resize((size_t)count);
    data = buf.data();
    if (rounding == 0) {
      long i = 0;
      const _Float16* h = (const _Float16*)at;
#if defined(__F16C__)  // (GCC widens _Float16 one element at a time, as perf showed in a plain step)
      for (; i + 8 <= count; i += 8) _mm256_storeu_ps(data + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
#endif
      for (; i < count; i++) data[i] = (float)h[i];
    } else {
      const uint16_t* h = (const uint16_t*)at;
#pragma omp simd
      for (long i = 0; i < count; i++) data[i] = __builtin_bit_cast(float, (uint32_t)h[i] << 16);
    }
  }
  ~ConvStates() {
    if (rounding_ < 0 || !written_ || !at_) return;
    if (rounding_ == 0) {  // (exact: the values are float16's)
      long i = 0;
      _Float16* h = (_Float16*)at_;
#if defined(__F16C__)
      for (; i + 8 <= count_; i += 8)
        _mm_storeu_si128((__m128i*)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(data + i), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; i < count_; i++) h[i] = (_Float16)data[i];
    } else {
      uint16_t* h = (uint16_t*)at_;
#pragma omp simd
      for (long i = 0; i < count_; i++) h[i] = (uint16_t)(__builtin_bit_cast(uint32_t, data[i]) >> 16);
    }
  }
  ConvStates(const ConvStates&) = delete;
  ConvStates& operator=(const ConvStates&) = delete;
  float* data;

 private:
  void* at_;
  long count_;
  int64_t rounding_;
  bool written_;
};

// The conv states of every layer's b rows, [layers, b, conv_dim, d_conv]: their count
long conv_count(const Model* m, long b) { return m->n.layers * b * m->n.conv_dim * m->n.d_conv; }

thread_local std::vector<float> cache_conv, node_conv_buf, before_conv_buf;  // (ConvStates' buffers)

// The first index of the row's largest entry, as a scan taking each entry strictly above the best so far
// (NaNs never taken; a NaN first entry stays the choice): the largest by lanes, whose maximum a NaN
// never enters (x > m ? x : m keeps m), then the first entry equal to it. Scalar, the scan's compare
// and select per entry took a 13-node iteration's walk some microseconds a node.
long first_max(const float* row, long V) {
  float best = row[0];
  if (best != best) return 0;
  constexpr long W = 16;
  float lane[W];
  for (long j = 0; j < W; j++) lane[j] = best;
  long i = 0;
  for (; i + W <= V; i += W)
#pragma omp simd
    for (long j = 0; j < W; j++) lane[j] = row[i + j] > lane[j] ? row[i + j] : lane[j];
  for (; i < V; i++) best = row[i] > best ? row[i] : best;
  for (long j = 0; j < W; j++) best = lane[j] > best ? lane[j] : best;
  for (i = 0; i + W <= V; i += W) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (long j = 0; j < W; j++) hit |= row[i + j] == best;
    if (hit) break;
  }
  for (; row[i] != best; i++) {
  }
  return i;
}

// Whether every entry is below +inf (NaN not), as one reduction (a scalar compare per entry, kept
// apart by `&=` on a bool, had taken a 13-node iteration's check about as long as its walk)
bool all_below_inf(const float* x, long count) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (long i = 0; i < count; i++) bad |= !(x[i] < INFINITY);
  return !bad;
}

// What a drafter learns of the target at one node: the softmax of its logits (its max taken off, the
// exp a polynomial's, the sum in float), the k most likely ids and their probabilities (most likely
// first; of equal ones the lower id, as steps.py's _top_laws), and token's own probability. ids [k],
// probs [k], own; work [V].
void node_law(const float* logits, long V, long k, int64_t token, int64_t* ids, float* probs, float* own, float* work) {
  float top = logits[0];
  for (long i = 1; i < V; i++) top = logits[i] > top ? logits[i] : top;
#pragma omp simd
  for (long i = 0; i < V; i++) work[i] = exp_poly(logits[i] - top);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (long i = 0; i < V; i++) sum += work[i];
  for (long i = 0; i < V; i++) work[i] /= sum;
  for (long j = 0; j < k; j++) probs[j] = -INFINITY, ids[j] = 0;
  // (a block none of whose entries beats the k-th kept is passed over by one vector compare: scalar, the
  // compare and branch per entry had taken most of the law's time)
  constexpr long W = 16;
  for (long i0 = 0; i0 < V; i0 += W) {
    long end = i0 + W < V ? i0 + W : V;
    float least = probs[k - 1];
    int beats = 0;
#pragma omp simd reduction(| : beats)
    for (long i = i0; i < end; i++) beats |= work[i] > least;
    if (!beats) continue;
    for (long i = i0; i < end; i++) {
      float p = work[i];
      if (!(p > probs[k - 1])) continue;
      long j = k - 1;
      for (; j > 0 && probs[j - 1] < p; j--) probs[j] = probs[j - 1], ids[j] = ids[j - 1];
      probs[j] = p, ids[j] = i;
    }
  }
  *own = work[token];
}

}  // namespace

// The step's arguments as one array of int64 (see mamba_step.py): the model's layout, the tokens [b]
// (int64), b, the conv states [layers, b, conv_dim, d_conv] and SSM states [layers, b, heads, headdim,
// d_state] (float32, contiguous, advanced in place), the rows whose logits are made (int64 [k], or
// 0: every row, k = b), k, the logits [k, vocab], threads, and where a greedy step wants them (else 0),
// each logits row's choice (int64 [k]: its first largest entry, as first_max) and whether it is below
// +inf throughout (uint8 [k]): the host's argmax and check of the logits, a few microseconds of work,
// had cost a plain step's host path a tenth of the step in calls; then, with a choice, laws (0: none) and,
// for each row, the target's law for a drafter (node_law, at the row's choice): top ids [k, laws] (int64),
// their probabilities [k, laws] and the choice's own [k] (float32; torch's softmax, top-k and gather
// after the call had taken a plain step a sixth more); last, lengths (int64 [b], or 0: none), each advanced by
// one with the states (a cache's, as a greedy iteration advances them). Returns 0; or, where nothing was
// computed, 1 + the first row whose token is outside the vocabulary, or -1 - the first entry of the rows
// outside [0, b).
extern "C" long stree_mamba_step(const int64_t* a) {
  const Model* m = (const Model*)a[0];
  const int64_t* tokens = (const int64_t*)a[1];
  long b = a[2];
  float *conv_states = (float*)a[3], *ssm_states = (float*)a[4];
  const int64_t* heads_at = (const int64_t*)a[5];
  long k = a[6];
  float* logits = (float*)a[7];
  int threads = (int)a[8];
  int64_t* choice = (int64_t*)a[9];
  uint8_t* finite = (uint8_t*)a[10];
  const Sizes& n = m->n;
  for (long r = 0; r < b; r++)
    if (tokens[r] < 0 || tokens[r] >= n.vocab) return r + 1;
  for (long j = 0; heads_at && j < k; j++)
    if (heads_at[j] < 0 || heads_at[j] >= b) return -1 - j;
  long HP = n.heads * n.headdim;
  ConvStates conv(conv_states, conv_count(m, b), n.rounding, true, cache_conv);
  float* x = step_rows(m, tokens, b, conv.data, b * n.conv_dim * n.d_conv, ssm_states, b * HP * n.d_state, threads);
  head_rows(m, x, heads_at, k, m->head_w, m->head_h, n.vocab, logits, threads);
  for (long j = 0; choice && j < k; j++) {
    choice[j] = first_max(logits + j * n.vocab, n.vocab);
    finite[j] = all_below_inf(logits + j * n.vocab, n.vocab);
  }
  long laws = choice ? a[11] : 0;
  if (laws) {
    int64_t* top_ids = (int64_t*)a[12];
    float *top_probs = (float*)a[13], *own = (float*)a[14];
    for_each(k, threads > 1 && k > 1, threads, [&](long j) {
      thread_local std::vector<float> work;
      work.resize((size_t)n.vocab);
      node_law(logits + j * n.vocab, n.vocab, laws, choice[j], top_ids + j * laws, top_probs + j * laws, own + j,
               work.data());
    });
  }
  int64_t* lengths = (int64_t*)a[15];
  for (long r = 0; lengths && r < b; r++) lengths[r] += 1;
  return 0;
}

// A prefill's arguments as one array of int64 (see mamba_step.py): the model's layout, the tokens [b, T]
// (int64, row-major), counts [b] (int64, 1 <= counts[r] <= T: row r feeds its first counts[r]), b, T,
// the conv and SSM states (advanced in place by every row's tokens), the logits [b, vocab] after each
// row's last token, the dt clamp's two doubles (as their bits: a prefill's may not be decoding's),
// threads. feed_rows' arithmetic: the states and logits are exactly those of counts[r] steps. Returns 0,
// or 1 + the first (row-major) fed token outside the vocabulary (nothing computed then).
extern "C" long stree_mamba_prefill(const int64_t* a) {
  const Model* m = (const Model*)a[0];
  const int64_t *tokens = (const int64_t*)a[1], *counts = (const int64_t*)a[2];
  long b = a[3], T = a[4];
  float *conv_states = (float*)a[5], *ssm_states = (float*)a[6];
  float* logits = (float*)a[7];
  double lo = __builtin_bit_cast(double, a[8]), hi = __builtin_bit_cast(double, a[9]);
  int threads = (int)a[10];
  for (long r = 0; r < b; r++)
    for (long t = 0; t < counts[r]; t++)
      if (tokens[r * T + t] < 0 || tokens[r * T + t] >= m->n.vocab) return r * T + t + 1;
  ConvStates conv(conv_states, conv_count(m, b), m->n.rounding, true, cache_conv);
  float* last = feed_rows(m, tokens, counts, b, T, conv.data, ssm_states, lo, hi, threads);
  head_rows(m, last, nullptr, b, m->head_w, m->head_h, m->n.vocab, logits, threads);
  return 0;
}

namespace {

// A tree pass over b rows' trees of n nodes (parents [rows, n], rows 1 or b, parents before children), each
// row r its first sizes[r] nodes alone (sizes null: all n; the nodes past them are neither read nor
// computed), laid back to back: row r's nodes are rows start[r] .. of the scratch (xBC raw, x and B after
// the conv, dt raw: [layers, the nodes in all, ...]), and its logits rows r * n .. of logits [b, n, vocab]
// (those past its size untouched). With `hidden`, no logits: *hidden is set to the last block's output
// [the nodes in all, d_model] (the thread's scratch, until its next pass), whose final norm and head the
// caller takes on the rows it needs (head_rows). Returns 0, or 1 + the first node (row-major) it computes
// whose token is outside the vocabulary (nothing computed then).
long tree_pass(const Model* m, const int64_t* tokens, long b, long n, const int64_t* parents, long rows,
               const int64_t* sizes, const float* conv_states, const float* ssm_states, float* xBC_s, float* x_s,
               float* dt_s, float* B_s, float* logits, int threads, const float** hidden = nullptr) {
  const Sizes& sz = m->n;
  thread_local std::vector<int64_t> starts;
  starts.resize((size_t)(b + 1));
  int64_t* start = starts.data();
  bool whole = true;
  start[0] = 0;
  for (long r = 0; r < b; r++) {
    long size = sizes ? sizes[r] : n;
    whole = whole && size == n;
    start[r + 1] = start[r] + size;
    for (long i = 0; i < size; i++)
      if (tokens[r * n + i] < 0 || tokens[r * n + i] >= sz.vocab) return r * n + i + 1;
  }
  long N = start[b];
  long D = sz.d_model, P = sz.d_in_proj, I = sz.d_inner, CD = sz.conv_dim, K = sz.d_conv, S = sz.d_state;
  long H = sz.heads, HP = H * sz.headdim, GS = sz.groups * S;
  thread_local std::vector<float> scratch;
  thread_local std::vector<double> work;
  thread_local std::vector<int64_t> fed;
  scratch_of(scratch, N * (3 * D + P + CD + 3 * I + HP));
  long parts = b < threads ? threads / b : 1;
  scratch_of(work, b * parts * 2 * n * H);  // per (row, part): at (doubles), then d and decay (floats)
  float *x = scratch.data(), *h = x + N * D, *out = h + N * D, *proj = out + N * D, *conv = proj + N * P;
  float *y = conv + N * CD, *gate = y + N * I, *normed = gate + N * I, *xs = normed + N * I;
  double* parts_work = work.data();  // (taken here: inside the parallel loop, `work` is each thread's own)
  // each row's conv and scan is its own memory, a row's nodes independent in both: over the threads as (row,
  // part) pairs, a row's nodes in parts where rows are fewer than threads, each part writing whole nodes'
  // rows (at batch 1 both had run on one thread, the other waiting, a seventh of an 8-node pass; split by
  // channels and heads, the parts' writes met in lines that moved from core to core: a 16-node chain's conv
  // and scan took 77 and 92 us of its 824 on the 2-core Xeon, split by nodes 56 and 69 of 778,
  // benchmarks/pass_parts.py, results pass_parts_xeon_192f0ee and _node_split)
  bool wide = threads > 1 && N * HP * S >= SPLIT_WORK;
  const int64_t* ids = tokens;
  if (!whole) {  // (the rows' nodes back to back)
    fed.resize((size_t)N);
    for (long r = 0; r < b; r++)
      for (long i = 0; i < start[r + 1] - start[r]; i++) fed[start[r] + i] = tokens[r * n + i];
    ids = fed.data();
  }
  PART_START();
  embed_rows(m, ids, N, x);
  for (long l = 0; l < sz.layers; l++) {
    const Layer& L = m->layer[l];
    block_in(m, L, N, x, h, proj, threads);
    PART(PART_IN);
    float *xBC_l = xBC_s + l * N * CD, *x_l = x_s + l * N * HP, *dt_l = dt_s + l * N * H, *B_l = B_s + l * N * GS;
    for_each(b * parts, wide, threads, [&](long t) {
      long r = t / parts, part = t % parts;
      const int64_t* pr = parents + (rows > 1 ? r : 0) * n;
      long at = start[r], size = start[r + 1] - at;
      // a part of the row's nodes, every channel; a row of fewer nodes than parts, a part of its channels (split
      // by nodes, a 1-node pass's conv ran on one thread: 14 -> 19 us)
      bool by_nodes = size >= parts;
      long i0 = by_nodes ? size * part / parts : 0, i1 = by_nodes ? size * (part + 1) / parts : size;
      long c0 = by_nodes ? 0 : channel_split(CD, part, parts), c1 = by_nodes ? CD : channel_split(CD, part + 1, parts);
      const float* pj = proj + at * P;
      for (long i = i0; i < i1; i++) {
        const float* raw = pj + i * P + I;
        float *xBC_i = xBC_l + (at + i) * CD, *dt_i = dt_l + (at + i) * H;
        for (long c = c0; c < c1; c++) xBC_i[c] = raw[c];
        if (by_nodes || !part)
          for (long c = 0; c < H; c++) dt_i[c] = raw[CD + c];
      }
      tree_conv_row(pj + I + c0, P, pr, i0, i1, conv_states + ((l * b + r) * CD + c0) * K, L.conv_w + c0 * K,
                    L.conv_b ? L.conv_b + c0 : nullptr, c1 - c0, K, conv + at * CD + c0, CD, sz.rounding);
      // (of x [0, HP) and B [HP, HP + GS) the channels among c0 .. c1)
      long x1 = c1 < HP ? c1 : HP, b0 = c0 > HP ? c0 : HP, b1 = c1 < HP + GS ? c1 : HP + GS;
      for (long i = i0; i < i1; i++) {
        const float* ci = conv + (at + i) * CD;
        for (long e = c0; e < x1; e++) x_l[(at + i) * HP + e] = ci[e];
        for (long e = b0; e < b1; e++) B_l[(at + i) * GS + e - HP] = ci[e];
      }
    });
    PART(PART_CONV);
    // the state's term, C_i . x0, for every row's nodes as products (each block of the state packed once;
    // rows of their own sizes one call each)
    if (whole)
      stree_state_term(conv + HP + GS, b, n, sz.groups, S, CD, n * CD, ssm_states + l * b * HP * S, H, sz.headdim,
                       xs, threads);
    else
      for (long r = 0; r < b; r++)
        stree_state_term(conv + start[r] * CD + HP + GS, 1, start[r + 1] - start[r], sz.groups, S, CD, 0,
                         ssm_states + (l * b + r) * HP * S, H, sz.headdim, xs + start[r] * HP, threads);
    PART(PART_STATE);
    for_each(b * parts, wide, threads, [&](long t) {
      long r = t / parts, part = t % parts, at = start[r], size = start[r + 1] - at;
      const int64_t* pr = parents + (rows > 1 ? r : 0) * n;
      // (each part's decays its own, over the nodes up to its last: a part's nodes' ancestors come before them)
      long i0 = node_split(pr, size, part, parts), i1 = node_split(pr, size, part + 1, parts);
      double* own = parts_work + t * 2 * n * H;
      tree_scan_decays(proj + at * P + I + CD, P, pr, i1, L, H, m->e.dt_lo, m->e.dt_hi, own);
      tree_scan_nodes(conv + at * CD, CD, pr, i1, i0, i1, xs + at * HP, L, sz, y + at * I, own);
    });
    PART(PART_SCAN);
    block_out(m, L, N, proj, y, gate, normed, out, x, threads);
    PART(PART_OUT);
  }
  if (hidden) {
    *hidden = x;
    return 0;
  }
  for_each(N, threads > 1 && N >= ROWS_APART, threads, [&](long t) {
    rms_norm(x + t * D, D, m->final_w, m->e.final_eps, h + t * D);
    round_half(h + t * D, D, sz.rounding);
  });
  if (whole) {
    product(m, h, N, D, D, m->head_w, m->head_h, sz.vocab, logits, sz.vocab, nullptr, threads);
    round_rows(logits, N, sz.vocab, sz.rounding, threads);
  } else {
    for (long r = 0; r < b; r++) {
      product(m, h + start[r] * D, start[r + 1] - start[r], D, D, m->head_w, m->head_h, sz.vocab,
              logits + r * n * sz.vocab, sz.vocab, nullptr, threads);
      round_rows(logits + r * n * sz.vocab, start[r + 1] - start[r], sz.vocab, sz.rounding, threads);
    }
  }
  return 0;
}

}  // namespace

// A tree pass's arguments as one array of int64 (see mamba_step.py): the model's layout, the tokens
// [b, n] (int64), b, n, the parents [rows, n] (int64, rows 1 or b, parents before children), rows, the
// conv and SSM states (read only), the four scratch arrays replay reads, [layers, b, n, ...] float32 (xBC
// raw, x and B after the conv, dt raw), the logits [b, n, vocab], threads. Returns 0, or 1 + the first
// node (row-major) whose token is outside the vocabulary (nothing computed then).
extern "C" long stree_mamba_tree(const int64_t* a) {
  const Model* m = (const Model*)a[0];
  ConvStates conv((void*)a[6], conv_count(m, a[2]), m->n.rounding, false, cache_conv);
  return tree_pass(m, (const int64_t*)a[1], a[2], a[3], (const int64_t*)a[4], a[5], nullptr, conv.data,
                   (const float*)a[7], (float*)a[8], (float*)a[9], (float*)a[10], (float*)a[11], (float*)a[12],
                   (int)a[13]);
}

namespace {

// Greedy verification of one row (verify_jit.greedy_walk's), resumable: from the root, each node's choice
// is the argmax of its logits (the first of equal maxima), and the walk moves to the node's first valid
// child (in index order) holding it. path [L] (root first, 0 past it), emitted [L] (the accepted drafts,
// then the last node's choice, the root's token past them), finite: whether every logit the walk read is
// below +inf (NaN not).
struct Walk {
  long v = 0, count = 1;  // the node reached, the path's length so far
  bool open = true, finite = true;

  // Walks on while the node reached has logits (at(node): its row, else null); returns -1 where the path
  // would run past L (the caller's max depth was wrong: nothing is committed), else 0.
  template <class Logits>
  long run(Logits at, long V, const int64_t* tokens, const int64_t* parents, const uint8_t* valid, long n, long L,
           int64_t* path, int64_t* emitted) {
    while (open) {
      const float* lv = at(v);
      if (!lv) return 0;
      finite = finite && all_below_inf(lv, V);
      long choice = first_max(lv, V), next = -1;
      for (long c = v + 1; c < n && next < 0; c++)
        if (parents[c] == v && valid[c] && tokens[c] == choice) next = c;
      if (next < 0) {
        emitted[count - 1] = choice;
        for (long j = count; j < L; j++) emitted[j] = tokens[0];
        open = false;
        return 0;
      }
      if (count == L) return -1;
      v = next;
      path[count] = v;
      emitted[count - 1] = tokens[v];
      count++;
    }
    return 0;
  }
};

// The head's rows a wave takes at least where the walks' chains hold fewer (topped up with the rest of each
// waiting node's subtree, in index order): a product's cost stays about one row's, the head's weight
// streamed once, for the first few rows of a tile
constexpr long HEAD_WAVE = 4;

// The node's first valid child in index order (-1: none): the chain a walk is likeliest to follow (a
// drafter's children come most likely first).
long first_child(const int64_t* parents, const uint8_t* valid, long n, long v) {
  for (long c = v + 1; c < n; c++)
    if (parents[c] == v && valid[c]) return c;
  return -1;
}

// Activation replay (replay_jit.replay_layers' arithmetic, per entry token by token: state * decay + dt x
// B in float) of one row's accepted path acc [m] in one layer, in place: the SSM state [heads, headdim,
// d_state] and the conv window [conv_dim, d_conv], from the pass's scratch of the row (xBC, x, dt, B at
// its nodes, strides of a node CD, HP, H, GS). work: m * (1 + headdim) floats.
void replay_row(const Layer& L, const Sizes& sz, double lo, double hi, const float* xBC, const float* x,
                const float* dt, const float* B, const int64_t* acc, long m, float* conv, float* ssm, float* work) {
  long H = sz.heads, Pd = sz.headdim, S = sz.d_state, CD = sz.conv_dim, K = sz.d_conv, per_group = H / sz.groups;
  long HP = H * Pd, GS = sz.groups * S;
  float *decay = work, *xs = work + m;
  for (long h = 0; h < H; h++) {
    for (long t = 0; t < m; t++) {
      long node = acc[t];
      double d = processed_dt(dt[node * H + h], L.dt_bias[h], lo, hi);
      decay[t] = (float)exp(d * (double)L.A[h]);
      for (long p = 0; p < Pd; p++) xs[t * Pd + p] = (float)(d * (double)x[node * HP + h * Pd + p]);
    }
    float* st = ssm + h * Pd * S;
    long g = h / per_group;
    for (long p = 0; p < Pd; p++) {
      float* row = st + p * S;
      for (long t = 0; t < m; t++) {
        const float* Bt = B + acc[t] * GS + g * S;
        float dec = decay[t], xv = xs[t * Pd + p];
#pragma omp simd
        for (long s = 0; s < S; s++) row[s] = row[s] * dec + xv * Bt[s];
      }
    }
  }
  // the window: slot j holds the path's node m - K + j, or, before the path, the old slot j + m (read
  // before it is written: j rises). Slot by slot, each a loop over the channels without a branch (a
  // channel's K slots one by one, each choosing its source, had taken half of a one-node replay)
  for (long j = 0; j < K; j++) {
    long q = m - K + j;
    if (q >= 0) {
      const float* src = xBC + acc[q] * CD;
      for (long c = 0; c < CD; c++) conv[c * K + j] = src[c];
    } else {
      for (long c = 0; c < CD; c++) conv[c * K + j] = conv[c * K + j + m];
    }
  }
}

}  // namespace

// A greedy iteration: the tree pass (stree_mamba_tree's arguments, a[0..13], the scratch arrays 0:
// the call's own), greedy verification of its logits, and the accepted paths' replay into the states
// (conv and SSM, advanced in place). Of the logits [b, n, vocab] only each row's path nodes' are written
// (the head is made where the walks read it). Then: valid [b, n] (uint8), L (the tree's max depth + 1),
// and the outputs path [b, L], num [b], emitted [b, L], bonus [b] (int64), finite [b] (uint8: every logit
// the row's walk read below +inf, NaN not); then k (0: none) and, at each row's path nodes, the target's laws
// (node_law) for a drafter: top ids [b, L, k] (int64), their probabilities [b, L, k] and each emitted
// token's own [b, L] (float32; 0 past a row's count); then sizes (int64 [b], or 0: every row all n
// nodes): row r's tree is its first sizes[r] nodes, the others neither computed nor walked (their
// logits untouched), so that a row drafting less costs the pass its nodes alone; last, the rows'
// lengths (int64 [b], or 0: none), each advanced by its path's length with the states (the host's
// torch add after the call had taken a tenth of the iteration's host work). Returns
// stree_mamba_tree's status (nothing computed where it is not 0), or -1 where a path ran past L
// (nothing committed).
extern "C" long stree_mamba_tree_greedy(const int64_t* a) {
  const Model* m = (const Model*)a[0];
  const Sizes& sz = m->n;
  long b = a[2], n = a[3], rows = a[5];
  const int64_t* sizes = (const int64_t*)a[25];
  long N = 0;
  for (long r = 0; r < b; r++) N += sizes ? sizes[r] : n;
  long CD = sz.conv_dim, K = sz.d_conv, H = sz.heads, HP = H * sz.headdim, GS = sz.groups * sz.d_state;
  thread_local std::vector<float> kept;  // the pass's scratch (xBC, x, dt, B), read by the replay alone
  float* xBC = scratch_of(kept, sz.layers * N * (CD + HP + H + GS));
  float *x = xBC + sz.layers * N * CD, *dt = x + sz.layers * N * HP, *B = dt + sz.layers * N * H;
  const int64_t *tokens = (const int64_t*)a[1], *parents = (const int64_t*)a[4];
  ConvStates conv((void*)a[6], conv_count(m, b), sz.rounding, true, cache_conv);
  float *conv_states = conv.data, *ssm_states = (float*)a[7];
  float* logits = (float*)a[12];
  const float* hidden = nullptr;
  int threads = (int)a[13];
  long status = tree_pass(m, tokens, b, n, parents, rows, sizes, conv_states, ssm_states, xBC, x, dt, B, logits,
                          threads, &hidden);
  if (status) return status;
  const uint8_t* valid = (const uint8_t*)a[14];
  long L = a[15];
  int64_t *path = (int64_t*)a[16], *num = (int64_t*)a[17], *emitted = (int64_t*)a[18], *bonus = (int64_t*)a[19];
  uint8_t* finite = (uint8_t*)a[20];
  long V = sz.vocab;
  // The head on the nodes the walks read, wave by wave, not on every node: a walk reads its path's nodes
  // alone, and the head's product was the pass's largest per node. A wave takes, for each walk waiting on
  // a node, the chain of first children from it; the walks go on over what it made.
  thread_local std::vector<int64_t> first, made, wave;  // row r's first node in the pass; a node's row of
  thread_local std::vector<float> heads;                // `heads` (-1: not made); the wave's nodes
  thread_local std::vector<Walk> walks;
  first.resize((size_t)(b + 1));
  first[0] = 0;
  for (long r = 0; r < b; r++) first[r + 1] = first[r] + (sizes ? sizes[r] : n);
  made.assign((size_t)N, -1);
  walks.assign((size_t)b, Walk());
  for (long r = 0; r < b * L; r++) path[r] = 0;
  long rows_made = 0;
  while (true) {
    wave.clear();
    for (long r = 0; r < b; r++) {  // (each walk's chain)
      const Walk& w = walks[r];
      long size = first[r + 1] - first[r];
      const int64_t* pr = parents + (rows > 1 ? r : 0) * n;
      if (!w.open || made[first[r] + w.v] >= 0) continue;
      for (long u = w.v; u >= 0; u = first_child(pr, valid + r * n, size, u))
        if (made[first[r] + u] < 0) wave.push_back(first[r] + u);
    }
    if (wave.empty()) break;
    for (long r = 0; r < b && (long)wave.size() < HEAD_WAVE; r++) {  // (topped up with the rest of its subtree)
      const Walk& w = walks[r];
      if (!w.open) continue;
      const int64_t* pr = parents + (rows > 1 ? r : 0) * n;
      long size = first[r + 1] - first[r];
      thread_local std::vector<uint8_t> under;
      under.assign((size_t)size, 0);
      under[w.v] = 1;
      for (long u = w.v + 1; u < size && (long)wave.size() < HEAD_WAVE; u++) {
        under[u] = under[pr[u]];
        long at = first[r] + u;
        if (under[u] && made[at] < 0 && std::find(wave.begin(), wave.end(), at) == wave.end()) wave.push_back(at);
      }
    }
    long k = (long)wave.size();
    // (grown wave by wave to the rows made: room for every node held a second copy of all the logits)
    if ((long)heads.size() < (rows_made + k) * V) heads.resize((size_t)((rows_made + k) * V));
    PART(PART_WALK);
    head_rows(m, hidden, wave.data(), k, m->head_w, m->head_h, V, heads.data() + rows_made * V, threads);
    PART(PART_HEAD);
    PART_COUNT(PART_HEAD_ROWS, k);
    for (long j = 0; j < k; j++) made[wave[j]] = rows_made + j;
    rows_made += k;
    for (long r = 0; r < b; r++) {
      const float* hr = heads.data();
      const int64_t* mr = made.data() + first[r];
      auto at = [hr, mr, V](long v) { return mr[v] < 0 ? nullptr : hr + mr[v] * V; };
      if (walks[r].run(at, V, tokens + r * n, parents + (rows > 1 ? r : 0) * n, valid + r * n,
                       first[r + 1] - first[r], L, path + r * L, emitted + r * L))
        return -1;
    }
  }
  for (long r = 0; r < b; r++) {  // (the logits of each row's path, where the caller reads them)
    num[r] = walks[r].count;
    finite[r] = walks[r].finite;
    bonus[r] = emitted[r * L + num[r] - 1];
    for (long t = 0; t < num[r]; t++)
      memcpy(logits + (r * n + path[r * L + t]) * V, heads.data() + made[first[r] + path[r * L + t]] * V,
             (size_t)V * sizeof(float));
  }
  PART(PART_WALK);
  long SS = HP * sz.d_state, jobs = sz.layers * b;
  // Each (layer, row) replays alone, so they are split over the threads (the pass's products have just run
  // on them): replayed on one, a 16-node chain accepted whole had taken 0.6 of a plain step more than split
  // (benchmarks/pass_ab.py --accepted, docs/benchmarks.md); the root alone too, whose replay reads and writes
  // every layer's SSM state after the pass's products pushed them out of the core's caches (split, a 1-node
  // replay of the shipped float16 target took 10-11 us, on one thread 18-19: benchmarks/pass_parts.py, 2-core
  // EPYC Zen 4)
  for_each(jobs, threads > 1 && jobs > 1, threads, [&](long j) {
    long l = j / b, r = j % b, at = l * N;  // (at: the row's first node in the layer's scratch)
    for (long q = 0; q < r; q++) at += sizes ? sizes[q] : n;
    thread_local std::vector<float> work;
    work.resize((size_t)(L * (1 + sz.headdim)));
    replay_row(m->layer[l], sz, m->e.dt_lo, m->e.dt_hi, xBC + at * CD, x + at * HP, dt + at * H, B + at * GS,
               path + r * L, num[r], conv_states + (l * b + r) * CD * K, ssm_states + (l * b + r) * SS, work.data());
  });
  PART(PART_REPLAY);
  int64_t* lengths = (int64_t*)a[26];
  if (lengths)
    for (long r = 0; r < b; r++) lengths[r] += num[r];
  long k = a[21];
  if (k) {
    int64_t* top_ids = (int64_t*)a[22];
    float *top_probs = (float*)a[23], *own = (float*)a[24];
    thread_local std::vector<float> work;
    work.resize((size_t)V);
    for (long r = 0; r < b; r++)
      for (long t = 0; t < L; t++) {
        long at = r * L + t;
        if (t < num[r]) {
          node_law(logits + (r * n + path[at]) * V, V, k, emitted[at], top_ids + at * k, top_probs + at * k, own + at,
                   work.data());
        } else {
          for (long j = 0; j < k; j++) top_ids[at * k + j] = 0, top_probs[at * k + j] = 0.f;
          own[at] = 0.f;
        }
      }
  }
  PART(PART_LAWS);
  PART_COUNT(PART_CALLS, 1);
  return 0;
}

namespace {

// The c largest entries of row [V] into out, largest first, ties to the lower index; entries that are NaN
// or -inf are taken last, lowest index first (a draft's children need c distinct ids whatever the logits).
void top_entries(const float* row, long V, long c, int64_t* out) {
  constexpr long MAX_C = 64;
  float best[MAX_C];
  long have = 0;
  for (long i = 0; i < V; i++) {
    float v = row[i];
    if (!(v > (have < c ? -INFINITY : best[c - 1]))) continue;  // (NaN, -inf, or not above the c-th)
    long j = have < c ? have++ : c - 1;
    for (; j > 0 && v > best[j - 1]; j--) best[j] = best[j - 1], out[j] = out[j - 1];
    best[j] = v, out[j] = i;
  }
  for (long i = 0; have < c && i < V; i++) {
    bool taken = false;
    for (long j = 0; j < have && !taken; j++) taken = out[j] == i;
    if (!taken) out[have++] = i;
  }
}

}  // namespace

// A greedy draft of one tree shape by a drafter model in one call: each row's new tokens fed (feed_rows,
// the step's dt clamp), then level by level each node's children are its parent's most likely tokens under
// a head of V rows (a cut of the vocabulary: ids[i] is row i's token; 0: row i is token i), in order, and
// every node that is not at the deepest level is stepped from a copy of its parent's state, so that the
// next call finds the state of any such node on the accepted path. Arguments, as one array of int64:
// the model's layout, tokens [b, T], counts [b] (1 <= counts[r] <= T), b, T, parents [n] (int64: -1,
// then each node's parent before it), n, the conv and SSM states [layers, b, ...] (advanced in place by
// the feed), the node slots' conv and SSM states [layers, n * b, ...] (slot s of row r at s * b + r),
// the head (packed as gemm.pack packs) and V, ids (int64 [V], or 0), the draft's tokens [b, n] (int64:
// every node's but the root's written), each node's slot [n] (int64, -1: a node not stepped), threads;
// then restore [b] (int64, or 0: none) and the node slots' conv and SSM states of an earlier draft with
// their rows in a layer: row r's states are first those of that draft's row restore[r] where it is >= 0
// (the state after a node of it that the new tokens followed), then fed. The stepped nodes take the
// slots 0, 1, ... level by level, in index order within a level. Returns 0;
// 1 + the first (row-major) fed token outside the vocabulary, -1 where the parents are no tree (or a row
// to restore past the earlier slots), -2 where
// a node has more than 64 children or the head fewer rows than a node's children (nothing computed then).
extern "C" long stree_mamba_draft(const int64_t* a) {
  const Model* m = (const Model*)a[0];
  const int64_t *tokens = (const int64_t*)a[1], *counts = (const int64_t*)a[2];
  long b = a[3], T = a[4];
  const int64_t* parents = (const int64_t*)a[5];
  long n = a[6];
  float *ssm_states = (float*)a[8], *node_ssm = (float*)a[10];
  const float* head_w = (const float*)a[11];
  const void* head_h = head_w == m->head_w ? m->head_h : nullptr;  // (a cut of the head has no half pack)
  long V = a[12];
  const int64_t* ids = (const int64_t*)a[13];
  int64_t *drafted = (int64_t*)a[14], *slot = (int64_t*)a[15];
  int threads = (int)a[16];
  const int64_t* restore = (const int64_t*)a[17];
  const float* before_ssm = (const float*)a[19];
  long before_rows = a[20];
  const Sizes& sz = m->n;
  for (long r = 0; r < b; r++)
    for (long t = 0; t < counts[r]; t++)
      if (tokens[r * T + t] < 0 || tokens[r * T + t] >= sz.vocab) return r * T + t + 1;
  for (long r = 0; restore && r < b; r++)
    if (restore[r] >= before_rows) return -1;
  if (n < 1 || parents[0] != -1) return -1;
  std::vector<long> depth((size_t)n, 0), kids((size_t)n, 0);
  long deepest = 0;
  for (long v = 1; v < n; v++) {
    if (parents[v] < 0 || parents[v] >= v) return -1;
    depth[v] = depth[parents[v]] + 1;
    kids[parents[v]]++;
    deepest = depth[v] > deepest ? depth[v] : deepest;
  }
  for (long v = 0; v < n; v++)
    if (kids[v] > 64 || kids[v] > V) return -2;
  // the stepped nodes (depth 1 to deepest - 1) level by level: level d's slots first[d] .. first[d + 1] - 1
  std::vector<long> order, first((size_t)deepest + 1, 0);
  for (long v = 0; v < n; v++) slot[v] = -1;
  for (long d = 1; d < deepest; d++) {
    first[d] = (long)order.size();
    for (long v = 1; v < n; v++)
      if (depth[v] == d) slot[v] = (int64_t)order.size(), order.push_back(v);
  }
  if (deepest) first[deepest] = (long)order.size();
  long CK = sz.conv_dim * sz.d_conv, SS = sz.heads * sz.headdim * sz.d_state;
  ConvStates cache((void*)a[7], conv_count(m, b), sz.rounding, true, cache_conv);
  ConvStates nodes((void*)a[9], conv_count(m, n * b), sz.rounding, true, node_conv_buf);
  ConvStates before(restore ? (void*)a[18] : nullptr, conv_count(m, before_rows), sz.rounding, false, before_conv_buf);
  float *conv_states = cache.data, *node_conv = nodes.data;
  const float* before_conv = before.data;
  for (long l = 0; restore && l < sz.layers; l++)
    for (long r = 0; r < b; r++)
      if (restore[r] >= 0) {
        memcpy(conv_states + (l * b + r) * CK, before_conv + (l * before_rows + restore[r]) * CK, sizeof(float) * CK);
        memcpy(ssm_states + (l * b + r) * SS, before_ssm + (l * before_rows + restore[r]) * SS, sizeof(float) * SS);
      }
  float* last = feed_rows(m, tokens, counts, b, T, conv_states, ssm_states, m->e.dt_lo, m->e.dt_hi, threads);
  if (n == 1) return 0;
  thread_local std::vector<float> logits;
  thread_local std::vector<int64_t> level_tokens, heads, picked;
  // node v's children in row r (in index order) from its row of logits
  auto children = [&](long v, long r, const float* row) {
    picked.resize((size_t)kids[v]);
    top_entries(row, V, kids[v], picked.data());
    long c = 0;
    for (long u = v + 1; u < n && c < kids[v]; u++)
      if (parents[u] == v) drafted[r * n + u] = ids ? ids[picked[c]] : picked[c], c++;
  };
  logits.resize((size_t)(b * V));
  head_rows(m, last, nullptr, b, head_w, head_h, V, logits.data(), threads);
  for (long r = 0; r < b; r++) children(0, r, logits.data() + r * V);
  long rows_all = n * b;  // the node slots' rows in a layer
  for (long d = 1; d < deepest; d++) {
    long f = first[d], count = first[d + 1] - first[d];
    // each node's rows start from its parent's state: the cache's row (the root's) or the parent's slot
    for (long l = 0; l < sz.layers; l++)
      for (long i = 0; i < count; i++) {
        long v = order[f + i], p = parents[v];
        for (long r = 0; r < b; r++) {
          long to = l * rows_all + (f + i) * b + r, from = p ? l * rows_all + slot[p] * b + r : l * b + r;
          memcpy(node_conv + to * CK, (p ? node_conv : conv_states) + from * CK, sizeof(float) * CK);
          memcpy(node_ssm + to * SS, (p ? node_ssm : ssm_states) + from * SS, sizeof(float) * SS);
        }
      }
    level_tokens.resize((size_t)(count * b));
    heads.clear();
    for (long i = 0; i < count; i++)
      for (long r = 0; r < b; r++) {
        level_tokens[i * b + r] = drafted[r * n + order[f + i]];
        if (kids[order[f + i]]) heads.push_back(i * b + r);
      }
    float* x = step_rows(m, level_tokens.data(), count * b, node_conv + f * b * CK, rows_all * CK,
                         node_ssm + f * b * SS, rows_all * SS, threads);
    long k = (long)heads.size();
    logits.resize((size_t)(k * V));
    head_rows(m, x, heads.data(), k, head_w, head_h, V, logits.data(), threads);
    for (long j = 0; j < k; j++) children(order[f + heads[j] / b], heads[j] % b, logits.data() + j * V);
  }
  return 0;
}

// v [count] rounded in place to float16's (mode 0) or bfloat16's (mode 1) values: a half model's rounding,
// for tests/kernels/test_round.py to hold to PyTorch's conversions
extern "C" void stree_round_half(float* v, long count, long mode) { round_half(v, count, mode); }

// the int64 words of the model's layout before its layers, and of one layer (mamba_step.py checks them)
extern "C" long stree_mamba_model_words(void) { return (long)(offsetof(Model, layer) / 8); }
extern "C" long stree_mamba_layer_words(void) { return LAYER_WORDS; }
