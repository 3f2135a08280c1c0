/* export: the `trainer export` program (see export.h). */
#include "trainer/run/export.h"

#include <cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/err.h"
#include "common/fs.h"
#include "common/log.h"
#include "trainer/formats/tokenizer.h"
#include "trainer/run/weights.h"

#define TOKENIZER_JSON_MAX (256u << 20)

/* Writes len bytes to dir/name through a temporary file and a rename. */
static int write_beside(const char *dir, const char *name, const char *data, size_t len, char *err, size_t errlen) {
  char path[PLAN_PATH_MAX + 64], tmp[PLAN_PATH_MAX + 96];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
  FILE *fp = fopen(tmp, "wb");
  if (!fp) return err_set(err, errlen, 1, "export error: cannot create %s: %s", tmp, strerror(errno));
  int failed = fwrite(data, 1, len, fp) != len;
  failed |= fclose(fp) != 0;
  if (failed || rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    return err_set(err, errlen, 1, "export error: cannot write %s: %s", path, strerror(e));
  }
  return 0;
}

/* A token's text for tokenizer_config.json, or JSON null. */
static void add_token(cJSON *o, const char *key, const tokenizer_t *t, int id) {
  size_t len = 0;
  const char *b = id >= 0 ? tokenizer_token_bytes(t, id, -1, &len) : NULL;
  char *s = b ? strndup(b, len) : NULL;
  if (s) cJSON_AddStringToObject(o, key, s);
  else cJSON_AddNullToObject(o, key);
  free(s);
}

/* The tokenizer that goes with an HF export: loaded and checked before anything is written. */
typedef struct {
  tokenizer_t *t;
  char *json; /* tokenizer.json's bytes (a tokenizer.bin's converted, or BOS put first); NULL when none */
  size_t len;
  int converted; /* json is llama2.c's tokenizer.bin converted */
} export_tok_t;

/* path: a tokenizer.json, a folder holding one, or a tokenizer.bin. Returns 0, 1 (cannot be
 * read) or 2 (more tokens than the model's vocabulary). */
static int tok_open(export_tok_t *x, const char *path, const plan_model_t *cfg, char *err, size_t errlen) {
  char json_path[PLAN_PATH_MAX + 32], why[512];
  struct stat sb;
  if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) snprintf(json_path, sizeof json_path, "%s/tokenizer.json", path);
  else snprintf(json_path, sizeof json_path, "%s", path);
  int rc = tokenizer_load_within(&x->t, path, cfg->vocab_size, why, sizeof why);
  if (rc) return err_set(err, errlen, rc == TOKENIZER_EVOCAB ? 2 : 1, "export error: %s", why);
  int r = fs_read_file(json_path, TOKENIZER_JSON_MAX, &x->json, &x->len, NULL);
  if (r) return err_set(err, errlen, 1, "export error: tokenizer %s: %s", json_path, strerror(-r));
  size_t i = 0;
  while (i < x->len && strchr(" \t\r\n", x->json[i])) i++;
  if (i == x->len || x->json[i] != '{') { /* llama2.c's tokenizer.bin: written as tokenizer.json */
    free(x->json);
    x->json = NULL;
    if (tokenizer_llama2c_json(x->t, &x->json, &x->len, why, sizeof why) == TOKENIZER_ENOMEM)
      return err_set(err, errlen, 1, "export error: %s", why);
    if (!x->json) log_warn("export: %s: %s; the HF folder gets no tokenizer", path, why);
    x->converted = x->json != NULL;
    return 0; /* the converted JSON puts <s> first */
  }
  /* trainer sample puts BOS before a prompt; transformers' tokenizer(text) must too */
  char *bos_first = NULL;
  size_t n = 0;
  r = tokenizer_json_bos_first(x->t, x->json, x->len, &bos_first, &n, why, sizeof why);
  if (r < 0) return err_set(err, errlen, 1, "export error: %s: %s", json_path, why);
  if (r == 1) {
    free(x->json);
    x->json = bos_first;
    x->len = n;
    log_info("export: %s: the exported tokenizer.json gets a post-processor that puts BOS (id %d) first, as trainer "
             "sample does",
             json_path, tokenizer_bos(x->t));
    if (why[0]) log_warn("export: %s: %s (trainer sample adds no token but BOS)", json_path, why);
  }
  return 0;
}

/* tokenizer.json, and a tokenizer_config.json naming BOS, EOS and the model's inputs, into out. */
static int tok_write(const export_tok_t *x, const plan_model_t *cfg, const char *out, char *err, size_t errlen) {
  if (!x->json) return 0;
  int rc = write_beside(out, "tokenizer.json", x->json, x->len, err, errlen);
  /* a converted tokenizer.bin is read back as what was written: its ids and BOS/EOS must be the
   * .bin's, and its BOS/EOS names (<s>, </s>) are the JSON's, not the .bin's "\n<s>\n" */
  tokenizer_t *names = x->t, *back = NULL;
  if (rc == 0 && x->converted) {
    char path[PLAN_PATH_MAX + 32], why[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", out);
    if (tokenizer_load(&back, path, why, sizeof why))
      rc = err_set(err, errlen, 1, "export error: the tokenizer.json written from llama2.c's does not read back: %s",
                   why);
    else if (tokenizer_vocab_size(back) != tokenizer_vocab_size(x->t) || tokenizer_bos(back) != tokenizer_bos(x->t) ||
             tokenizer_eos(back) != tokenizer_eos(x->t))
      rc = err_set(err, errlen, 1,
                   "export error: %s reads back as %d tokens, BOS %d, EOS %d; the tokenizer.bin has %d, %d, %d", path,
                   tokenizer_vocab_size(back), tokenizer_bos(back), tokenizer_eos(back), tokenizer_vocab_size(x->t),
                   tokenizer_bos(x->t), tokenizer_eos(x->t));
    names = back;
  }
  cJSON *o = rc == 0 ? cJSON_CreateObject() : NULL;
  char *text = NULL;
  if (o) {
    cJSON_AddStringToObject(o, "tokenizer_class", "PreTrainedTokenizerFast");
    add_token(o, "bos_token", names, tokenizer_bos(names));
    add_token(o, "eos_token", names, tokenizer_eos(names));
    size_t ul = 0;
    const char *unk = x->converted ? tokenizer_token_bytes(names, 0, -1, &ul) : NULL;
    if (unk && ul == 5 && memcmp(unk, "<unk>", 5) == 0) cJSON_AddStringToObject(o, "unk_token", "<unk>");
    cJSON_AddNumberToObject(o, "model_max_length", cfg->max_seq_len);
    /* what a Llama takes: without it tokenizer(text) adds token_type_ids, which generate refuses */
    cJSON_AddItemToObject(o, "model_input_names",
                          cJSON_CreateStringArray((const char *const[]){"input_ids", "attention_mask"}, 2));
    cJSON_AddFalseToObject(o, "clean_up_tokenization_spaces");
    text = cJSON_Print(o);
    cJSON_Delete(o);
  }
  char *line = text ? malloc(strlen(text) + 2) : NULL;
  if (rc == 0 && !line) rc = err_set(err, errlen, 1, "export error: out of memory");
  if (rc == 0) {
    size_t n = strlen(text);
    memcpy(line, text, n);
    line[n] = '\n';
    rc = write_beside(out, "tokenizer_config.json", line, n + 1, err, errlen);
  }
  free(line);
  if (text) cJSON_free(text);
  tokenizer_free(back);
  if (rc == 0)
    log_info("exported the tokenizer%s to %s/tokenizer.json and tokenizer_config.json",
             x->converted ? " (llama2.c's tokenizer.bin, converted)" : "", out);
  return rc;
}

/* An HF export without a tokenizer: a tokenizer.json or tokenizer_config.json left in out by an
 * earlier export belongs to other weights, and transformers would load it with these; removed,
 * with a warning naming each. */
static void drop_stale_tokenizer(const char *out) {
  static const char *const names[] = {"tokenizer.json", "tokenizer_config.json"};
  for (int i = 0; i < 2; i++) {
    char path[PLAN_PATH_MAX + 64];
    snprintf(path, sizeof path, "%s/%s", out, names[i]);
    if (unlink(path) == 0)
      log_warn("export: removed %s, left by an earlier export: these weights come with no tokenizer", path);
    else if (errno != ENOENT)
      log_warn("export: %s is left from an earlier export and cannot be removed: %s", path, strerror(errno));
  }
}

int export_run(const plan_t *p, const char *path, int plan_file, const char *const *sets, int nsets,
               const char *format, const char *out, char *err, size_t errlen) {
  weights_file_t *f = NULL;
  plan_model_t cfg;
  export_tok_t tok = {0};
  int rc = weights_open(&f, path, err, errlen);
  if (rc == 0) rc = weights_resolve_model(f, &p->model, plan_file, sets, nsets, &cfg, err, errlen);
  if (rc == 0 && !strcmp(format, "hf")) { /* the tokenizer, when one is known (export.h) */
    const plan_data_t *fd = plan_file ? NULL : weights_data(f);
    const char *tp = p->data.tokenizer[0] ? p->data.tokenizer
                     : fd && fd->tokenizer[0] ? fd->tokenizer
                                              : weights_tokenizer(f);
    if (tp) rc = tok_open(&tok, tp, &cfg, err, errlen);
  }
  /* the tokenizer's BOS and EOS go into config.json even when its file does not go along
   * (llama2.c's tokenizer.bin): they are the ids generation starts from and stops at */
  const int bos = tok.t ? tokenizer_bos(tok.t) : -1, eos = tok.t ? tokenizer_eos(tok.t) : -1;
  if (rc == 0) rc = weights_export(f, &cfg, format, bos, eos, out, err, errlen);
  if (rc == 0) rc = tok_write(&tok, &cfg, out, err, errlen);
  if (rc == 0 && !strcmp(format, "hf") && !tok.json) drop_stale_tokenizer(out);
  free(tok.json);
  tokenizer_free(tok.t);
  weights_close(f);
  return rc;
}
