/* backend_cuda: the CUDA implementation of backend.h, fp32 or bf16 storage.
 *
 * Every call is queued on one stream that the backend owns; only to_device, to_host, sumsq,
 * sumsq_parts (one wait for all its pieces) and synchronize wait for it (the host reads or
 * reuses memory). Uploads of batches run on a second stream, the copy stream, from pinned host
 * memory, ordered against the compute stream by two events per slot (upload_async).
 * Matrix products go through cuBLASLt (row-major operands, called as the column-major product
 * c^T = op(b)^T op(a)^T); their descriptors and the chosen algorithm are cached per shape,
 * transposition, dtypes and pointer alignment, so one shape always runs the same algorithm.
 * fp32 operands: plain fp32 by default; set_tf32 (backend.h) lets them use TF32 tensor cores
 * (10-bit mantissa inputs). bf16 operands: bf16 tensor cores with fp32 accumulation
 * (CUBLAS_COMPUTE_32F), the output bf16 or fp32 (the dW += dy^T x of the parameter gradients);
 * a bf16 output's split-K partial sums are fp32 (the reduction-scheme preference).
 * Attention: cuDNN's fused flash attention (tensor cores, attention_cudnn.h) where
 * attention_select chose it (model.attention), else the reference kernel written here; the
 * blocks of ring attention likewise, where a block is one cuDNN's masks describe (below).
 * Everything else is a kernel written here: RMSNorm, RoPE, SwiGLU, embedding, softmax
 * cross-entropy and AdamW fused one pass each, and the reference flash-style causal attention
 * with grouped-query heads that keeps no (T, T) matrix: tiles of 32 queries and 32 keys in
 * shared memory, an online softmax in the forward, the probabilities recomputed from the saved
 * log-sum-exp in the backward. In bf16 the SwiGLU, RMSNorm forward, RoPE and cross-entropy
 * kernels load and store 8 elements (16 bytes) at a time where the pointers allow (bf16x8_t),
 * with the same per-element arithmetic.
 *
 * Dtypes: each kernel is a template on its storage type T (float or __nv_bfloat16), and the
 * host wrapper picks the instantiation from the call's dt. Loads widen to fp32 (widen), all
 * arithmetic and every statistic (RMSNorm's rstd, attention's lse and delta, the
 * cross-entropy's max and sums) is fp32, and each store rounds once (narrow: round to nearest
 * even, __float2bfloat16_rn); an accumulating store (dx +=) widens the old value, adds in fp32
 * and rounds. For T = float widen and narrow are the identity, so the fp32 instantiations
 * compute the same expressions, in the same order, as the fp32-only kernels before them (the
 * same bits). The attention tiles in shared memory are fp32 whatever T is: they are widened as
 * they are loaded. Parameter gradients (RMSNorm's dw, the embedding's dtable) and the
 * optimizer's tensors are fp32 always; AdamW writes the bf16 compute copy of the updated
 * parameters in the same pass when asked (param_lp).
 *
 * Determinism: no float atomics anywhere. Reductions that cross blocks (sumsq, RMSNorm's dw)
 * write per-block partials and add them in a fixed order; the embedding backward sorts the
 * positions by token (a stable radix sort) and one block per distinct token adds its rows in
 * position order (the cpu backend's order, so the bits agree with it); the attention backward
 * runs one kernel for dq (one block per query tile) and one for dk/dv (one block per key tile,
 * looping over its query heads in order). The grid of every reduction depends on the sizes
 * only, never on the device.
 *
 * cuDNN's backward is its deterministic algorithm (checked: reruns give the same bits).
 *
 * Not here: fused QKV and W1||W3 products, a multi-tensor AdamW, CUDA graphs, overlap of
 * communication (issue 34's list). The fatal checks abort every live communicator before exiting
 * (trainer/backend/backend_cuda_check.h). The reference attention takes head dims up to 128. */
#include <cublasLt.h>
#include <cublas_api.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cub/cub.cuh>

extern "C" {
#include "common/env.h"
#include "common/gpus.h"
#include "trainer/backend/backend.h"
#define SKIP_RULE_FN static __device__ inline
#include "trainer/backend/step_skip_rule.h"
#include "trainer/backend/backend_cuda_check.h"
#include "trainer/backend/attention_cudnn.h"
}

#define MM_CACHE 128                  /* cached matmul shapes */
#define WORKSPACE_BYTES ((size_t)32 << 20) /* cuBLASLt workspace (32 MiB, Hopper's advice) */
#define EW_THREADS 256                /* elementwise kernels */
#define SUMSQ_BLOCKS 1024             /* at most this many sumsq partials */
#define RMS_PARTIALS 512              /* at most this many dw partial rows in rmsnorm_bwd */
#define ATT_TILE 32                   /* queries per block, keys per tile */
#define ATT_WARPS 4
#define ATT_ROWS 8                    /* rows (queries or keys) per warp: ATT_WARPS * ATT_ROWS = ATT_TILE */
#define ATT_THREADS (ATT_WARPS * 32)

/* ------------------------------------------------------------------ fatal checks */

/* Device errors have no recovery path inside a kernel call: CUDA_CHECK and CUBLAS_CHECK
 * (trainer/backend/backend_cuda_check.h) print where, abort every live communicator so that
 * peers do not hang, and exit non-zero so that meshrun restarts or reports (backend_fatal). */
/* after a kernel launch: launch errors now, execution errors at the next synchronizing call */
#define LAUNCH_CHECK(name) CUDA_CHECK(cudaPeekAtLastError())

/* ------------------------------------------------------------------ storage types */

/* widen: a stored element as fp32 (exact). narrow<T>: fp32 to storage, rounded to nearest even
 * for bf16 (the one rounding of a store). Both are the identity for float. */
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ float widen(nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T narrow(float x);
template <>
__device__ __forceinline__ float narrow<float>(float x) { return x; }
template <>
__device__ __forceinline__ nv_bfloat16 narrow<nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* Runs the statements with T the storage type of dt (nv_bfloat16 for DT_BF16, else float):
 * the host wrappers' one switch from a dtype_t to a kernel instantiation. */
#define DT_DISPATCH(dt, ...)                                                                   \
  do {                                                                                         \
    if ((dt) == DT_BF16) {                                                                     \
      typedef nv_bfloat16 T;                                                                   \
      __VA_ARGS__;                                                                             \
    } else {                                                                                   \
      typedef float T;                                                                         \
      __VA_ARGS__;                                                                             \
    }                                                                                          \
  } while (0)

/* Eight bf16 elements as one 16-byte load or store (the vectorized kernels' unit: their pointers
 * are 16-byte aligned, aligned16, and a tail shorter than 8 goes to the one-element kernel). */
typedef union {
  uint4 u;
  nv_bfloat16 h[8];
} bf16x8_t;
static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* ------------------------------------------------------------------ state */

typedef struct {
  int m, n, k, trans_a, trans_b, tf32;
  dtype_t ab_dt, c_dt;           /* operands', output's */
  int align_a, align_b, align_c; /* bytes, of the row-major a, b, c */
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc; /* of the column-major call: la describes b, lb describes a */
  cublasLtMatmulAlgo_t algo;
} mm_entry_t;

typedef struct {
  void *p;
  size_t bytes;
} scratch_t;

/* What the backend's allocator holds: every cudaMalloc it made (alloc's buffers, kept with their
 * sizes for free; scratch; the cuBLASLt workspace), the bytes of them now, and the most ever.
 * That peak is the "allocator's peak" of the step line, as torch.cuda.max_memory_allocated is
 * PyTorch's; NCCL's and the CUDA context's own memory are not in it. */
typedef struct {
  void *p;
  size_t bytes;
} mem_held_t;
typedef struct {
  mem_held_t *v;
  int n, cap;
  size_t now, peak;
} mem_track_t;

/* A piece of sumsq_parts: its elements, and its blocks of pass 1 (g from first on). */
typedef struct {
  size_t offset, count;
  int g, first;
} sumsq_piece_t;

typedef struct {
  int device;
  size_t smem_optin; /* the most dynamic shared memory one block may have */
  cudaStream_t stream;
  cublasLtHandle_t lt;
  void *workspace;
  int allow_tf32;
  mm_entry_t mm[MM_CACHE];
  int mm_count, mm_next;
  /* scratch, grown on demand, never shrunk */
  scratch_t sumsq;                      /* SUMSQ_BLOCKS partials + the total, double */
  scratch_t rms;                        /* (RMS_PARTIALS, C) dw partials, fp32 */
  scratch_t att_delta;                  /* (B, H, T) rowsum(dout * out), fp32 */
  scratch_t emb_keys, emb_pos, emb_pos_sorted, emb_cub; /* embedding backward sort */
  scratch_t rope;                       /* (T, D/2) cos then (T, D/2) sin, fp32 */
  int rope_t, rope_d, rope_offset, rope_valid;
  float rope_theta;
  mem_track_t mem;
  /* attention: cuDNN's fused kernels once attention_select chose them (attention_cudnn.h) */
  cudnn_att_t *cudnn;
  int att_cudnn;         /* attention_select chose cuDNN: shapes it takes run there */
  int att_fallback_said; /* a later shape that cuDNN refused has been reported */
  scratch_t cudnn_ws;    /* cuDNN's workspace */
  scratch_t att_blk;     /* a block on cuDNN: its bf16 out, or its bf16 dq | dk | dv */
  scratch_t att_blk_lse; /* a block on cuDNN: its lse where the caller's is not 16-byte aligned */
  /* adamw_multi: the chunk table of the last segment list (adamw_segs, a host copy), on the
   * device, rebuilt only when a call brings another list */
  scratch_t adamw_tab;
  adamw_segment_t *adamw_segs;
  int adamw_nsegs;
  unsigned adamw_chunks;
  /* sumsq_groups: the device table of the last piece list (groups_tab, a host copy: pieces then
   * groups), its partials and totals after it in groups_dev, rebuilt only when a call brings
   * another list */
  scratch_t groups_dev;
  scratch_t sumsq_add; /* sumsq_parts_add: SUMSQ_ADD_PIECES x SUMSQ_BLOCKS partials, then its ticket */
  sumsq_piece_t *groups_tab;
  int *groups_of;
  int groups_n, groups_blocks;
  /* uploads: the copy stream, and per slot the event of its last copy (copied) and the point of
   * the compute stream after which its last destination is no longer read (freed) */
  cudaStream_t copy_stream;
  cudaEvent_t copied[2], freed[2];
} cuda_t;

static cuda_t *cuda_of(backend_t *be) { return (cuda_t *)be->impl; }

static void mem_add(mem_track_t *m, ptrdiff_t bytes) {
  m->now += (size_t)bytes; /* wraps back for a negative bytes */
  if (m->now > m->peak) m->peak = m->now;
}

/* Grows s to at least bytes. Kernels have no error path, so running out of device memory for
 * scratch is fatal (the model's own buffers are far larger than any of these). */
static void *scratch_get(cuda_t *cu, scratch_t *s, size_t bytes) {
  if (bytes == 0) bytes = 16;
  if (bytes > s->bytes) {
    if (s->p) CUDA_CHECK(cudaFree(s->p));
    mem_add(&cu->mem, -(ptrdiff_t)s->bytes);
    s->p = NULL;
    s->bytes = 0;
    CUDA_CHECK(cudaMalloc(&s->p, bytes));
    s->bytes = bytes;
    mem_add(&cu->mem, (ptrdiff_t)bytes);
  }
  return s->p;
}

static void scratch_free(cuda_t *cu, scratch_t *s) {
  if (s->p) cudaFree(s->p);
  mem_add(&cu->mem, -(ptrdiff_t)s->bytes);
  s->p = NULL;
  s->bytes = 0;
}

static unsigned ew_blocks(size_t n) {
  size_t b = (n + EW_THREADS - 1) / EW_THREADS;
  if (b > 65536) b = 65536; /* grid-stride loops do the rest */
  return b ? (unsigned)b : 1u;
}

/* ------------------------------------------------------------------ reductions (device) */

/* xor butterflies: every lane ends with the same value (float addition and max are
 * commutative, so partners compute identical sums), in a fixed order. */
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ double warp_sum_d(double x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
 * sh holds 32 floats. */
__device__ float block_sum(float x, float *sh) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  x = warp_sum(x);
  __syncthreads(); /* sh may still be read by an earlier call */
  if (lane == 0) sh[w] = x;
  __syncthreads();
  x = lane < nw ? sh[lane] : 0.0f;
  return warp_sum(x);
}

/* ------------------------------------------------------------------ memory */

static void *cu_alloc(backend_t *be, size_t bytes) {
  cuda_t *cu = cuda_of(be);
  mem_track_t *m = &cu->mem;
  void *p = NULL;
  if (bytes == 0) bytes = 16;
  if (m->n == m->cap) {
    int cap = m->cap ? 2 * m->cap : 256;
    mem_held_t *v = (mem_held_t *)realloc(m->v, (size_t)cap * sizeof *v);
    if (!v) return NULL;
    m->v = v;
    m->cap = cap;
  }
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    (void)cudaGetLastError(); /* out of memory is not sticky: clear it, let the caller report */
    return NULL;
  }
  if (cudaMemsetAsync(p, 0, bytes, cu->stream) != cudaSuccess) {
    (void)cudaGetLastError();
    cudaFree(p);
    return NULL;
  }
  m->v[m->n].p = p;
  m->v[m->n++].bytes = bytes;
  mem_add(m, (ptrdiff_t)bytes);
  return p;
}

/* Buffers are few (hundreds) and freed at the end, so a scan from the newest is enough. */
static void cu_free(backend_t *be, void *p) {
  if (!p) return;
  mem_track_t *m = &cuda_of(be)->mem;
  for (int i = m->n - 1; i >= 0; i--)
    if (m->v[i].p == p) {
      mem_add(m, -(ptrdiff_t)m->v[i].bytes);
      m->v[i] = m->v[--m->n];
      break;
    }
  CUDA_CHECK(cudaFree(p));
}

static size_t cu_mem_peak(backend_t *be) { return cuda_of(be)->mem.peak; }

/* The host buffer may be reused as soon as this returns, as with the cpu backend: wait. */
static void cu_to_device(backend_t *be, void *dst, const void *host_src, size_t bytes) {
  cuda_t *cu = cuda_of(be);
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, cu->stream));
  CUDA_CHECK(cudaStreamSynchronize(cu->stream));
}

static void cu_to_host(backend_t *be, void *host_dst, const void *src, size_t bytes) {
  cuda_t *cu = cuda_of(be);
  if (!bytes) return;
  CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, cu->stream));
  CUDA_CHECK(cudaStreamSynchronize(cu->stream));
}

static void cu_copy(backend_t *be, void *dst, const void *src, size_t bytes) {
  if (!bytes || dst == src) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cuda_of(be)->stream));
}

static void cu_zero(backend_t *be, void *p, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, cuda_of(be)->stream));
}

static void cu_sync(backend_t *be) { CUDA_CHECK(cudaStreamSynchronize(cuda_of(be)->stream)); }

/* ------------------------------------------------------------------ elementwise */

template <typename T>
__global__ void add_kernel(T *out, const T *a, const T *b, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    out[i] = narrow<T>(widen(a[i]) + widen(b[i]));
}

__global__ void scale_kernel(float *x, float s, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    x[i] = __fmul_rn(x[i], s);
}

/* beta * c for an empty product (k = 0); beta = 0 writes zeros even over NaNs */
template <typename T>
__global__ void beta_kernel(T *c, float beta, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    c[i] = narrow<T>(beta == 0.0f ? 0.0f : beta * widen(c[i]));
}

/* dst = src in another dtype: widening is exact, narrowing rounds to nearest even */
template <typename D, typename S>
__global__ void convert_kernel(D *dst, const S *src, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = narrow<D>(widen(src[i]));
}

/* acc += x: a bf16 result added into an fp32 accumulator, one fp32 add (the gradients of a block
 * of ring attention on cuDNN) */
__global__ void add_widen_kernel(float *acc, const nv_bfloat16 *x, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    acc[i] += widen(x[i]);
}

static void cu_add(backend_t *be, void *out, const void *a, const void *b, size_t n, dtype_t dt) {
  if (!n) return;
  DT_DISPATCH(dt, add_kernel<T><<<ew_blocks(n), EW_THREADS, 0, cuda_of(be)->stream>>>((T *)out, (const T *)a,
                                                                                      (const T *)b, n));
  LAUNCH_CHECK("add_kernel");
}

static void cu_scale(backend_t *be, float *x, float s, size_t n) {
  if (!n) return;
  scale_kernel<<<ew_blocks(n), EW_THREADS, 0, cuda_of(be)->stream>>>(x, s, n);
  LAUNCH_CHECK("scale_kernel");
}

static void cu_convert(backend_t *be, void *dst, dtype_t dst_dt, const void *src, dtype_t src_dt, size_t n) {
  cudaStream_t st = cuda_of(be)->stream;
  if (!n) return;
  if (dst_dt == src_dt) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, n * dtype_size(dst_dt), cudaMemcpyDeviceToDevice, st));
  } else if (dst_dt == DT_BF16) {
    convert_kernel<nv_bfloat16, float><<<ew_blocks(n), EW_THREADS, 0, st>>>((nv_bfloat16 *)dst, (const float *)src, n);
    LAUNCH_CHECK("convert_kernel");
  } else {
    convert_kernel<float, nv_bfloat16><<<ew_blocks(n), EW_THREADS, 0, st>>>((float *)dst, (const nv_bfloat16 *)src, n);
    LAUNCH_CHECK("convert_kernel");
  }
}

/* sumsq in two passes. Pass 1, block b of g: the sum of x[i]^2 (in double) for i = b*256 + tid +
 * j*g*256, then its threads in a fixed tree; the block's partial lands in *out. Pass 2: one thread
 * adds the g partials in order (sum_in_order). Depends on (n, b, g) alone, so a block of the
 * batched kernel below gives the bits a block of sumsq_partial_kernel gives. */
__device__ __forceinline__ void sumsq_block(double *out, const float *x, size_t n, int b, int g) {
  __shared__ double sh[32];
  double s = 0.0;
  for (size_t i = (size_t)b * blockDim.x + threadIdx.x; i < n; i += (size_t)g * blockDim.x)
    s += (double)x[i] * (double)x[i];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  s = warp_sum_d(s);
  if (lane == 0) sh[w] = s;
  __syncthreads();
  if (w == 0) {
    s = lane < nw ? sh[lane] : 0.0;
    s = warp_sum_d(s);
    if (lane == 0) *out = s;
  }
}

/* g partials added in order by one thread. */
__device__ __forceinline__ double sum_in_order(const double *part, int g) {
  double s = 0.0;
  for (int i = 0; i < g; i++) s += part[i];
  return s;
}

/* Blocks for n elements: one per 16 x 256, at most SUMSQ_BLOCKS (from n only, never the device). */
static size_t sumsq_blocks(size_t n) {
  size_t g = (n + 256 * 16 - 1) / (256 * 16);
  return g > SUMSQ_BLOCKS ? SUMSQ_BLOCKS : g;
}

__global__ void sumsq_partial_kernel(double *part, const float *x, size_t n) {
  sumsq_block(&part[blockIdx.x], x, n, (int)blockIdx.x, (int)gridDim.x);
}

__global__ void sumsq_final_kernel(double *total, const double *part, int g) { *total = sum_in_order(part, g); }

static double cu_sumsq(backend_t *be, const float *x, size_t n) {
  cuda_t *cu = cuda_of(be);
  if (!n) return 0.0;
  size_t g = sumsq_blocks(n);
  double *part = (double *)scratch_get(cu, &cu->sumsq, (SUMSQ_BLOCKS + 1) * sizeof(double));
  sumsq_partial_kernel<<<(unsigned)g, 256, 0, cu->stream>>>(part, x, n);
  LAUNCH_CHECK("sumsq_partial_kernel");
  sumsq_final_kernel<<<1, 1, 0, cu->stream>>>(part + SUMSQ_BLOCKS, part, (int)g);
  LAUNCH_CHECK("sumsq_final_kernel");
  double total = 0.0;
  CUDA_CHECK(cudaMemcpyAsync(&total, part + SUMSQ_BLOCKS, sizeof total, cudaMemcpyDeviceToHost, cu->stream));
  CUDA_CHECK(cudaStreamSynchronize(cu->stream));
  return total;
}

/* The pieces' sums in two launches and one wait. Piece i gets the blocks cu_sumsq would give it
 * (g_i, from its size alone), numbered from first[i]: pass 1 runs every piece's blocks in one
 * grid, each block doing for its piece exactly what sumsq_partial_kernel's block of the same index
 * does (so each partial has the same bits); pass 2 has one thread per piece add that piece's g_i
 * partials in order, as sumsq_final_kernel does. Each piece's sum is therefore cu_sumsq's, bit for
 * bit. The table (offset, count, g, first per piece: sumsq_piece_t) travels with the call. */

__global__ void sumsq_parts_partial_kernel(double *part, const float *x, const sumsq_piece_t *pieces, int n) {
  int lo = 0, hi = n - 1; /* the piece whose blocks include this one: the last first <= blockIdx.x */
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (pieces[mid].first <= (int)blockIdx.x) lo = mid;
    else hi = mid - 1;
  }
  const sumsq_piece_t pc = pieces[lo];
  sumsq_block(&part[blockIdx.x], x + pc.offset, pc.count, (int)blockIdx.x - pc.first, pc.g);
}

__global__ void sumsq_parts_final_kernel(double *totals, const double *part, const sumsq_piece_t *pieces, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) totals[i] = sum_in_order(part + pieces[i].first, pieces[i].g);
}

/* The piece table of (offset, count) into tab (n entries); returns the blocks of pass 1. */
static int sumsq_pieces(sumsq_piece_t *tab, const size_t *offset, const size_t *count, int n) {
  int blocks = 0;
  for (int i = 0; i < n; i++) {
    size_t g = sumsq_blocks(count[i]);
    tab[i] = (sumsq_piece_t){offset[i], count[i], (int)g, blocks};
    blocks += (int)g;
  }
  return blocks;
}

static void cu_sumsq_parts(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n,
                           double *out) {
  cuda_t *cu = cuda_of(be);
  if (n <= 0) return;
  sumsq_piece_t *tab = (sumsq_piece_t *)malloc((size_t)n * sizeof *tab);
  if (!tab) backend_fatal(__FILE__, __LINE__, "sumsq_parts", "out of host memory for the piece table");
  int blocks = sumsq_pieces(tab, offset, count, n);
  /* scratch: the table, then the partials, then the totals (8-byte aligned throughout) */
  size_t tab_bytes = ((size_t)n * sizeof *tab + 7) & ~(size_t)7;
  char *base = (char *)scratch_get(cu, &cu->sumsq, tab_bytes + ((size_t)blocks + (size_t)n) * sizeof(double));
  sumsq_piece_t *dtab = (sumsq_piece_t *)base;
  double *part = (double *)(base + tab_bytes), *totals = part + blocks;
  CUDA_CHECK(cudaMemcpyAsync(dtab, tab, (size_t)n * sizeof *tab, cudaMemcpyHostToDevice, cu->stream));
  if (blocks) {
    sumsq_parts_partial_kernel<<<(unsigned)blocks, 256, 0, cu->stream>>>(part, x, dtab, n);
    LAUNCH_CHECK("sumsq_parts_partial_kernel");
  }
  sumsq_parts_final_kernel<<<(unsigned)((n + 127) / 128), 128, 0, cu->stream>>>(totals, part, dtab, n);
  LAUNCH_CHECK("sumsq_parts_final_kernel");
  CUDA_CHECK(cudaMemcpyAsync(out, totals, (size_t)n * sizeof(double), cudaMemcpyDeviceToHost, cu->stream));
  CUDA_CHECK(cudaStreamSynchronize(cu->stream)); /* also: tab may be freed once the copy is done */
  free(tab);
}

/* ------------------------------------------------------------------ matmul (cuBLASLt) */

/* The largest power of two (at most 256) dividing the address, at least 2: a bf16 tensor
 * carved at an odd element offset is only 2-byte aligned, and the heuristic must know. */
static int ptr_align(const void *p) {
  uintptr_t a = (uintptr_t)p;
  int al = 256;
  while (al > 2 && (a % (uintptr_t)al) != 0) al >>= 1;
  return al;
}

static cudaDataType_t cuda_type(dtype_t dt) { return dt == DT_BF16 ? CUDA_R_16BF : CUDA_R_32F; }

static void mm_entry_destroy(mm_entry_t *e) {
  if (e->la) cublasLtMatrixLayoutDestroy(e->la);
  if (e->lb) cublasLtMatrixLayoutDestroy(e->lb);
  if (e->lc) cublasLtMatrixLayoutDestroy(e->lc);
  if (e->desc) cublasLtMatmulDescDestroy(e->desc);
  memset(e, 0, sizeof *e);
}

/* Row-major c (m,n) = op(a) op(b) is column-major c^T (n,m) = op(b)^T op(a)^T: the column-major
 * call's first operand is b, (n,k) after its op, stored as b's row-major layout read column-major:
 * (n,k) ld n without trans_b, (k,n) ld k with it (then op T); likewise a as the second operand.
 * Compute type: fp32 accumulation always; TF32 tensor cores only for fp32 operands when allowed
 * (bf16 operands use bf16 tensor cores with fp32 accumulation under CUBLAS_COMPUTE_32F). */
static mm_entry_t *mm_lookup(cuda_t *cu, int m, int n, int k, int ta, int tb, dtype_t ab_dt, dtype_t c_dt, int al_a,
                             int al_b, int al_c) {
  int tf32 = cu->allow_tf32 && ab_dt == DT_F32;
  for (int i = 0; i < cu->mm_count; i++) {
    mm_entry_t *e = &cu->mm[i];
    if (e->m == m && e->n == n && e->k == k && e->trans_a == ta && e->trans_b == tb && e->tf32 == tf32 &&
        e->ab_dt == ab_dt && e->c_dt == c_dt && e->align_a == al_a && e->align_b == al_b && e->align_c == al_c)
      return e;
  }
  mm_entry_t *e;
  if (cu->mm_count < MM_CACHE) {
    e = &cu->mm[cu->mm_count++];
  } else { /* full: replace in turn (the heuristic gives the same algorithm when asked again) */
    e = &cu->mm[cu->mm_next];
    cu->mm_next = (cu->mm_next + 1) % MM_CACHE;
    mm_entry_destroy(e);
  }
  e->m = m, e->n = n, e->k = k, e->trans_a = ta, e->trans_b = tb, e->tf32 = tf32;
  e->ab_dt = ab_dt, e->c_dt = c_dt;
  e->align_a = al_a, e->align_b = al_b, e->align_c = al_c;
  cudaDataType_t tab = cuda_type(ab_dt), tc = cuda_type(c_dt);

  CUBLAS_CHECK(cublasLtMatmulDescCreate(&e->desc, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof op_first));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(e->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof op_second));
  /* first operand (b): op N -> stored (n,k) ld n; op T -> stored (k,n) ld k */
  if (tb) CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->la, tab, (uint64_t)k, (uint64_t)n, (int64_t)k));
  else CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->la, tab, (uint64_t)n, (uint64_t)k, (int64_t)n));
  /* second operand (a): op N -> stored (k,m) ld k; op T -> stored (m,k) ld m */
  if (ta) CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->lb, tab, (uint64_t)m, (uint64_t)k, (int64_t)m));
  else CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->lb, tab, (uint64_t)k, (uint64_t)m, (int64_t)k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&e->lc, tc, (uint64_t)n, (uint64_t)m, (int64_t)n));

  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = WORKSPACE_BYTES;
  uint32_t a1 = (uint32_t)al_b, a2 = (uint32_t)al_a, a3 = (uint32_t)al_c; /* column-major A is b, B is a */
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a1, sizeof a1));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &a2, sizeof a2));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &a3, sizeof a3));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &a3, sizeof a3));
  if (c_dt == DT_BF16) {
    /* A split-K algorithm must add its partial sums in fp32 (the compute type), not in the bf16
     * output (in place, or in output-type workspace): bf16 partials lose bits per split (an H200
     * gave m=300 n=200 k=500 with both operands transposed results 1e-3 x max|c| off). */
    uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &scheme,
                                                      sizeof scheme));
  }
  cublasLtMatmulHeuristicResult_t res;
  int found = 0;
  memset(&res, 0, sizeof res);
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(cu->lt, e->desc, e->la, e->lb, e->lc, e->lc, pref, 1, &res, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  if (found < 1) {
    char msg[192];
    snprintf(msg, sizeof msg, "no algorithm for m=%d n=%d k=%d trans_a=%d trans_b=%d tf32=%d operands %s output %s", m,
             n, k, ta, tb, tf32, dtype_name(ab_dt), dtype_name(c_dt));
    backend_fatal(__FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic", msg);
  }
  e->algo = res.algo;
  return e;
}

static void cu_matmul(backend_t *be, void *c, const void *a, const void *b, int m, int n, int k, int trans_a,
                      int trans_b, float alpha, float beta, dtype_t ab_dt, dtype_t c_dt) {
  cuda_t *cu = cuda_of(be);
  if (ab_dt != DT_BF16 && c_dt == DT_BF16) /* not one of backend.h's combinations */
    backend_fatal(__FILE__, __LINE__, "matmul", "fp32 operands with a bf16 output are not supported");
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    size_t cn = (size_t)m * n;
    DT_DISPATCH(c_dt, beta_kernel<T><<<ew_blocks(cn), EW_THREADS, 0, cu->stream>>>((T *)c, beta, cn));
    LAUNCH_CHECK("beta_kernel");
    return;
  }
  mm_entry_t *e = mm_lookup(cu, m, n, k, trans_a, trans_b, ab_dt, c_dt, ptr_align(a), ptr_align(b), ptr_align(c));
  CUBLAS_CHECK(cublasLtMatmul(cu->lt, e->desc, &alpha, b, e->la, a, e->lb, &beta, c, e->lc, c, e->lc, &e->algo,
                              cu->workspace, WORKSPACE_BYTES, cu->stream));
}

/* ------------------------------------------------------------------ embedding */

/* one block per token row; a copy of stored elements (no rounding) */
template <typename T>
__global__ void embedding_fwd_kernel(T *out, const T *table, const int32_t *tokens, int c, int vocab_start, int rows) {
  int i = blockIdx.x;
  int r = tokens[i] - vocab_start;
  T *o = out + (size_t)i * c;
  if (r >= 0 && r < rows) {
    const T *src = table + (size_t)r * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = src[j];
  } else {
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = narrow<T>(0.0f);
  }
}

__global__ void iota_kernel(int32_t *x, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = i;
}

/* Block s of the (token, position)-sorted list works only if s starts a run of one token: it
 * adds the run's dout rows (widened) into the token's fp32 table row in position order, the cpu
 * order. */
template <typename T>
__global__ void embedding_bwd_kernel(float *dtable, const T *dout, const int32_t *keys, const int32_t *pos, int n,
                                     int c, int vocab_start, int rows) {
  int s = blockIdx.x;
  int key = keys[s];
  if (s > 0 && keys[s - 1] == key) return;
  int r = key - vocab_start;
  if (r < 0 || r >= rows) return;
  int e = s + 1;
  while (e < n && keys[e] == key) e++;
  float *dt = dtable + (size_t)r * c;
  for (int j = threadIdx.x; j < c; j += blockDim.x) {
    float acc = dt[j];
    for (int u = s; u < e; u++) acc += widen(dout[(size_t)pos[u] * c + j]);
    dt[j] = acc;
  }
}

static void cu_embedding_fwd(backend_t *be, void *out, const void *table, const int32_t *tokens, int n, int c,
                             int vocab_start, int rows, dtype_t dt) {
  if (n <= 0 || c <= 0) return;
  DT_DISPATCH(dt, embedding_fwd_kernel<T><<<n, 256, 0, cuda_of(be)->stream>>>((T *)out, (const T *)table, tokens, c,
                                                                             vocab_start, rows));
  LAUNCH_CHECK("embedding_fwd_kernel");
}

static void cu_embedding_bwd(backend_t *be, float *dtable, const void *dout, const int32_t *tokens, int n, int c,
                             int vocab_start, int rows, dtype_t dt) {
  cuda_t *cu = cuda_of(be);
  if (n <= 0 || c <= 0) return;
  int32_t *keys = (int32_t *)scratch_get(cu, &cu->emb_keys, (size_t)n * sizeof(int32_t));
  int32_t *pos = (int32_t *)scratch_get(cu, &cu->emb_pos, (size_t)n * sizeof(int32_t));
  int32_t *pos_sorted = (int32_t *)scratch_get(cu, &cu->emb_pos_sorted, (size_t)n * sizeof(int32_t));
  size_t tmp_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(NULL, tmp_bytes, tokens, keys, pos, pos_sorted, n, 0, 32, cu->stream));
  void *tmp = scratch_get(cu, &cu->emb_cub, tmp_bytes);
  iota_kernel<<<ew_blocks((size_t)n), EW_THREADS, 0, cu->stream>>>(pos, n);
  LAUNCH_CHECK("iota_kernel");
  /* LSD radix sort: stable, so equal tokens keep position order */
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, tokens, keys, pos, pos_sorted, n, 0, 32, cu->stream));
  DT_DISPATCH(dt, embedding_bwd_kernel<T><<<n, 256, 0, cu->stream>>>(dtable, (const T *)dout, keys, pos_sorted, n, c,
                                                                    vocab_start, rows));
  LAUNCH_CHECK("embedding_bwd_kernel");
}

/* ------------------------------------------------------------------ RMSNorm */

/* With y (add_rmsnorm_fwd), the row is x + y: add_kernel's sum, stored in sum first, and the
 * second pass reads it back (each thread its own columns; sum may alias x). */
template <typename T>
__global__ void rmsnorm_fwd_kernel(T *out, float *rstd, const T *x, const T *w, int c, float eps, const T *y, T *sum) {
  __shared__ float sh[32];
  int i = blockIdx.x;
  const T *xi = x + (size_t)i * c;
  T *oi = out + (size_t)i * c;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < c; j += blockDim.x) {
    T xs = xi[j];
    if (y) {
      xs = narrow<T>(widen(xs) + widen(y[(size_t)i * c + j]));
      sum[(size_t)i * c + j] = xs;
    }
    float xv = widen(xs);
    ss += xv * xv;
  }
  ss = block_sum(ss, sh);
  float r = 1.0f / sqrtf(ss / (float)c + eps);
  if (threadIdx.x == 0) rstd[i] = r;
  if (y) xi = sum + (size_t)i * c;
  for (int j = threadIdx.x; j < c; j += blockDim.x) oi[j] = narrow<T>(widen(xi[j]) * r * widen(w[j]));
}

/* Block g takes rows g, g+G, ...: dx for each row, and dw's contributions of its rows, summed in
 * row order into its own fp32 partial row part[g] (each thread owns the same columns
 * throughout). */
template <typename T>
__global__ void rmsnorm_bwd_kernel(T *dx, float *part, const T *dout, const T *x, const T *w, const float *rstd, int n,
                                   int c) {
  __shared__ float sh[32];
  float *pg = part + (size_t)blockIdx.x * c;
  for (int j = threadIdx.x; j < c; j += blockDim.x) pg[j] = 0.0f;
  for (int i = blockIdx.x; i < n; i += gridDim.x) {
    const T *xi = x + (size_t)i * c, *di = dout + (size_t)i * c;
    T *dxi = dx + (size_t)i * c;
    float r = rstd[i], dot = 0.0f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) dot += widen(di[j]) * widen(w[j]) * widen(xi[j]);
    dot = block_sum(dot, sh);
    float k = dot * r * r * r / (float)c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
      float d = widen(di[j]), xv = widen(xi[j]); /* read before dx is written: dx may alias dout */
      pg[j] += d * xv * r;
      dxi[j] = narrow<T>(widen(dxi[j]) + (r * widen(w[j]) * d - xv * k));
    }
  }
}

__global__ void rmsnorm_dw_kernel(float *dw, const float *part, int g, int c) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= c) return;
  float s = 0.0f;
  for (int i = 0; i < g; i++) s += part[(size_t)i * c + j];
  dw[j] += s;
}

/* bf16 rows of c = 8 c8 elements, 16-byte aligned: the forward above, 8 columns per load. (An
 * 8-wide backward ran slower on an H200, 159 us against 123 for 8192 x 2048, its partial dw rows
 * updated 32 bytes apart by neighbouring threads; docs/gpu.md says what would fix it.) */
__global__ void rmsnorm_fwd_x8_kernel(uint4 *out, float *rstd, const uint4 *x, const uint4 *w, int c8, float eps,
                                      const uint4 *y, uint4 *sum) {
  __shared__ float sh[32];
  int i = blockIdx.x;
  const uint4 *xi = x + (size_t)i * c8;
  uint4 *oi = out + (size_t)i * c8;
  float ss = 0.0f;
  for (int j = threadIdx.x; j < c8; j += blockDim.x) {
    bf16x8_t v;
    v.u = xi[j];
    if (y) {
      bf16x8_t yv;
      yv.u = y[(size_t)i * c8 + j];
#pragma unroll
      for (int k = 0; k < 8; k++) v.h[k] = narrow<nv_bfloat16>(widen(v.h[k]) + widen(yv.h[k]));
      sum[(size_t)i * c8 + j] = v.u;
    }
#pragma unroll
    for (int k = 0; k < 8; k++) {
      float xv = widen(v.h[k]);
      ss += xv * xv;
    }
  }
  ss = block_sum(ss, sh);
  float r = 1.0f / sqrtf(ss / (float)(8 * c8) + eps);
  if (threadIdx.x == 0) rstd[i] = r;
  if (y) xi = sum + (size_t)i * c8;
  for (int j = threadIdx.x; j < c8; j += blockDim.x) {
    bf16x8_t v, wv, o;
    v.u = xi[j];
    wv.u = w[j];
#pragma unroll
    for (int k = 0; k < 8; k++) o.h[k] = narrow<nv_bfloat16>(widen(v.h[k]) * r * widen(wv.h[k]));
    oi[j] = o.u;
  }
}

/* Threads for c8 groups a row: one group each, a multiple of 32, at most 1024. */
static int rms_threads_x8(int c8) {
  int t = 32;
  while (t < 1024 && t < c8) t *= 2;
  return t;
}

static int rms_threads(int c) {
  int t = 32;
  while (t < 1024 && t * 4 < c) t *= 2; /* about 4 columns per thread */
  return t;
}

/* rmsnorm_fwd, or with y add_rmsnorm_fwd (sum = x + y first). The 8-wide kernel where out, the
 * normed rows (x, or sum with y) and w are aligned, so that add_rmsnorm_fwd takes the kernel
 * rmsnorm_fwd would take on sum (the same bits as the two calls); x or y unaligned then takes
 * the two calls. */
static void rmsnorm_launch(backend_t *be, void *out, float *rstd, const void *x, const void *w, int n, int c, float eps,
                           const void *y, void *sum, dtype_t dt) {
  if (n <= 0 || c <= 0) return;
  cudaStream_t st = cuda_of(be)->stream;
  if (dt == DT_BF16 && c % 8 == 0 && aligned16(out) && aligned16(y ? sum : x) && aligned16(w)) {
    if (y && !(aligned16(x) && aligned16(y))) {
      cu_add(be, sum, x, y, (size_t)n * c, dt);
      rmsnorm_launch(be, out, rstd, sum, w, n, c, eps, NULL, NULL, dt);
      return;
    }
    rmsnorm_fwd_x8_kernel<<<n, rms_threads_x8(c / 8), 0, st>>>((uint4 *)out, rstd, (const uint4 *)x,
                                                               (const uint4 *)w, c / 8, eps, (const uint4 *)y,
                                                               (uint4 *)sum);
    LAUNCH_CHECK("rmsnorm_fwd_x8_kernel");
    return;
  }
  DT_DISPATCH(dt, rmsnorm_fwd_kernel<T><<<n, rms_threads(c), 0, st>>>((T *)out, rstd, (const T *)x, (const T *)w, c,
                                                                     eps, (const T *)y, (T *)sum));
  LAUNCH_CHECK("rmsnorm_fwd_kernel");
}

static void cu_rmsnorm_fwd(backend_t *be, void *out, float *rstd, const void *x, const void *w, int n, int c, float eps,
                           dtype_t dt) {
  rmsnorm_launch(be, out, rstd, x, w, n, c, eps, NULL, NULL, dt);
}

/* Residual add and RMSNorm (backend.h) in one pass: rmsnorm_fwd's kernels over the sum. */
static void cu_add_rmsnorm_fwd(backend_t *be, void *sum, void *out, float *rstd, const void *a, const void *b,
                               const void *w, int n, int c, float eps, dtype_t dt) {
  rmsnorm_launch(be, out, rstd, a, w, n, c, eps, b, sum, dt);
}

static void cu_rmsnorm_bwd(backend_t *be, void *dx, float *dw, const void *dout, const void *x, const void *w,
                           const float *rstd, int n, int c, dtype_t dt) {
  cuda_t *cu = cuda_of(be);
  if (n <= 0 || c <= 0) return;
  int g = n < RMS_PARTIALS ? n : RMS_PARTIALS;
  float *part = (float *)scratch_get(cu, &cu->rms, (size_t)g * c * sizeof(float));
  DT_DISPATCH(dt, rmsnorm_bwd_kernel<T><<<g, rms_threads(c), 0, cu->stream>>>(
                      (T *)dx, part, (const T *)dout, (const T *)x, (const T *)w, rstd, n, c));
  LAUNCH_CHECK("rmsnorm_bwd_kernel");
  rmsnorm_dw_kernel<<<(c + 255) / 256, 256, 0, cu->stream>>>(dw, part, g, c);
  LAUNCH_CHECK("rmsnorm_dw_kernel");
}

/* ------------------------------------------------------------------ RoPE */

/* The table in double, rounded once to fp32, as the cpu backend does (so both use the same
 * angles). */
__global__ void rope_table_kernel(float *cs, float *sn, int t, int d, int pos_offset, double theta) {
  int half = d / 2;
  int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= t * half) return;
  int p = idx / half, i = idx % half;
  double freq = pow(theta, -2.0 * i / (double)d);
  double ang = (double)(pos_offset + p) * freq;
  cs[idx] = (float)cos(ang);
  sn[idx] = (float)sin(ang);
}

/* one thread per pair; explicit roundings (no fused multiply-add) give the cpu backend's bits */
template <typename T>
__global__ void rope_kernel(T *x, const float *cs, const float *sn, size_t pairs, int t, int h, int d, int half,
                            float sign) {
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < pairs; idx += (size_t)gridDim.x * blockDim.x) {
    int i = (int)(idx % half);
    size_t rest = idx / half; /* (row, head) */
    size_t row = rest / h;
    int p = (int)(row % t);
    float c = cs[(size_t)p * half + i], s = sign * sn[(size_t)p * half + i];
    T *xp = x + rest * (size_t)d + 2 * i;
    float x0 = widen(xp[0]), x1 = widen(xp[1]);
    xp[0] = narrow<T>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
    xp[1] = narrow<T>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
  }
}

/* Four pairs of one head (8 bf16 values) rotated by the angles from cr, sr (times sign), with
 * rope_kernel's arithmetic. */
__device__ __forceinline__ void rope_rotate8(bf16x8_t &xv, const float *cr, const float *sr, float sign) {
#pragma unroll
  for (int q = 0; q < 4; q++) {
    float c = cr[q], s = sign * sr[q];
    float x0 = widen(xv.h[2 * q]), x1 = widen(xv.h[2 * q + 1]);
    xv.h[2 * q] = narrow<nv_bfloat16>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
    xv.h[2 * q + 1] = narrow<nv_bfloat16>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
  }
}

/* bf16 with d a multiple of 8: four pairs of one head per 16-byte load, the same arithmetic. */
__global__ void rope_x8_kernel(uint4 *x, const float *cs, const float *sn, size_t n8, int t, int h, int d, int half,
                               float sign) {
  for (size_t v = blockIdx.x * (size_t)blockDim.x + threadIdx.x; v < n8; v += (size_t)gridDim.x * blockDim.x) {
    size_t e = v * 8, rest = e / d; /* (row, head) */
    int i0 = (int)(e % d) / 2, p = (int)((rest / h) % t);
    bf16x8_t xv;
    xv.u = x[v];
    rope_rotate8(xv, cs + (size_t)p * half + i0, sn + (size_t)p * half + i0, sign);
    x[v] = xv.u;
  }
}

/* The (t, d/2) cos table then the sin table, from the cache or made now. */
static const float *rope_cs(backend_t *be, int t, int d, int pos_offset, float theta) {
  cuda_t *cu = cuda_of(be);
  int half = d / 2;
  if (!(cu->rope_valid && cu->rope_t == t && cu->rope_d == d && cu->rope_offset == pos_offset &&
        cu->rope_theta == theta)) {
    float *tab = (float *)scratch_get(cu, &cu->rope, 2 * (size_t)t * half * sizeof(float));
    int cnt = t * half;
    rope_table_kernel<<<(cnt + 255) / 256, 256, 0, cu->stream>>>(tab, tab + (size_t)t * half, t, d, pos_offset,
                                                                 (double)theta);
    LAUNCH_CHECK("rope_table_kernel");
    cu->rope_t = t, cu->rope_d = d, cu->rope_offset = pos_offset, cu->rope_theta = theta, cu->rope_valid = 1;
  }
  return (const float *)cu->rope.p;
}

static void rope_apply(backend_t *be, void *x, int b, int t, int h, int d, int pos_offset, float theta, float sign,
                       dtype_t dt) {
  cuda_t *cu = cuda_of(be);
  int half = d / 2;
  if (b <= 0 || t <= 0 || h <= 0 || half <= 0) return;
  const float *cs = rope_cs(be, t, d, pos_offset, theta), *sn = cs + (size_t)t * half;
  size_t pairs = (size_t)b * t * h * half;
  if (dt == DT_BF16 && d % 8 == 0 && aligned16(x)) {
    size_t n8 = pairs / 4;
    rope_x8_kernel<<<ew_blocks(n8), EW_THREADS, 0, cu->stream>>>((uint4 *)x, cs, sn, n8, t, h, d, half, sign);
    LAUNCH_CHECK("rope_x8_kernel");
    return;
  }
  DT_DISPATCH(dt, rope_kernel<T><<<ew_blocks(pairs), EW_THREADS, 0, cu->stream>>>((T *)x, cs, sn, pairs, t, h, d, half,
                                                                                 sign));
  LAUNCH_CHECK("rope_kernel");
}

static void cu_rope_fwd(backend_t *be, void *x, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt) {
  rope_apply(be, x, b, t, h, d, pos_offset, theta, 1.0f, dt);
}
static void cu_rope_bwd(backend_t *be, void *dx, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt) {
  rope_apply(be, dx, b, t, h, d, pos_offset, theta, -1.0f, dt);
}

/* ------------------------------------------------------------------ Q, K, V of one product */

/* Column c (even) of a packed row r of width hd + 2 kd: its place in q, k or v (rows of hd, kd,
 * kd), and whether it rotates (q and k do). */
template <typename P>
__device__ __forceinline__ P *qkv_place(P *q, P *k, P *v, size_t r, int c, int hd, int kd, int &rot) {
  rot = c < hd + kd;
  return c < hd ? q + r * hd + c : c < hd + kd ? k + r * kd + (c - hd) : v + r * kd + (c - hd - kd);
}

/* One thread per pair of a packed row, between qkv and q, k, v (to_packed: toward qkv), with
 * rope_kernel's arithmetic (explicit roundings: the cpu backend's bits). */
template <typename T>
__global__ void qkv_rope_kernel(T *qkv, T *q, T *k, T *v, const float *cs, const float *sn, size_t pairs, int t,
                                int hd, int kd, int d, float sign, int to_packed) {
  const int w2 = (hd + 2 * kd) / 2, half = d / 2;
  for (size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x; idx < pairs; idx += (size_t)gridDim.x * blockDim.x) {
    size_t r = idx / w2;
    int c = 2 * (int)(idx % w2), rot;
    T *sp = qkv_place(q, k, v, r, c, hd, kd, rot), *pp = qkv + r * (2 * (size_t)w2) + c;
    const T *src = to_packed ? sp : pp;
    T *dst = to_packed ? pp : sp;
    float x0 = widen(src[0]), x1 = widen(src[1]);
    if (rot) {
      int i = (c % d) / 2, p = (int)(r % t);
      float cv = cs[(size_t)p * half + i], s = sign * sn[(size_t)p * half + i];
      dst[0] = narrow<T>(__fsub_rn(__fmul_rn(x0, cv), __fmul_rn(x1, s)));
      dst[1] = narrow<T>(__fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, cv)));
    } else {
      dst[0] = narrow<T>(x0);
      dst[1] = narrow<T>(x1);
    }
  }
}

/* bf16 with d a multiple of 8: 8 columns of one head per 16-byte load and store. */
__global__ void qkv_rope_x8_kernel(uint4 *qkv, uint4 *q, uint4 *k, uint4 *v, const float *cs, const float *sn,
                                   size_t n8, int t, int hd8, int kd8, int d, float sign, int to_packed) {
  const int w8 = hd8 + 2 * kd8, half = d / 2;
  for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < n8; g += (size_t)gridDim.x * blockDim.x) {
    size_t r = g / w8;
    int c8 = (int)(g % w8), rot;
    uint4 *sp = qkv_place(q, k, v, r, c8, hd8, kd8, rot), *pp = qkv + g;
    bf16x8_t xv;
    xv.u = to_packed ? *sp : *pp;
    if (rot) {
      int i0 = (c8 * 8 % d) / 2, p = (int)(r % t);
      rope_rotate8(xv, cs + (size_t)p * half + i0, sn + (size_t)p * half + i0, sign);
    }
    if (to_packed) *pp = xv.u;
    else *sp = xv.u;
  }
}

static void qkv_rope(backend_t *be, void *qkv, void *q, void *k, void *v, int b, int t, int h, int kv, int d,
                     int pos_offset, float theta, float sign, int to_packed, dtype_t dt) {
  cuda_t *cu = cuda_of(be);
  int half = d / 2;
  if (b <= 0 || t <= 0 || h <= 0 || kv <= 0 || half <= 0) return;
  const float *cs = rope_cs(be, t, d, pos_offset, theta), *sn = cs + (size_t)t * half;
  const size_t rows = (size_t)b * t;
  const int hd = h * d, kd = kv * d;
  if (dt == DT_BF16 && d % 8 == 0 && aligned16(qkv) && aligned16(q) && aligned16(k) && aligned16(v)) {
    size_t n8 = rows * (size_t)(hd + 2 * kd) / 8;
    qkv_rope_x8_kernel<<<ew_blocks(n8), EW_THREADS, 0, cu->stream>>>((uint4 *)qkv, (uint4 *)q, (uint4 *)k,
                                                                     (uint4 *)v, cs, sn, n8, t, hd / 8, kd / 8, d,
                                                                     sign, to_packed);
    LAUNCH_CHECK("qkv_rope_x8_kernel");
    return;
  }
  size_t pairs = rows * (size_t)(hd + 2 * kd) / 2;
  DT_DISPATCH(dt, qkv_rope_kernel<T><<<ew_blocks(pairs), EW_THREADS, 0, cu->stream>>>(
                      (T *)qkv, (T *)q, (T *)k, (T *)v, cs, sn, pairs, t, hd, kd, d, sign, to_packed));
  LAUNCH_CHECK("qkv_rope_kernel");
}

static void cu_qkv_rope_fwd(backend_t *be, void *q, void *k, void *v, const void *qkv, int b, int t, int h, int kv,
                            int d, int pos_offset, float theta, dtype_t dt) {
  qkv_rope(be, (void *)qkv, q, k, v, b, t, h, kv, d, pos_offset, theta, 1.0f, 0, dt);
}
static void cu_qkv_rope_bwd(backend_t *be, void *dqkv, const void *dq, const void *dk, const void *dv, int b, int t,
                            int h, int kv, int d, int pos_offset, float theta, dtype_t dt) {
  qkv_rope(be, dqkv, (void *)dq, (void *)dk, (void *)dv, b, t, h, kv, d, pos_offset, theta, -1.0f, 1, dt);
}

/* ------------------------------------------------------------------ attention */

/* Shapes: q, out, dq (B,T,H,D) with row stride H*D; k, v, dk, dv (B,T,KV,D) with row stride KV*D.
 * DP is D rounded up to 16, 32, 64 or 128; tiles are zero-filled past D and past T, so dot
 * products over DP equal those over D. Tiles are fp32 whatever the storage type T of the
 * tensors: widened as they are loaded. lse and delta are fp32.
 *
 * Layout in a block: ATT_WARPS warps of ATT_ROWS rows each cover one tile of 32 rows (queries
 * in the forward and dq kernels, keys in the dk/dv kernel); within a warp, lane j stands for
 * column j of the 32-wide tile on the other side. Scores are dot products of a "row" held in
 * shared memory (read as broadcasts) with a "lane" row of a padded (stride DP+4) tile, 16 bytes
 * at a time. Products with a value tile (P V, dS K, P^T dO, dS^T Q) put the lanes on D instead:
 * the warp writes its (ATT_ROWS, 32) probabilities to shared memory and reads them back as
 * broadcasts. */

template <int DP>
struct att_dims {
  static constexpr int DS = DP + 4;             /* padded stride of lane-row tiles */
  static constexpr int DPL = (DP + 31) / 32;    /* D elements per lane in value products */
};

/* Loads rows [r0, r0+32) of a (T, stride) tensor into a fp32 (32, ld) tile, zero past t and
 * past d. */
template <int DP, typename T>
__device__ __forceinline__ void att_load_tile(float *tile, int ld, const T *src, size_t stride, int r0, int t, int d) {
  for (int idx = threadIdx.x; idx < ATT_TILE * DP; idx += blockDim.x) {
    int r = idx / DP, col = idx % DP, row = r0 + r;
    tile[r * ld + col] = (row < t && col < d) ? widen(src[(size_t)row * stride + col]) : 0.0f;
  }
}

/* s[r] += dot(rows[r], lanerow) over DP, rows broadcast (stride DP), lanerow padded. */
template <int DP>
__device__ __forceinline__ void att_dots(float *s, const float *rows, const float *lanerow) {
#pragma unroll 4
  for (int c = 0; c < DP; c += 4) {
    float4 kk = *(const float4 *)(lanerow + c);
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
      float4 qq = *(const float4 *)(rows + r * DP + c);
      s[r] = fmaf(qq.x, kk.x, s[r]);
      s[r] = fmaf(qq.y, kk.y, s[r]);
      s[r] = fmaf(qq.z, kk.z, s[r]);
      s[r] = fmaf(qq.w, kk.w, s[r]);
    }
  }
}

/* acc[r][i] += sum_j w[r][j] * tile[j][lane + 32 i], w (ATT_ROWS, 32) in shared memory. */
template <int DP>
__device__ __forceinline__ void att_accum(float (*acc)[att_dims<DP>::DPL], const float *w, const float *tile, int ld,
                                          int lane) {
  constexpr int DPL = att_dims<DP>::DPL;
  for (int j = 0; j < ATT_TILE; j += 4) {
    float tv[4][DPL];
#pragma unroll
    for (int u = 0; u < 4; u++)
#pragma unroll
      for (int i = 0; i < DPL; i++) {
        int dd = lane + 32 * i;
        tv[u][i] = dd < DP ? tile[(j + u) * ld + dd] : 0.0f;
      }
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
      float4 ww = *(const float4 *)(w + r * ATT_TILE + j);
#pragma unroll
      for (int i = 0; i < DPL; i++) {
        float a = acc[r][i];
        a = fmaf(ww.x, tv[0][i], a);
        a = fmaf(ww.y, tv[1][i], a);
        a = fmaf(ww.z, tv[2][i], a);
        a = fmaf(ww.w, tv[3][i], a);
        acc[r][i] = a;
      }
    }
  }
}

/* Forward: block (query tile, head, batch); the heaviest tiles (last queries) start first.
 * tq queries against tk keys, query i seeing key j when j <= i + off (off: the queries' first
 * position minus the keys'; the whole causal attention is tq = tk, off 0). Out is O: the
 * tensors' type, or fp32 for a block of ring attention, whose rows that see no key get 0 and
 * lse -inf. */
template <int DP, typename T, typename O>
__global__ void __launch_bounds__(ATT_THREADS) attn_fwd_kernel(O *out, float *lse, const T *q, const T *k, const T *v,
                                                                int tq, int tk, int off, int h, int kv, int d,
                                                                float scale) {
  constexpr int DS = att_dims<DP>::DS, DPL = att_dims<DP>::DPL;
  extern __shared__ float4 att_smem4[];
  float *Qs = (float *)att_smem4;        /* (32, DP)  queries, broadcast rows */
  float *Ks = Qs + ATT_TILE * DP;        /* (32, DS)  keys, lane rows */
  float *Vs = Ks + ATT_TILE * DS;        /* (32, DP)  values */
  float *Ps = Vs + ATT_TILE * DP;        /* (WARPS, ROWS, 32) probabilities */
  int qt = gridDim.x - 1 - blockIdx.x, hi = blockIdx.y, bi = blockIdx.z, ki = hi / (h / kv);
  int q0 = qt * ATT_TILE, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  size_t qs = (size_t)h * d, ks = (size_t)kv * d;
  const T *qb = q + (size_t)bi * tq * qs + (size_t)hi * d;
  const T *kb = k + (size_t)bi * tk * ks + (size_t)ki * d;
  const T *vb = v + (size_t)bi * tk * ks + (size_t)ki * d;
  att_load_tile<DP>(Qs, DP, qb, qs, q0, tq, d);
  const float *myq = Qs + warp * ATT_ROWS * DP;
  float *myp = Ps + warp * ATT_ROWS * ATT_TILE;
  int qrow0 = q0 + warp * ATT_ROWS;

  float m[ATT_ROWS], l[ATT_ROWS], o[ATT_ROWS][DPL];
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    m[r] = -INFINITY, l[r] = 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++) o[r][i] = 0.0f;
  }
  int last = min(q0 + ATT_TILE - 1 + off, tk - 1);
  for (int k0 = 0; k0 <= last; k0 += ATT_TILE) {
    __syncthreads(); /* the previous tiles are no longer read */
    att_load_tile<DP>(Ks, DS, kb, ks, k0, tk, d);
    att_load_tile<DP>(Vs, DP, vb, ks, k0, tk, d);
    __syncthreads();
    float s[ATT_ROWS];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) s[r] = 0.0f;
    att_dots<DP>(s, myq, Ks + lane * DS);
    int j = k0 + lane;
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
      int qi = qrow0 + r;
      bool valid = qi < tq && j < tk && j <= qi + off;
      float x = valid ? s[r] * scale : -INFINITY;
      float mnew = fmaxf(m[r], warp_max(x));
      float p = 0.0f, corr = 1.0f;
      if (mnew != -INFINITY) { /* rows past t see no key at all */
        corr = expf(m[r] - mnew);
        p = valid ? expf(x - mnew) : 0.0f;
      }
      l[r] = l[r] * corr + warp_sum(p);
      m[r] = mnew;
#pragma unroll
      for (int i = 0; i < DPL; i++) o[r][i] *= corr;
      myp[r * ATT_TILE + lane] = p;
    }
    __syncwarp();
    att_accum<DP>(o, myp, Vs, DP, lane);
    __syncwarp();
  }
  O *ob = out + (size_t)bi * tq * qs + (size_t)hi * d;
  float *lb = lse + ((size_t)bi * h + hi) * tq;
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    int qi = qrow0 + r;
    if (qi >= tq) continue;
    bool seen = l[r] > 0.0f; /* a row before every key of a block saw none */
    if (lane == 0) lb[qi] = seen ? m[r] + logf(l[r]) : -INFINITY;
    float inv = seen ? 1.0f / l[r] : 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      int dd = lane + 32 * i;
      if (dd < d) ob[(size_t)qi * qs + dd] = narrow<O>(o[r][i] * inv);
    }
  }
}

/* delta (B,H,T) fp32 = rowsum(dout * out), one warp per row */
template <typename T>
__global__ void attn_delta_kernel(float *delta, const T *out, const T *dout, int b, int t, int h, int d) {
  size_t rows = (size_t)b * t * h;
  size_t wid = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (wid >= rows) return;
  /* wid walks (B,T,H) so that reads are contiguous; delta is stored (B,H,T) */
  size_t bi = wid / ((size_t)t * h), rest = wid % ((size_t)t * h);
  int ti = (int)(rest / h), hi = (int)(rest % h);
  const T *o = out + wid * d, *g = dout + wid * d;
  float s = 0.0f;
  for (int j = lane; j < d; j += 32) s += widen(o[j]) * widen(g[j]);
  s = warp_sum(s);
  if (lane == 0) delta[(bi * h + hi) * t + ti] = s;
}

/* dq: block (query tile, head, batch), over the key tiles up to the diagonal:
 * p = exp(scale q.k - lse), ds = p (do.v - delta), dq += scale ds k. Geometry as the forward's;
 * dq is G: the tensors' type, or fp32 for a block of ring attention. */
template <int DP, typename T, typename G>
__global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq_kernel(G *dq, const T *dout, const T *q, const T *k,
                                                                   const T *v, const float *lse, const float *delta,
                                                                   int tq, int tk, int off, int h, int kv, int d,
                                                                   float scale) {
  constexpr int DS = att_dims<DP>::DS, DPL = att_dims<DP>::DPL;
  extern __shared__ float4 att_smem4[];
  float *Qs = (float *)att_smem4;   /* (32, DP) */
  float *dOs = Qs + ATT_TILE * DP;  /* (32, DP) */
  float *Ks = dOs + ATT_TILE * DP;  /* (32, DS) */
  float *Vs = Ks + ATT_TILE * DS;   /* (32, DS) */
  float *dSs = Vs + ATT_TILE * DS;  /* (WARPS, ROWS, 32) */
  int qt = gridDim.x - 1 - blockIdx.x, hi = blockIdx.y, bi = blockIdx.z, ki = hi / (h / kv);
  int q0 = qt * ATT_TILE, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  size_t qs = (size_t)h * d, ks = (size_t)kv * d;
  const T *qb = q + (size_t)bi * tq * qs + (size_t)hi * d;
  const T *gb = dout + (size_t)bi * tq * qs + (size_t)hi * d;
  const T *kb = k + (size_t)bi * tk * ks + (size_t)ki * d;
  const T *vb = v + (size_t)bi * tk * ks + (size_t)ki * d;
  const float *lb = lse + ((size_t)bi * h + hi) * tq, *db = delta + ((size_t)bi * h + hi) * tq;
  att_load_tile<DP>(Qs, DP, qb, qs, q0, tq, d);
  att_load_tile<DP>(dOs, DP, gb, qs, q0, tq, d);
  int qrow0 = q0 + warp * ATT_ROWS;
  float lr[ATT_ROWS], dr[ATT_ROWS], acc[ATT_ROWS][DPL];
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    int qi = qrow0 + r;
    lr[r] = qi < tq ? lb[qi] : 0.0f;
    dr[r] = qi < tq ? db[qi] : 0.0f;
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[r][i] = 0.0f;
  }
  float *myds = dSs + warp * ATT_ROWS * ATT_TILE;
  int last = min(q0 + ATT_TILE - 1 + off, tk - 1);
  for (int k0 = 0; k0 <= last; k0 += ATT_TILE) {
    __syncthreads();
    att_load_tile<DP>(Ks, DS, kb, ks, k0, tk, d);
    att_load_tile<DP>(Vs, DS, vb, ks, k0, tk, d);
    __syncthreads();
    float s[ATT_ROWS], dp[ATT_ROWS];
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) s[r] = 0.0f, dp[r] = 0.0f;
    att_dots<DP>(s, Qs + warp * ATT_ROWS * DP, Ks + lane * DS);
    att_dots<DP>(dp, dOs + warp * ATT_ROWS * DP, Vs + lane * DS);
    int j = k0 + lane;
#pragma unroll
    for (int r = 0; r < ATT_ROWS; r++) {
      int qi = qrow0 + r;
      bool valid = qi < tq && j < tk && j <= qi + off;
      float p = valid ? expf(s[r] * scale - lr[r]) : 0.0f;
      myds[r * ATT_TILE + lane] = p * (dp[r] - dr[r]);
    }
    __syncwarp();
    att_accum<DP>(acc, myds, Ks, DS, lane);
    __syncwarp();
  }
  G *dqb = dq + (size_t)bi * tq * qs + (size_t)hi * d;
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    int qi = qrow0 + r;
    if (qi >= tq) continue;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      int dd = lane + 32 * i;
      if (dd < d) {
        G *p = dqb + (size_t)qi * qs + dd;
        *p = narrow<G>(widen(*p) + scale * acc[r][i]);
      }
    }
  }
}

/* dk, dv: block (key tile, kv head, batch), over the group's query heads in order and, for each,
 * the query tiles from the diagonal on: dv += p^T do, dk += scale ds^T q. Geometry as the
 * forward's; dk and dv are G. */
template <int DP, typename T, typename G>
__global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dkdv_kernel(G *dk, G *dv, const T *dout, const T *q,
                                                                     const T *k, const T *v, const float *lse,
                                                                     const float *delta, int tq, int tk, int off,
                                                                     int h, int kv, int d, float scale) {
  constexpr int DS = att_dims<DP>::DS, DPL = att_dims<DP>::DPL;
  extern __shared__ float4 att_smem4[];
  float *Ks = (float *)att_smem4;   /* (32, DP) keys, broadcast rows */
  float *Vs = Ks + ATT_TILE * DP;   /* (32, DP) */
  float *Qs = Vs + ATT_TILE * DP;   /* (32, DS) queries, lane rows */
  float *dOs = Qs + ATT_TILE * DS;  /* (32, DS) */
  float *Pss = dOs + ATT_TILE * DS; /* (WARPS, ROWS, 32) */
  float *dSs = Pss + ATT_WARPS * ATT_ROWS * ATT_TILE;
  float *Ls = dSs + ATT_WARPS * ATT_ROWS * ATT_TILE; /* (32) lse of the query tile */
  float *Dls = Ls + ATT_TILE;                        /* (32) delta of the query tile */
  int kt = blockIdx.x, ki = blockIdx.y, bi = blockIdx.z, group = h / kv;
  int k0 = kt * ATT_TILE, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  size_t qs = (size_t)h * d, ks = (size_t)kv * d;
  const T *kb = k + (size_t)bi * tk * ks + (size_t)ki * d;
  const T *vb = v + (size_t)bi * tk * ks + (size_t)ki * d;
  att_load_tile<DP>(Ks, DP, kb, ks, k0, tk, d);
  att_load_tile<DP>(Vs, DP, vb, ks, k0, tk, d);
  /* the first query tile with a query that sees key k0 (k0 itself when off = 0) */
  int first = k0 - off > 0 ? (k0 - off) / ATT_TILE * ATT_TILE : 0;
  int krow0 = k0 + warp * ATT_ROWS;
  float dka[ATT_ROWS][DPL], dva[ATT_ROWS][DPL];
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++)
#pragma unroll
    for (int i = 0; i < DPL; i++) dka[r][i] = 0.0f, dva[r][i] = 0.0f;
  float *myp = Pss + warp * ATT_ROWS * ATT_TILE, *myds = dSs + warp * ATT_ROWS * ATT_TILE;
  for (int hi = ki * group; hi < (ki + 1) * group; hi++) {
    const T *qb = q + (size_t)bi * tq * qs + (size_t)hi * d;
    const T *gb = dout + (size_t)bi * tq * qs + (size_t)hi * d;
    const float *lb = lse + ((size_t)bi * h + hi) * tq, *db = delta + ((size_t)bi * h + hi) * tq;
    for (int q0 = first; q0 < tq; q0 += ATT_TILE) {
      __syncthreads();
      att_load_tile<DP>(Qs, DS, qb, qs, q0, tq, d);
      att_load_tile<DP>(dOs, DS, gb, qs, q0, tq, d);
      if (threadIdx.x < ATT_TILE) {
        int qi = q0 + threadIdx.x;
        Ls[threadIdx.x] = qi < tq ? lb[qi] : 0.0f;
        Dls[threadIdx.x] = qi < tq ? db[qi] : 0.0f;
      }
      __syncthreads();
      float s[ATT_ROWS], dp[ATT_ROWS];
#pragma unroll
      for (int r = 0; r < ATT_ROWS; r++) s[r] = 0.0f, dp[r] = 0.0f;
      att_dots<DP>(s, Ks + warp * ATT_ROWS * DP, Qs + lane * DS);
      att_dots<DP>(dp, Vs + warp * ATT_ROWS * DP, dOs + lane * DS);
      int qi = q0 + lane;
      float lq = Ls[lane], dlt = Dls[lane];
#pragma unroll
      for (int r = 0; r < ATT_ROWS; r++) {
        int kj = krow0 + r;
        bool valid = qi < tq && kj < tk && kj <= qi + off;
        float p = valid ? expf(s[r] * scale - lq) : 0.0f;
        myp[r * ATT_TILE + lane] = p;
        myds[r * ATT_TILE + lane] = p * (dp[r] - dlt);
      }
      __syncwarp();
      att_accum<DP>(dva, myp, dOs, DS, lane);
      att_accum<DP>(dka, myds, Qs, DS, lane);
      __syncwarp();
    }
  }
  G *dkb = dk + (size_t)bi * tk * ks + (size_t)ki * d;
  G *dvb = dv + (size_t)bi * tk * ks + (size_t)ki * d;
#pragma unroll
  for (int r = 0; r < ATT_ROWS; r++) {
    int kj = krow0 + r;
    if (kj >= tk) continue;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
      int dd = lane + 32 * i;
      if (dd < d) {
        G *pk = dkb + (size_t)kj * ks + dd, *pv = dvb + (size_t)kj * ks + dd;
        *pk = narrow<G>(widen(*pk) + scale * dka[r][i]);
        *pv = narrow<G>(widen(*pv) + dva[r][i]);
      }
    }
  }
}

template <int DP>
static size_t att_fwd_smem(void) {
  return sizeof(float) * (size_t)(ATT_TILE * DP + ATT_TILE * att_dims<DP>::DS + ATT_TILE * DP +
                                  ATT_WARPS * ATT_ROWS * ATT_TILE);
}
template <int DP>
static size_t att_dq_smem(void) {
  return sizeof(float) * (size_t)(2 * ATT_TILE * DP + 2 * ATT_TILE * att_dims<DP>::DS + ATT_WARPS * ATT_ROWS * ATT_TILE);
}
template <int DP>
static size_t att_dkdv_smem(void) {
  return sizeof(float) * (size_t)(2 * ATT_TILE * DP + 2 * ATT_TILE * att_dims<DP>::DS +
                                  2 * ATT_WARPS * ATT_ROWS * ATT_TILE + 2 * ATT_TILE);
}

/* Raises the dynamic shared-memory limits (above 48 KB needs it) of the kernels for tensors of
 * type T with outputs and gradients of type O. 0, or -1 when the device refuses. */
template <int DP, typename T, typename O>
static int att_setup_t(void) {
  if (cudaFuncSetAttribute(attn_fwd_kernel<DP, T, O>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           (int)att_fwd_smem<DP>()) != cudaSuccess ||
      cudaFuncSetAttribute(attn_bwd_dq_kernel<DP, T, O>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           (int)att_dq_smem<DP>()) != cudaSuccess ||
      cudaFuncSetAttribute(attn_bwd_dkdv_kernel<DP, T, O>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           (int)att_dkdv_smem<DP>()) != cudaSuccess)
    return -1;
  return 0;
}

/* At create, for fp32 and bf16 tensors alike (the tiles are fp32 in both), and bf16 tensors
 * with fp32 outputs (the blocks of ring attention). 0, or -1 when the device's shared memory is
 * too small for the tiles of head size DP. */
template <int DP>
static int att_setup(cuda_t *cu) {
  size_t need = att_dkdv_smem<DP>();
  if (att_fwd_smem<DP>() > need) need = att_fwd_smem<DP>();
  if (att_dq_smem<DP>() > need) need = att_dq_smem<DP>();
  if (need > cu->smem_optin) return -1;
  return (att_setup_t<DP, float, float>() || att_setup_t<DP, nv_bfloat16, nv_bfloat16>() ||
          att_setup_t<DP, nv_bfloat16, float>())
             ? -1
             : 0;
}

/* A call's geometry: tq queries against tk keys, query i seeing key j when j <= i + off. */
typedef struct {
  int b, tq, tk, off, h, kv, d;
} att_geom_t;

template <int DP, typename T, typename O>
static void att_fwd_launch(cuda_t *cu, O *out, float *lse, const T *q, const T *k, const T *v, att_geom_t g) {
  dim3 grid((unsigned)((g.tq + ATT_TILE - 1) / ATT_TILE), (unsigned)g.h, (unsigned)g.b);
  attn_fwd_kernel<DP, T, O><<<grid, ATT_THREADS, att_fwd_smem<DP>(), cu->stream>>>(
      out, lse, q, k, v, g.tq, g.tk, g.off, g.h, g.kv, g.d, 1.0f / sqrtf((float)g.d));
  LAUNCH_CHECK("attn_fwd_kernel");
}

template <int DP, typename T, typename G>
static void att_bwd_launch(cuda_t *cu, G *dq, G *dk, G *dv, const T *dout, const T *q, const T *k, const T *v,
                           const float *lse, const float *delta, att_geom_t g) {
  unsigned qtiles = (unsigned)((g.tq + ATT_TILE - 1) / ATT_TILE), ktiles = (unsigned)((g.tk + ATT_TILE - 1) / ATT_TILE);
  float scale = 1.0f / sqrtf((float)g.d);
  attn_bwd_dq_kernel<DP, T, G><<<dim3(qtiles, (unsigned)g.h, (unsigned)g.b), ATT_THREADS, att_dq_smem<DP>(),
                                 cu->stream>>>(dq, dout, q, k, v, lse, delta, g.tq, g.tk, g.off, g.h, g.kv, g.d, scale);
  LAUNCH_CHECK("attn_bwd_dq_kernel");
  attn_bwd_dkdv_kernel<DP, T, G><<<dim3(ktiles, (unsigned)g.kv, (unsigned)g.b), ATT_THREADS, att_dkdv_smem<DP>(),
                                   cu->stream>>>(dk, dv, dout, q, k, v, lse, delta, g.tq, g.tk, g.off, g.h, g.kv, g.d,
                                                 scale);
  LAUNCH_CHECK("attn_bwd_dkdv_kernel");
}

static void att_check_dims(int h, int kv, int d) {
  if (d > 128 || d <= 0 || kv <= 0 || h % kv != 0) {
    char msg[128];
    snprintf(msg, sizeof msg, "unsupported shape h=%d kv=%d d=%d (need d <= 128, h a multiple of kv)", h, kv, d);
    backend_fatal(__FILE__, __LINE__, "attention", msg);
  }
}

template <typename T, typename O>
static void att_fwd_typed(cuda_t *cu, O *out, float *lse, const T *q, const T *k, const T *v, att_geom_t g) {
  if (g.d <= 16) att_fwd_launch<16, T, O>(cu, out, lse, q, k, v, g);
  else if (g.d <= 32) att_fwd_launch<32, T, O>(cu, out, lse, q, k, v, g);
  else if (g.d <= 64) att_fwd_launch<64, T, O>(cu, out, lse, q, k, v, g);
  else att_fwd_launch<128, T, O>(cu, out, lse, q, k, v, g);
}

/* Accumulates into dq, dk, dv (G); delta from the rows' whole out. */
template <typename T, typename G>
static void att_bwd_typed(cuda_t *cu, G *dq, G *dk, G *dv, const T *dout, const T *q, const T *k, const T *v,
                          const T *out, const float *lse, att_geom_t g) {
  size_t rows = (size_t)g.b * g.tq * g.h;
  float *delta = (float *)scratch_get(cu, &cu->att_delta, rows * sizeof(float));
  attn_delta_kernel<T><<<(unsigned)((rows * 32 + 255) / 256), 256, 0, cu->stream>>>(delta, out, dout, g.b, g.tq, g.h,
                                                                                     g.d);
  LAUNCH_CHECK("attn_delta_kernel");
  if (g.d <= 16) att_bwd_launch<16, T, G>(cu, dq, dk, dv, dout, q, k, v, lse, delta, g);
  else if (g.d <= 32) att_bwd_launch<32, T, G>(cu, dq, dk, dv, dout, q, k, v, lse, delta, g);
  else if (g.d <= 64) att_bwd_launch<64, T, G>(cu, dq, dk, dv, dout, q, k, v, lse, delta, g);
  else att_bwd_launch<128, T, G>(cu, dq, dk, dv, dout, q, k, v, lse, delta, g);
}

/* cuDNN's workspace: the backend's scratch, so that its memory counts in the peak. */
static void *cudnn_workspace(void *ctx, size_t bytes) {
  cuda_t *cu = (cuda_t *)ctx;
  return scratch_get(cu, &cu->cudnn_ws, bytes);
}

static int cu_attention_select(backend_t *be, int mode, int b, int t, int h, int kv, int d, dtype_t dt, char *why,
                               size_t len) {
  cuda_t *cu = cuda_of(be);
  const int refused = mode == ATTN_FUSED ? -1 : 0; /* what a fused kernel that cannot run means */
  char e[400] = "";
  int det = 1;
  cu->att_cudnn = 0;
  if (mode == ATTN_REFERENCE) {
    snprintf(why, len, "the reference kernel (model.attention reference)");
    return 0;
  }
  if (dt != DT_BF16) {
    snprintf(why, len, "cuDNN's flash attention needs bf16 compute, and param_dtype is %s", dtype_name(dt));
    return refused;
  }
  if (!cu->cudnn && !(cu->cudnn = cudnn_att_open(cu->stream, cudnn_workspace, cu, why, len))) return refused;
  if (cudnn_att_prepare(cu->cudnn, b, t, h, kv, d, 1, &det, e, sizeof e)) {
    snprintf(why, len, "cuDNN %s refused B=%d T=%d H=%d KV=%d D=%d: %s", cudnn_att_version(cu->cudnn), b, t, h, kv,
             d, e);
    return refused;
  }
  cu->att_cudnn = 1;
  snprintf(why, len, "cuDNN %s fused flash attention%s", cudnn_att_version(cu->cudnn),
           det ? "" : " (its backward is not deterministic: this cuDNN refused the deterministic one)");
  return 1;
}

/* Whether this call runs on cuDNN: chosen by attention_select, and the shape taken with its mask
 * (causal 1, none 0; -1: a block no mask of cuDNN's describes). A refused shape runs the
 * reference kernel in both directions, said once. */
static int att_on_cudnn(cuda_t *cu, int b, int t, int h, int kv, int d, int causal, dtype_t dt) {
  if (!cu->att_cudnn || dt != DT_BF16 || causal < 0) return 0;
  char e[400];
  if (cudnn_att_prepare(cu->cudnn, b, t, h, kv, d, causal, NULL, e, sizeof e) == 0) return 1;
  if (!cu->att_fallback_said)
    fprintf(stderr, "trainer: attention%s B=%d T=%d H=%d KV=%d D=%d runs the reference kernel: cuDNN refused it: %s\n",
            causal ? "" : " blocks without a mask", b, t, h, kv, d, e);
  cu->att_fallback_said = 1;
  return 0;
}

static void cu_attention_fwd(backend_t *be, void *out, float *lse, const void *q, const void *k, const void *v, int b,
                             int t, int h, int kv, int d, dtype_t dt) {
  cuda_t *cu = cuda_of(be);
  if (b <= 0 || t <= 0 || h <= 0) return;
  if (att_on_cudnn(cu, b, t, h, kv, d, 1, dt)) {
    char e[400];
    if (cudnn_att_fwd(cu->cudnn, out, lse, q, k, v, b, t, h, kv, d, 1, e, sizeof e))
      backend_fatal(__FILE__, __LINE__, "cudnn_att_fwd", e);
    return;
  }
  att_check_dims(h, kv, d);
  const att_geom_t g = {b, t, t, 0, h, kv, d};
  DT_DISPATCH(dt, att_fwd_typed<T, T>(cu, (T *)out, lse, (const T *)q, (const T *)k, (const T *)v, g));
}

static void cu_attention_bwd(backend_t *be, void *dq, void *dk, void *dv, const void *dout, const void *q,
                             const void *k, const void *v, const void *out, const float *lse, int b, int t, int h,
                             int kv, int d, dtype_t dt) {
  cuda_t *cu = cuda_of(be);
  if (b <= 0 || t <= 0 || h <= 0) return;
  if (att_on_cudnn(cu, b, t, h, kv, d, 1, dt)) {
    char e[400];
    if (cudnn_att_bwd(cu->cudnn, dq, dk, dv, dout, q, k, v, out, lse, b, t, h, kv, d, 1, e, sizeof e))
      backend_fatal(__FILE__, __LINE__, "cudnn_att_bwd", e);
    return;
  }
  att_check_dims(h, kv, d);
  const size_t es = dtype_size(dt), nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  CUDA_CHECK(cudaMemsetAsync(dq, 0, nq * es, cu->stream)); /* the kernels accumulate; the contract writes */
  CUDA_CHECK(cudaMemsetAsync(dk, 0, nk * es, cu->stream));
  CUDA_CHECK(cudaMemsetAsync(dv, 0, nk * es, cu->stream));
  const att_geom_t g = {b, t, t, 0, h, kv, d};
  DT_DISPATCH(dt, att_bwd_typed<T, T>(cu, (T *)dq, (T *)dk, (T *)dv, (const T *)dout, (const T *)q, (const T *)k,
                                      (const T *)v, (const T *)out, lse, g));
}

/* ---- blocks of ring attention (backend.h): the reference kernels with the block's geometry
 * and fp32 outputs, or cuDNN's where attention_select chose it and the block is square (tq = tk)
 * and either diagonal (q_pos = k_pos: the causal mask) or past (every key before every query:
 * no mask) -- with balanced chunks of equal length every block of ring attention is one of the
 * two. cuDNN's outputs are bf16: a block's out goes through scratch and is widened into the fp32
 * out (one bf16 rounding, which backend.h states); its dq, dk, dv go through scratch and are
 * added into the fp32 accumulators. */

/* The cuDNN mask of a block: 1 causal (the diagonal), 0 none (every key seen), -1 neither. */
static int att_block_mask(int tq, int tk, long q_pos, long k_pos) {
  if (tq != tk) return -1;
  if (q_pos == k_pos) return 1;
  return q_pos - k_pos >= (long)tk - 1 ? 0 : -1; /* the first query sees the last key */
}

/* cuDNN takes its stats 16-byte aligned: the caller's lse, or scratch where it starts elsewhere
 * (a later chunk's rows of (2,B,H,c) when B H c is not a multiple of 4); copy_in: scratch
 * starts as lse. */
static float *att_blk_stats(cuda_t *cu, const float *lse, size_t rows, int copy_in) {
  if (((uintptr_t)lse & 15) == 0) return (float *)lse;
  float *s = (float *)scratch_get(cu, &cu->att_blk_lse, rows * sizeof(float));
  if (copy_in) CUDA_CHECK(cudaMemcpyAsync(s, lse, rows * sizeof(float), cudaMemcpyDeviceToDevice, cu->stream));
  return s;
}

static void att_fwd_block_cudnn(cuda_t *cu, float *out, float *lse, const void *q, const void *k, const void *v, int b,
                                int t, int h, int kv, int d, int causal) {
  const size_t nq = (size_t)b * t * h * d, rows = (size_t)b * h * t;
  nv_bfloat16 *o = (nv_bfloat16 *)scratch_get(cu, &cu->att_blk, nq * sizeof(nv_bfloat16));
  float *st = att_blk_stats(cu, lse, rows, 0);
  char e[400];
  if (cudnn_att_fwd(cu->cudnn, o, st, q, k, v, b, t, h, kv, d, causal, e, sizeof e))
    backend_fatal(__FILE__, __LINE__, "cudnn_att_fwd", e);
  if (st != lse) CUDA_CHECK(cudaMemcpyAsync(lse, st, rows * sizeof(float), cudaMemcpyDeviceToDevice, cu->stream));
  convert_kernel<float, nv_bfloat16><<<ew_blocks(nq), EW_THREADS, 0, cu->stream>>>(out, o, nq);
  LAUNCH_CHECK("convert_kernel");
}

static void att_bwd_block_cudnn(cuda_t *cu, float *dq, float *dk, float *dv, const void *dout, const void *q,
                                const void *k, const void *v, const void *out, const float *lse, int b, int t, int h,
                                int kv, int d, int causal) {
  const size_t nq = (size_t)b * t * h * d, nk = (size_t)b * t * kv * d;
  nv_bfloat16 *g = (nv_bfloat16 *)scratch_get(cu, &cu->att_blk, (nq + 2 * nk) * sizeof(nv_bfloat16));
  const float *st = att_blk_stats(cu, lse, (size_t)b * h * t, 1);
  char e[400];
  if (cudnn_att_bwd(cu->cudnn, g, g + nq, g + nq + nk, dout, q, k, v, out, st, b, t, h, kv, d, causal, e, sizeof e))
    backend_fatal(__FILE__, __LINE__, "cudnn_att_bwd", e);
  float *acc[3] = {dq, dk, dv};
  const size_t n[3] = {nq, nk, nk}, at[3] = {0, nq, nq + nk};
  for (int i = 0; i < 3; i++) {
    add_widen_kernel<<<ew_blocks(n[i]), EW_THREADS, 0, cu->stream>>>(acc[i], g + at[i], n[i]);
    LAUNCH_CHECK("add_widen_kernel");
  }
}

/* off = q_pos - k_pos, held to where it changes nothing: past tk every key is seen, below -tq
 * none is. */
static att_geom_t att_block_geom(int b, int tq, int tk, int h, int kv, int d, long q_pos, long k_pos) {
  long off = q_pos - k_pos;
  off = off > tk ? tk : off < -(long)tq - 1 ? -(long)tq - 1 : off;
  return att_geom_t{b, tq, tk, (int)off, h, kv, d};
}

static void cu_attention_fwd_block(backend_t *be, float *out, float *lse, const void *q, const void *k, const void *v,
                                   int b, int tq, int tk, int h, int kv, int d, long q_pos, long k_pos, dtype_t dt) {
  if (b <= 0 || tq <= 0 || tk <= 0 || h <= 0) return;
  cuda_t *cu = cuda_of(be);
  const int mask = att_block_mask(tq, tk, q_pos, k_pos);
  if (att_on_cudnn(cu, b, tq, h, kv, d, mask, dt)) {
    att_fwd_block_cudnn(cu, out, lse, q, k, v, b, tq, h, kv, d, mask);
    return;
  }
  att_check_dims(h, kv, d);
  const att_geom_t g = att_block_geom(b, tq, tk, h, kv, d, q_pos, k_pos);
  DT_DISPATCH(dt, att_fwd_typed<T, float>(cu, out, lse, (const T *)q, (const T *)k, (const T *)v, g));
}

static void cu_attention_bwd_block(backend_t *be, float *dq, float *dk, float *dv, const void *dout, const void *q,
                                   const void *k, const void *v, const void *out, const float *lse, int b, int tq,
                                   int tk, int h, int kv, int d, long q_pos, long k_pos, dtype_t dt) {
  if (b <= 0 || tq <= 0 || tk <= 0 || h <= 0) return;
  cuda_t *cu = cuda_of(be);
  const int mask = att_block_mask(tq, tk, q_pos, k_pos);
  if (att_on_cudnn(cu, b, tq, h, kv, d, mask, dt)) {
    att_bwd_block_cudnn(cu, dq, dk, dv, dout, q, k, v, out, lse, b, tq, h, kv, d, mask);
    return;
  }
  att_check_dims(h, kv, d);
  const att_geom_t g = att_block_geom(b, tq, tk, h, kv, d, q_pos, k_pos);
  DT_DISPATCH(dt, att_bwd_typed<T, float>(cu, dq, dk, dv, (const T *)dout, (const T *)q, (const T *)k, (const T *)v,
                                          (const T *)out, lse, g));
}

/* One warp per (batch, query, head) row: the weights of the running result and of the block
 * from their log-sum-exps (a side at -inf weighs exactly 0), then lse. */
__global__ void attn_merge_kernel(float *out, float *lse, const float *out_b, const float *lse_b, int t, int h, int d,
                                  size_t rows) {
  size_t wid = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (wid >= rows) return;
  size_t bi = wid / ((size_t)t * h), rest = wid % ((size_t)t * h); /* wid walks (B,T,H) */
  int ti = (int)(rest / h), hi = (int)(rest % h);
  size_t li = (bi * h + hi) * t + ti; /* lse is (B,H,T) */
  float la = lse[li], lb = lse_b[li];
  if (lb == -INFINITY) return;
  float mx = fmaxf(la, lb);
  float wa = la == -INFINITY ? 0.0f : expf(la - mx), wb = expf(lb - mx), sum = wa + wb;
  float fa = wa / sum, fb = wb / sum;
  float *o = out + wid * d;
  const float *ob = out_b + wid * d;
  for (int j = lane; j < d; j += 32) o[j] = fa * o[j] + fb * ob[j];
  __syncwarp();
  if (lane == 0) lse[li] = mx + logf(sum);
}

static void cu_attention_merge(backend_t *be, float *out, float *lse, const float *out_b, const float *lse_b, int b,
                               int t, int h, int d) {
  size_t rows = (size_t)b * t * h;
  if (!rows) return;
  attn_merge_kernel<<<(unsigned)((rows * 32 + 255) / 256), 256, 0, cuda_of(be)->stream>>>(out, lse, out_b, lse_b, t, h,
                                                                                         d, rows);
  LAUNCH_CHECK("attn_merge_kernel");
}

/* ------------------------------------------------------------------ SwiGLU */

/* One element of each direction, the same expressions whatever the width of the load. */
__device__ __forceinline__ float swiglu_one(float x, float gv) { return x / (1.0f + expf(-x)) * gv; }
/* silu(a) = a s, s = sigmoid(a); silu'(a) = s (1 + a (1 - s)). The gradients are written: 0 + ...
 * keeps the bits that accumulating into zeroed buffers gave. */
__device__ __forceinline__ void swiglu_grad_one(float x, float gv, float d, float &da, float &dg) {
  float s = 1.0f / (1.0f + expf(-x));
  da = 0.0f + d * gv * s * (1.0f + x * (1.0f - s));
  dg = 0.0f + d * x * s;
}

/* Rows of ag hold a then g (f each): element i of out is row i / f, column i % f. */
template <typename T>
__global__ void swiglu_fwd_kernel(T *out, const T *ag, size_t nf, int f) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nf; i += (size_t)gridDim.x * blockDim.x) {
    size_t ra = i / f * 2 * f + i % f;
    out[i] = narrow<T>(swiglu_one(widen(ag[ra]), widen(ag[ra + f])));
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(T *dag, const T *dout, const T *ag, size_t nf, int f) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < nf; i += (size_t)gridDim.x * blockDim.x) {
    size_t ra = i / f * 2 * f + i % f;
    float ga, gg;
    swiglu_grad_one(widen(ag[ra]), widen(ag[ra + f]), widen(dout[i]), ga, gg);
    dag[ra] = narrow<T>(ga);
    dag[ra + f] = narrow<T>(gg);
  }
}

/* f a multiple of 8 (f8 groups a row): 8 columns per 16-byte load. */
__global__ void swiglu_fwd_x8_kernel(uint4 *out, const uint4 *ag, size_t n8, int f8) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
    size_t ra = i / f8 * 2 * f8 + i % f8;
    bf16x8_t av, gv, o;
    av.u = ag[ra];
    gv.u = ag[ra + f8];
#pragma unroll
    for (int j = 0; j < 8; j++) o.h[j] = narrow<nv_bfloat16>(swiglu_one(widen(av.h[j]), widen(gv.h[j])));
    out[i] = o.u;
  }
}

__global__ void swiglu_bwd_x8_kernel(uint4 *dag, const uint4 *dout, const uint4 *ag, size_t n8, int f8) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
    size_t ra = i / f8 * 2 * f8 + i % f8;
    bf16x8_t av, gv, dv, oa, og;
    av.u = ag[ra];
    gv.u = ag[ra + f8];
    dv.u = dout[i];
#pragma unroll
    for (int j = 0; j < 8; j++) {
      float ga, gg;
      swiglu_grad_one(widen(av.h[j]), widen(gv.h[j]), widen(dv.h[j]), ga, gg);
      oa.h[j] = narrow<nv_bfloat16>(ga);
      og.h[j] = narrow<nv_bfloat16>(gg);
    }
    dag[ra] = oa.u;
    dag[ra + f8] = og.u;
  }
}

static void cu_swiglu_fwd(backend_t *be, void *out, const void *ag, int n, int f, dtype_t dt) {
  if (n <= 0 || f <= 0) return;
  cudaStream_t st = cuda_of(be)->stream;
  const size_t nf = (size_t)n * f;
  if (dt == DT_BF16 && f % 8 == 0 && aligned16(out) && aligned16(ag)) {
    swiglu_fwd_x8_kernel<<<ew_blocks(nf / 8), EW_THREADS, 0, st>>>((uint4 *)out, (const uint4 *)ag, nf / 8, f / 8);
    LAUNCH_CHECK("swiglu_fwd_x8_kernel");
    return;
  }
  DT_DISPATCH(dt, swiglu_fwd_kernel<T><<<ew_blocks(nf), EW_THREADS, 0, st>>>((T *)out, (const T *)ag, nf, f));
  LAUNCH_CHECK("swiglu_fwd_kernel");
}

static void cu_swiglu_bwd(backend_t *be, void *dag, const void *dout, const void *ag, int n, int f, dtype_t dt) {
  if (n <= 0 || f <= 0) return;
  cudaStream_t st = cuda_of(be)->stream;
  const size_t nf = (size_t)n * f;
  if (dt == DT_BF16 && f % 8 == 0 && aligned16(dag) && aligned16(dout) && aligned16(ag)) {
    swiglu_bwd_x8_kernel<<<ew_blocks(nf / 8), EW_THREADS, 0, st>>>((uint4 *)dag, (const uint4 *)dout,
                                                                   (const uint4 *)ag, nf / 8, f / 8);
    LAUNCH_CHECK("swiglu_bwd_x8_kernel");
    return;
  }
  DT_DISPATCH(dt, swiglu_bwd_kernel<T><<<ew_blocks(nf), EW_THREADS, 0, st>>>((T *)dag, (const T *)dout,
                                                                              (const T *)ag, nf, f));
  LAUNCH_CHECK("swiglu_bwd_kernel");
}

/* ------------------------------------------------------------------ cross-entropy */

/* (max, sum of exp(x - max)) pairs merge commutatively, so butterflies stay in step. */
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2) {
  float mn = fmaxf(m, m2);
  if (mn == -INFINITY) {
    s = 0.0f;
  } else {
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
  }
  m = mn;
}

/* One step of a thread's online (max, sum of exp(x - max)). */
__device__ __forceinline__ void lse_push(float &m, float &s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;
    m = x;
  } else {
    s += expf(x - m);
  }
}

/* The block's (max, sum) merged into every thread, in a fixed tree. */
__device__ __forceinline__ void lse_block(float &m, float &s, float *shm, float *shs) {
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  if (lane == 0) shm[w] = m, shs[w] = s;
  __syncthreads();
  m = lane < nw ? shm[lane] : -INFINITY;
  s = lane < nw ? shs[lane] : 0.0f;
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
}

/* A row whose target is ignored (< 0) or out of range: loss 0 and, with dlogits, a zero row.
 * Returns whether the row was one. */
template <typename T>
__device__ __forceinline__ bool ce_ignored_row(float *losses, T *di, int i, int tg, int v, int ld) {
  if (tg >= 0 && tg < v) return false;
  if (threadIdx.x == 0) losses[i] = 0.0f;
  if (di)
    for (int j = threadIdx.x; j < ld; j += blockDim.x) di[j] = narrow<T>(0.0f);
  return true;
}

/* One block per row: each thread an online (max, sum) over its columns, merged in a fixed tree;
 * then the gradient row. The target's logit is read before the tree's barrier, so before any
 * write (dlogits may alias), and each gradient element is written by the thread that read its
 * logit. */
template <typename T>
__global__ void cross_entropy_kernel(float *losses, T *dlogits, const T *logits, const int32_t *targets, int v, int ld,
                                     float grad_scale) {
  __shared__ float shm[32], shs[32];
  int i = blockIdx.x, tid = threadIdx.x;
  const T *li = logits + (size_t)i * ld;
  T *di = dlogits ? dlogits + (size_t)i * ld : NULL;
  int tg = targets[i];
  if (ce_ignored_row(losses, di, i, tg, v, ld)) return;
  float m = -INFINITY, s = 0.0f;
  for (int j = tid; j < v; j += blockDim.x) lse_push(m, s, widen(li[j]));
  float xt = tid == 0 ? widen(li[tg]) : 0.0f;
  lse_block(m, s, shm, shs);
  float lse = m + logf(s);
  if (tid == 0) losses[i] = lse - xt;
  if (!di) return;
  for (int j = tid; j < v; j += blockDim.x) {
    float g = expf(widen(li[j]) - lse) * grad_scale;
    if (j == tg) g -= grad_scale;
    di[j] = narrow<T>(g);
  }
  for (int j = v + tid; j < ld; j += blockDim.x) di[j] = narrow<T>(0.0f);
}

static int ce_threads(int v) { return v >= 8192 ? 1024 : v >= 1024 ? 256 : 64; }

/* bf16 rows read and written 8 elements (16 bytes) at a time: rows 16-byte aligned (ld a multiple
 * of 8, aligned pointers). Each thread folds a group's max into its running (max, sum) once, so
 * one exp per element plus one per group. Same contract as cross_entropy_kernel. */
__global__ void cross_entropy_x8_kernel(float *losses, nv_bfloat16 *dlogits, const nv_bfloat16 *logits,
                                        const int32_t *targets, int v, int ld, float grad_scale) {
  __shared__ float shm[32], shs[32];
  int i = blockIdx.x, tid = threadIdx.x, v8 = v / 8;
  const nv_bfloat16 *li = logits + (size_t)i * ld;
  nv_bfloat16 *di = dlogits ? dlogits + (size_t)i * ld : NULL;
  int tg = targets[i];
  if (ce_ignored_row(losses, di, i, tg, v, ld)) return;
  float m = -INFINITY, s = 0.0f;
  const uint4 *l8 = (const uint4 *)li;
  for (int j = tid; j < v8; j += blockDim.x) {
    bf16x8_t x;
    x.u = l8[j];
    float f[8], mx = -INFINITY;
#pragma unroll
    for (int k = 0; k < 8; k++) f[k] = widen(x.h[k]), mx = fmaxf(mx, f[k]);
    if (mx > m) s *= expf(m - mx), m = mx;
#pragma unroll
    for (int k = 0; k < 8; k++) s += expf(f[k] - m);
  }
  for (int j = v8 * 8 + tid; j < v; j += blockDim.x) lse_push(m, s, widen(li[j])); /* past the last group */
  float xt = tid == 0 ? widen(li[tg]) : 0.0f; /* before the tree's barrier, so before any write */
  lse_block(m, s, shm, shs);
  float lse = m + logf(s);
  if (tid == 0) losses[i] = lse - xt;
  if (!di) return;
  uint4 *d8 = (uint4 *)di;
  for (int j = tid; j < v8; j += blockDim.x) {
    bf16x8_t x, o;
    x.u = l8[j];
#pragma unroll
    for (int k = 0; k < 8; k++) {
      float g = expf(widen(x.h[k]) - lse) * grad_scale;
      if (j * 8 + k == tg) g -= grad_scale;
      o.h[k] = narrow<nv_bfloat16>(g);
    }
    d8[j] = o.u;
  }
  for (int j = v8 * 8 + tid; j < v; j += blockDim.x) {
    float g = expf(widen(li[j]) - lse) * grad_scale;
    if (j == tg) g -= grad_scale;
    di[j] = narrow<nv_bfloat16>(g);
  }
  for (int j = v + tid; j < ld; j += blockDim.x) di[j] = narrow<nv_bfloat16>(0.0f);
}

static void cu_cross_entropy(backend_t *be, float *losses, void *dlogits, const void *logits, const int32_t *targets,
                             int n, int v, int ld, float grad_scale, dtype_t dt) {
  if (n <= 0) return;
  if (dt == DT_BF16 && ld % 8 == 0 && aligned16(logits) && (!dlogits || aligned16(dlogits))) {
    cross_entropy_x8_kernel<<<n, ce_threads(v), 0, cuda_of(be)->stream>>>(
        losses, (nv_bfloat16 *)dlogits, (const nv_bfloat16 *)logits, targets, v, ld, grad_scale);
    LAUNCH_CHECK("cross_entropy_x8_kernel");
    return;
  }
  DT_DISPATCH(dt, cross_entropy_kernel<T><<<n, ce_threads(v), 0, cuda_of(be)->stream>>>(
                      losses, (T *)dlogits, (const T *)logits, targets, v, ld, grad_scale));
  LAUNCH_CHECK("cross_entropy_kernel");
}

/* ------------------------------------------------------------------ tensor-parallel pieces */

static void cu_copy_2d(backend_t *be, void *dst, int ldd, const void *src, int lds, int rows, int cols, dtype_t dt) {
  size_t es = dtype_size(dt);
  if (rows <= 0 || cols <= 0) return;
  CUDA_CHECK(cudaMemcpy2DAsync(dst, (size_t)ldd * es, src, (size_t)lds * es, (size_t)cols * es, (size_t)rows,
                               cudaMemcpyDeviceToDevice, cuda_of(be)->stream));
}

/* Vocab-parallel cross-entropy (backend.h), one block per row; reductions in a fixed tree. */
__device__ float block_reduce(float x, int is_max) {
  __shared__ float sh[32];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  __syncthreads(); /* sh may still be read by an earlier call */
  if (lane == 0) sh[w] = x;
  __syncthreads();
  float init = is_max ? -FLT_MAX : 0.0f;
  x = lane < nw ? sh[lane] : init;
  for (int o = 16; o > 0; o >>= 1) {
    float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  return x; /* every thread gets the total */
}

template <typename T>
__global__ void ce_shard_max_kernel(float *rowmax, const T *logits, int v, int ld) {
  const T *li = logits + (size_t)blockIdx.x * ld;
  float m = -FLT_MAX;
  for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, widen(li[j]));
  m = block_reduce(m, 1);
  if (threadIdx.x == 0) rowmax[blockIdx.x] = m;
}

template <typename T>
__global__ void ce_shard_stats_kernel(float *stats, const T *logits, const float *rowmax, const int32_t *targets, int n,
                                      int v, int ld, int vocab_start) {
  int i = blockIdx.x;
  const T *li = logits + (size_t)i * ld;
  float mx = rowmax[i], s = 0.0f;
  for (int j = threadIdx.x; j < v; j += blockDim.x) s += expf(widen(li[j]) - mx);
  s = block_reduce(s, 0);
  if (threadIdx.x == 0) {
    int tg = targets[i], j = tg - vocab_start;
    stats[i] = s;
    stats[n + i] = tg >= 0 && j >= 0 && j < v ? widen(li[j]) : 0.0f;
  }
}

template <typename T>
__global__ void ce_shard_loss_kernel(float *losses, T *dlogits, const T *logits, const float *rowmax,
                                     const float *stats, const int32_t *targets, int n, int v, int ld, int vocab_start,
                                     float grad_scale) {
  int i = blockIdx.x, tg = targets[i];
  T *di = dlogits ? dlogits + (size_t)i * ld : NULL;
  if (tg < 0) {
    if (threadIdx.x == 0) losses[i] = 0.0f;
    if (di)
      for (int j = threadIdx.x; j < ld; j += blockDim.x) di[j] = narrow<T>(0.0f);
    return;
  }
  float mx = rowmax[i], sum = stats[i];
  if (threadIdx.x == 0) losses[i] = mx + logf(sum) - stats[n + i];
  if (!di) return;
  const T *li = logits + (size_t)i * ld;
  float k = grad_scale / sum;
  int jt = tg - vocab_start;
  for (int j = threadIdx.x; j < ld; j += blockDim.x) {
    float g = 0.0f;
    if (j < v) g = expf(widen(li[j]) - mx) * k - (j == jt ? grad_scale : 0.0f);
    di[j] = narrow<T>(g);
  }
}

static void cu_ce_shard_max(backend_t *be, float *rowmax, const void *logits, int n, int v, int ld, dtype_t dt) {
  if (n <= 0) return;
  DT_DISPATCH(dt, ce_shard_max_kernel<T><<<n, ce_threads(v), 0, cuda_of(be)->stream>>>(rowmax, (const T *)logits, v,
                                                                                      ld));
  LAUNCH_CHECK("ce_shard_max_kernel");
}

static void cu_ce_shard_stats(backend_t *be, float *stats, const void *logits, const float *rowmax,
                              const int32_t *targets, int n, int v, int ld, int vocab_start, dtype_t dt) {
  if (n <= 0) return;
  DT_DISPATCH(dt, ce_shard_stats_kernel<T><<<n, ce_threads(v), 0, cuda_of(be)->stream>>>(
                      stats, (const T *)logits, rowmax, targets, n, v, ld, vocab_start));
  LAUNCH_CHECK("ce_shard_stats_kernel");
}

static void cu_ce_shard_loss(backend_t *be, float *losses, void *dlogits, const void *logits, const float *rowmax,
                             const float *stats, const int32_t *targets, int n, int v, int ld, int vocab_start,
                             float grad_scale, dtype_t dt) {
  if (n <= 0) return;
  DT_DISPATCH(dt, ce_shard_loss_kernel<T><<<n, ce_threads(v), 0, cuda_of(be)->stream>>>(
                      losses, (T *)dlogits, (const T *)logits, rowmax, stats, targets, n, v, ld, vocab_start,
                      grad_scale));
  LAUNCH_CHECK("ce_shard_loss_kernel");
}

/* ------------------------------------------------------------------ AdamW */

/* PyTorch's AdamW, step for step, on the fp32 master weights; the bias corrections come from
 * the host, computed as the cpu backend computes them. With param_lp the same pass writes the
 * bf16 compute copy: the updated parameter rounded once to nearest even. adamw_update is the
 * per-element formula of both kernels (adamw_kernel, adamw_multi_kernel): the moments in
 * place, the new parameter returned. */
typedef struct {
  float beta1, beta2, eps, step_size, bc2_sqrt, grad_scale;
} adamw_args_t;

static adamw_args_t adamw_args(float lr, float beta1, float beta2, float eps, int step, float grad_scale) {
  const adamw_step_t st = adamw_step_make(lr, beta1, beta2, step);
  return adamw_args_t{beta1, beta2, eps, st.step_size, st.bc2_sqrt, grad_scale};
}

__device__ __forceinline__ float adamw_update(float param, float grad, float &m, float &v, const adamw_args_t &a,
                                              float decay) {
  float g = grad * a.grad_scale;
  m = a.beta1 * m + (1.0f - a.beta1) * g;
  v = a.beta2 * v + (1.0f - a.beta2) * g * g;
  float p = param * decay;
  return p - a.step_size * m / (sqrtf(v) / a.bc2_sqrt + a.eps);
}

__device__ __forceinline__ void adamw_at(float *param, const float *grad, float *m, float *v, nv_bfloat16 *param_lp,
                                         size_t i, const adamw_args_t &a, float decay) {
  float mi = m[i], vi = v[i];
  float np = adamw_update(param[i], grad[i], mi, vi, a, decay);
  m[i] = mi;
  v[i] = vi;
  param[i] = np;
  if (param_lp) param_lp[i] = __float2bfloat16_rn(np);
}

__global__ void adamw_kernel(float *param, const float *grad, float *m, float *v, nv_bfloat16 *param_lp, size_t n,
                             adamw_args_t a, float decay) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    adamw_at(param, grad, m, v, param_lp, i, a, decay);
}

static void cu_adamw(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp, size_t n,
                     float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale) {
  if (!n) return;
  adamw_kernel<<<ew_blocks(n), EW_THREADS, 0, cuda_of(be)->stream>>>(
      param, grad, m, v, (nv_bfloat16 *)param_lp, n, adamw_args(lr, beta1, beta2, eps, step, grad_scale),
      1.0f - lr * weight_decay);
  LAUNCH_CHECK("adamw_kernel");
}

/* adamw_multi: the segments cut into chunks of at most ADAMW_CHUNK elements (a multiple of 4,
 * so a chunk starts as 4-aligned as its segment does), one block per chunk, all in one launch.
 * Where param, grad, m and v are 16-byte aligned and param_lp 8-byte aligned (vec), a block
 * moves the 4-aligned middle of its chunk 4 elements per load; the few elements before and
 * after it one at a time. The arithmetic is adamw_update's either way. */
#define ADAMW_CHUNK 16384
typedef struct {
  size_t start;  /* first element, from the range's start */
  unsigned len;  /* elements, <= ADAMW_CHUNK */
  unsigned decay;
} adamw_chunk_t;

__global__ void __launch_bounds__(EW_THREADS)
    adamw_multi_kernel(const adamw_chunk_t *chunks, float *param, const float *grad, float *m, float *v,
                       nv_bfloat16 *param_lp, adamw_args_t a, const float *scale_dev, const adamw_step_t *st,
                       float weight_decay, float decay_on, float decay_off, int vec) {
  if (st && st->skip) return; /* step_skip's verdict: this step does not update */
  if (scale_dev) a.grad_scale = *scale_dev; /* adamw_multi_dev: the scale the device computed */
  if (st) { /* and the step's values the host put there: the host's arithmetic, unfused */
    a.step_size = st->step_size;
    a.bc2_sqrt = st->bc2_sqrt;
    decay_on = __fsub_rn(1.0f, __fmul_rn(st->lr, weight_decay));
    decay_off = __fsub_rn(1.0f, __fmul_rn(st->lr, 0.0f));
  }
  const adamw_chunk_t c = chunks[blockIdx.x];
  const float decay = c.decay ? decay_on : decay_off;
  unsigned head = 0, body = 0; /* [head, head + body) goes 4 at a time */
  if (vec) {
    head = (unsigned)((4 - (c.start & 3)) & 3);
    if (head > c.len) head = c.len;
    body = (c.len - head) & ~3u;
  }
  for (unsigned j = threadIdx.x; j < head; j += blockDim.x)
    adamw_at(param, grad, m, v, param_lp, c.start + j, a, decay);
  for (unsigned j = head + 4 * threadIdx.x; j < head + body; j += 4 * blockDim.x) {
    const size_t i = c.start + j;
    float4 p = *(const float4 *)(param + i), g = *(const float4 *)(grad + i);
    float4 mi = *(const float4 *)(m + i), vi = *(const float4 *)(v + i);
    p.x = adamw_update(p.x, g.x, mi.x, vi.x, a, decay);
    p.y = adamw_update(p.y, g.y, mi.y, vi.y, a, decay);
    p.z = adamw_update(p.z, g.z, mi.z, vi.z, a, decay);
    p.w = adamw_update(p.w, g.w, mi.w, vi.w, a, decay);
    *(float4 *)(param + i) = p;
    *(float4 *)(m + i) = mi;
    *(float4 *)(v + i) = vi;
    if (param_lp) {
      union {
        uint2 u;
        nv_bfloat16 h[4];
      } w;
      w.h[0] = __float2bfloat16_rn(p.x);
      w.h[1] = __float2bfloat16_rn(p.y);
      w.h[2] = __float2bfloat16_rn(p.z);
      w.h[3] = __float2bfloat16_rn(p.w);
      *(uint2 *)(param_lp + i) = w.u;
    }
  }
  for (unsigned j = head + body + threadIdx.x; j < c.len; j += blockDim.x)
    adamw_at(param, grad, m, v, param_lp, c.start + j, a, decay);
}

static int adamw_same_segs(const cuda_t *cu, const adamw_segment_t *segs, int n) {
  if (!cu->adamw_segs || cu->adamw_nsegs != n) return 0;
  for (int i = 0; i < n; i++) {
    const adamw_segment_t *x = &cu->adamw_segs[i];
    if (x->offset != segs[i].offset || x->numel != segs[i].numel || !x->decay != !segs[i].decay) return 0;
  }
  return 1;
}

/* The device chunk table of segs (cached: built and uploaded when the list changes, which an
 * optimizer's never does), and its number of chunks. */
static const adamw_chunk_t *adamw_table(cuda_t *cu, const adamw_segment_t *segs, int n) {
  if (adamw_same_segs(cu, segs, n)) return (const adamw_chunk_t *)cu->adamw_tab.p;
  size_t count = 0;
  for (int i = 0; i < n; i++) count += (segs[i].numel + ADAMW_CHUNK - 1) / ADAMW_CHUNK;
  if (count > 0x7fffffffu) backend_fatal(__FILE__, __LINE__, "adamw_multi", "too many chunks for one grid");
  adamw_chunk_t *tab = (adamw_chunk_t *)malloc((count ? count : 1) * sizeof *tab);
  adamw_segment_t *copy = (adamw_segment_t *)malloc((n > 0 ? (size_t)n : 1) * sizeof *copy);
  if (!tab || !copy) backend_fatal(__FILE__, __LINE__, "adamw_multi", "out of host memory for the chunk table");
  size_t k = 0;
  for (int i = 0; i < n; i++) {
    copy[i] = segs[i];
    for (size_t done = 0; done < segs[i].numel; done += ADAMW_CHUNK) {
      size_t len = segs[i].numel - done < ADAMW_CHUNK ? segs[i].numel - done : ADAMW_CHUNK;
      tab[k++] = adamw_chunk_t{segs[i].offset + done, (unsigned)len, segs[i].decay ? 1u : 0u};
    }
  }
  void *dev = scratch_get(cu, &cu->adamw_tab, count * sizeof *tab);
  CUDA_CHECK(cudaMemcpyAsync(dev, tab, count * sizeof *tab, cudaMemcpyHostToDevice, cu->stream));
  CUDA_CHECK(cudaStreamSynchronize(cu->stream)); /* tab is freed next */
  free(tab);
  free(cu->adamw_segs);
  cu->adamw_segs = copy;
  cu->adamw_nsegs = n;
  cu->adamw_chunks = (unsigned)count;
  return (const adamw_chunk_t *)dev;
}

/* Both entries: the scale and the step's values from the host (scale_dev and st NULL) or read by
 * the kernel from scale_dev and st. */
static void adamw_multi_launch(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                               const adamw_segment_t *segs, int n_segs, float lr, float beta1, float beta2,
                               float eps, float weight_decay, int step, float grad_scale, const float *scale_dev,
                               const adamw_step_t *st) {
  cuda_t *cu = cuda_of(be);
  const adamw_chunk_t *tab = adamw_table(cu, segs, n_segs);
  if (!cu->adamw_chunks) return;
  const int vec = aligned16(param) && aligned16(grad) && aligned16(m) && aligned16(v) &&
                  ((uintptr_t)param_lp & 7u) == 0;
  adamw_multi_kernel<<<cu->adamw_chunks, EW_THREADS, 0, cu->stream>>>(
      tab, param, grad, m, v, (nv_bfloat16 *)param_lp, adamw_args(lr, beta1, beta2, eps, step, grad_scale),
      scale_dev, st, weight_decay, 1.0f - lr * weight_decay, 1.0f - lr * 0.0f, vec);
  LAUNCH_CHECK("adamw_multi_kernel");
}

static void cu_adamw_multi(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                           const adamw_segment_t *segs, int n_segs, float lr, float beta1, float beta2, float eps,
                           float weight_decay, int step, float grad_scale) {
  adamw_multi_launch(be, param, grad, m, v, param_lp, segs, n_segs, lr, beta1, beta2, eps, weight_decay, step,
                     grad_scale, NULL, NULL);
}

/* ------------------------------------------------------------------ a step without host waits */

/* One thread: the rows in the host's order (backend.h), then the step's running sum. */
__global__ void step_loss_kernel(const float *rows, int n, int valid, int micro, int accum, int poison, double *stat,
                                 float *mean) {
  double sum = 0.0;
  for (int i = 0; i < n; i++) sum += rows[i];
  float l = valid > 0 ? (float)(sum / valid) : 0.0f;
  if (poison) l = __int_as_float(0x7fc00000); /* nan */
  if (micro == 0) stat[0] = stat[1] = 0.0;
  stat[0] += l;
  if (!isfinite(l) && stat[1] == 0.0) stat[1] = micro + 1;
  if (micro == accum - 1) {
    stat[0] /= accum;
    *mean = (float)stat[0];
  }
}

static void cu_step_loss(backend_t *be, const float *rows, int n, int valid, int micro, int accum, int poison,
                         double *stat, float *mean) {
  step_loss_kernel<<<1, 1, 0, cuda_of(be)->stream>>>(rows, n, valid, micro, accum, poison, stat, mean);
  LAUNCH_CHECK("step_loss_kernel");
}

/* One thread adds the pieces' totals in piece order, per group. */
__global__ void sumsq_groups_kernel(double *sums, float *shares, const double *totals, const int *group, int n) {
  double s0 = 0.0, s1 = 0.0; /* scalars, not an indexed array: registers, not local memory */
  for (int i = 0; i < n; i++) {
    if (group[i]) s1 += totals[i];
    else s0 += totals[i];
  }
  sums[0] = s0;
  sums[1] = s1;
  shares[0] = (float)s0;
  shares[1] = (float)s1;
}

static int groups_same(const cuda_t *cu, const size_t *offset, const size_t *count, const int *group, int n) {
  if (!cu->groups_tab || cu->groups_n != n) return 0;
  for (int i = 0; i < n; i++)
    if (cu->groups_tab[i].offset != offset[i] || cu->groups_tab[i].count != count[i] ||
        !cu->groups_of[i] != !group[i])
      return 0;
  return 1;
}

/* The scratch of sumsq_groups: the piece table, the groups, the partials, the totals (8-byte
 * aligned throughout); built and uploaded when the list changes, which a strategy's never does
 * (the one wait is then, at the first step). */
static char *groups_table(cuda_t *cu, const size_t *offset, const size_t *count, const int *group, int n,
                          size_t *tab_bytes) {
  *tab_bytes = (((size_t)n * sizeof(sumsq_piece_t) + 7) & ~(size_t)7) + (((size_t)n * sizeof(int) + 7) & ~(size_t)7);
  if (groups_same(cu, offset, count, group, n)) return (char *)cu->groups_dev.p;
  sumsq_piece_t *tab = (sumsq_piece_t *)malloc((size_t)n * sizeof *tab);
  int *grp = (int *)malloc((size_t)n * sizeof *grp);
  if (!tab || !grp) backend_fatal(__FILE__, __LINE__, "sumsq_groups", "out of host memory for the piece table");
  cu->groups_blocks = sumsq_pieces(tab, offset, count, n);
  for (int i = 0; i < n; i++) grp[i] = group[i] ? 1 : 0;
  char *base = (char *)scratch_get(
      cu, &cu->groups_dev, *tab_bytes + ((size_t)cu->groups_blocks + (size_t)n) * sizeof(double));
  const size_t grp_at = ((size_t)n * sizeof *tab + 7) & ~(size_t)7;
  CUDA_CHECK(cudaMemcpyAsync(base, tab, (size_t)n * sizeof *tab, cudaMemcpyHostToDevice, cu->stream));
  CUDA_CHECK(cudaMemcpyAsync(base + grp_at, grp, (size_t)n * sizeof *grp, cudaMemcpyHostToDevice, cu->stream));
  CUDA_CHECK(cudaStreamSynchronize(cu->stream)); /* the host tables are kept, but may change next */
  free(cu->groups_tab);
  free(cu->groups_of);
  cu->groups_tab = tab;
  cu->groups_of = grp;
  cu->groups_n = n;
  return base;
}

/* sumsq_parts' two passes (the same bits per piece), then the groups' sums: three launches. */
static void cu_sumsq_groups(backend_t *be, const float *x, const size_t *offset, const size_t *count, const int *group,
                            int n, double *sums, float *shares) {
  cuda_t *cu = cuda_of(be);
  if (n <= 0) {
    CUDA_CHECK(cudaMemsetAsync(sums, 0, 2 * sizeof(double), cu->stream));
    CUDA_CHECK(cudaMemsetAsync(shares, 0, 2 * sizeof(float), cu->stream));
    return;
  }
  size_t tab_bytes;
  char *base = groups_table(cu, offset, count, group, n, &tab_bytes);
  const sumsq_piece_t *dtab = (const sumsq_piece_t *)base;
  const int *dgrp = (const int *)(base + (((size_t)n * sizeof(sumsq_piece_t) + 7) & ~(size_t)7));
  double *part = (double *)(base + tab_bytes), *totals = part + cu->groups_blocks;
  if (cu->groups_blocks) {
    sumsq_parts_partial_kernel<<<(unsigned)cu->groups_blocks, 256, 0, cu->stream>>>(part, x, dtab, n);
    LAUNCH_CHECK("sumsq_parts_partial_kernel");
  }
  sumsq_parts_final_kernel<<<(unsigned)((n + 127) / 128), 128, 0, cu->stream>>>(totals, part, dtab, n);
  LAUNCH_CHECK("sumsq_parts_final_kernel");
  sumsq_groups_kernel<<<1, 1, 0, cu->stream>>>(sums, shares, totals, dgrp, n);
  LAUNCH_CHECK("sumsq_groups_kernel");
}

/* sumsq_parts_add's pieces, by value: no table to upload, and a recorded step replays the call
 * as it was made. */
typedef struct {
  sumsq_piece_t p[SUMSQ_ADD_PIECES];
  int n;
} sumsq_add_arg_t;

/* One launch: every piece's blocks as sumsq_parts' pass 1 numbers them write their partials; the
 * block that finishes last (an integer ticket, so no float atomics: each piece's partials are
 * added in order) adds each piece's partials into out[i] and resets the ticket for the next
 * launch. Thread 0 wrote the block's partial (sumsq_block), so its fence orders the partial
 * before the ticket. */
__global__ void sumsq_add_kernel(double *out, const float *x, sumsq_add_arg_t a, double *part, unsigned *ticket) {
  __shared__ int last;
  int k = 0; /* the piece whose blocks include this one: the last whose first is not past it */
  while (k + 1 < a.n && a.p[k + 1].first <= (int)blockIdx.x) k++;
  sumsq_block(&part[blockIdx.x], x + a.p[k].offset, a.p[k].count, (int)blockIdx.x - a.p[k].first, a.p[k].g);
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if ((int)threadIdx.x < a.n) {
    const volatile double *pp = part + a.p[threadIdx.x].first; /* other blocks' writes, not a cached copy */
    double s = 0.0;
    for (int i = 0; i < a.p[threadIdx.x].g; i++) s += pp[i];
    out[threadIdx.x] += s;
  }
  if (threadIdx.x == 0) *ticket = 0;
}

static void cu_sumsq_parts_add(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n,
                               double *out) {
  cuda_t *cu = cuda_of(be);
  const size_t parts = (size_t)SUMSQ_ADD_PIECES * SUMSQ_BLOCKS;
  const int fresh = cu->sumsq_add.p == NULL;
  double *part = (double *)scratch_get(cu, &cu->sumsq_add, parts * sizeof(double) + sizeof(unsigned));
  unsigned *ticket = (unsigned *)(part + parts);
  if (fresh) CUDA_CHECK(cudaMemsetAsync(ticket, 0, sizeof *ticket, cu->stream));
  for (int at = 0; at < n; at += SUMSQ_ADD_PIECES) {
    sumsq_add_arg_t a;
    a.n = n - at < SUMSQ_ADD_PIECES ? n - at : SUMSQ_ADD_PIECES;
    const int blocks = sumsq_pieces(a.p, offset + at, count + at, a.n);
    if (!blocks) continue; /* only empty pieces: nothing to add */
    sumsq_add_kernel<<<(unsigned)blocks, 256, 0, cu->stream>>>(out + at, x, a, part, ticket);
    LAUNCH_CHECK("sumsq_add_kernel");
  }
}

__global__ void clip_scale_kernel(const double *sums, const float *shares, int use_shares, double clip, double *norm,
                                  float *scale) {
  const double r = use_shares ? sqrt((double)shares[0] + (double)shares[1]) : sqrt(sums[0] + sums[1]);
  *norm = r;
  *scale = (float)(clip <= 0 || r <= clip ? 1.0 : clip / r);
}

static void cu_clip_scale(backend_t *be, const double *sums, const float *shares, int use_shares, double clip,
                          double *norm, float *scale) {
  clip_scale_kernel<<<1, 1, 0, cuda_of(be)->stream>>>(sums, shares, use_shares, clip, norm, scale);
  LAUNCH_CHECK("clip_scale_kernel");
}

static void cu_adamw_multi_dev(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                               const adamw_segment_t *segs, int n_segs, float beta1, float beta2, float eps,
                               float weight_decay, const adamw_step_t *st, const float *grad_scale) {
  /* lr 0 and step 1 on the host: placeholders the kernel replaces with *st (a finite step size) */
  adamw_multi_launch(be, param, grad, m, v, param_lp, segs, n_segs, 0.0f, beta1, beta2, eps, weight_decay, 1, 1.0f,
                     grad_scale, st);
}

/* One thread: the verdict, the window and the update's flag (step_skip_rule.h). */
__global__ void step_skip_kernel(const float *loss, const double *norm, int nonfinite, double loss_z, double norm_z,
                                 skip_window_t *win, skip_verdict_t *out, adamw_step_t *st) {
  skip_rule(*loss, *norm, nonfinite, loss_z, norm_z, win, out, st);
}

static void cu_step_skip(backend_t *be, const float *loss, const double *norm, int nonfinite, double loss_z,
                         double norm_z, skip_window_t *win, skip_verdict_t *out, adamw_step_t *st) {
  step_skip_kernel<<<1, 1, 0, cuda_of(be)->stream>>>(loss, norm, nonfinite, loss_z, norm_z, win, out, st);
  LAUNCH_CHECK("step_skip_kernel");
}

/* The step's values: the pinned slot to the device behind the compute stream's work. */
static void cu_to_device_async(backend_t *be, void *dst, const void *src, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cuda_of(be)->stream));
}

/* Pinned memory is not the allocator's (mem_peak counts device memory only). */
static void *cu_alloc_pinned(backend_t *be, size_t bytes) {
  void *p = NULL;
  if (cudaMallocHost(&p, bytes ? bytes : 16) != cudaSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  memset(p, 0, bytes ? bytes : 16);
  return p;
}

static void cu_free_pinned(backend_t *be, void *p) {
  if (p) CUDA_CHECK(cudaFreeHost(p));
}

/* The protocol of backend.h: the copy waits for freed[slot] (recorded on the compute stream at
 * the other slot's upload_wait: everything that read this slot's last destination is before
 * it), records copied[slot]; upload_wait makes the compute stream wait for copied[slot] and
 * marks the other slot's destination free from there. An event never recorded is complete. */
static void cu_upload_host_wait(backend_t *be, int slot) { CUDA_CHECK(cudaEventSynchronize(cuda_of(be)->copied[slot & 1])); }

static void cu_upload_async(backend_t *be, void *dst, const void *src, size_t bytes, int slot) {
  cuda_t *cu = cuda_of(be);
  if (!bytes) return;
  CUDA_CHECK(cudaStreamWaitEvent(cu->copy_stream, cu->freed[slot & 1], 0));
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cu->copy_stream));
  CUDA_CHECK(cudaEventRecord(cu->copied[slot & 1], cu->copy_stream));
}

static void cu_upload_wait(backend_t *be, int slot) {
  cuda_t *cu = cuda_of(be);
  CUDA_CHECK(cudaStreamWaitEvent(cu->stream, cu->copied[slot & 1], 0));
  CUDA_CHECK(cudaEventRecord(cu->freed[(slot & 1) ^ 1], cu->stream));
}

/* ------------------------------------------------------------------ graphs */

/* Capture in thread-local mode: a comm's progress thread may still call CUDA while the step is
 * recorded. An upload queued on the copy stream joins the capture through the events the compute
 * stream waits for; the host's wait for an upload (upload_host_wait) breaks it, so a recorded
 * step has its uploads queued outside. */
static int cu_graph_begin(backend_t *be, char *err, size_t errlen) {
  cudaError_t e = cudaStreamBeginCapture(cuda_of(be)->stream, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(err, errlen, "cudaStreamBeginCapture: %s", cudaGetErrorString(e));
    return -1;
  }
  backend_recording = 1;
  backend_record_error = 0;
  return 0;
}

static void *cu_graph_end(backend_t *be, char *err, size_t errlen) {
  cudaGraph_t g = NULL;
  cudaGraphExec_t x = NULL;
  const char *call = "cudaStreamEndCapture";
  cudaError_t e = cudaStreamEndCapture(cuda_of(be)->stream, &g);
  backend_recording = 0;
  if (e == cudaSuccess && backend_record_error) e = (cudaError_t)backend_record_error;
  if (e == cudaSuccess) {
    call = "cudaGraphInstantiate";
    e = cudaGraphInstantiate(&x, g, 0);
  }
  if (g) (void)cudaGraphDestroy(g);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(err, errlen, "%s: %s", call, backend_record_error ? "a call the capture cannot hold" : cudaGetErrorString(e));
    backend_record_error = 0;
    return NULL;
  }
  return (void *)x;
}

static int cu_graph_launch(backend_t *be, void *graph, char *err, size_t errlen) {
  cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, cuda_of(be)->stream);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(err, errlen, "cudaGraphLaunch: %s", cudaGetErrorString(e));
    return -1;
  }
  return 0;
}

static void cu_graph_destroy(backend_t *be, void *graph) {
  if (graph) CUDA_CHECK(cudaGraphExecDestroy((cudaGraphExec_t)graph));
}

/* ------------------------------------------------------------------ lifecycle */

static void cu_destroy(backend_t *be) {
  if (!be) return;
  cuda_t *cu = (cuda_t *)be->impl;
  if (cu) {
    if (cu->stream) cudaStreamSynchronize(cu->stream);
    for (int i = 0; i < cu->mm_count; i++) mm_entry_destroy(&cu->mm[i]);
    scratch_free(cu, &cu->sumsq);
    scratch_free(cu, &cu->rms);
    scratch_free(cu, &cu->att_delta);
    scratch_free(cu, &cu->emb_keys);
    scratch_free(cu, &cu->emb_pos);
    scratch_free(cu, &cu->emb_pos_sorted);
    scratch_free(cu, &cu->emb_cub);
    scratch_free(cu, &cu->rope);
    cudnn_att_close(cu->cudnn);
    scratch_free(cu, &cu->cudnn_ws);
    scratch_free(cu, &cu->att_blk);
    scratch_free(cu, &cu->att_blk_lse);
    scratch_free(cu, &cu->adamw_tab);
    free(cu->adamw_segs);
    scratch_free(cu, &cu->groups_dev);
    scratch_free(cu, &cu->sumsq_add);
    free(cu->groups_tab);
    free(cu->groups_of);
    for (int i = 0; i < 2; i++) {
      if (cu->copied[i]) cudaEventDestroy(cu->copied[i]);
      if (cu->freed[i]) cudaEventDestroy(cu->freed[i]);
    }
    if (cu->copy_stream) cudaStreamDestroy(cu->copy_stream);
    if (cu->workspace) cudaFree(cu->workspace);
    free(cu->mem.v);
    if (cu->lt) cublasLtDestroy(cu->lt);
    if (cu->stream) cudaStreamDestroy(cu->stream);
    free(cu);
  }
  free(be);
}

static void cu_set_tf32(backend_t *be, int allow) { cuda_of(be)->allow_tf32 = allow != 0; }

/* Dense tensor-core peaks from the vendors' data sheets, TFLOP/s (bf16, tf32). The first name
 * that the device name contains wins, so the longer names come first. */
static const struct {
  const char *name;
  double bf16, tf32;
} gpu_peaks[] = {
    {"H100 PCIe", 756, 378}, {"H100 NVL", 835, 418}, {"H100", 989, 495}, {"H200", 989, 495},
    {"H800 PCIe", 756, 378}, {"H800", 989, 495},     {"GH200", 989, 495}, {"B200", 2250, 1100},
    {"A100", 312, 156},      {"A800", 312, 156},      {"A10G", 70, 35},    {"A10", 125, 62.5},
    {"L40S", 362, 183},      {"L4", 121, 60},         {"RTX 4090", 165, 82.6}, {"V100", 125, 0},
};

static double cu_peak_flops(backend_t *be, dtype_t dt) {
  for (size_t i = 0; i < sizeof gpu_peaks / sizeof gpu_peaks[0]; i++)
    if (strstr(be->device, gpu_peaks[i].name)) return 1e12 * (dt == DT_BF16 ? gpu_peaks[i].bf16 : gpu_peaks[i].tf32);
  return 0;
}

/* The table's functions: memory, kernels and lifecycle, set once the device is ready. */
static void cu_set_ops(backend_t *be) {
  be->alloc = cu_alloc;
  be->free = cu_free;
  be->mem_peak = cu_mem_peak;
  be->to_device = cu_to_device;
  be->to_host = cu_to_host;
  be->copy = cu_copy;
  be->zero = cu_zero;
  be->synchronize = cu_sync;
  be->matmul = cu_matmul;
  be->add = cu_add;
  be->scale = cu_scale;
  be->sumsq = cu_sumsq;
  be->sumsq_parts = cu_sumsq_parts;
  be->convert = cu_convert;
  be->embedding_fwd = cu_embedding_fwd;
  be->embedding_bwd = cu_embedding_bwd;
  be->rmsnorm_fwd = cu_rmsnorm_fwd;
  be->rmsnorm_bwd = cu_rmsnorm_bwd;
  be->add_rmsnorm_fwd = cu_add_rmsnorm_fwd;
  be->rope_fwd = cu_rope_fwd;
  be->rope_bwd = cu_rope_bwd;
  be->qkv_rope_fwd = cu_qkv_rope_fwd;
  be->qkv_rope_bwd = cu_qkv_rope_bwd;
  be->attention_fwd = cu_attention_fwd;
  be->attention_bwd = cu_attention_bwd;
  be->attention_fwd_block = cu_attention_fwd_block;
  be->attention_merge = cu_attention_merge;
  be->attention_bwd_block = cu_attention_bwd_block;
  be->swiglu_fwd = cu_swiglu_fwd;
  be->swiglu_bwd = cu_swiglu_bwd;
  be->cross_entropy = cu_cross_entropy;
  be->copy_2d = cu_copy_2d;
  be->ce_shard_max = cu_ce_shard_max;
  be->ce_shard_stats = cu_ce_shard_stats;
  be->ce_shard_loss = cu_ce_shard_loss;
  be->adamw = cu_adamw;
  be->adamw_multi = cu_adamw_multi;
  be->step_loss = cu_step_loss;
  be->sumsq_groups = cu_sumsq_groups;
  be->sumsq_parts_add = cu_sumsq_parts_add;
  be->clip_scale = cu_clip_scale;
  be->adamw_multi_dev = cu_adamw_multi_dev;
  be->step_skip = cu_step_skip;
  be->to_device_async = cu_to_device_async;
  be->graph_begin = cu_graph_begin;
  be->graph_end = cu_graph_end;
  be->graph_launch = cu_graph_launch;
  be->graph_destroy = cu_graph_destroy;
  be->host_alloc_pinned = cu_alloc_pinned;
  be->host_free_pinned = cu_free_pinned;
  be->upload_host_wait = cu_upload_host_wait;
  be->upload_async = cu_upload_async;
  be->upload_wait = cu_upload_wait;
  be->destroy = cu_destroy;
  be->peak_flops = cu_peak_flops;
  be->set_tf32 = cu_set_tf32;
  be->attention_select = cu_attention_select;
}

/* device < 0: the only visible GPU, else the one numbered LOCAL_RANK. Errors here are reported,
 * not fatal: "device: auto" falls back to cpu on them; with no GPU visible err starts "cuda: no
 * GPU visible". threads mean nothing here. */
static backend_t *cu_create(int device, int threads, char *err, size_t errlen) {
  int count = 0;
  cudaError_t ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess || count == 0) {
    if (err && errlen)
      snprintf(err, errlen, "cuda: no GPU visible (cudaGetDeviceCount: %s)",
               ce != cudaSuccess ? cudaGetErrorString(ce) : "0 devices");
    (void)cudaGetLastError();
    return NULL;
  }
  if (device < 0) { /* auto: the only GPU, else the one of this LOCAL_RANK */
    int lr;
    env_int("LOCAL_RANK", 0, INT_MAX, 0, &lr);
    device = count == 1 ? 0 : lr;
  }
  if (device >= count) {
    if (err && errlen) snprintf(err, errlen, "cuda: device %d requested but %d visible", device, count);
    return NULL;
  }
  backend_t *be = (backend_t *)calloc(1, sizeof *be);
  cuda_t *cu = (cuda_t *)calloc(1, sizeof *cu);
  const char *what = NULL;
  cudaError_t e = cudaSuccess;
  cublasStatus_t bs = CUBLAS_STATUS_SUCCESS;
  int optin = 0;
  if (!be || !cu) {
    free(be);
    free(cu);
    if (err && errlen) snprintf(err, errlen, "cuda: out of host memory");
    return NULL;
  }
  be->impl = cu;
  be->name = "cuda";
  be->mem = BACKEND_MEM_DEVICE;
  cu->device = device;
  if ((e = cudaSetDevice(device)) != cudaSuccess) { what = "cudaSetDevice"; goto fail; }
  {
    cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess) { what = "cudaGetDeviceProperties"; goto fail; }
    snprintf(be->device, sizeof be->device, "%.95s", prop.name); /* cu_peak_flops's key */
  }
  if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)) != cudaSuccess) {
    what = "cudaDeviceGetAttribute";
    goto fail;
  }
  cu->smem_optin = (size_t)optin;
  if ((e = cudaStreamCreateWithFlags(&cu->stream, cudaStreamNonBlocking)) != cudaSuccess) {
    what = "cudaStreamCreate";
    goto fail;
  }
  if ((e = cudaStreamCreateWithFlags(&cu->copy_stream, cudaStreamNonBlocking)) != cudaSuccess) {
    what = "cudaStreamCreate(copy stream)";
    goto fail;
  }
  for (int i = 0; i < 2; i++)
    if ((e = cudaEventCreateWithFlags(&cu->copied[i], cudaEventDisableTiming)) != cudaSuccess ||
        (e = cudaEventCreateWithFlags(&cu->freed[i], cudaEventDisableTiming)) != cudaSuccess) {
      what = "cudaEventCreate(uploads)";
      goto fail;
    }
  if ((e = cudaMalloc(&cu->workspace, WORKSPACE_BYTES)) != cudaSuccess) { what = "cudaMalloc(workspace)"; goto fail; }
  mem_add(&cu->mem, (ptrdiff_t)WORKSPACE_BYTES);
  if ((bs = cublasLtCreate(&cu->lt)) != CUBLAS_STATUS_SUCCESS) { what = "cublasLtCreate"; goto fail; }
  if (att_setup<16>(cu) || att_setup<32>(cu) || att_setup<64>(cu) || att_setup<128>(cu)) {
    what = "attention kernels' shared memory (cudaFuncSetAttribute)";
    e = cudaGetLastError();
    goto fail;
  }
  cu_set_ops(be);
  return be;

fail:
  if (err && errlen)
    snprintf(err, errlen, "cuda: device %d: %s: %s", device, what,
             bs != CUBLAS_STATUS_SUCCESS ? cublasGetStatusString(bs) : cudaGetErrorString(e));
  (void)cudaGetLastError();
  cu_destroy(be);
  return NULL;
}

/* The registry's entry (trainer/backend/registry.c). Positional: C++17 has no designated
 * initializers. The GPUs are counted as meshrun counts them (common/gpus.h). */
extern "C" const backend_entry_t backend_entry_cuda = {
    "cuda",             /* name */
    BACKEND_MEM_DEVICE, /* mem */
    cu_create,          /* create */
    gpus_visible,       /* visible_devices */
    NULL, NULL,         /* absent, remedy */
};
