// deps: trainer/run/train.c trainer/run/hooks.c trainer/run/metrics.c trainer/run/tensorboard.c trainer/run/opprof.c trainer/run/weights.c trainer/formats/data.c trainer/formats/tokenizer.c trainer/formats/ckpt.c trainer/formats/safetensors.c trainer/formats/interop.c trainer/parallel/dp.c trainer/parallel/dp_ddp.c trainer/parallel/dp_fsdp.c trainer/parallel/dp_zero2.c trainer/parallel/mesh.c trainer/parallel/pipeline_run.c trainer/model/model.c trainer/model/ring_attention.c trainer/model/optim.c trainer/model/rng.c trainer/plan/plan.c trainer/plan/pipeline.c trainer/backend/backend.c trainer/backend/backend_cpu.c trainer/backend/fatal.c trainer/comm/comm.c trainer/comm/comm_cpu.c trainer/comm/trace.c common/store.c common/store_proto.c common/net.c common/log.c common/fs.c common/err.c common/env.c test/support/step_run.c test/support/serial_run.c
/* test_opcount: what one training step asks of the device, counted on the cpu backend (which
 * runs the same model code as a GPU backend) and held to budgets, so that launches and host
 * synchronizations cannot creep back unnoticed:
 *   - host syncs per optimizer step, whatever the number of micro-batches: none in a step that
 *     does not read its values back (QUIET_SYNC_BUDGET: the loss and the gradient norm stay on
 *     the device), one in a step that reads them with those of the steps before it
 *     (READ_SYNC_BUDGET: the trainer's log steps);
 *   - kernels per layer per micro-step: at most LAYER_KERNEL_BUDGET (see there why that number).
 * A layer's count is the difference between the same run with two layers and with one, divided
 * by the micro-steps: what the embedding, the classifier and the optimizer add drops out. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include <cmocka.h>

#include "test/support/step_run.h"
#include "trainer/run/opprof.h"

enum { QUIET_SYNC_BUDGET = 0, READ_SYNC_BUDGET = 1 };

/* llm.c's GPT-2 layer on an H100 (train_gpt2.cu: cuDNN attention, GELU in the FC matmul's
 * epilogue, residual add fused with the next norm) launches 7 kernels forward and 15 backward
 * (3 per linear: bias, input and weight gradients; attention; two norms): 22. The same layer in
 * Llama's shape, as the model runs it: no biases (-4 bias reductions); Q||K||V one product and
 * W1||W3 one product, as GPT-2's c_attn and c_fc are (+0); RoPE on q and k, applied by the
 * kernel that splits the product into q, k, v, and undone by the one that packs their gradients
 * (+1, +1); SwiGLU's gate, which no cuBLASLt epilogue computes (+1, +1); the residual adds folded
 * into the rowwise products (beta 1; a separate add, fused with the norm after it, only under
 * tensor parallelism) (+0): 22 - 4 + 2 + 2 = 22, 9 forward and 13 backward. llm.c's AdamW is one
 * launch over every parameter, so a layer adds no optimizer launch. */
enum { LAYER_KERNEL_BUDGET = 22 };

typedef struct {
  opcount_t step;  /* the last of the steps run: it reads the values of all three */
  opcount_t quiet; /* the most host syncs of the steps before it, which do not read */
  int accum, read;
} counted_t;

static int read_at_3(void *arg, int step) { return step == 3; }

/* train.skip_*'s keys, on: one more launch per step (step_skip), none per layer. */
static const char *const skip_sets[] = {"train.skip_nonfinite=true", "train.skip_loss_z=6", "train.skip_grad_z=6"};

static counted_t count_steps(int layers, int accum, int skip) {
  char l[32], a[48];
  snprintf(l, sizeof l, "model.n_layers=%d", layers);
  snprintf(a, sizeof a, "train.global_batch_size=%d", 2 * accum);
  const char *sets[] = {l, a, "train.steps=3", "log.interval=100", "eval.interval=0", skip_sets[0], skip_sets[1],
                        skip_sets[2]};
  step_run_t r;
  char err[1024] = "";
  int rc = step_run_open(&r, sets, skip ? 8 : 5, 0, 1, NULL, err, sizeof err);
  if (rc) printf("  setup: %s\n", err);
  assert_int_equal(rc, 0);
  assert_int_equal(r.p.train.grad_accum_steps, accum);
  assert_int_equal(opprof_install(r.be, 0, NULL), 0);
  r.t.read_due = read_at_3; /* as the trainer reads at its log steps */
  train_result_t res;
  counted_t c = {.accum = accum};
  for (int s = 0; s < 3; s++) {
    rc = train_step(&r.t, s, &res, err, sizeof err);
    if (rc) printf("  step %d: %s\n", s + 1, err);
    assert_int_equal(rc, 0);
    opprof_counts(NULL, &c.step);
    if (s < 2 && c.step.host_syncs > c.quiet.host_syncs) c.quiet = c.step;
  }
  c.read = res.read;
  opprof_uninstall(r.be);
  step_run_close(&r);
  return c;
}

static void check(int accum) {
  counted_t one = count_steps(1, accum, 0), two = count_steps(2, accum, 0);
  long per_layer = (long)(two.step.kernels - one.step.kernels);
  printf("  %d micro-step(s): a step of 2 layers: %llu kernels, %llu B to device, %llu B to host; per layer per "
         "micro-step: %.1f kernels (budget %d); host syncs per step: %llu without a read (budget %d), %llu with the "
         "read of %d steps (budget %d)\n",
         accum, (unsigned long long)two.step.kernels, (unsigned long long)two.step.bytes_to_device,
         (unsigned long long)two.step.bytes_to_host, (double)per_layer / accum, LAYER_KERNEL_BUDGET,
         (unsigned long long)two.quiet.host_syncs, QUIET_SYNC_BUDGET, (unsigned long long)two.step.host_syncs,
         two.read, READ_SYNC_BUDGET);
  assert_true(per_layer > 0);
  assert_true(per_layer <= (long)LAYER_KERNEL_BUDGET * accum);
  assert_int_equal(two.read, 3);
  assert_true(two.quiet.host_syncs <= QUIET_SYNC_BUDGET && one.quiet.host_syncs <= QUIET_SYNC_BUDGET);
  assert_true(two.step.host_syncs <= READ_SYNC_BUDGET && one.step.host_syncs <= READ_SYNC_BUDGET);
}

static void test_one_micro_step(void **state) { check(1); }
static void test_four_micro_steps(void **state) { check(4); }

/* train.skip_* adds step_skip's one launch to a step, whatever the layers and micro-steps (the
 * counts of the last of three steps), and no host sync. */
static void test_skip_adds_one_launch(void **state) {
  for (int accum = 1; accum <= 2; accum++) {
    for (int layers = 1; layers <= 2; layers++) {
      counted_t off = count_steps(layers, accum, 0), on = count_steps(layers, accum, 1);
      const long more = (long)(on.step.kernels - off.step.kernels);
      printf("  %d layer(s), %d micro-step(s): a step's kernels %llu with train.skip_*, %llu without: %ld more "
             "(want 1); host syncs %llu and %llu\n", layers, accum, (unsigned long long)on.step.kernels,
             (unsigned long long)off.step.kernels, more, (unsigned long long)on.step.host_syncs,
             (unsigned long long)off.step.host_syncs);
      assert_int_equal(more, 1);
      assert_true(on.step.host_syncs == off.step.host_syncs);
    }
  }
}

/* A step that a device records once (a CUDA graph) and replays: after the first steps, the part
 * of each step train.c marks issues the same calls with the same arguments (pointers, scalars) as
 * the step two before (a step's batches are staged into one of two buffers in turn: a recording
 * per parity); and no host sync or allocation happens inside it. Under the
 * cosine schedule the learning rate changes at every step, so this fails where lr, the update
 * count or the step's record slot reach the kernels as arguments instead of device memory. */
static void replays(int accum, int skip) {
  char a[48];
  snprintf(a, sizeof a, "train.global_batch_size=%d", 2 * accum);
  const char *sets[] = {"model.n_layers=2", a, "train.steps=6", "train.warmup_steps=2", "log.interval=100",
                        "eval.interval=0", skip_sets[0], skip_sets[1], skip_sets[2]};
  step_run_t r;
  char err[1024] = "", msg[512] = "";
  int rc = step_run_open(&r, sets, skip ? 9 : 6, 0, 1, NULL, err, sizeof err);
  if (rc) printf("  setup: %s\n", err);
  assert_int_equal(rc, 0);
  assert_int_equal(opprof_install(r.be, 0, NULL), 0);
  opprof_replay_watch(1);
  r.t.read_due = read_at_3;
  const int back = 2;
  train_result_t res;
  int bad = 0;
  for (int s = 0; s < 6; s++) {
    rc = train_step(&r.t, s, &res, err, sizeof err);
    if (rc) printf("  step %d: %s\n", s + 1, err);
    assert_int_equal(rc, 0);
    if (s < 2 + back) continue; /* warm-up: the first steps allocate and build their tables */
    const int d = opprof_replay_diff(back, msg, sizeof msg);
    printf("  %d micro-step(s)%s, step %d against step %d: %s\n", accum, skip ? ", train.skip_*" : "", s + 1,
           s + 1 - back, msg);
    bad |= d != 0;
  }
  opprof_replay_watch(0);
  opprof_uninstall(r.be);
  step_run_close(&r);
  assert_false(bad);
}

static void test_step_replays_one_micro_step(void **state) { replays(1, 0); }
static void test_step_replays_two_micro_steps(void **state) { replays(2, 0); }
static void test_step_replays_with_skip(void **state) { replays(1, 1); }

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_one_micro_step),
      cmocka_unit_test(test_four_micro_steps),
      cmocka_unit_test(test_step_replays_one_micro_step),
      cmocka_unit_test(test_step_replays_two_micro_steps),
      cmocka_unit_test(test_step_replays_with_skip),
      cmocka_unit_test(test_skip_adds_one_launch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
