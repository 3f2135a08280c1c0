/* backend: memory and the kernels the Llama model needs, forward and backward.
 *
 * The model calls kernels only through this table, so it never sees a device type. The backends
 * are listed by the registry (backend_registry, trainer/backend/registry.c), each defined in its
 * own file (backend_<name>.*: "cpu" with OpenBLAS and OpenMP, "cuda" with cuBLASLt and fused
 * kernels); shared code loops over the registry and asks an entry or a backend_t what it can do,
 * never which one it is. All tensor pointers are device memory of the backend (plain host memory
 * for cpu), row-major. Integer ids (tokens, targets) are int32 device memory.
 *
 * Dtypes (mixed precision, PyTorch's MixedPrecisionPolicy): a kernel's last argument dt is the
 * dtype of its activation and parameter tensors (the compute copies): DT_F32, or DT_BF16 for
 * bf16 storage. Whatever dt is, arithmetic happens in fp32: kernels widen bf16 inputs, compute
 * in fp32 and round once to bf16 when they store (trainer/backend/bf16.h: to nearest even). Some
 * arguments are fp32 whatever dt says, and their comments say "fp32": statistics (RMSNorm's
 * rstd, attention's log-sum-exp, the losses, the loss-parallel row stats), parameter gradients
 * (rmsnorm dw, embedding dtable: the fp32 gradient buffers the strategies reduce), and the
 * optimizer's tensors. matmul names two dtypes: its operands' and its output's, so that
 * dW += dy^T x takes bf16 operands and accumulates into fp32 gradients.
 *
 * Conventions, the same for every kernel:
 * - Shapes in comments use N = B*T rows, C = model dim, H = heads, KV = kv heads, D = head dim,
 *   V = vocab (local shard under tensor parallelism), F = hidden dim of the feed-forward.
 * - Backward kernels ACCUMULATE into every gradient they produce (dx +=, dw +=), as llm.c does:
 *   callers zero gradient buffers once per step. The exceptions say so: rope_bwd works in place;
 *   a gradient with one producer is WRITTEN by it (attention_bwd, qkv_rope_bwd, swiglu_bwd), so
 *   that no buffer is zeroed to be added into once.
 *   A bf16 accumulation widens the old value, adds in fp32 and rounds once.
 * - With dt = DT_F32 every kernel computes exactly what it computed before dtypes existed
 *   (the same bits).
 * - Kernels are deterministic: the same inputs and thread count give the same bits.
 * - A kernel never allocates per call beyond scratch it caches inside the backend. */
#ifndef MESHRUN_BACKEND_H
#define MESHRUN_BACKEND_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

typedef struct backend backend_t;

/* Which attention kernel (the plan's model.attention): the backend's fused one where it loads
 * and takes the shape, else its reference ("auto"); the fused one or an error; the reference. Their
 * names, in this order, are attention_names (trainer/backend/attention_registry.c). */
typedef enum { ATTN_AUTO = 0, ATTN_FUSED, ATTN_REFERENCE } attn_choice_t;
extern const char *const attention_names[];

/* Element types of tensors, the one dtype enum of the trainer: kernels, collectives (comm.h) and
 * the plan's mixed-precision keys use it. dtype_size gives the bytes of one element, 0 for a
 * value outside the enum (the comm layer refuses such a call). */
typedef enum { DT_F32 = 0, DT_BF16 = 1 } dtype_t;
static inline size_t dtype_size(dtype_t dt) { return dt == DT_BF16 ? 2 : dt == DT_F32 ? 4 : 0; }
static inline const char *dtype_name(dtype_t dt) { return dt == DT_BF16 ? "bf16" : "fp32"; }

/* Where a backend's memory lives: plain host memory (cpu) or a device's (cuda). Callers ask this,
 * never the backend's name, whether a buffer can be touched from the host or handed to a comm
 * that moves host memory. */
typedef enum { BACKEND_MEM_HOST = 0, BACKEND_MEM_DEVICE } backend_mem_t;

/* One piece of the range adamw_multi updates: numel elements from offset (in elements from the
 * range's start), with the call's weight decay (decay != 0) or none. */
typedef struct {
  size_t offset, numel;
  int decay;
} adamw_segment_t;

/* The most pieces one launch of sumsq_parts_add takes (a call with more makes more launches). */
#define SUMSQ_ADD_PIECES 16

/* AdamW's values of one update that change from step to step, in device memory where a step
 * reads them (adamw_multi_dev), so that a captured step replays with the next step's values: the
 * learning rate, the update count (from 1) and the bias corrections the host derived from them
 * (adamw_step_make: the arithmetic every backend's adamw uses, the one place it is written). */
typedef struct {
  float lr;
  int32_t step;
  float step_size; /* lr / (1 - beta1^step) */
  float bc2_sqrt;  /* sqrt(1 - beta2^step) */
  int32_t skip;    /* 0 from the host; step_skip sets it on the device: no update this step */
} adamw_step_t;

static inline adamw_step_t adamw_step_make(float lr, float beta1, float beta2, int step) {
  const float bc1 = 1.0f - powf(beta1, (float)step), bc2 = 1.0f - powf(beta2, (float)step);
  return (adamw_step_t){lr, step, lr / bc1, sqrtf(bc2), 0};
}

/* The skipping of a step's update (train.skip_nonfinite, train.skip_loss_z, train.skip_grad_z),
 * decided on the device by step_skip. The window holds the loss and the gradient norm of the
 * last SKIP_WINDOW steps that updated (fp32; a skipped step's values never enter it), oldest
 * overwritten first; a z-score decides nothing until it holds SKIP_MIN values. It lives in
 * device memory, and a checkpoint carries it. */
#define SKIP_WINDOW 128
#define SKIP_MIN 16
typedef struct {
  float loss[SKIP_WINDOW], norm[SKIP_WINDOW];
  int32_t n;     /* values held, <= SKIP_WINDOW */
  int32_t next;  /* the slot the next value goes into */
  int32_t total; /* steps skipped since the run began */
  int32_t pad;
} skip_window_t;

/* Why a step was skipped (skip_verdict_t.why); SKIP_NONE: it updated. */
enum { SKIP_NONE = 0, SKIP_LOSS_NONFINITE, SKIP_NORM_NONFINITE, SKIP_LOSS_Z, SKIP_NORM_Z };
typedef struct {
  int32_t why;         /* SKIP_* */
  int32_t total;       /* the window's total after this step (this one counted) */
  double z, mean, std; /* the z-score that skipped it and the window's mean and std (0 otherwise) */
} skip_verdict_t;

struct backend {
  const char *name; /* its registry entry's name: for messages, and compared only with registry
                       names (which comm backend moves this device's memory) */
  char device[96];  /* the device's own name ("NVIDIA H100 80GB HBM3"); "" on cpu. Reports only */
  backend_mem_t mem;
  void *impl;       /* backend-private state */

  /* --- memory (bytes). alloc returns zeroed memory, or NULL when it cannot. */
  void *(*alloc)(backend_t *be, size_t bytes);
  void (*free)(backend_t *be, void *p); /* accepts NULL */
  /* The most device memory the backend's allocator has held at once (alloc's buffers, its
   * scratch and workspaces); NULL where memory is the host's, whose figure is the process's
   * peak resident memory (metrics). */
  size_t (*mem_peak)(backend_t *be);
  void (*to_device)(backend_t *be, void *dst, const void *host_src, size_t bytes);
  void (*to_host)(backend_t *be, void *host_dst, const void *src, size_t bytes);
  void (*copy)(backend_t *be, void *dst, const void *src, size_t bytes); /* device to device */
  void (*zero)(backend_t *be, void *p, size_t bytes);
  void (*synchronize)(backend_t *be);

  /* --- dense algebra. c(m,n) = alpha * op(a) op(b) + beta * c, row-major; op(a) is (m,k):
   * a is (m,k) or, with trans_a, (k,m); op(b) is (k,n): b is (k,n) or, with trans_b, (n,k).
   * a and b are ab_dt, c is c_dt; products accumulate in fp32 (beta * c too), rounded once
   * when c is bf16, except that a bf16 c with beta != 0 may also have alpha op(a) op(b) rounded
   * to bf16 before beta * c is added (cuBLASLt's epilogue for some shapes, as PyTorch's bf16
   * addmm): within one more bf16 ulp of the larger term. Combinations: (bf16, bf16), (bf16,
   * fp32), (fp32, fp32). (The cpu backend
   * computes a bf16 product as fp32 sgemm of the widened operands: products of two bf16 values
   * are exact in fp32.)
   * A linear layer y = x W^T with W (out,in):  matmul(y, x, W, N, out, in, 0, 1, 1, 0, dt, dt)
   *   dx += dy W:                               matmul(dx, dy, W, N, in, out, 0, 0, 1, 1, dt, dt)
   *   dW += dy^T x:                             matmul(dW, dy, x, out, in, N, 1, 0, 1, 1, dt, DT_F32) */
  void (*matmul)(backend_t *be, void *c, const void *a, const void *b, int m, int n, int k, int trans_a,
                 int trans_b, float alpha, float beta, dtype_t ab_dt, dtype_t c_dt);

  /* --- elementwise */
  /* out = a + b (out may alias) */
  void (*add)(backend_t *be, void *out, const void *a, const void *b, size_t n, dtype_t dt);
  void (*scale)(backend_t *be, float *x, float s, size_t n);  /* x *= s, fp32 */
  /* Sum of squares of x (fp32), accumulated in double, returned to the host (gradient norms). */
  double (*sumsq)(backend_t *be, const float *x, size_t n);
  /* The sums of squares of n pieces of x, out[i] over x[offset[i]] .. x[offset[i] + count[i] - 1],
   * each the same double sumsq gives for that piece, with one wait for the device in all (not one
   * per piece): the gradient norm over a strategy's parameter pieces. */
  void (*sumsq_parts)(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n, double *out);
  /* dst (n elements of dst_dt) = src (n of src_dt): widening exact, narrowing rounded to nearest
   * even; the same dtype copies. dst and src do not overlap. */
  void (*convert)(backend_t *be, void *dst, dtype_t dst_dt, const void *src, dtype_t src_dt, size_t n);

  /* --- embedding. out(N,C) = table[tok - vocab_start] for tokens in [vocab_start,
   * vocab_start + rows); other tokens give zero rows (vocab-parallel embedding under TP).
   * out and table are dt; dtable is fp32 (a parameter gradient), dout dt. */
  void (*embedding_fwd)(backend_t *be, void *out, const void *table, const int32_t *tokens, int n, int c,
                        int vocab_start, int rows, dtype_t dt);
  void (*embedding_bwd)(backend_t *be, float *dtable, const void *dout, const int32_t *tokens, int n, int c,
                        int vocab_start, int rows, dtype_t dt);

  /* --- RMSNorm. out(N,C) = x / rms(x) * w; rstd(N) fp32, saved for backward. dw fp32. */
  void (*rmsnorm_fwd)(backend_t *be, void *out, float *rstd, const void *x, const void *w, int n, int c, float eps,
                      dtype_t dt);
  void (*rmsnorm_bwd)(backend_t *be, void *dx, float *dw, const void *dout, const void *x, const void *w,
                      const float *rstd, int n, int c, dtype_t dt);

  /* Residual add and RMSNorm in one pass (a sharded rowwise product's residual add, which the norm
   * after it reads): sum(N,C) = a + b, rounded to dt and stored, then out and rstd as rmsnorm_fwd
   * computes them from the stored sum: the bits of add followed by rmsnorm_fwd. sum may alias a;
   * out aliases nothing. */
  void (*add_rmsnorm_fwd)(backend_t *be, void *sum, void *out, float *rstd, const void *a, const void *b,
                          const void *w, int n, int c, float eps, dtype_t dt);

  /* --- RoPE, in place on x (B,T,H,D). Adjacent pairs (2i, 2i+1) of each head rotate by
   * angle pos * theta^(-2i/D), pos = pos_offset + t (Meta's layout, as llama2.c checkpoints).
   * rope_bwd rotates a gradient back (by -angle), in place. */
  void (*rope_fwd)(backend_t *be, void *x, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt);
  void (*rope_bwd)(backend_t *be, void *dx, int b, int t, int h, int d, int pos_offset, float theta, dtype_t dt);

  /* --- Q, K and V of one product (the fused linear of the adjacent wq, wk, wv) and back.
   * qkv (B*T rows, (H + 2 KV) D) holds each row's q (H*D), k (KV*D) and v (KV*D) side by side.
   * qkv_rope_fwd WRITES q (B,T,H,D) and k (B,T,KV,D) rotated as rope_fwd rotates them, and v
   * (B,T,KV,D) copied; qkv_rope_bwd WRITES the B*T rows of dqkv from dq and dk rotated back as
   * rope_bwd rotates them and dv copied (dq, dk, dv are only read). The arithmetic of rope_fwd
   * and rope_bwd on the separate tensors, element for element: the same bits. No output
   * overlaps an input. */
  void (*qkv_rope_fwd)(backend_t *be, void *q, void *k, void *v, const void *qkv, int b, int t, int h, int kv,
                       int d, int pos_offset, float theta, dtype_t dt);
  void (*qkv_rope_bwd)(backend_t *be, void *dqkv, const void *dq, const void *dk, const void *dv, int b, int t,
                       int h, int kv, int d, int pos_offset, float theta, dtype_t dt);

  /* --- causal attention with grouped-query heads, scale 1/sqrt(D).
   * q (B,T,H,D), k and v (B,T,KV,D), out (B,T,H,D); head h uses kv head h / (H/KV).
   * lse (B,H,T) fp32 saves the natural log-sum-exp of each row of scaled scores for the
   * backward, which recomputes the probabilities (no (T,T) matrix is kept between forward and
   * backward). The backward WRITES dq, dk and dv (the one producer of those gradients; the
   * exception to the accumulate rule above). Which kernel runs is attention_select's choice. */
  void (*attention_fwd)(backend_t *be, void *out, float *lse, const void *q, const void *k, const void *v, int b,
                        int t, int h, int kv, int d, dtype_t dt);
  void (*attention_bwd)(backend_t *be, void *dq, void *dk, void *dv, const void *dout, const void *q,
                        const void *k, const void *v, const void *out, const float *lse, int b, int t, int h, int kv,
                        int d, dtype_t dt);

  /* --- blocks of causal attention: the pieces of ring attention (context parallelism). A block
   * is tq query rows at sequence positions q_pos .. q_pos + tq - 1 against tk keys at positions
   * k_pos .. k_pos + tk - 1; a query sees the keys whose position is not past its own. q
   * (B,tq,H,D), k and v (B,tk,KV,D) are dt; everything else is fp32. attention_fwd_block writes
   * the block's out (B,tq,H,D) and lse (B,H,tq): a row that sees no key gets out 0 and lse
   * -inf. attention_merge folds a block's result (out_b, lse_b) into a running one (out, lse;
   * start from out 0, lse -inf) through their log-sum-exps, so that once every key block of a
   * row is in, out and lse are the row's attention over all its keys (out is then converted to
   * dt). attention_bwd_block ACCUMULATES the block's share of dq (B,tq,H,D) and dk, dv
   * (B,tk,KV,D) into them, given dout and the row's whole out (dt, after every merge) and lse.
   * attention_fwd and attention_bwd are the block t = tq = tk at positions 0 (same arithmetic on
   * the cpu). Where attention_select chose a fused kernel that takes blocks (cuda: cuDNN, for
   * square blocks on the diagonal or wholly in the past, dt bf16), its outputs are bf16: the
   * block's out then carries one bf16 rounding before it is widened into the fp32 out, and each
   * block's share of dq, dk, dv one before it is added into the fp32 accumulators. Optional
   * (NULL: the backend has no blocks; plans with context parallelism refuse it). */
  void (*attention_fwd_block)(backend_t *be, float *out, float *lse, const void *q, const void *k, const void *v,
                              int b, int tq, int tk, int h, int kv, int d, long q_pos, long k_pos, dtype_t dt);
  void (*attention_merge)(backend_t *be, float *out, float *lse, const float *out_b, const float *lse_b, int b, int t,
                          int h, int d);
  void (*attention_bwd_block)(backend_t *be, float *dq, float *dk, float *dv, const void *dout, const void *q,
                              const void *k, const void *v, const void *out, const float *lse, int b, int tq, int tk,
                              int h, int kv, int d, long q_pos, long k_pos, dtype_t dt);

  /* --- SwiGLU over rows of one product of the adjacent w1, w3: ag (N, 2F) holds each row's
   * a = x W1^T (F) and g = x W3^T (F) side by side; out (N,F) = silu(a) * g. The backward WRITES
   * dag (N, 2F), da and dg side by side as a and g are (their one producer; an exception to the
   * accumulate rule, like attention_bwd). */
  void (*swiglu_fwd)(backend_t *be, void *out, const void *ag, int n, int f, dtype_t dt);
  void (*swiglu_bwd)(backend_t *be, void *dag, const void *dout, const void *ag, int n, int f, dtype_t dt);

  /* --- softmax cross-entropy, fused forward and backward.
   * logits (N, ld) dt with V valid columns (ld >= V: columns past V are padding and ignored).
   * losses(N) fp32 = -log softmax(logits)[target], computed in fp32; a target < 0 is ignored
   * (loss 0, zero gradient). If dlogits (dt) is non-NULL it receives (softmax - onehot) *
   * grad_scale (may alias logits; padding columns get 0). */
  void (*cross_entropy)(backend_t *be, float *losses, void *dlogits, const void *logits, const int32_t *targets,
                        int n, int v, int ld, float grad_scale, dtype_t dt);

  /* --- 2-D strided copy (device to device) of dt elements: dst[i*ldd + j] = src[i*lds + j]
   * for i < rows, j < cols. Tensor parallelism rearranges column blocks with it (gathered vocab
   * shards into full logit rows, and back). */
  void (*copy_2d)(backend_t *be, void *dst, int ldd, const void *src, int lds, int rows, int cols, dtype_t dt);

  /* --- vocab-parallel cross-entropy (loss parallel under tensor parallelism). logits (N, ld)
   * dt hold one rank's vocabulary shard: column j is vocabulary id vocab_start + j, and only the
   * first v columns are real (v may be 0 on a shard that is all padding). targets are ids of
   * the full vocabulary (< 0 = ignored). rowmax, stats and losses are fp32. The model
   * all-reduces across the shards between the steps, so no rank ever holds all logits of a row:
   *   ce_shard_max:   rowmax(N) = max over the shard's v columns (-FLT_MAX when v = 0)
   *                   -> all_reduce(max)
   *   ce_shard_stats: stats(2N): stats[i] = sum_j exp(logit - rowmax[i]) over the v columns,
   *                   stats[N + i] = the target's logit when this shard holds it, else 0
   *                   -> all_reduce(sum)
   *   ce_shard_loss:  losses(N) = log(stats[i]) + rowmax[i] - stats[N + i] (0 for ignored
   *                   targets); if dlogits (dt) is non-NULL (it may alias logits) it receives
   *                   (exp(logit - rowmax) / stats[i] - onehot) * grad_scale over the v columns,
   *                   0 on padding columns and ignored rows. (Written, not accumulated.) */
  void (*ce_shard_max)(backend_t *be, float *rowmax, const void *logits, int n, int v, int ld, dtype_t dt);
  void (*ce_shard_stats)(backend_t *be, float *stats, const void *logits, const float *rowmax,
                         const int32_t *targets, int n, int v, int ld, int vocab_start, dtype_t dt);
  void (*ce_shard_loss)(backend_t *be, float *losses, void *dlogits, const void *logits, const float *rowmax,
                        const float *stats, const int32_t *targets, int n, int v, int ld, int vocab_start,
                        float grad_scale, dtype_t dt);

  /* --- AdamW with decoupled weight decay on n elements, all fp32 (the master weights, their
   * gradients and moments). g is multiplied by grad_scale first (gradient clipping). step
   * counts from 1 (bias correction). param_lp, when not NULL, receives the updated parameters
   * rounded to bf16 (n elements): the compute copy, written by the same pass. */
  void (*adamw)(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp, size_t n,
                float lr, float beta1, float beta2, float eps, float weight_decay, int step, float grad_scale);
  /* The same update over the n_segs segments of one range in one pass (one launch on a device):
   * param, grad, m, v (and param_lp, in bf16 elements) point at the range's start, and segment i
   * updates its numel elements from its offset with weight_decay where segs[i].decay is set and
   * with none where it is not. Every element gets the arithmetic adamw gives it, called per
   * segment with weight_decay or 0: the same bits. Segments do not overlap; elements outside
   * them are not touched. Optional: NULL, and the caller calls adamw per segment. */
  void (*adamw_multi)(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                      const adamw_segment_t *segs, int n_segs, float lr, float beta1, float beta2, float eps,
                      float weight_decay, int step, float grad_scale);

  /* --- a training step without host waits (trainer/run/train.c): its loss, gradient norm and
   * clip scale stay in device memory, and AdamW reads the scale there. Required. None of these
   * waits for the device; every pointer is device memory unless it says host. */
  /* The loss of micro-batch `micro` (0-based) of `accum` from its n per-row losses (fp32): l is
   * their sum in double, in order, over valid, rounded to fp32 (0 when valid is 0): the bits of
   * model_loss_of_rows. With poison set, l is nan instead (a test's fault). stat (2 doubles):
   * micro 0 sets stat[0] = l and stat[1] = 0, a later micro-batch adds l to stat[0]; stat[1]
   * becomes micro + 1 at the first l that is not finite. The last (micro == accum - 1) then
   * divides stat[0] by accum and writes *mean = (float)stat[0]. One thread adds the rows, in
   * the host's order. */
  void (*step_loss)(backend_t *be, const float *rows, int n, int valid, int micro, int accum, int poison,
                    double *stat, float *mean);
  /* sumsq_parts' sums of the n pieces (offset, count and group are host arrays), added in piece
   * order into two groups (group[i] is 0 or 1): sums (2 doubles), and shares (2 floats) the same
   * rounded to fp32, what a reduction across ranks moves. The piece table is cached on the
   * device while a call brings the same one (a strategy's always does). */
  void (*sumsq_groups)(backend_t *be, const float *x, const size_t *offset, const size_t *count, const int *group,
                       int n, double *sums, float *shares);
  /* The n pieces' sums of squares added into out (n doubles): out[i] += the sum of x[offset[i]]^2
   * .. x[offset[i] + count[i] - 1]^2 in double (offset and count are host arrays, read during the
   * call; pieces do not overlap out). One launch on a device for up to SUMSQ_ADD_PIECES pieces,
   * and no wait. A strategy's per-tensor sums of this rank's own gradients before it reduces them
   * (dp.h), read only when a step's norm is not finite; their bits need not be sumsq's. */
  void (*sumsq_parts_add)(backend_t *be, const float *x, const size_t *offset, const size_t *count, int n,
                          double *out);
  /* The gradient norm and the clip scale: *norm = sqrt(sums[0] + sums[1]), or with use_shares
   * (the shares were reduced across ranks) sqrt((double)shares[0] + (double)shares[1]); *scale =
   * (float)min(1, clip / norm), 1 when clip <= 0: optim_clip_scale's value, in double, rounded
   * once. (A norm that is not finite gives a scale that is not either: the caller's read of the
   * norm stops the run.) */
  void (*clip_scale)(backend_t *be, const double *sums, const float *shares, int use_shares, double clip,
                     double *norm, float *scale);
  /* adamw_multi with the step's values read from device memory when the kernel runs: lr and step
   * from *st (its step_size and bc2_sqrt as adamw_step_make made them), the gradient scale from
   * *grad_scale (fp32): the bits adamw_multi gives for those values; nothing at all when
   * st->skip is set. Nothing of a call's arguments changes from one step to the next (a captured
   * step replays it). */
  void (*adamw_multi_dev)(backend_t *be, float *param, const float *grad, float *m, float *v, void *param_lp,
                          const adamw_segment_t *segs, int n_segs, float beta1, float beta2, float eps,
                          float weight_decay, const adamw_step_t *st, const float *grad_scale);
  /* Whether this step updates (the types above): *loss (fp32, the step's mean over dp) and *norm
   * (the reduced gradient norm) against the window. With nonfinite set, a loss, then a norm,
   * that is nan or inf skips; a finite loss (norm) whose z-score over the window's values,
   * (x - mean) / std with the population std, is above loss_z (norm_z; 0: off) skips, once
   * the window holds SKIP_MIN values and std > 0; checked in that order, the first that holds
   * is the verdict. A skip adds 1 to win->total and sets st->skip, which makes adamw_multi_dev
   * leave param, m, v and param_lp as they are; a step that updates with both values finite
   * puts them into the window. *out gets the verdict. Required; one launch. */
  void (*step_skip)(backend_t *be, const float *loss, const double *norm, int nonfinite, double loss_z,
                    double norm_z, skip_window_t *win, skip_verdict_t *out, adamw_step_t *st);
  /* bytes of pinned host memory (host_alloc_pinned's) to device memory, queued on the compute
   * stream behind what is queued there, without a wait: src must stay as it is until the device
   * has run the copy (a caller writes each step's values into its own slot of a ring). The
   * step's small values go up this way (adamw_step_t). Required; a copy on a host backend. */
  void (*to_device_async)(backend_t *be, void *dst, const void *src, size_t bytes);

  /* --- batches uploaded while the device computes: pinned (page-locked) host memory, a copy
   * stream beside the compute stream, and two slots used in turn (double buffering). Required;
   * on a host backend plain memory, memcpy, and no waits. One upload goes:
   *   upload_host_wait(slot)               the host may write the slot's pinned buffer again
   *                                        (the slot's last upload has read it)
   *   (the host writes the pinned buffer)
   *   upload_async(dst, src, bytes, slot)  src (pinned) to dst (device) on the copy stream, once
   *                                        the compute stream is done with the slot's last dst
   *   upload_wait(slot)                    the compute stream waits for the copy: what is queued
   *                                        after it may read dst
   * A slot's dst is in use from its upload_wait until the other slot's next upload_wait: a
   * caller alternates the slots and queues everything that reads dst in between. The host waits
   * only in upload_host_wait, and only for the copy two uploads back. */
  void *(*host_alloc_pinned)(backend_t *be, size_t bytes); /* zeroed; NULL when it cannot */
  void (*host_free_pinned)(backend_t *be, void *p);        /* accepts NULL */
  void (*upload_host_wait)(backend_t *be, int slot);
  void (*upload_async)(backend_t *be, void *dst, const void *src, size_t bytes, int slot);
  void (*upload_wait)(backend_t *be, int slot);

  void (*destroy)(backend_t *be);

  /* --- graphs: a step's queued work recorded once and replayed (CUDA graphs). Optional: NULL on a
   * backend that queues nothing (cpu), whose steps run as they are called. graph_begin starts
   * recording what is queued on the compute stream from this thread (nothing runs until a launch);
   * graph_end stops and returns the recorded work made ready to launch, or NULL with a line in err
   * when something queued could not be recorded (a host wait, an allocation, another stream's
   * work not joined to it); the recording is then dropped and the work queued since graph_begin
   * did not run. graph_launch queues one replay on the compute stream, with the arguments and
   * pointers of the recording: whatever changes between replays is read from device memory that
   * the caller updated (to_device_async) before it. graph_destroy accepts NULL. */
  int (*graph_begin)(backend_t *be, char *err, size_t errlen);
  void *(*graph_end)(backend_t *be, char *err, size_t errlen);
  int (*graph_launch)(backend_t *be, void *graph, char *err, size_t errlen);
  void (*graph_destroy)(backend_t *be, void *graph);

  /* --- what the backend knows of its device, optional (NULL: nothing to say) */
  /* The device's dense peak FLOP/s for matmuls whose operands are dt (bf16 tensor cores, or
   * fp32 as TF32), for MFU; 0 when the device is not one the backend knows. */
  double (*peak_flops)(backend_t *be, dtype_t dt);
  /* Lets fp32 matmuls use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation); off by
   * default (plain fp32). */
  void (*set_tf32)(backend_t *be, int allow);
  /* Chooses the attention kernel for the shape (b, t, h, kv, d) in dt, the model's (mode: an
   * attn_choice_t): 1 when the backend's fused kernel will run, why saying which; 0 when its
   * reference kernel will, why saying why under ATTN_AUTO; -1 when ATTN_FUSED asked for the fused
   * kernel and it cannot run, why saying why. Other shapes later use the fused kernel where it
   * takes them, else the reference. NULL: the backend has its reference kernel only. */
  int (*attention_select)(backend_t *be, int mode, int b, int t, int h, int kv, int d, dtype_t dt, char *why,
                          size_t len);
};

/* One compute backend as the registry lists it. Its own file defines the entry
 * (backend_entry_<name>, next to its create function); trainer/backend/registry.c lists the
 * entries, one line each, in the order messages and --version name them. A backend that a build
 * cannot compile (no toolkit) is listed all the same, through a stand-in file the Makefile picks
 * instead (backend_<name>_absent.c: create NULL, and why), so that asking for it says why
 * rather than "unknown". */
typedef struct {
  const char *name;   /* the plan's device value, the name in messages: "cpu" */
  backend_mem_t mem;  /* where its tensors live: host backends need no device */
  /* Creates the backend on device number device (< 0: the backend's choice, the only one or
   * LOCAL_RANK's), with threads host threads where it has them (<= 0: OMP_NUM_THREADS or the
   * CPUs). NULL with err, never fatal: device "auto" falls back on failure. NULL in a stand-in. */
  backend_t *(*create)(int device, int threads, char *err, size_t errlen);
  /* The devices this process may use, as meshrun counts them for --nproc_per_node=gpu
   * (common/gpus.h); NULL on a host backend. */
  int (*visible_devices)(void);
  /* A stand-in's reason ("built without nvcc") and remedy ("rebuild where nvcc is found"). */
  const char *absent, *remedy;
} backend_entry_t;

/* Every backend this trainer knows, NULL-terminated (trainer/backend/registry.c). */
extern const backend_entry_t *const backend_registry[];
/* The entry called name, or NULL. */
const backend_entry_t *backend_find(const char *name);
/* The registered names joined by sep ("cpu, cuda"), of built backends only (create not NULL)
 * when built_only; out is always terminated. */
void backend_names(char *out, size_t len, const char *sep, int built_only);

/* Creates a backend by its registry name, on the device the backend chooses (device < 0 of
 * backend_entry_t.create). threads <= 0: OMP_NUM_THREADS or the number of CPUs. Returns NULL
 * with a message in err: an unknown name, one this build has not (the stand-in's reason), or
 * the backend's own failure. */
backend_t *backend_create(const char *name, int threads, char *err, size_t errlen);
void backend_destroy(backend_t *be); /* accepts NULL */

/* The cpu backend, which every build has (tests that compare against it create it directly). */
backend_t *backend_cpu_create(int threads, char *err, size_t errlen);

/* The one fatal path of device errors (the check macros of a device backend's library calls end
 * in it): prints "[trainer rank R host] file:line: call: message" to stderr (R from RANK, 0 when
 * unset), calls the hook of backend_on_fatal (the comm room's: abort every live
 * communicator, so peers fail at once), and exits with status 1. It never returns. */
void backend_fatal(const char *file, int line, const char *call, const char *msg) __attribute__((noreturn));
/* What backend_fatal calls before it exits (one hook; the last one set). */
void backend_on_fatal(void (*hook)(const char *why));

/* A device backend's recording on this thread (graph_begin to graph_end, trainer/backend/fatal.c):
 * while backend_recording is set, the backend's check macros keep the first error that only a
 * recording has (a call it cannot hold, or any call after the recording broke) in
 * backend_record_error instead of taking the fatal path, so that graph_end fails and the caller
 * runs its steps unrecorded. */
extern __thread int backend_recording;
extern __thread int backend_record_error;

#endif
