// Varlen attention on the CPU: flash-attention-style tiles with an online softmax.
//
// A tile is (sequence, a block of query positions, a range of kv heads). Its rows are the query
// heads of those kv heads' GQA groups stacked under each position, so each K/V row read serves
// the whole group (GQA by index, no copies). Prefill tiles take one kv head and many positions
// and run two small GEMMs per key block on packed K/V; decode-like tiles (few rows per kv head)
// take every kv head and read K/V rows in place, a block of keys at a time, each kv head's query
// rows held in registers while its key rows stream past. The causal
// (bottom-right) and sliding-window masks are computed from positions; key blocks no row can see
// are never visited. With a soft-cap (Gemma 2) a row's visible scores become
// softcap * tanh(score / softcap) before its online softmax. Few tiles with long key ranges are
// split over the keys (split-KV). Paged caches may hold K/V in a narrower dtype than q
// (bfloat16 / float16 under float32 q): rows are converted to float32 as they are read, like
// rows of q's dtype, so a decode step streams half the bytes through the same code.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention/attention.h"
#include "common/batch_invariant.h"
#include "common/dispatch.h"
#include "common/vec.h"
#include "common/vec_gemm.h"

namespace fastllm {
namespace {

constexpr int64_t kTileRows = 256;  // query rows (positions x group heads) per tile
constexpr int64_t kTileKeys = 256;  // keys per inner step
// A decode step reads every cached K/V row once, so from a few hundred keys on it is bound by
// memory bandwidth, which one thread does not saturate: split the keys from there.
constexpr int64_t kMinKeysPerSplit = 128;
// Below this many multiply-adds a call runs on the calling thread: waking OpenMP workers that
// went to sleep costs more than the work (decode of short sequences, tiny prefills).
constexpr int64_t kMinParallelWork = int64_t(1) << 17;
// Decode tiles (one position: its GQA group's rows, at most this many) read K and V rows in
// place instead of packing them for the tile GEMM, which needs more rows to pay off: from two
// positions on (a verification step's) the GEMM path is the faster one.
constexpr int64_t kDirectMaxRows = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Strides3 {
  int64_t token, head, dim;
  explicit Strides3(const at::Tensor& t) : token(t.stride(0)), head(t.stride(1)), dim(t.stride(2)) {}
};

struct Problem {
  int64_t n_heads, n_kv_heads, group, head_dim, head_dim_padded;
  bool causal;
  int64_t window_left;
  float scale;
  float softcap;      // > 0: scores become softcap * tanh(score / softcap); 0: left as they are
  float inv_softcap;  // 1 / softcap
  bool direct_ok;  // head_dim a whole number of vectors and unit dim strides on k and v
  // Pre-RoPE caches: key j of a sequence is rotated by position j as it is read.
  const float* rope_cos_sin = nullptr;  // [max_position, rope_dim], cos | sin halves
  int64_t rope_dim = 0;                 // 0: keys are used as stored
  bool rope_neox = true;                // pairs (i, i + rope_dim/2), else (2i, 2i + 1)
};

// Where the K or V row of key j of sequence b starts, in elements: packed varlen rows found
// through cu_seqlens_k, or cache pages found through a block table.
struct KeyLayout {
  int64_t head, dim;  // strides of a row's heads and channels
  const int32_t* cu_k = nullptr;  // packed: first key token of each sequence
  int64_t token = 0;
  const int32_t* block_tables = nullptr;  // paged: [batch, max_blocks]
  int64_t max_blocks = 0, block_size = 1, block = 0, slot = 0;

  // rows[c] = base + the row of key j0 + c of sequence b, for c < n; a block's keys are one run.
  template <typename scalar_t>
  void fill_rows(int64_t b, int64_t j0, int64_t n, const scalar_t* base,
                 const scalar_t** rows) const {
    if (!block_tables) {
      const scalar_t* first = base + (int64_t(cu_k[b]) + j0) * token;
      for (int64_t c = 0; c < n; ++c) rows[c] = first + c * token;
      return;
    }
    for (int64_t c = 0, j = j0; c < n;) {
      const int64_t offset = j % block_size;
      const int64_t run = std::min(block_size - offset, n - c);
      const scalar_t* first =
          base + int64_t(block_tables[b * max_blocks + j / block_size]) * block + offset * slot;
      for (int64_t i = 0; i < run; ++i) rows[c + i] = first + i * slot;
      c += run;
      j += run;
    }
  }
};

struct Tile {
  int64_t q_token;   // first query token of the tile in the packed q
  int64_t q_pos;     // position of that token within its sequence
  int64_t n_pos;     // query positions in the tile
  int64_t seq;       // the sequence (row of cu_seqlens / block_tables)
  int64_t len_q, len_k;
  int64_t kv_head0, n_kv;  // kv heads [kv_head0, kv_head0 + n_kv)
  bool direct;             // K/V rows read in place (else packed for the GEMMs; then n_kv == 1)
  int64_t key_lo, key_hi;  // keys [key_lo, key_hi) that some row of the tile can see

  // Rows are ordered (position, kv head, head in group): row r is query head
  // kv_head0 * group + r % heads_per_pos() of position r / heads_per_pos().
  int64_t heads_per_pos(const Problem& pb) const { return n_kv * pb.group; }
  int64_t rows(const Problem& pb) const { return n_pos * heads_per_pos(pb); }
};

// Visible keys of query position p: [lo, hi) with bottom-right causal alignment.
inline void visible_keys(const Problem& pb, const Tile& t, int64_t p, int64_t& lo, int64_t& hi) {
  const int64_t diag = p + t.len_k - t.len_q;
  hi = pb.causal ? std::min(t.len_k, diag + 1) : t.len_k;
  lo = pb.window_left >= 0 ? std::max<int64_t>(0, diag - pb.window_left) : 0;
}

// Rows of one head sit n_kv_heads * head_dim apart in the packed and paged layouts, often a
// page or more: hardware prefetchers stop at page boundaries, so fetch rows ahead by hand. Far
// enough to hide a miss plus a page walk where a paged block ends, so paged decode keeps up
// with the contiguous layout.
constexpr int64_t kPrefetchRows = 16;

template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < n * int64_t(sizeof(scalar_t)); off += 64) __builtin_prefetch(p + off);
}

// Calls fn(c, r, row) for every key c < nk of a direct tile's block and every tile row r, with
// `row` the K or V row of key c for r's kv head (rows[c] is key c's row at the tile's first kv
// head). Key rows are streamed in order, all heads of a key at once, a few keys prefetched ahead.
template <typename scalar_t, typename Fn>
inline void for_each_key_row(const Problem& pb, const Tile& t, const scalar_t* const* rows,
                             int64_t head_stride, int64_t nk, const Fn& fn) {
  const int64_t G = pb.group, hp = t.heads_per_pos(pb);
  for (int64_t c = 0; c < nk; ++c) {
    if (c + kPrefetchRows < nk)
      for (int64_t j = 0; j < t.n_kv; ++j)
        prefetch_row(rows[c + kPrefetchRows] + j * head_stride, pb.head_dim);
    for (int64_t j = 0; j < t.n_kv; ++j)
      for (int64_t i = 0; i < t.n_pos; ++i)
        for (int64_t g = 0; g < G; ++g) fn(c, i * hp + j * G + g, rows[c] + j * head_stride);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// out[c] = the sum of the W floats at vectors + c * W, for c < W: a tree of in-lane unpacks and
// 128-bit shuffles, 45 instructions for the 16 sums where reducing each vector alone takes 8
// with a long dependency chain. The vectors are loaded as the tree needs them (an array of 16
// loaded vectors passed to a helper was copied through the stack).
inline void store_vector_sums(const float* vectors, float* out) {
  const auto row = [vectors](int c) { return _mm512_loadu_ps(vectors + c * 16); };
  __m512 pairs[8], quads[4];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: a_2k's and a_2k+1's elements 0+2, 1+3
    const __m512 a = row(2 * k), b = row(2 * k + 1);
    pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the sums of a_4k .. a_4k+3
    const __m512d x = _mm512_castps_pd(pairs[2 * k]), y = _mm512_castps_pd(pairs[2 * k + 1]);
    quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Then over the four 128-bit lanes: the 16 sums in order.
  const auto halves = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  _mm512_storeu_ps(out, halves(halves(quads[0], quads[1]), halves(quads[2], quads[3])));
}
#elif defined(CPU_CAPABILITY_AVX2)
// out[c] = the sum of the W floats at vectors + c * W, for c < W: horizontal adds of pairs,
// then of pairs of pairs (each 128-bit half's sums), then the halves added.
inline void store_vector_sums(const float* vectors, float* out) {
  const auto row = [vectors](int c) { return _mm256_loadu_ps(vectors + c * 8); };
  const auto quad = [&](int c) {  // per 128-bit half: the sums of rows c .. c + 3
    return _mm256_hadd_ps(_mm256_hadd_ps(row(c), row(c + 1)),
                          _mm256_hadd_ps(row(c + 2), row(c + 3)));
  };
  const __m256 low = quad(0), high = quad(4);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                      _mm256_permute2f128_ps(low, high, 0x31)));
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// Query vectors a direct tile keeps in registers while a kv head's key rows stream past, beside
// a converted key vector and a sum per row (AVX-512's 32 registers, AVX2's 16).
constexpr int kQueryVectors = VecF::size() == 16 ? 24 : 12;

// partial[(r * W + c) * W, + W) = the lane-wise products of query row r (at q + r * d) and the
// key row k_rows[c0 + c] + head_offset, summed over the row's vectors, for r < R and c < n;
// zeros for c in [n, W). d is head_dim. With V > 0 (head_dim = V vectors) the R query rows stay
// in registers and each key vector is converted once for them; V = 0: one row (R = 1), its
// query read as it goes. With `prefetch`, the key kPrefetchRows ahead is fetched as each is
// read.
template <int V, int R, typename scalar_t>
inline void row_key_products(const float* q, int64_t d, const scalar_t* const* k_rows,
                             int64_t head_offset, int64_t c0, int64_t n, int64_t nk,
                             bool prefetch, float* partial) {
  static_assert(V > 0 || R == 1);
  constexpr int64_t W = VecF::size();
  const int64_t D = V > 0 ? V * W : d;
  VecF qv[R][V > 0 ? V : 1];
  if constexpr (V > 0)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) qv[r][v] = VecF::loadu(q + r * d + v * W);
  const auto query_vector = [&](int r, int64_t e) {
    if constexpr (V > 0) return qv[r][e / W];
    else return VecF::loadu(q + e);
  };
  for (int64_t c = 0; c < n; ++c) {
    if (prefetch && c0 + c + kPrefetchRows < nk)
      prefetch_row(k_rows[c0 + c + kPrefetchRows] + head_offset, D);
    const scalar_t* kc = k_rows[c0 + c] + head_offset;
    VecF acc[R];
    const VecF k0 = load_as_float(kc);
    for (int r = 0; r < R; ++r) acc[r] = query_vector(r, 0) * k0;
    for (int64_t e = W; e < D; e += W) {
      const VecF k = load_as_float(kc + e);
      for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(query_vector(r, e), k, acc[r]);
    }
    for (int r = 0; r < R; ++r) acc[r].store(partial + (r * W + c) * W);
  }
  for (int64_t c = n; c < W; ++c)
    for (int r = 0; r < R; ++r) VecF(0.f).store(partial + (r * W + c) * W);
}

// scores_direct with SIMD: W keys at a time, each kv head's rows (R at a time, their queries in
// registers) against the head's key rows, each row's W products then summed at once
// (store_vector_sums) into s's columns (lds is whole vectors: keys past nk score 0, and the
// softmax clears them). Each row's sums take the same steps whatever the tile.
template <int V, typename scalar_t>
void scores_by_head(const Problem& pb, const Tile& t, const float* qf,
                    const scalar_t* const* k_rows, int64_t head_stride, int64_t nk, float* s,
                    int64_t lds, float* partial) {
  constexpr int64_t W = VecF::size();
  constexpr int R = V > 0 ? kQueryVectors / V : 1;
  const int64_t D = pb.head_dim, G = pb.group, hp = t.heads_per_pos(pb);
  for (int64_t c0 = 0; c0 < nk; c0 += W) {
    const int64_t n = std::min(W, nk - c0);
    for (int64_t j = 0; j < t.n_kv; ++j)
      for (int64_t i = 0; i < t.n_pos; ++i)
        for (int64_t g = 0; g < G; g += R) {
          const int64_t r0 = i * hp + j * G + g, rows = std::min<int64_t>(R, G - g);
          const bool prefetch = i == 0 && g == 0;  // each key row fetched once
          const float* q = qf + r0 * D;
          const int64_t offset = j * head_stride;
          [&]<int... kRows>(std::integer_sequence<int, kRows...>) {
            ((rows == kRows + 1 ? row_key_products<V, kRows + 1>(q, D, k_rows, offset, c0, n, nk,
                                                                 prefetch, partial)
                                : void()),
             ...);
          }(std::make_integer_sequence<int, R>());
          for (int64_t r = 0; r < rows; ++r)
            store_vector_sums(partial + r * W * W, s + (r0 + r) * lds + c0);
        }
  }
}
#endif

// s[r, c] = q_r . k_c for a direct tile, key rows read in place. work: direct_scores_floats.
template <typename scalar_t>
void scores_direct(const Problem& pb, const Tile& t, const float* qf,
                   const scalar_t* const* k_rows, int64_t head_stride, int64_t nk, float* s,
                   int64_t lds, [[maybe_unused]] float* work) {
  constexpr int64_t W = VecF::size();
  const int64_t D = pb.head_dim;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (D == 4 * W) return scores_by_head<4>(pb, t, qf, k_rows, head_stride, nk, s, lds, work);
  if (D == 8 * W) return scores_by_head<8>(pb, t, qf, k_rows, head_stride, nk, s, lds, work);
  if constexpr (kQueryVectors >= 16)
    if (D == 16 * W) return scores_by_head<16>(pb, t, qf, k_rows, head_stride, nk, s, lds, work);
  scores_by_head<0>(pb, t, qf, k_rows, head_stride, nk, s, lds, work);
#else
  for_each_key_row(pb, t, k_rows, head_stride, nk, [&](int64_t c, int64_t r, const scalar_t* kc) {
    const float* qr = qf + r * D;
    VecF acc0(0.f), acc1(0.f);
    int64_t d = 0;
    for (; d + 2 * W <= D; d += 2 * W) {
      acc0 = at::vec::fmadd(VecF::loadu(qr + d), load_as_float(kc + d), acc0);
      acc1 = at::vec::fmadd(VecF::loadu(qr + d + W), load_as_float(kc + d + W), acc1);
    }
    if (d < D) acc0 = at::vec::fmadd(VecF::loadu(qr + d), load_as_float(kc + d), acc0);
    s[r * lds + c] =
        at::vec::vec_reduce_all<float>([](VecF& x, VecF& y) { return x + y; }, acc0 + acc1);
  });
#endif
}

// Vectors of output a direct tile keeps in registers while the value rows stream past: half
// the registers (32 with AVX-512, 16 with AVX2).
constexpr int kOutputVectors = VecF::size() == 16 ? 16 : 8;

// o[r, :] += sum_c p[r, c] * v_c for rows [r0, r0 + R) of one kv head, whose value rows are
// v_rows[c] + head_offset, V vectors each: the rows' outputs stay in registers over the keys,
// each value row converted once for them. Every key is added, a zero probability too (no
// branch per row and key): v_c is a finite cached value.
template <int V, int R, typename scalar_t>
inline void pv_rows(const scalar_t* const* v_rows, int64_t head_offset, int64_t c_begin,
                    int64_t c_end, int64_t nk, const float* p, int64_t ldp, int64_t r0,
                    float* o, int64_t ldo) {
  constexpr int64_t W = VecF::size();
  VecF acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = VecF::loadu(o + (r0 + r) * ldo + v * W);
  for (int64_t c = c_begin; c < c_end; ++c) {
    if (c + kPrefetchRows < nk) prefetch_row(v_rows[c + kPrefetchRows] + head_offset, V * W);
    const scalar_t* vc = v_rows[c] + head_offset;
    VecF values[V];
    for (int v = 0; v < V; ++v) values[v] = load_as_float(vc + v * W);
    for (int r = 0; r < R; ++r) {
      const VecF pv(p[(r0 + r) * ldp + c]);
      for (int v = 0; v < V; ++v) acc[r][v] = at::vec::fmadd(pv, values[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v].store(o + (r0 + r) * ldo + v * W);
}

// o[r, :] += sum_c p[r, c] * v_c for a direct tile, value rows read in place.
template <typename scalar_t>
void pv_direct(const Problem& pb, const Tile& t, const float* p, int64_t ldp,
               const scalar_t* const* v_rows, int64_t head_stride, int64_t nk, float* o,
               int64_t ldo) {
  constexpr int64_t W = VecF::size();
  const int64_t D = pb.head_dim, G = pb.group, hp = t.heads_per_pos(pb);
  // Each kv head's rows, up to R at a time, against slices of V vectors of the value rows (the
  // whole row, or as many slices as it takes), over kPrefetchRows keys at a time: the keys'
  // rows of every head are read before the next keys'. Each output element adds its keys'
  // products in key order whatever the slicing.
  const auto by_head = [&]<int V, int R>() {
    const int64_t slices = D / (V * W);
    for (int64_t c0 = 0; c0 < nk; c0 += kPrefetchRows) {
      const int64_t c1 = std::min(nk, c0 + kPrefetchRows);
      for (int64_t i = 0; i < t.n_pos; ++i)
        for (int64_t j = 0; j < t.n_kv; ++j)
          for (int64_t g = 0; g < G; g += R) {
            const int64_t r0 = i * hp + j * G + g;
            for (int64_t d0 = 0; d0 < slices * V * W; d0 += V * W) {
              const int64_t offset = j * head_stride + d0;
              if (G - g >= R)
                pv_rows<V, R>(v_rows, offset, c0, c1, nk, p, ldp, r0, o + d0, ldo);
              else  // the group's last rows, fewer than R
                [&]<int... kRows>(std::integer_sequence<int, kRows...>) {
                  ((G - g == kRows + 1
                        ? pv_rows<V, kRows + 1>(v_rows, offset, c0, c1, nk, p, ldp, r0, o + d0, ldo)
                        : void()),
                   ...);
                }(std::make_integer_sequence<int, R - 1>());
            }
          }
    }
  };
  // The outputs and a value slice in registers: R * V + V of the registers.
  if (D == 4 * W) return by_head.template operator()<4, kOutputVectors / 4>();
  if constexpr (kOutputVectors >= 16)
    if (D == 8 * W) return by_head.template operator()<8, 2>();
  constexpr int kSliceVectors = kOutputVectors / 4;
  if (D % (kSliceVectors * W) == 0) return by_head.template operator()<kSliceVectors, 4>();
  for_each_key_row(pb, t, v_rows, head_stride, nk, [&](int64_t c, int64_t r, const scalar_t* vc) {
    const float pc = p[r * ldp + c];
    if (pc == 0.f) return;  // masked or underflowed: nothing to add
    const VecF pv(pc);
    float* orow = o + r * ldo;
    for (int64_t d = 0; d < D; d += W)
      at::vec::fmadd(pv, load_as_float(vc + d), VecF::loadu(orow + d)).store(orow + d);
  });
}

// Calls fn(first_row, n_rows, cols) for the tile's rows in GEMM-height panels, where the panel's
// rows see at most the first `cols` keys of the block [k0, k0 + nk): on the causal diagonal the
// masked triangle is not computed. Panels that see nothing are skipped.
template <typename Fn>
void for_each_row_panel(const Problem& pb, const Tile& t, int64_t k0, int64_t nk, const Fn& fn) {
  constexpr int64_t kPanel = detail::kGemmRows;
  const int64_t rows = t.rows(pb), hp = t.heads_per_pos(pb);
  for (int64_t r0 = 0; r0 < rows; r0 += kPanel) {
    const int64_t n = std::min(kPanel, rows - r0);
    int64_t lo, hi;
    visible_keys(pb, t, t.q_pos + (r0 + n - 1) / hp, lo, hi);
    const int64_t cols = std::clamp<int64_t>(hi - k0, 0, nk);
    if (cols > 0) fn(r0, n, cols);
  }
}

// Floats of scores_direct's work area for a tile of `rows` rows: each row's products with 16
// keys.
inline int64_t direct_scores_floats(int64_t rows) { return rows * VecF::size() * VecF::size(); }

// What a call's tiles need of the scratch: the most rows of a tile and of a direct tile (0:
// none), and whether some tile packs K/V for the GEMMs.
struct ScratchShape {
  int64_t rows = 1, direct_rows = 0;
  bool packing = false;
};

// Per-thread scratch, reused across tiles: one uninitialized allocation (every element is
// written before it is read), sized for the largest tile; packing and direct buffers only when
// needed.
struct Scratch {
  std::unique_ptr<float[]> buffer;
  float *q, *kt, *v, *s, *o, *m, *l, *rotated_k, *direct_scores;
  Scratch(const Problem& pb, const ScratchShape& shape) {
    const int64_t d = pb.head_dim, dp = pb.head_dim_padded, rows = shape.rows;
    const int64_t pack = shape.packing ? kTileKeys : 0;
    const int64_t rotated = pb.rope_dim > 0 ? kTileKeys * pb.n_kv_heads * d : 0;
    const int64_t direct = direct_scores_floats(shape.direct_rows);
    const int64_t sizes[] = {rows * d, d * pack, pack * dp, rows * kTileKeys, rows * dp,
                             rows,     rows,     rotated,   direct};
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    buffer.reset(new float[total]);
    float** parts[] = {&q, &kt, &v, &s, &o, &m, &l, &rotated_k, &direct_scores};
    float* p = buffer.get();
    for (int i = 0; i < 9; ++i) {
      *parts[i] = p;
      p += sizes[i];
    }
  }
};

// Rotates the pre-RoPE K rows of keys [k0, k0 + nk) by their positions into float rows:
// dst + (c * n_kv + j) * head_dim is head j of key c, for the tile's n_kv heads.
template <typename scalar_t>
void rotate_key_rows(const Problem& pb, int64_t n_kv, int64_t k0, int64_t nk,
                     const scalar_t* const* rows, int64_t head_stride, int64_t dim_stride,
                     float* dst) {
  constexpr int64_t W = VecF::size();
  const int64_t D = pb.head_dim, rot = pb.rope_dim, half = rot / 2;
  const bool vectorized = pb.rope_neox && dim_stride == 1 && half % W == 0;
  for (int64_t c = 0; c < nk; ++c) {
    if (c + kPrefetchRows < nk)
      for (int64_t j = 0; j < n_kv; ++j)
        prefetch_row(rows[c + kPrefetchRows] + j * head_stride, D);
    const float* cos = pb.rope_cos_sin + (k0 + c) * rot;
    const float* sin = cos + half;
    for (int64_t j = 0; j < n_kv; ++j) {
      const scalar_t* x = rows[c] + j * head_stride;
      float* out = dst + (c * n_kv + j) * D;
      if (vectorized) {
        for (int64_t i = 0; i < half; i += W) {
          const VecF x1 = load_as_float(x + i), x2 = load_as_float(x + half + i);
          const VecF vc = VecF::loadu(cos + i), vs = VecF::loadu(sin + i);
          (x1 * vc - x2 * vs).store(out + i);
          (x2 * vc + x1 * vs).store(out + half + i);
        }
      } else {
        for (int64_t i = 0; i < half; ++i) {
          const int64_t d1 = pb.rope_neox ? i : 2 * i, d2 = pb.rope_neox ? i + half : 2 * i + 1;
          const float x1 = float(x[d1 * dim_stride]), x2 = float(x[d2 * dim_stride]);
          out[d1] = x1 * cos[i] - x2 * sin[i];
          out[d2] = x2 * cos[i] + x1 * sin[i];
        }
      }
      for (int64_t d = rot; d < D; ++d) out[d] = float(x[d * dim_stride]);  // not rotated
    }
  }
}

// s[r, c] = q_r . k_c for the tile's rows and keys [k0, k0 + nk); rows[c] is key c's K row at
// the tile's first kv head (cache rows, or rotated float rows).
template <typename key_t>
void key_block_scores(const Problem& pb, const Tile& t, int64_t k0, int64_t nk, const float* qf,
                      const key_t* const* rows, int64_t head_stride, int64_t dim_stride,
                      float* kt, float* direct_scores, float* s, int64_t nk_padded) {
  if (t.direct) {
    scores_direct(pb, t, qf, rows, head_stride, nk, s, nk_padded, direct_scores);
    return;
  }
  // kt [D, nk_padded]: keys along the vector lanes. Transposed a vector's worth of keys at a
  // time, so each d writes one contiguous vector.
  constexpr int64_t W = VecF::size();
  const int64_t D = pb.head_dim;
  for (int64_t c0 = 0; c0 < nk_padded; c0 += W) {
    const int64_t n = std::min<int64_t>(W, nk - c0);
    for (int64_t d = 0; d < D; ++d) {
      float* dst = kt + d * nk_padded + c0;
      for (int64_t j = 0; j < n; ++j) dst[j] = float(rows[c0 + j][d * dim_stride]);
      for (int64_t j = n; j < W; ++j) dst[j] = 0.f;
    }
  }
  for_each_row_panel(pb, t, k0, nk, [&](int64_t r0, int64_t n, int64_t cols) {
    gemm_f32(n, round_up_to_vec(cols), D, qf + r0 * D, D, kt, nk_padded, s + r0 * nk_padded,
             nk_padded, /*accumulate=*/false);
  });
}

// Unnormalized output (o), running max (m) and sum (l) of one tile over keys [k_begin, k_end);
// q in scalar_t, K and V rows in cache_t.
template <typename scalar_t, typename cache_t>
void attend_tile(const Problem& pb, const Tile& t, int64_t k_begin, int64_t k_end,
                 const scalar_t* q, Strides3 qs, const cache_t* k, const KeyLayout& kl,
                 const cache_t* v, const KeyLayout& vl, Scratch& sc) {
  const int64_t D = pb.head_dim, Dp = pb.head_dim_padded, hp = t.heads_per_pos(pb);
  const int64_t rows = t.rows(pb);
  float* qf = sc.q;
  float* o = sc.o;
  float* m = sc.m;
  float* l = sc.l;

  // The scale is folded into q once.
  for (int64_t i = 0; i < t.n_pos; ++i)
    for (int64_t h = 0; h < hp; ++h) {
      const scalar_t* src = q + (t.q_token + i) * qs.token + (t.kv_head0 * pb.group + h) * qs.head;
      float* dst = qf + (i * hp + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = float(src[d * qs.dim]) * pb.scale;
    }
  std::fill(o, o + rows * Dp, 0.f);
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.f);

  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTileKeys) {
    const int64_t nk = std::min(kTileKeys, k_end - k0);
    const int64_t nk_padded = round_up_to_vec(nk);
    float* s = sc.s;  // [rows, nk_padded]
    // Key c's K and V rows at the tile's first kv head (packed or paged alike).
    const cache_t* k_rows[kTileKeys];
    const cache_t* v_rows[kTileKeys];
    kl.fill_rows(t.seq, k0, nk, k + t.kv_head0 * kl.head, k_rows);
    vl.fill_rows(t.seq, k0, nk, v + t.kv_head0 * vl.head, v_rows);
    if (pb.rope_dim > 0) {
      rotate_key_rows(pb, t.n_kv, k0, nk, k_rows, kl.head, kl.dim, sc.rotated_k);
      const float* rotated_rows[kTileKeys];
      for (int64_t c = 0; c < nk; ++c) rotated_rows[c] = sc.rotated_k + c * t.n_kv * D;
      key_block_scores(pb, t, k0, nk, qf, rotated_rows, D, 1, sc.kt, sc.direct_scores, s,
                       nk_padded);
    } else {
      key_block_scores(pb, t, k0, nk, qf, k_rows, kl.head, kl.dim, sc.kt, sc.direct_scores, s,
                       nk_padded);
    }

    // Online softmax: scores become probabilities in place; columns a row cannot see are 0.
    for (int64_t i = 0; i < t.n_pos; ++i) {
      int64_t lo, hi;
      visible_keys(pb, t, t.q_pos + i, lo, hi);
      const int64_t c_lo = std::max<int64_t>(0, lo - k0);
      const int64_t c_hi = std::min(nk, hi - k0);
      for (int64_t h = 0; h < hp; ++h) {
        const int64_t r = i * hp + h;
        float* sr = s + r * nk_padded;
        if (c_lo >= c_hi) {
          std::fill(sr, sr + nk_padded, 0.f);
          continue;
        }
        const int64_t n = c_hi - c_lo;
        if (pb.softcap > 0.f) {  // Gemma 2's soft-cap, on the scaled scores, before the softmax
          const VecF cap(pb.softcap), inv(pb.inv_softcap);
          at::vec::map([cap, inv](VecF x) { return cap * (x * inv).tanh(); }, sr + c_lo,
                       sr + c_lo, n);
        }
        const float block_max = at::vec::reduce_all<float>(
            [](VecF& a, VecF& b) { return at::vec::maximum(a, b); }, sr + c_lo, n);
        const float m_new = std::max(m[r], block_max);
        const float alpha = std::exp(m[r] - m_new);  // 0 on the first visible block
        const VecF m_vec(m_new);
        at::vec::map([m_vec](VecF x) { return (x - m_vec).exp_u20(); }, sr + c_lo, sr + c_lo, n);
        const float block_sum =
            at::vec::reduce_all<float>([](VecF& a, VecF& b) { return a + b; }, sr + c_lo, n);
        std::fill(sr, sr + c_lo, 0.f);
        std::fill(sr + c_hi, sr + nk_padded, 0.f);
        l[r] = l[r] * alpha + block_sum;
        m[r] = m_new;
        if (alpha != 1.f) {
          float* orow = o + r * Dp;
          const VecF a(alpha);
          for (int64_t d = 0; d < Dp; d += VecF::size()) (VecF::loadu(orow + d) * a).store(orow + d);
        }
      }
    }
    if (t.direct) {
      pv_direct(pb, t, s, nk_padded, v_rows, vl.head, nk, o, Dp);
    } else {
      float* vf = sc.v;  // [nk, Dp]
      for (int64_t c = 0; c < nk; ++c) {
        float* dst = vf + c * Dp;
        const cache_t* src = v_rows[c];
        if (vl.dim == 1)
          convert_to_float(src, dst, D);
        else
          for (int64_t d = 0; d < D; ++d) dst[d] = float(src[d * vl.dim]);
        std::fill(dst + D, dst + Dp, 0.f);
      }

      for_each_row_panel(pb, t, k0, nk, [&](int64_t r0, int64_t n, int64_t cols) {
        gemm_f32(n, Dp, cols, s + r0 * nk_padded, nk_padded, vf, Dp, o + r0 * Dp, Dp,
                 /*accumulate=*/true);
      });
    }
  }
}

template <typename scalar_t>
void write_tile_output(const Problem& pb, const Tile& t, const float* o, const float* l,
                       scalar_t* out, Strides3 os) {
  const int64_t D = pb.head_dim, Dp = pb.head_dim_padded, hp = t.heads_per_pos(pb);
  for (int64_t i = 0; i < t.n_pos; ++i)
    for (int64_t h = 0; h < hp; ++h) {
      const int64_t r = i * hp + h;
      // A row that sees no key (len_k == 0, or len_q > len_k above the diagonal) outputs 0.
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      scalar_t* dst = out + (t.q_token + i) * os.token + (t.kv_head0 * pb.group + h) * os.head;
      const float* src = o + r * Dp;
      for (int64_t d = 0; d < D; ++d) dst[d * os.dim] = scalar_t(src[d] * inv);
    }
}

// Tiles of the batch. Batch-invariant (common/batch_invariant.h): every query row takes the
// direct path, whatever its sequence's number of queries, in tiles of one kv head, and its key
// blocks start at multiples of kTileKeys whatever its tile's first position: a row's sums are
// then those it gets alone (the GEMM path's would depend on its panel).
std::vector<Tile> make_tiles(const Problem& pb, const int32_t* cu_q,
                             const std::vector<int64_t>& key_lens, bool invariant) {
  const int64_t batch = int64_t(key_lens.size());
  const int64_t gemm_positions = std::max<int64_t>(1, kTileRows / pb.group);
  const int64_t invariant_positions = std::max<int64_t>(1, kDirectMaxRows / pb.group);
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len_q = cu_q[b + 1] - cu_q[b], len_k = key_lens[b];
    const bool direct =
        pb.direct_ok && (invariant || (len_q == 1 && pb.group <= kDirectMaxRows));
    const int64_t positions = !direct ? gemm_positions : invariant ? invariant_positions : len_q;
    for (int64_t p0 = 0; p0 < len_q; p0 += positions) {
      Tile t{cu_q[b] + p0, p0, std::min(positions, len_q - p0), b, len_q, len_k,
             0, direct && !invariant ? pb.n_kv_heads : 1, direct, 0, 0};
      int64_t lo_first, hi_first, lo_last, hi_last;
      visible_keys(pb, t, p0, lo_first, hi_first);
      visible_keys(pb, t, p0 + t.n_pos - 1, lo_last, hi_last);
      t.key_lo = invariant ? lo_first / kTileKeys * kTileKeys : lo_first;
      t.key_hi = std::max(t.key_lo, hi_last);
      for (int64_t h = 0; h < pb.n_kv_heads; h += t.n_kv) {
        t.kv_head0 = h;
        tiles.push_back(t);
      }
    }
  }
  // Longest first, handed out dynamically: causal tiles differ a lot in cost.
  std::stable_sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& b) {
    return (a.key_hi - a.key_lo) * a.rows(pb) > (b.key_hi - b.key_lo) * b.rows(pb);
  });
  return tiles;
}

// Runs fn(index, scratch) for index in [0, n) on `threads` threads, each index taken by the
// first free thread.
template <typename Fn>
void parallel_dynamic(int64_t n, int64_t threads, const Problem& pb, const ScratchShape& shape,
                      const Fn& fn) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(n, threads), 1, [&](int64_t, int64_t) {
    Scratch scratch(pb, shape);
    for (int64_t i = next++; i < n; i = next++) fn(i, scratch);
  });
}

template <typename scalar_t, typename cache_t>
void attention_kernel(const Problem& pb, const std::vector<Tile>& tiles, bool invariant,
                      const at::Tensor& q, const at::Tensor& k, const KeyLayout& kl,
                      const at::Tensor& v, const KeyLayout& vl, const at::Tensor& out) {
  const scalar_t* qp = q.const_data_ptr<scalar_t>();
  const cache_t* kp = k.const_data_ptr<cache_t>();
  const cache_t* vp = v.const_data_ptr<cache_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const Strides3 qs(q), os(out);
  const int64_t n_tiles = tiles.size();
  ScratchShape shape;
  int64_t work = 0;
  for (const auto& t : tiles) {
    shape.rows = std::max(shape.rows, t.rows(pb));
    if (t.direct) shape.direct_rows = std::max(shape.direct_rows, t.rows(pb));
    shape.packing |= !t.direct;
    work += t.rows(pb) * (t.key_hi - t.key_lo) * pb.head_dim;
  }
  const int64_t threads = work < kMinParallelWork ? 1 : at::get_num_threads();

  // Few tiles with long key ranges (decode, small batches): split the keys so every thread has
  // work, then merge the partial softmaxes (not when batch-invariant: the split would depend on
  // the number of tiles).
  int64_t max_keys = 0;
  for (const auto& t : tiles) max_keys = std::max(max_keys, t.key_hi - t.key_lo);
  int64_t n_split = 1;
  if (threads > 1 && n_tiles < 2 * threads && !invariant) {
    n_split = std::min((2 * threads + n_tiles - 1) / std::max<int64_t>(n_tiles, 1),
                       max_keys / kMinKeysPerSplit);
    n_split = std::max<int64_t>(n_split, 1);
  }
  if (n_split == 1) {
    parallel_dynamic(n_tiles, threads, pb, shape, [&](int64_t i, Scratch& sc) {
      const Tile& t = tiles[i];
      attend_tile(pb, t, t.key_lo, t.key_hi, qp, qs, kp, kl, vp, vl, sc);
      write_tile_output(pb, t, sc.o, sc.l, op, os);
    });
    return;
  }

  const int64_t rows = shape.rows;
  const int64_t Dp = pb.head_dim_padded;
  const int64_t part_stride = rows * (Dp + 2);  // o [rows, Dp], m [rows], l [rows]
  std::vector<float> parts(n_tiles * n_split * part_stride);
  parallel_dynamic(n_tiles * n_split, threads, pb, shape, [&](int64_t i, Scratch& sc) {
    const Tile& t = tiles[i / n_split];
    const int64_t split = i % n_split;
    const int64_t span = (t.key_hi - t.key_lo + n_split - 1) / n_split;
    const int64_t begin = std::min(t.key_hi, t.key_lo + split * span);
    const int64_t end = std::min(t.key_hi, begin + span);
    attend_tile(pb, t, begin, end, qp, qs, kp, kl, vp, vl, sc);
    float* part = parts.data() + i * part_stride;
    const int64_t tile_rows = t.rows(pb);
    std::copy(sc.o, sc.o + tile_rows * Dp, part);
    std::copy(sc.m, sc.m + tile_rows, part + rows * Dp);
    std::copy(sc.l, sc.l + tile_rows, part + rows * Dp + rows);
  });
  at::parallel_for(0, n_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(rows * Dp), l(rows);
    for (int64_t ti = begin; ti < end; ++ti) {
      const Tile& t = tiles[ti];
      const int64_t tile_rows = t.rows(pb);
      const float* first = parts.data() + ti * n_split * part_stride;
      for (int64_t r = 0; r < tile_rows; ++r) {
        float m_max = kNegInf;
        for (int64_t s = 0; s < n_split; ++s)
          m_max = std::max(m_max, first[s * part_stride + rows * Dp + r]);
        float* orow = o.data() + r * Dp;
        std::fill(orow, orow + Dp, 0.f);
        l[r] = 0.f;
        if (m_max == kNegInf) continue;
        for (int64_t s = 0; s < n_split; ++s) {
          const float* part = first + s * part_stride;
          const float w = std::exp(part[rows * Dp + r] - m_max);  // 0 for an empty split
          if (w == 0.f) continue;
          l[r] += w * part[rows * Dp + rows + r];
          const float* prow = part + r * Dp;
          for (int64_t d = 0; d < Dp; ++d) orow[d] += w * prow[d];
        }
      }
      write_tile_output(pb, t, o.data(), l.data(), op, os);
    }
  });
}

Problem make_problem(const AttentionDims& dims, bool causal, std::optional<double> scale,
                     int64_t window_left, double softcap, bool unit_dim_strides) {
  return {dims.n_heads,
          dims.n_kv_heads,
          dims.n_heads / dims.n_kv_heads,
          dims.head_dim,
          round_up_to_vec(dims.head_dim),
          causal,
          window_left,
          float(resolve_attention_scale(scale, dims.head_dim)),
          float(softcap),
          softcap > 0.0 ? float(1.0 / softcap) : 0.f,
          dims.head_dim % VecF::size() == 0 && unit_dim_strides};
}

void run_attention(const Problem& pb, const at::Tensor& cu_seqlens_q,
                   const std::vector<int64_t>& key_lens, const at::Tensor& q,
                   const at::Tensor& k, const KeyLayout& kl, const at::Tensor& v,
                   const KeyLayout& vl, const at::Tensor& out) {
  const auto cu_q = cu_seqlens_q.contiguous();
  const bool invariant = batch_invariant();
  const auto tiles = make_tiles(pb, cu_q.const_data_ptr<int32_t>(), key_lens, invariant);
  // Packed K/V are in q's dtype; paged caches may be narrower (check_kv_cache_dtype).
  FASTLLM_DISPATCH_KV_CACHE_TYPES(q.scalar_type(), k.scalar_type(), "fastllm::attention_cpu", [&] {
    attention_kernel<scalar_t, cache_t>(pb, tiles, invariant, q, k, kl, v, vl, out);
  });
}

void attention_out_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                       std::optional<double> scale, int64_t window_left, at::Tensor& out,
                       double softcap) {
  const AttentionDims dims = check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q, max_seqlen_k, window_left,
                                                    softcap);
  check_attention_out(out, q, k, v);
  check_cu_seqlens_values(cu_seqlens_q, q.size(0), max_seqlen_q, "cu_seqlens_q");
  check_cu_seqlens_values(cu_seqlens_k, k.size(0), max_seqlen_k, "cu_seqlens_k");
  const auto cu_k = cu_seqlens_k.contiguous();
  const int32_t* ck = cu_k.const_data_ptr<int32_t>();
  std::vector<int64_t> key_lens(dims.batch);
  for (int64_t b = 0; b < dims.batch; ++b) key_lens[b] = ck[b + 1] - ck[b];
  const KeyLayout kl{k.stride(1), k.stride(2), ck, k.stride(0)};
  const KeyLayout vl{v.stride(1), v.stride(2), ck, v.stride(0)};
  run_attention(
      make_problem(dims, causal, scale, window_left, softcap, kl.dim == 1 && vl.dim == 1),
      cu_seqlens_q, key_lens, q, k, kl, v, vl, out);
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q,
                               int64_t max_seqlen_q, bool causal, std::optional<double> scale,
                               int64_t window_left,
                               const std::optional<at::Tensor>& rotary_cos_sin_cache,
                               bool rotary_is_neox, double softcap) {
  const AttentionDims dims =
      check_paged_attention_inputs(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                                   max_seqlen_q, window_left, softcap);
  const int64_t rope_dim = check_key_rotary(rotary_cos_sin_cache, k_cache);
  check_cu_seqlens_values(cu_seqlens_q, q.size(0), max_seqlen_q, "cu_seqlens_q");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  check_block_table_values(tables, lens, k_cache.size(0), k_cache.size(1));
  at::Tensor rope_table;
  if (rope_dim > 0) {
    check_key_rotary_positions(*rotary_cos_sin_cache, lens);
    rope_table = rotary_cos_sin_cache->contiguous();
  }
  std::vector<int64_t> key_lens(lens.const_data_ptr<int32_t>(),
                                lens.const_data_ptr<int32_t>() + dims.batch);
  auto paged = [&](const at::Tensor& cache) {
    return KeyLayout{cache.stride(2), cache.stride(3), nullptr, 0, tables.const_data_ptr<int32_t>(),
                     tables.size(1), cache.size(1), cache.stride(0), cache.stride(1)};
  };
  const KeyLayout kl = paged(k_cache), vl = paged(v_cache);
  Problem pb =
      make_problem(dims, causal, scale, window_left, softcap, kl.dim == 1 && vl.dim == 1);
  if (rope_dim > 0) {
    pb.rope_cos_sin = rope_table.const_data_ptr<float>();
    pb.rope_dim = rope_dim;
    pb.rope_neox = rotary_is_neox;
  }
  auto out = at::empty_like(q, at::MemoryFormat::Contiguous);
  run_attention(pb, cu_seqlens_q, key_lens, q, k_cache, kl, v_cache, vl, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastllm, CPU, m) {
  m.impl("attention", &attention_op<attention_out_cpu>);
  m.impl("attention_out", &attention_out_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
}

}  // namespace fastllm
