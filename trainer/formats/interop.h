/* interop: our Llama's weights to and from two outside formats.
 *
 * - llama2.c, version 0 ("legacy"): a header of seven int32 (dim, hidden_dim, n_layers, n_heads,
 *   n_kv_heads, vocab_size, seq_len), then float32 arrays in the order token_embedding, rms_att
 *   (all layers), wq, wk, wv, wo (all layers each), rms_ffn, w1, w2, w3, rms_final, the RoPE
 *   tables freq_cis real and imaginary (seq_len x head_size/2 each), then the classifier when
 *   vocab_size is negative (unshared). The file has no magic; it is recognized by its exact size.
 *   Meta's layout: wq/wk rows of a head are adjacent RoPE pairs, exactly our model's layout.
 * - Hugging Face Llama (LlamaForCausalLM): a directory with config.json and model.safetensors,
 *   names model.embed_tokens.weight, model.layers.i.self_attn.{q,k,v,o}_proj.weight,
 *   model.layers.i.mlp.{gate,up,down}_proj.weight (= our w1, w3, w2),
 *   model.layers.i.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight.
 *   HF's RoPE rotates the two halves of a head, so the rows of wq and wk are permuted per head:
 *   our (Meta) row 2i of a head is HF row i, our row 2i+1 is HF row i + head_size/2.
 *
 * Our output layer is untied. Import of a shared classifier (llama2.c vocab_size > 0, HF
 * tie_word_embeddings true or no lm_head) copies the embedding into output.weight. Export to
 * llama2.c writes a shared classifier (positive vocab_size, no classifier array) exactly when
 * output.weight equals tok_embeddings.weight bit for bit, otherwise a negative vocab_size and
 * the classifier; export to HF always writes lm_head.weight with tie_word_embeddings false.
 * RoPE tables are written on llama2.c export (cos/sin of t * theta^(-2i/head_size), computed in
 * double) and ignored on import: the model computes RoPE itself.
 *
 * What it is not: a converter of dtypes (float32 only; bf16/f16 HF files are refused), of sharded
 * HF checkpoints (model-0000x-of-0000y.safetensors), of llama2.c versions 1 and 2 (magic "ak42",
 * refused with a message), or of tokenizers. Every error is one line "interop error: <file>: ..."
 * in the caller's buffer. */
#ifndef MESHRUN_INTEROP_H
#define MESHRUN_INTEROP_H

#include <stddef.h>

#include "trainer/model/model.h"
#include "trainer/plan/plan.h"

typedef enum {
  INTEROP_AUTO = 0, /* by content (interop_detect) */
  INTEROP_MESHRUN,  /* our own safetensors (trainer's weights files); not opened by interop_open */
  INTEROP_LLAMA2C,
  INTEROP_HF
} interop_format_t;

enum {
  INTEROP_OK = 0,
  INTEROP_EINVAL = -1,   /* bad argument (unknown format name, NULL) */
  INTEROP_EIO = -2,      /* open/read/write failed (errno text in the message) */
  INTEROP_ECORRUPT = -3, /* the file is not a valid file of its format */
  INTEROP_ENOMEM = -4,
  INTEROP_EMISMATCH = -5, /* the file's model is not the plan's model */
};

typedef struct interop_file interop_file_t;

/* "llama2c" | "hf" | "meshrun" | "auto". Returns 0 or INTEROP_EINVAL. */
int interop_format_parse(const char *name, interop_format_t *out);
const char *interop_format_name(interop_format_t f);
/* The format INTEROP_AUTO means for path (never INTEROP_AUTO), from what is there: a directory
 * or a JSON file (config.json) is HF, a safetensors file is HF when it holds
 * model.embed_tokens.weight and ours otherwise, any other file llama2.c (checked when opened).
 * A path that does not exist is judged by its name (.safetensors ours, config.json or
 * model.safetensors HF, else llama2.c). */
interop_format_t interop_detect(const char *path);

/* Opens a llama2.c file or an HF directory (path may also name the directory's config.json),
 * validates it completely (header, sizes, every tensor's shape) and fills the model config it
 * implies: dims, hidden_dim (explicit), max_seq_len, rope_theta, norm_eps; init = path. */
int interop_open(interop_file_t **out, const char *path, interop_format_t fmt, char *err, size_t errlen);
void interop_close(interop_file_t *f); /* accepts NULL */
const plan_model_t *interop_config(const interop_file_t *f);
interop_format_t interop_file_format(const interop_file_t *f);

/* Checks that the plan's model is the file's: dim, n_layers, n_heads, n_kv_heads, vocab_size,
 * hidden_dim, rope_theta and norm_eps (relative 1e-6). max_seq_len is not checked (RoPE is
 * computed for any length). Returns 0 or INTEROP_EMISMATCH with e.g.
 * "interop error: stories260K.bin: n_kv_heads 4 but the plan says 2 (set model.n_kv_heads=4)". */
int interop_check_plan(const interop_file_t *f, const plan_model_t *plan, char *err, size_t errlen);
/* The comparison behind interop_check_plan, of any two models: file's (what a weights file
 * holds) against plan's, on every field it checks or (key not NULL) on that field only
 * ("dim", "norm_eps", ...; other keys compare nothing). Returns 0 when they agree, else 1 with
 * "dim 64 but the plan says 128 (set model.dim=64)" in msg. */
int interop_model_diff(const plan_model_t *file, const plan_model_t *plan, const char *key, char *msg, size_t len);

/* Copies the full tensor of our name (e.g. "layers.0.attention.wq.weight") into dst, numel
 * floats, in our layout (HF wq/wk rows un-permuted; output.weight from the embedding when the
 * classifier is shared). Returns 0, INTEROP_EINVAL (unknown name) or INTEROP_EMISMATCH (numel). */
int interop_read_tensor(interop_file_t *f, const char *name, float *dst, size_t numel, char *err, size_t errlen);

/* Sets every parameter of m from f through model_import_tensor (each rank keeps its tp slice).
 * Every unit must hold its full local parameters (flat buffers, or gathered by the caller).
 * Checks each tensor's full shape. Returns 0 or a negative code. */
int interop_load_model(interop_file_t *f, model_t *m, char *err, size_t errlen);

/* Export. A source hands out full tensors by our name, numel floats (NULL: not there). */
typedef const float *(*interop_get_fn)(void *ctx, const char *name, size_t numel);
/* Writes cfg's model from get to out: a llama2.c file, or an HF directory (created if needed;
 * config.json and model.safetensors inside). bos_id and eos_id, the ids of the tokenizer that
 * goes with the weights (-1: none known), are what an HF directory's config.json records
 * (null when -1), and its generation_config.json, written when either is known, so that
 * transformers' generate stops where `trainer sample` does; llama2.c files have no place for
 * them. interop_export_weights and interop_export_model know no tokenizer (-1, -1). */
int interop_export(const plan_model_t *cfg, interop_get_fn get, void *ctx, interop_format_t fmt, int bos_id,
                   int eos_id, const char *out, char *err, size_t errlen);
/* From our safetensors weights file (what the trainer saves): `trainer export`. */
int interop_export_weights(const plan_model_t *cfg, const char *weights, interop_format_t fmt, const char *out,
                           char *err, size_t errlen);
/* From a live model, through model_export_tensor (units must hold their parameters). Collective
 * over the tp group as model_export_tensor is: every tp rank calls it, and only the one that
 * writes passes out; the others pass out NULL and only take part in the gathers. */
int interop_export_model(model_t *m, const plan_model_t *cfg, interop_format_t fmt, const char *out, char *err,
                         size_t errlen);

#endif
