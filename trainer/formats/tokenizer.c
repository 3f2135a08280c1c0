/* tokenizer: see tokenizer.h for what it reads and what it refuses.
 *
 * Both kinds share one representation once loaded: per id, the bytes it decodes to (dec) and,
 * for ids that merges can make, a lookup key (key: the raw bytes of a byte-level token, the piece
 * of a llama2.c token) indexed by a hash map. Both encode by the same merge loop over a linked
 * list of symbols with a binary heap of candidate pairs ordered by (priority, position): BPE's
 * priority is the merge's rank, llama2.c's the negated score of the merged piece. Taking the best
 * candidate, leftmost among equals, after dropping those a previous merge made stale, is exactly
 * "merge the best adjacent pair, leftmost first, until none" (what both the library and run.c
 * do), at n log n instead of run.c's n squared; run.c encodes prompts, we encode corpora.
 *
 * tokenizer.json encoding order, as the library's: added tokens are cut out of the input first
 * (those with normalized false, then those with normalized true, in the pieces between); each
 * remaining piece goes through the pre-tokenizers in order (Split: the regex's matches and the
 * gaps between them are each a piece; ByteLevel: a space prepended with add_prefix_space, then
 * GPT-2's regex when use_regex), and each final piece ("word") through BPE. Words repeat, so a
 * per-call cache keeps each word's ids. Regex subjects are the piece itself, so a lookahead such
 * as \s+(?!\S) sees the end of the piece (before a special token) as the end of the text. */
#include "trainer/formats/tokenizer.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "common/err.h"
#include "common/fs.h"

#define TOK_MAX_FILE (1u << 30) /* 1 GiB; Llama 3's tokenizer.json is 9 MB */
#define TOK_MAX_ID (1 << 24)    /* ids past this are refused: the tables are per id */
#define TOK_NO_PIECE UINT32_MAX /* dec_len/key_len of an id the file does not define */
#define CACHE_MAX_WORD 256      /* longer words are not cached */
#define CACHE_MAX_WORDS (1u << 18)

/* GPT-2's pre-tokenizer regex (the library's ByteLevel with use_regex). */
static const char GPT2_PATTERN[] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef enum { TOK_BPE = 0, TOK_LLAMA2C = 1 } tok_kind_t;

/* A string -> int32 hash map; keys are (offset, length) in an arena the caller passes to every
 * call, so the arena may grow (realloc) under it. Open addressing, linear probing; h == 0 marks
 * an empty slot. */
typedef struct {
  uint64_t h;
  uint32_t off, len;
  int32_t val;
} sslot_t;
typedef struct {
  sslot_t *slot;
  size_t cap, n; /* cap a power of two */
} smap_t;

/* (left id, right id) -> (rank, merged id). id < 0 marks an empty slot. */
typedef struct {
  uint64_t key;
  int32_t rank, id;
} pslot_t;
typedef struct {
  pslot_t *slot;
  size_t cap, n;
} pmap_t;

typedef struct {
  char *content;
  size_t len;
  int32_t id;
  int lstrip, rstrip, normalized;
} added_t;

typedef enum { PRE_SPLIT, PRE_BYTELEVEL, PRE_METASPACE } pre_kind_t;
typedef enum { PREPEND_NEVER, PREPEND_ALWAYS, PREPEND_FIRST } prepend_t;
typedef struct {
  pre_kind_t kind;
  pcre2_code *re;       /* Split's pattern; ByteLevel's GPT-2 regex, NULL without use_regex */
  int add_prefix_space; /* ByteLevel */
  char rep[8];          /* Metaspace: the replacement character's UTF-8 ("▁") */
  size_t rep_len;
  prepend_t prepend; /* Metaspace: when the piece gets a replacement in front */
  int split;         /* Metaspace: each replacement starts a new word */
} pre_t;

/* A normalizer step: Prepend (from NULL) or Replace of a literal string. */
typedef struct {
  char *from, *to;
  size_t from_len, to_len;
} norm_t;

struct tokenizer {
  tok_kind_t kind;
  int32_t vocab_size, bos, eos;
  /* Per id (vocab_size): decoded bytes dec_buf[dec_off[i] .. + dec_len[i]), NUL after each. */
  uint32_t *dec_off, *dec_len;
  char *dec_buf;
  /* Per id: lookup key key_buf[key_off[i] .. + key_len[i]); keys maps key -> id. */
  uint32_t *key_off, *key_len;
  char *key_buf;
  size_t max_key; /* the longest key */
  smap_t keys;

  /* tokenizer.json */
  int32_t byte_id[256]; /* the token of each single byte, -1 when the vocab lacks it */
  pmap_t merges;
  int32_t unk_id; /* -1 when none */
  int fuse_unk, ignore_merges;
  added_t *added;
  int n_added;
  int *added_by_byte;   /* indices into added, by first byte then longest first */
  int added_start[257]; /* added_by_byte[added_start[b] .. added_start[b+1]) start with b */
  pre_t *pre;
  int n_pre;
  norm_t *norm; /* the normalizer's steps, in order */
  int n_norm;
  /* sentencepiece-style tokenizer.json: a word's symbols are its UTF-8 characters (the vocab's
   * strings as they are), a character the vocab lacks its <0xNN> tokens with byte_fallback */
  int spm, byte_fallback;
  int32_t fallback_id[256]; /* <0xNN>'s id, -1 when the vocab lacks it */
  int strip_first;          /* decoder Strip/Metaspace: the first token loses a leading space */

  /* llama2.c */
  float *score;     /* (vocab_size) */
  uint8_t *is_byte; /* (vocab_size) 1 for <0xNN> pieces */
  int32_t space_id; /* the dummy prefix " ", -1 when the vocab lacks it */
};

/* ---------------------------------------------------------------- small containers */

typedef struct {
  int32_t *v;
  size_t n, cap;
} ids_t;

static int ids_push(ids_t *a, int32_t x) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 256;
    int32_t *v = realloc(a->v, cap * sizeof *v);
    if (!v) return TOKENIZER_ENOMEM;
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n++] = x;
  return 0;
}

static int buf_reserve(char **b, size_t *cap, size_t need) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap : 4096;
  while (c < need) c *= 2;
  char *nb = realloc(*b, c);
  if (!nb) return TOKENIZER_ENOMEM;
  *b = nb;
  *cap = c;
  return 0;
}

static uint64_t hash_bytes(const void *p, size_t n) {
  const unsigned char *s = p;
  uint64_t h = 1469598103934665603ull; /* FNV-1a 64 */
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
  return h ? h : 1;
}

static int smap_grow(smap_t *m) {
  size_t cap = m->cap ? m->cap * 2 : 1024;
  sslot_t *s = calloc(cap, sizeof *s);
  if (!s) return TOKENIZER_ENOMEM;
  for (size_t i = 0; i < m->cap; i++) {
    if (!m->slot[i].h) continue;
    size_t j = m->slot[i].h & (cap - 1);
    while (s[j].h) j = (j + 1) & (cap - 1);
    s[j] = m->slot[i];
  }
  free(m->slot);
  m->slot = s;
  m->cap = cap;
  return 0;
}

/* The value stored for key k (n bytes), or -1 when there is none. */
static int32_t smap_find(const smap_t *m, const char *arena, const void *k, size_t n) {
  if (!m->cap) return -1;
  uint64_t h = hash_bytes(k, n);
  for (size_t j = h & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
    const sslot_t *s = &m->slot[j];
    if (!s->h) return -1;
    if (s->h == h && s->len == n && memcmp(arena + s->off, k, n) == 0) return s->val;
  }
}

/* Adds key arena[off .. off+len) -> val unless the key is there already (the first one stays).
 * Returns 0, 1 when the key was there, or TOKENIZER_ENOMEM. */
static int smap_add(smap_t *m, const char *arena, uint32_t off, uint32_t len, int32_t val) {
  if ((m->n + 1) * 2 > m->cap && smap_grow(m)) return TOKENIZER_ENOMEM;
  uint64_t h = hash_bytes(arena + off, len);
  size_t j = h & (m->cap - 1);
  for (; m->slot[j].h; j = (j + 1) & (m->cap - 1))
    if (m->slot[j].h == h && m->slot[j].len == len && memcmp(arena + m->slot[j].off, arena + off, len) == 0) return 1;
  m->slot[j] = (sslot_t){.h = h, .off = off, .len = len, .val = val};
  m->n++;
  return 0;
}

static void smap_free(smap_t *m) {
  free(m->slot);
  *m = (smap_t){0};
}

static uint64_t mix64(uint64_t x) { /* splitmix64's finalizer */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }

static int pmap_grow(pmap_t *m) {
  size_t cap = m->cap ? m->cap * 2 : 1024;
  pslot_t *s = malloc(cap * sizeof *s);
  if (!s) return TOKENIZER_ENOMEM;
  for (size_t i = 0; i < cap; i++) s[i].id = -1;
  for (size_t i = 0; i < m->cap; i++) {
    if (m->slot[i].id < 0) continue;
    size_t j = mix64(m->slot[i].key) & (cap - 1);
    while (s[j].id >= 0) j = (j + 1) & (cap - 1);
    s[j] = m->slot[i];
  }
  free(m->slot);
  m->slot = s;
  m->cap = cap;
  return 0;
}

/* Sets (a, b) -> (rank, id); a pair listed twice keeps its last rank, as the library's map. */
static int pmap_put(pmap_t *m, int32_t a, int32_t b, int32_t rank, int32_t id) {
  if ((m->n + 1) * 2 > m->cap && pmap_grow(m)) return TOKENIZER_ENOMEM;
  uint64_t k = pair_key(a, b);
  size_t j = mix64(k) & (m->cap - 1);
  for (; m->slot[j].id >= 0; j = (j + 1) & (m->cap - 1))
    if (m->slot[j].key == k) break;
  if (m->slot[j].id < 0) m->n++;
  m->slot[j] = (pslot_t){.key = k, .rank = rank, .id = id};
  return 0;
}

static const pslot_t *pmap_get(const pmap_t *m, int32_t a, int32_t b) {
  if (!m->cap) return NULL;
  uint64_t k = pair_key(a, b);
  for (size_t j = mix64(k) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
    if (m->slot[j].id < 0) return NULL;
    if (m->slot[j].key == k) return &m->slot[j];
  }
}

/* ---------------------------------------------------------------- byte-level alphabet */

/* GPT-2's bytes_to_unicode: printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for
 * themselves, the other 68 for U+0100 onwards in byte order. */
static void byte_level_tables(uint32_t cp_of[256], int16_t byte_of[324]) {
  int n = 0;
  for (int c = 0; c < 324; c++) byte_of[c] = -1;
  for (int b = 0; b < 256; b++) {
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cp_of[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
    byte_of[cp_of[b]] = (int16_t)b;
  }
}

/* Decodes one UTF-8 character of s[0..n) into *cp; returns its length, 0 when invalid. */
static size_t utf8_next(const unsigned char *s, size_t n, uint32_t *cp) {
  if (n == 0) return 0;
  unsigned c = s[0];
  size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
  if (len == 0 || len > n) return 0;
  uint32_t v = len == 1 ? c : c & (0x7Fu >> len);
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xC0) != 0x80) return 0;
    v = v << 6 | (s[i] & 0x3F);
  }
  *cp = v;
  return len;
}

/* Unicode White_Space, what Rust's char::is_whitespace (the library's lstrip/rstrip) tests. */
static int is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* ---------------------------------------------------------------- the merge loop */

typedef struct {
  int32_t id, prev, next; /* id -1 once merged into its left neighbour */
} sym_t;

typedef struct {
  double pri; /* lower merges first */
  int32_t left, right, a, b, id;
} cand_t;

/* Per-call encoding state: nothing in tokenizer_t changes while encoding. */
typedef struct {
  const tokenizer_t *t;
  ids_t out;
  sym_t *sym;
  size_t nsym, symcap;
  cand_t *heap;
  size_t nheap, heapcap;
  char *scratch; /* a piece with its prefix space; llama2.c's concatenated pair */
  size_t scratchcap;
  char *norm; /* the normalized piece (pass 1), norm_len bytes */
  size_t normcap, norm_len;
  char *meta; /* a piece after Metaspace */
  size_t metacap;
  const char *orig;  /* the text given to tokenizer_encode */
  const char *start; /* where the normalized piece that begins the text begins, else NULL */
  smap_t cache; /* word -> index into cache_at */
  char *cache_keys;
  size_t cache_keys_n, cache_keys_cap;
  uint32_t *cache_at; /* (2 per word) offset and count in cache_ids */
  size_t cache_at_n, cache_at_cap;
  ids_t cache_ids;
  pcre2_match_data **md; /* one per pre-tokenizer (they nest) */
  pcre2_match_context *mctx;
  pcre2_jit_stack *jit;
  char *err;
  size_t errlen;
} enc_t;

static int cand_less(const cand_t *x, const cand_t *y) {
  return x->pri < y->pri || (x->pri == y->pri && x->left < y->left);
}

static int heap_push(enc_t *e, cand_t c) {
  if (e->nheap == e->heapcap) {
    size_t cap = e->heapcap ? e->heapcap * 2 : 256;
    cand_t *h = realloc(e->heap, cap * sizeof *h);
    if (!h) return TOKENIZER_ENOMEM;
    e->heap = h;
    e->heapcap = cap;
  }
  size_t i = e->nheap++;
  while (i > 0 && cand_less(&c, &e->heap[(i - 1) / 2])) {
    e->heap[i] = e->heap[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  e->heap[i] = c;
  return 0;
}

static cand_t heap_pop(enc_t *e) {
  cand_t top = e->heap[0], last = e->heap[--e->nheap];
  size_t i = 0, n = e->nheap;
  for (;;) {
    size_t l = 2 * i + 1, best = i;
    const cand_t *bc = &last;
    if (l < n && cand_less(&e->heap[l], bc)) best = l, bc = &e->heap[l];
    if (l + 1 < n && cand_less(&e->heap[l + 1], bc)) best = l + 1;
    if (best == i) break;
    e->heap[i] = e->heap[best];
    i = best;
  }
  if (n) e->heap[i] = last;
  return top;
}

static int sym_push(enc_t *e, int32_t id) {
  if (e->nsym == e->symcap) {
    size_t cap = e->symcap ? e->symcap * 2 : 256;
    sym_t *s = realloc(e->sym, cap * sizeof *s);
    if (!s) return TOKENIZER_ENOMEM;
    e->sym = s;
    e->symcap = cap;
  }
  int32_t i = (int32_t)e->nsym++;
  e->sym[i] = (sym_t){.id = id, .prev = i - 1, .next = -1};
  if (i > 0) e->sym[i - 1].next = i;
  return 0;
}

/* The merge of ids a and b, if there is one: its id and priority; -1 when there is none. */
static int32_t pair_merge(enc_t *e, int32_t a, int32_t b, double *pri) {
  const tokenizer_t *t = e->t;
  if (t->kind == TOK_BPE) {
    const pslot_t *m = pmap_get(&t->merges, a, b);
    if (!m) return -1;
    *pri = m->rank;
    return m->id;
  }
  /* llama2.c: the concatenated pieces, if that is a piece (none is longer than max_key). */
  uint32_t la = t->key_len[a], lb = t->key_len[b];
  if ((size_t)la + lb > t->max_key) return -1;
  memcpy(e->scratch, t->key_buf + t->key_off[a], la);
  memcpy(e->scratch + la, t->key_buf + t->key_off[b], lb);
  int32_t id = smap_find(&t->keys, t->key_buf, e->scratch, (size_t)la + lb);
  if (id < 0) return -1;
  *pri = -(double)t->score[id];
  return id;
}

static int push_pair(enc_t *e, int32_t left, int32_t right) {
  double pri;
  int32_t a = e->sym[left].id, b = e->sym[right].id;
  int32_t id = pair_merge(e, a, b, &pri);
  if (id < 0) return 0;
  return heap_push(e, (cand_t){.pri = pri, .left = left, .right = right, .a = a, .b = b, .id = id});
}

/* Merges e->sym[0..nsym) until no pair merges, then appends the ids to out and, when not NULL,
 * to also (the word cache's ids). Symbol 0 is never merged away: merges keep the left one. */
static int merge_and_emit(enc_t *e, ids_t *also) {
  int rc;
  e->nheap = 0;
  for (size_t i = 0; i + 1 < e->nsym; i++)
    if ((rc = push_pair(e, (int32_t)i, (int32_t)i + 1))) return rc;
  while (e->nheap) {
    cand_t c = heap_pop(e);
    sym_t *l = &e->sym[c.left], *r = &e->sym[c.right];
    if (l->id != c.a || l->next != c.right || r->id != c.b) continue; /* stale */
    l->id = c.id;
    l->next = r->next;
    if (r->next >= 0) e->sym[r->next].prev = c.left;
    r->id = -1;
    if (l->prev >= 0 && (rc = push_pair(e, l->prev, c.left))) return rc;
    if (l->next >= 0 && (rc = push_pair(e, c.left, l->next))) return rc;
  }
  for (int32_t i = e->nsym ? 0 : -1; i >= 0; i = e->sym[i].next) {
    if ((rc = ids_push(&e->out, e->sym[i].id))) return rc;
    if (also && (rc = ids_push(also, e->sym[i].id))) return rc;
  }
  return 0;
}

/* ---------------------------------------------------------------- tokenizer.json encoding */

/* BPE of one word (bytes after pre-tokenization). */
static int bpe_word(enc_t *e, const char *p, size_t n) {
  const tokenizer_t *t = e->t;
  int rc;
  if (n == 0) return 0;
  int32_t hit = smap_find(&e->cache, e->cache_keys, p, n);
  if (hit >= 0) {
    const uint32_t *at = &e->cache_at[2 * (size_t)hit];
    for (uint32_t i = 0; i < at[1]; i++)
      if ((rc = ids_push(&e->out, e->cache_ids.v[at[0] + i]))) return rc;
    return 0;
  }
  if (t->ignore_merges) { /* a word that is a token is that token, whatever the merges say */
    int32_t id = smap_find(&t->keys, t->key_buf, p, n);
    if (id >= 0) return ids_push(&e->out, id);
  }
  /* One symbol per byte (per character of the byte-level string); sentencepiece-style, one per
   * UTF-8 character, or its <0xNN> tokens when the vocab lacks it (byte_fallback, all of its
   * bytes there). What is left becomes unk_token (consecutive ones one unk with fuse_unk) or,
   * without one, is dropped. An invalid UTF-8 byte is a character of its own. */
  e->nsym = 0;
  int last_unk = 0;
  for (size_t i = 0, l; i < n; i += l) {
    uint32_t cp;
    l = t->spm ? utf8_next((const unsigned char *)p + i, n - i, &cp) : 1;
    l = l ? l : 1;
    int32_t id = t->spm ? smap_find(&t->keys, t->key_buf, p + i, l) : t->byte_id[(unsigned char)p[i]];
    if (id < 0 && t->byte_fallback) {
      size_t k = 0;
      while (k < l && t->fallback_id[(unsigned char)p[i + k]] >= 0) k++;
      if (k == l) {
        for (k = 0; k < l; k++)
          if ((rc = sym_push(e, t->fallback_id[(unsigned char)p[i + k]]))) return rc;
        last_unk = 0;
        continue;
      }
    }
    if (id < 0) {
      if (t->unk_id < 0 || (t->fuse_unk && last_unk)) continue;
      id = t->unk_id;
      last_unk = 1;
    } else {
      last_unk = 0;
    }
    if ((rc = sym_push(e, id))) return rc;
  }
  int cache_it = n <= CACHE_MAX_WORD && e->cache.n < CACHE_MAX_WORDS;
  size_t first = e->cache_ids.n;
  if ((rc = merge_and_emit(e, cache_it ? &e->cache_ids : NULL))) return rc;
  if (!cache_it) return 0;
  if (buf_reserve(&e->cache_keys, &e->cache_keys_cap, e->cache_keys_n + n)) return TOKENIZER_ENOMEM;
  if (e->cache_at_n + 2 > e->cache_at_cap) {
    size_t cap = e->cache_at_cap ? e->cache_at_cap * 2 : 1024;
    uint32_t *a = realloc(e->cache_at, cap * sizeof *a);
    if (!a) return TOKENIZER_ENOMEM;
    e->cache_at = a;
    e->cache_at_cap = cap;
  }
  memcpy(e->cache_keys + e->cache_keys_n, p, n);
  int32_t idx = (int32_t)(e->cache_at_n / 2);
  e->cache_at[e->cache_at_n++] = (uint32_t)first;
  e->cache_at[e->cache_at_n++] = (uint32_t)(e->cache_ids.n - first);
  rc = smap_add(&e->cache, e->cache_keys, (uint32_t)e->cache_keys_n, (uint32_t)n, idx);
  e->cache_keys_n += n;
  return rc < 0 ? rc : 0;
}

static int pre_run(enc_t *e, int step, const char *p, size_t n);

/* Pieces that step `next` of the pipeline (or BPE, past the last) takes. */
static int pre_next(enc_t *e, int next, const char *p, size_t n) {
  if (n == 0) return 0;
  return next < e->t->n_pre ? pre_run(e, next, p, n) : bpe_word(e, p, n);
}

/* Split with behavior Isolated: each match is a piece, and so is each gap between matches. */
static int split_isolated(enc_t *e, const pcre2_code *re, int step, int next, const char *p, size_t n) {
  pcre2_match_data *md = e->md[step];
  size_t off = 0, last = 0;
  int rc;
  while (off <= n) {
    int m = pcre2_match(re, (PCRE2_SPTR)p, n, off, 0, md, e->mctx);
    if (m == PCRE2_ERROR_NOMATCH) break;
    if (m < 0) {
      PCRE2_UCHAR msg[120];
      pcre2_get_error_message(m, msg, sizeof msg);
      return err_set(e->err, e->errlen, TOKENIZER_EINVAL, "tokenizer: regex match failed in a piece of %zu bytes: %s",
                     n, (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    size_t s = ov[0], end = ov[1];
    if (s > last && (rc = pre_next(e, next, p + last, s - last))) return rc;
    if (end > s && (rc = pre_next(e, next, p + s, end - s))) return rc;
    if (end > s) {
      last = off = end;
    } else { /* an empty match: step over one character (or one invalid byte) */
      uint32_t cp;
      size_t l = utf8_next((const unsigned char *)p + s, n - s, &cp);
      off = s + (l ? l : 1);
      last = last > s ? last : s;
    }
  }
  if (last < n && (rc = pre_next(e, next, p + last, n - last))) return rc;
  return 0;
}

/* Metaspace (always last): spaces become the replacement, which is put in front as prepend
 * says (unless the piece starts with one); with split, each replacement starts a new word. */
static int metaspace(enc_t *e, const pre_t *s, const char *p, size_t n) {
  int front = (s->prepend == PREPEND_ALWAYS || (s->prepend == PREPEND_FIRST && p == e->start)) && p[0] != ' ' &&
              !(n >= s->rep_len && memcmp(p, s->rep, s->rep_len) == 0);
  if (buf_reserve(&e->meta, &e->metacap, (n + 1) * s->rep_len)) return TOKENIZER_ENOMEM;
  size_t k = 0;
  if (front) memcpy(e->meta, s->rep, s->rep_len), k = s->rep_len;
  for (size_t i = 0; i < n; i++) {
    if (p[i] == ' ') memcpy(e->meta + k, s->rep, s->rep_len), k += s->rep_len;
    else e->meta[k++] = p[i];
  }
  if (!s->split) return bpe_word(e, e->meta, k);
  size_t last = 0;
  int rc;
  for (size_t i = 1; i + s->rep_len <= k; i++) {
    if (memcmp(e->meta + i, s->rep, s->rep_len) != 0) continue;
    if ((rc = bpe_word(e, e->meta + last, i - last))) return rc;
    last = i;
    i += s->rep_len - 1;
  }
  return bpe_word(e, e->meta + last, k - last);
}

static int pre_run(enc_t *e, int step, const char *p, size_t n) {
  const pre_t *s = &e->t->pre[step];
  if (s->kind == PRE_SPLIT) return split_isolated(e, s->re, step, step + 1, p, n);
  if (s->kind == PRE_METASPACE) return metaspace(e, s, p, n);
  /* ByteLevel (always last): the prefix space, then GPT-2's regex or the piece as one word. */
  if (s->add_prefix_space && p[0] != ' ') {
    if (buf_reserve(&e->scratch, &e->scratchcap, n + 1)) return TOKENIZER_ENOMEM;
    e->scratch[0] = ' ';
    memcpy(e->scratch + 1, p, n);
    p = e->scratch;
    n++;
  }
  if (s->re) return split_isolated(e, s->re, step, step + 1, p, n);
  return bpe_word(e, p, n);
}

/* The normalizer's steps over p[0..n) into e->norm (e->meta the other buffer of each step):
 * Prepend puts its string in front of a non-empty piece, Replace every occurrence of its string,
 * left to right, without overlap. */
static int normalize(enc_t *e, const char *p, size_t n) {
  const tokenizer_t *t = e->t;
  for (int s = 0; s < t->n_norm; s++) {
    const norm_t *st = &t->norm[s];
    size_t most = st->from ? n * (st->to_len > st->from_len ? st->to_len : 1) + 1 : n + st->to_len;
    if (buf_reserve(&e->meta, &e->metacap, most + 1)) return TOKENIZER_ENOMEM;
    size_t k = 0;
    if (!st->from) {
      if (n) memcpy(e->meta, st->to, st->to_len), k = st->to_len;
      memcpy(e->meta + k, p, n), k += n;
    } else {
      for (size_t i = 0; i < n;) {
        if (n - i >= st->from_len && memcmp(p + i, st->from, st->from_len) == 0) {
          memcpy(e->meta + k, st->to, st->to_len), k += st->to_len;
          i += st->from_len;
        } else {
          e->meta[k++] = p[i++];
        }
      }
    }
    char *b = e->norm; /* the result becomes e->norm, the old e->norm the next step's output */
    size_t c = e->normcap;
    e->norm = e->meta, e->normcap = e->metacap;
    e->meta = b, e->metacap = c;
    p = e->norm;
    n = k;
  }
  e->norm_len = n;
  return 0;
}

/* Cuts the added tokens of this pass out of p[0..n): pass 0 those with normalized false, pass 1
 * those with normalized true; what remains goes to the next pass, then to the pre-tokenizers.
 * At each position the longest token wins; lstrip/rstrip take the whitespace beside a match
 * into it (not past the previous match). */
static int encode_text(enc_t *e, int pass, const char *p, size_t n) {
  const tokenizer_t *t = e->t;
  int rc;
  if (n == 0) return 0;
  if (pass == 2) return t->n_pre ? pre_run(e, 0, p, n) : bpe_word(e, p, n);
  if (pass == 1) { /* a piece between non-normalized added tokens: normalized */
    int first = p == e->orig;
    if (t->n_norm) {
      if ((rc = normalize(e, p, n))) return rc;
      p = e->norm;
      n = e->norm_len;
    }
    e->start = first ? p : NULL;
  }
  size_t last = 0;
  for (size_t i = 0; i < n;) {
    unsigned char c = (unsigned char)p[i];
    const added_t *hit = NULL;
    for (int k = t->added_start[c]; k < t->added_start[c + 1]; k++) {
      const added_t *a = &t->added[t->added_by_byte[k]];
      if (a->normalized == (pass == 1) && a->len <= n - i && memcmp(p + i, a->content, a->len) == 0) {
        hit = a;
        break;
      }
    }
    if (!hit) {
      i++;
      continue;
    }
    size_t start = i, end = i + hit->len;
    if (hit->lstrip) {
      while (start > last) {
        size_t b = start - 1;
        while (b > last && ((unsigned char)p[b] & 0xC0) == 0x80 && start - b < 4) b--;
        uint32_t cp;
        if (utf8_next((const unsigned char *)p + b, start - b, &cp) != start - b || !is_white_space(cp)) break;
        start = b;
      }
    }
    if (hit->rstrip) {
      uint32_t cp;
      size_t l;
      while ((l = utf8_next((const unsigned char *)p + end, n - end, &cp)) && is_white_space(cp)) end += l;
    }
    if ((rc = encode_text(e, pass + 1, p + last, start - last))) return rc;
    if ((rc = ids_push(&e->out, hit->id))) return rc;
    last = i = end;
  }
  return encode_text(e, pass + 1, p + last, n - last);
}

/* ---------------------------------------------------------------- llama2.c encoding */

static int llama2c_encode(enc_t *e, const char *text, size_t len) {
  const tokenizer_t *t = e->t;
  int rc;
  if (len == 0) return 0;
  if (buf_reserve(&e->scratch, &e->scratchcap, 2 * t->max_key + 1)) return TOKENIZER_ENOMEM;
  e->nsym = 0;
  if (t->space_id >= 0 && (rc = sym_push(e, t->space_id))) return rc; /* the dummy prefix */
  /* One symbol per UTF-8 character (a byte and the continuation bytes after it, 4 at most) when
   * the vocab has it, else one <0xNN> symbol (id byte + 3) per byte. */
  for (size_t i = 0; i < len;) {
    size_t j = i + 1;
    while (j < len && ((unsigned char)text[j] & 0xC0) == 0x80 && j - i < 4) j++;
    int32_t id = smap_find(&t->keys, t->key_buf, text + i, j - i);
    if (id >= 0) {
      if ((rc = sym_push(e, id))) return rc;
    } else {
      for (size_t k = i; k < j; k++) {
        int32_t b = (unsigned char)text[k] + 3;
        if (b >= t->vocab_size)
          return err_set(e->err, e->errlen, TOKENIZER_EINVAL,
                         "tokenizer: byte 0x%02X at offset %zu has no piece and its byte token %d is past the vocab "
                         "size %d",
                         (unsigned char)text[k], k, b, t->vocab_size);
        if ((rc = sym_push(e, b))) return rc;
      }
    }
    i = j;
  }
  return merge_and_emit(e, NULL);
}

/* ---------------------------------------------------------------- public: encode / decode */

static void enc_free(enc_t *e) {
  free(e->sym);
  free(e->heap);
  free(e->scratch);
  free(e->norm);
  free(e->meta);
  smap_free(&e->cache);
  free(e->cache_keys);
  free(e->cache_at);
  free(e->cache_ids.v);
  if (e->md)
    for (int i = 0; i < e->t->n_pre; i++) pcre2_match_data_free(e->md[i]);
  free(e->md);
  pcre2_match_context_free(e->mctx);
  pcre2_jit_stack_free(e->jit);
}

int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, int32_t **ids, size_t *n, char *err,
                     size_t errlen) {
  if (!t || (!text && len) || !ids || !n) return err_set(err, errlen, TOKENIZER_EINVAL, "tokenizer: invalid arguments");
  *ids = NULL;
  *n = 0;
  if (len > INT32_MAX) /* symbols are indexed by int32 */
    return err_set(err, errlen, TOKENIZER_EINVAL, "tokenizer: %zu bytes is more than one call encodes (2 GiB)", len);
  enc_t e = {.t = t, .err = err, .errlen = errlen, .orig = text};
  int rc = TOKENIZER_ENOMEM;
  if (t->kind == TOK_LLAMA2C) {
    rc = llama2c_encode(&e, text, len);
  } else {
    /* A JIT stack larger than PCRE2's 32 KiB default: \s+(?!\S) over a long run of spaces
     * backtracks deeply. Without JIT the interpreter's heap limit applies instead. */
    e.md = calloc((size_t)t->n_pre + 1, sizeof *e.md);
    e.mctx = pcre2_match_context_create(NULL);
    e.jit = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    if (!e.md || !e.mctx) goto done;
    if (e.jit) pcre2_jit_stack_assign(e.mctx, NULL, e.jit);
    for (int i = 0; i < t->n_pre; i++)
      if (t->pre[i].re && !(e.md[i] = pcre2_match_data_create_from_pattern(t->pre[i].re, NULL))) goto done;
    rc = encode_text(&e, 0, text, len);
  }
done:
  if (rc == TOKENIZER_ENOMEM) err_set(err, errlen, rc, "tokenizer: out of memory encoding %zu bytes", len);
  if (rc == 0 && !e.out.v && !(e.out.v = malloc(sizeof(int32_t))))
    rc = err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: out of memory");
  if (rc == 0) {
    *ids = e.out.v;
    *n = e.out.n;
  } else {
    free(e.out.v);
  }
  enc_free(&e);
  return rc;
}

const char *tokenizer_token_bytes(const tokenizer_t *t, int32_t id, int32_t prev, size_t *len) {
  if (!t || id < 0 || id >= t->vocab_size || t->dec_len[id] == TOK_NO_PIECE) return NULL;
  const char *p = t->dec_buf + t->dec_off[id];
  size_t l = t->dec_len[id];
  /* run.c: after BOS a piece drops its leading space (the dummy prefix); a <0x20> byte token
   * is a space of the text and stays. */
  if (t->kind == TOK_LLAMA2C && t->bos >= 0 && prev == t->bos && !t->is_byte[id] && l > 0 && p[0] == ' ') p++, l--;
  /* sentencepiece-style tokenizer.json: the decoder's Strip (or Metaspace) takes the space off
   * the first token of the text; the first after BOS when BOS is skipped, as samples are. */
  if (t->strip_first && (prev < 0 || prev == t->bos) && l > 0 && p[0] == ' ') p++, l--;
  if (len) *len = l;
  return p;
}

int tokenizer_decode(const tokenizer_t *t, const int32_t *ids, size_t n, char **text, size_t *len) {
  if (!t || (!ids && n) || !text) return TOKENIZER_EINVAL;
  *text = NULL;
  if (len) *len = 0;
  size_t total = 0, l;
  for (size_t i = 0; i < n; i++) {
    if (!tokenizer_token_bytes(t, ids[i], i ? ids[i - 1] : t->bos, &l)) return TOKENIZER_EINVAL;
    total += l;
  }
  char *s = malloc(total + 1);
  if (!s) return TOKENIZER_ENOMEM;
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    const char *p = tokenizer_token_bytes(t, ids[i], i ? ids[i - 1] : t->bos, &l);
    memcpy(s + at, p, l);
    at += l;
  }
  s[at] = '\0';
  *text = s;
  if (len) *len = at;
  return 0;
}

int tokenizer_vocab_size(const tokenizer_t *t) { return t ? t->vocab_size : 0; }
int tokenizer_bos(const tokenizer_t *t) { return t ? t->bos : -1; }
int tokenizer_eos(const tokenizer_t *t) { return t ? t->eos : -1; }

void tokenizer_free(tokenizer_t *t) {
  if (!t) return;
  free(t->dec_off);
  free(t->dec_len);
  free(t->dec_buf);
  free(t->key_off);
  free(t->key_len);
  free(t->key_buf);
  smap_free(&t->keys);
  free(t->merges.slot);
  if (t->added)
    for (int i = 0; i < t->n_added; i++) free(t->added[i].content);
  free(t->added);
  free(t->added_by_byte);
  if (t->pre)
    for (int i = 0; i < t->n_pre; i++) pcre2_code_free(t->pre[i].re);
  free(t->pre);
  if (t->norm)
    for (int i = 0; i < t->n_norm; i++) free(t->norm[i].from), free(t->norm[i].to);
  free(t->norm);
  free(t->score);
  free(t->is_byte);
  free(t);
}

/* ---------------------------------------------------------------- loading: shared */

/* Per-id tables for vocab_size ids, every id without a piece yet. */
static int alloc_tables(tokenizer_t *t) {
  size_t v = (size_t)t->vocab_size;
  t->dec_off = calloc(v, sizeof *t->dec_off);
  t->dec_len = malloc(v * sizeof *t->dec_len);
  t->key_off = calloc(v, sizeof *t->key_off);
  t->key_len = malloc(v * sizeof *t->key_len);
  if (!t->dec_off || !t->dec_len || !t->key_off || !t->key_len) return TOKENIZER_ENOMEM;
  for (size_t i = 0; i < v; i++) t->dec_len[i] = t->key_len[i] = TOK_NO_PIECE;
  return 0;
}

/* A growing byte buffer of pieces, each followed by a NUL. */
typedef struct {
  char *b;
  size_t n, cap;
} arena_t;

static int arena_add(arena_t *a, const void *p, size_t n, uint32_t *off) {
  if (a->n + n + 1 > UINT32_MAX) return TOKENIZER_ENOMEM;
  if (buf_reserve(&a->b, &a->cap, a->n + n + 1)) return TOKENIZER_ENOMEM;
  memcpy(a->b + a->n, p, n);
  a->b[a->n + n] = '\0';
  *off = (uint32_t)a->n;
  a->n += n + 1;
  return 0;
}

/* ---------------------------------------------------------------- loading: llama2.c */

static int32_t rd_i32(const unsigned char *p) {
  uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
  int32_t r;
  memcpy(&r, &v, sizeof r);
  return r;
}

static int hexval(int c) {
  return c >= '0' && c <= '9'   ? c - '0'
         : c >= 'A' && c <= 'F' ? c - 'A' + 10
         : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                : -1;
}

/* The byte a piece <0xNN> stands for (either case of hex digit), -1 for any other piece. */
static int byte_piece(const char *s, size_t n) {
  int hi, lo;
  if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>' || (hi = hexval(s[3])) < 0 || (lo = hexval(s[4])) < 0)
    return -1;
  return hi << 4 | lo;
}

static int load_llama2c(tokenizer_t *t, const char *path, const unsigned char *buf, size_t len, char *err,
                        size_t errlen) {
  int rc;
  t->kind = TOK_LLAMA2C;
  if (len < 4)
    return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: %zu bytes is too short for a llama2.c tokenizer",
                   path, len);
  int32_t max_len = rd_i32(buf);
  if (max_len <= 0 || max_len > (1 << 20))
    return err_set(err, errlen, TOKENIZER_EFORMAT,
                   "tokenizer: %s: max_token_length %d is out of range (not a llama2.c tokenizer.bin?)", path, max_len);
  /* The vocab size is not stored: count records up to the end, each whole. */
  size_t count = 0;
  for (size_t pos = 4; pos < len; count++) {
    if (count >= TOK_MAX_ID)
      return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: more than %d tokens", path, TOK_MAX_ID);
    if (len - pos < 8)
      return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: truncated: token %zu's record is cut at byte %zu",
                     path, count, len);
    int32_t l = rd_i32(buf + pos + 4);
    if (l < 0 || l > max_len)
      return err_set(err, errlen, TOKENIZER_EFORMAT,
                     "tokenizer: %s: token %zu has length %d, outside 0..max_token_length %d", path, count, l, max_len);
    if ((size_t)l > len - pos - 8)
      return err_set(err, errlen, TOKENIZER_EFORMAT,
                     "tokenizer: %s: truncated: token %zu needs %d bytes at byte %zu, the file ends at %zu", path,
                     count, l, pos + 8, len);
    pos += 8 + (size_t)l;
  }
  if (count == 0) return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: no tokens", path);
  t->vocab_size = (int32_t)count;
  t->score = malloc(count * sizeof *t->score);
  t->is_byte = calloc(count, 1);
  if (!t->score || !t->is_byte || alloc_tables(t)) goto oom;

  arena_t keys = {0}, dec = {0};
  char *piece = malloc((size_t)max_len + 1);
  if (!piece) goto oom;
  size_t pos = 4;
  rc = 0;
  for (size_t i = 0; i < count && !rc; i++) {
    float s;
    memcpy(&s, buf + pos, sizeof s);
    size_t l = (size_t)rd_i32(buf + pos + 4);
    const unsigned char *p = buf + pos + 8;
    pos += 8 + l;
    if (!isfinite(s)) {
      rc = err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: token %zu has score %g", path, i, (double)s);
      break;
    }
    t->score[i] = s;
    /* sentencepiece's "▁" (E2 96 81) is a space; llama2.c's exporter already wrote spaces. */
    size_t k = 0;
    for (size_t j = 0; j < l; j++) {
      if (j + 2 < l && p[j] == 0xE2 && p[j + 1] == 0x96 && p[j + 2] == 0x81) {
        piece[k++] = ' ';
        j += 2;
      } else {
        piece[k++] = (char)p[j];
      }
    }
    if ((rc = arena_add(&keys, piece, k, &t->key_off[i]))) break;
    t->key_len[i] = (uint32_t)k;
    if (k > t->max_key) t->max_key = k;
    /* <0xNN> decodes to its byte */
    int b = byte_piece(piece, k);
    if (b >= 0) {
      piece[0] = (char)b;
      k = 1;
      t->is_byte[i] = 1;
    }
    if ((rc = arena_add(&dec, piece, k, &t->dec_off[i]))) break;
    t->dec_len[i] = (uint32_t)k;
  }
  free(piece);
  t->key_buf = keys.b;
  t->dec_buf = dec.b;
  if (rc == TOKENIZER_ENOMEM) goto oom;
  if (rc) return rc;
  for (int32_t i = 0; i < t->vocab_size; i++)
    if (smap_add(&t->keys, t->key_buf, t->key_off[i], t->key_len[i], i) < 0) goto oom;
  t->space_id = smap_find(&t->keys, t->key_buf, " ", 1);
  t->bos = count > 1 ? 1 : -1;
  t->eos = count > 2 ? 2 : -1;
  return 0;
oom:
  return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: %s: out of memory", path);
}

/* ---------------------------------------------------------------- loading: tokenizer.json */

/* The library's "type" of an object, "" when it has none. */
static const char *type_of(const cJSON *o) {
  const cJSON *ty = cJSON_GetObjectItemCaseSensitive(o, "type");
  return cJSON_IsString(ty) ? ty->valuestring : "";
}

static int is_false_or_absent(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return !v || cJSON_IsNull(v) || cJSON_IsFalse(v);
}

static int flag(const cJSON *o, const char *key, int dflt) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

static int empty_or_null(const cJSON *v) {
  return !v || cJSON_IsNull(v) || (cJSON_IsString(v) && v->valuestring[0] == '\0');
}

/* A copy of pattern pat[0..n) where \s and \S are \p{White_Space} and \P{White_Space}. PCRE2's
 * \s with UCP also takes U+180E, which Unicode no longer counts as white space and Oniguruma (the
 * library's regex engine) does not; White_Space is Oniguruma's set. \Q...\E is copied as it is.
 * NULL when out of memory. */
static char *onig_spaces(const char *pat, size_t n, size_t *outlen) {
  static const char ws[] = "\\p{White_Space}";
  char *o = malloc(n * (sizeof ws - 2) + 1), *w = o;
  if (!o) return NULL;
  for (size_t i = 0; i < n; i++) {
    if (pat[i] != '\\' || i + 1 == n) {
      *w++ = pat[i];
    } else if (pat[i + 1] == 's' || pat[i + 1] == 'S') {
      memcpy(w, ws, sizeof ws - 1);
      if (pat[i + 1] == 'S') w[1] = 'P';
      w += sizeof ws - 1;
      i++;
    } else if (pat[i + 1] == 'Q') {
      const char *e = memmem(pat + i, n - i, "\\E", 2);
      size_t end = e ? (size_t)(e - pat) + 2 : n;
      memcpy(w, pat + i, end - i);
      w += end - i;
      i = end - 1;
    } else {
      *w++ = pat[i++];
      *w++ = pat[i];
    }
  }
  *outlen = (size_t)(w - o);
  return o;
}

static int compile_regex(pcre2_code **out, const char *pat, size_t patlen, int literal, const char *path,
                         const char *what, char *err, size_t errlen) {
  int ec;
  PCRE2_SIZE eo;
  /* The pattern as written first, so that an error's offset is the file's; PCRE2_LITERAL takes
   * neither UCP nor a rewrite. */
  uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  *out = pcre2_compile((PCRE2_SPTR)pat, patlen, opts, &ec, &eo, NULL);
  if (*out && !literal) {
    size_t n;
    char *mine = onig_spaces(pat, patlen, &n);
    if (!mine) return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: %s: out of memory", path);
    pcre2_code_free(*out);
    *out = pcre2_compile((PCRE2_SPTR)mine, n, opts, &ec, &eo, NULL);
    free(mine);
  }
  if (!*out) {
    PCRE2_UCHAR msg[120];
    pcre2_get_error_message(ec, msg, sizeof msg);
    return err_set(err, errlen, TOKENIZER_EUNSUPPORTED, "tokenizer: %s: %s regex does not compile at offset %zu: %s",
                   path, what, (size_t)eo, (const char *)msg);
  }
  pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE); /* the interpreter when JIT is not there */
  return 0;
}

/* Flattens pre_tokenizer (ByteLevel, Split, Metaspace, Sequence of them) into t->pre. */
static int add_pre(tokenizer_t *t, const cJSON *pt, const char *path, int *cap, char *err, size_t errlen) {
  const char *ty = type_of(pt);
  int rc;
  if (strcmp(ty, "Sequence") == 0) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(pt, "pretokenizers"), *it;
    if (!cJSON_IsArray(list))
      return err_set(err, errlen, TOKENIZER_EFORMAT,
                     "tokenizer: %s: pre_tokenizer Sequence without a pretokenizers list", path);
    cJSON_ArrayForEach(it, list) {
      if ((rc = add_pre(t, it, path, cap, err, errlen))) return rc;
    }
    return 0;
  }
  if (t->n_pre == *cap) {
    int c = *cap ? *cap * 2 : 4;
    pre_t *p = realloc(t->pre, (size_t)c * sizeof *p);
    if (!p) return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: %s: out of memory", path);
    t->pre = p;
    *cap = c;
  }
  pre_t *p = &t->pre[t->n_pre];
  *p = (pre_t){0};
  if (strcmp(ty, "ByteLevel") == 0) {
    p->kind = PRE_BYTELEVEL;
    p->add_prefix_space = flag(pt, "add_prefix_space", 1);
    t->n_pre++;
    if (flag(pt, "use_regex", 1))
      return compile_regex(&p->re, GPT2_PATTERN, sizeof GPT2_PATTERN - 1, 0, path, "ByteLevel", err, errlen);
    return 0;
  }
  if (strcmp(ty, "Split") == 0) {
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(pt, "pattern");
    const cJSON *re = cJSON_GetObjectItemCaseSensitive(pat, "Regex");
    const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
    const cJSON *beh = cJSON_GetObjectItemCaseSensitive(pt, "behavior");
    if (!cJSON_IsString(re) && !cJSON_IsString(lit))
      return err_set(err, errlen, TOKENIZER_EFORMAT,
                     "tokenizer: %s: Split pre-tokenizer without a Regex or String pattern", path);
    if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated") != 0)
      return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: %s: Split pre-tokenizer behavior %s is unsupported (only Isolated)", path,
                     cJSON_IsString(beh) ? beh->valuestring : "(none)");
    if (!is_false_or_absent(pt, "invert"))
      return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: %s: Split pre-tokenizer with invert is unsupported", path);
    p->kind = PRE_SPLIT;
    t->n_pre++;
    const char *s = cJSON_IsString(re) ? re->valuestring : lit->valuestring;
    return compile_regex(&p->re, s, strlen(s), !cJSON_IsString(re), path, "Split", err, errlen);
  }
  if (strcmp(ty, "Metaspace") == 0) {
    const cJSON *rep = cJSON_GetObjectItemCaseSensitive(pt, "replacement");
    const cJSON *scheme = cJSON_GetObjectItemCaseSensitive(pt, "prepend_scheme");
    uint32_t cp;
    if (!cJSON_IsString(rep) || !rep->valuestring[0] ||
        utf8_next((const unsigned char *)rep->valuestring, strlen(rep->valuestring), &cp) != strlen(rep->valuestring))
      return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: Metaspace needs a replacement of one character",
                     path);
    p->kind = PRE_METASPACE;
    p->rep_len = strlen(rep->valuestring);
    memcpy(p->rep, rep->valuestring, p->rep_len);
    p->split = flag(pt, "split", 1);
    /* prepend_scheme since tokenizers 0.19; add_prefix_space before it */
    p->prepend = flag(pt, "add_prefix_space", 1) ? PREPEND_ALWAYS : PREPEND_NEVER;
    if (cJSON_IsString(scheme)) {
      const char *v = scheme->valuestring;
      if (strcmp(v, "always") && strcmp(v, "first") && strcmp(v, "never"))
        return err_set(err, errlen, TOKENIZER_EUNSUPPORTED, "tokenizer: %s: Metaspace prepend_scheme %.20s is unknown",
                       path, v);
      p->prepend = v[0] == 'a' ? PREPEND_ALWAYS : v[0] == 'f' ? PREPEND_FIRST : PREPEND_NEVER;
    }
    t->n_pre++;
    return 0;
  }
  return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                 "tokenizer: %s: pre_tokenizer %s is unsupported (only ByteLevel, Split, Metaspace and Sequence)", path,
                 ty[0] ? ty : "without a type");
}

/* A string field of o, "" when absent. */
static const char *str_of(const cJSON *o, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(v) ? v->valuestring : "";
}

/* Replace's {"pattern": {"String": from}, "content": to}: 0 with both, else a message. */
static int replace_of(const cJSON *o, const char *what, const char **from, const char **to, const char *path,
                      char *err, size_t errlen) {
  const cJSON *pat = cJSON_GetObjectItemCaseSensitive(o, "pattern");
  const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pat, "String");
  const cJSON *content = cJSON_GetObjectItemCaseSensitive(o, "content");
  if (cJSON_GetObjectItemCaseSensitive(pat, "Regex"))
    return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: %s: %s Replace with a Regex pattern is unsupported (only String)", path, what);
  if (!cJSON_IsString(lit) || !lit->valuestring[0] || !cJSON_IsString(content))
    return err_set(err, errlen, TOKENIZER_EFORMAT,
                   "tokenizer: %s: %s Replace needs a non-empty String pattern and a content", path, what);
  *from = lit->valuestring;
  *to = content->valuestring;
  return 0;
}

/* Flattens normalizer (Prepend, Replace with a String pattern, Sequence of them) into t->norm. */
static int add_norm(tokenizer_t *t, const cJSON *nj, const char *path, int *cap, char *err, size_t errlen) {
  const char *ty = type_of(nj);
  int rc;
  if (strcmp(ty, "Sequence") == 0) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(nj, "normalizers"), *it;
    if (!cJSON_IsArray(list))
      return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: normalizer Sequence without a normalizers list",
                     path);
    cJSON_ArrayForEach(it, list) {
      if ((rc = add_norm(t, it, path, cap, err, errlen))) return rc;
    }
    return 0;
  }
  const char *from = NULL, *to = NULL;
  if (strcmp(ty, "Prepend") == 0) {
    to = str_of(nj, "prepend");
  } else if (strcmp(ty, "Replace") == 0) {
    if ((rc = replace_of(nj, "normalizer", &from, &to, path, err, errlen))) return rc;
  } else {
    return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: %s: normalizer %s is unsupported (only Prepend, Replace of a String, Sequence)", path,
                   ty[0] ? ty : "without a type");
  }
  if (t->n_norm == *cap) {
    int c = *cap ? *cap * 2 : 4;
    norm_t *n = realloc(t->norm, (size_t)c * sizeof *n);
    if (!n) return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: %s: out of memory", path);
    t->norm = n;
    *cap = c;
  }
  norm_t *n = &t->norm[t->n_norm++];
  *n = (norm_t){.from = from ? strdup(from) : NULL, .to = strdup(to)};
  if ((from && !n->from) || !n->to) return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: %s: out of memory", path);
  n->from_len = from ? strlen(from) : 0;
  n->to_len = strlen(to);
  return 0;
}

/* A sentencepiece-style decoder: what a vocab token decodes to (*dec_step, in order) and whether
 * the text's first token loses a leading space. Steps: Replace of a String, ByteFallback (a
 * <0xNN> token is its byte), Fuse, Strip of one leading space after Fuse, Metaspace (its
 * replacement is a space; the first token's leading space goes unless prepend_scheme never). */
typedef struct {
  const char *from, *to; /* Replace, Metaspace; NULL for ByteFallback */
} dstep_t;
#define MAX_DSTEPS 16

static int spm_decoder(tokenizer_t *t, const cJSON *d, dstep_t *steps, int *n, int *fused, const char *path,
                       char *err, size_t errlen) {
  const char *ty = type_of(d);
  int rc;
  if (strcmp(ty, "Sequence") == 0) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(d, "decoders"), *it;
    if (!cJSON_IsArray(list))
      return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: decoder Sequence without a decoders list", path);
    cJSON_ArrayForEach(it, list) {
      if ((rc = spm_decoder(t, it, steps, n, fused, path, err, errlen))) return rc;
    }
    return 0;
  }
  if (*n == MAX_DSTEPS)
    return err_set(err, errlen, TOKENIZER_EUNSUPPORTED, "tokenizer: %s: more than %d decoder steps", path, MAX_DSTEPS);
  if (strcmp(ty, "Replace") == 0) {
    if ((rc = replace_of(d, "decoder", &steps[*n].from, &steps[*n].to, path, err, errlen))) return rc;
    if (strlen(steps[*n].to) > strlen(steps[*n].from)) /* a token's decoding never grows */
      return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: %s: decoder Replace with a content longer than its pattern is unsupported", path);
    ++*n;
  } else if (strcmp(ty, "ByteFallback") == 0) {
    steps[(*n)++] = (dstep_t){0};
  } else if (strcmp(ty, "Fuse") == 0) {
    *fused = 1;
  } else if (strcmp(ty, "Strip") == 0) {
    const cJSON *start = cJSON_GetObjectItemCaseSensitive(d, "start"), *stop = cJSON_GetObjectItemCaseSensitive(d, "stop");
    int st = cJSON_IsNumber(start) ? start->valueint : 0, sp = cJSON_IsNumber(stop) ? stop->valueint : 0;
    if (strcmp(str_of(d, "content"), " ") || st > 1 || st < 0 || sp || !*fused)
      return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: %s: decoder Strip is supported only as Fuse then Strip(\" \", 1, 0)", path);
    t->strip_first = st;
  } else if (strcmp(ty, "Metaspace") == 0) {
    steps[*n].from = str_of(d, "replacement");
    if (!steps[*n].from[0])
      return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: decoder Metaspace without a replacement", path);
    steps[(*n)++].to = " ";
    const char *scheme = str_of(d, "prepend_scheme");
    t->strip_first = scheme[0] ? strcmp(scheme, "never") != 0 : flag(d, "add_prefix_space", 1);
  } else {
    return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: %s: decoder %s is unsupported (ByteLevel; or Replace, ByteFallback, Fuse, Strip, "
                   "Metaspace)", path, ty[0] ? ty : "null");
  }
  return 0;
}

/* What token s[0..n) decodes to under steps, into out; its length. out and tmp hold n bytes:
 * no step lengthens a token. */
static size_t spm_decode_token(const dstep_t *steps, int nsteps, const char *s, size_t n, char *out, char *tmp) {
  memcpy(out, s, n);
  for (int i = 0; i < nsteps; i++) {
    const dstep_t *d = &steps[i];
    if (!d->from) {
      int b = byte_piece(out, n);
      if (b >= 0) out[0] = (char)b, n = 1;
      continue;
    }
    size_t fl = strlen(d->from), tl = strlen(d->to), k = 0;
    if (!fl) continue;
    for (size_t j = 0; j < n;) {
      if (n - j >= fl && memcmp(out + j, d->from, fl) == 0) memcpy(tmp + k, d->to, tl), k += tl, j += fl;
      else tmp[k++] = out[j++];
    }
    memcpy(out, tmp, k);
    n = k;
  }
  return n;
}

/* Raw bytes of a byte-level token string into out (room for strlen(s) bytes); 1 when every
 * character is of the byte-level alphabet, 0 when not (out then holds s's own UTF-8, as the
 * library's ByteLevel decoder does with such a token). */
static int byte_level_decode(const char *s, size_t n, char *out, size_t *outlen, const int16_t byte_of[324]) {
  size_t k = 0;
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    size_t l = utf8_next((const unsigned char *)s + i, n - i, &cp);
    if (!l || cp >= 324 || byte_of[cp] < 0) {
      memcpy(out, s, n);
      *outlen = n;
      return 0;
    }
    out[k++] = (char)byte_of[cp];
    i += l;
  }
  *outlen = k;
  return 1;
}

/* The id of a token named by its content: an added token's, else the vocab's (names holds the
 * vocab's strings). -1 when neither has it. */
static int32_t token_named(const tokenizer_t *t, const smap_t *names, const char *names_arena, const char *s) {
  for (int i = 0; i < t->n_added; i++)
    if (strcmp(t->added[i].content, s) == 0) return t->added[i].id;
  return smap_find(names, names_arena, s, strlen(s));
}

/* BOS and EOS: named by tokenizer_config.json when a folder holds one (bos_token, eos_token: a
 * string or {"content": ...}), else the first present of the usual names. GPT-2 uses
 * <|endoftext|> for both. */
static void find_bos_eos(tokenizer_t *t, const cJSON *config, const smap_t *names, const char *arena) {
  static const char *const bos_names[] = {"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "<|endoftext|>"};
  static const char *const eos_names[] = {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"};
  const char *keys[2] = {"bos_token", "eos_token"};
  int32_t *dst[2] = {&t->bos, &t->eos};
  for (int w = 0; w < 2; w++) {
    *dst[w] = -1;
    const cJSON *v = config ? cJSON_GetObjectItemCaseSensitive(config, keys[w]) : NULL;
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (cJSON_IsString(v)) *dst[w] = token_named(t, names, arena, v->valuestring);
    const char *const *list = w ? eos_names : bos_names;
    size_t nl = w ? sizeof eos_names / sizeof *eos_names : sizeof bos_names / sizeof *bos_names;
    for (size_t i = 0; i < nl && *dst[w] < 0; i++) *dst[w] = token_named(t, names, arena, list[i]);
  }
}

static int cmp_added_by_byte(const void *x, const void *y, void *ctx) {
  const added_t *a = (const added_t *)ctx + *(const int *)x, *b = (const added_t *)ctx + *(const int *)y;
  unsigned char ca = (unsigned char)a->content[0], cb = (unsigned char)b->content[0];
  if (ca != cb) return ca < cb ? -1 : 1;
  if (a->len != b->len) return a->len > b->len ? -1 : 1; /* longest first */
  return *(const int *)x - *(const int *)y;
}

/* An integer id in [0, TOK_MAX_ID), else -1. */
static int32_t json_id(const cJSON *v) {
  if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
      v->valuedouble >= TOK_MAX_ID)
    return -1;
  return (int32_t)v->valuedouble;
}

/* What the steps of load_json share: the file, the vocab's strings by name, the tables being
 * filled and a scratch buffer. */
typedef struct {
  tokenizer_t *t;
  const char *path;
  char *err;
  size_t errlen;
  int16_t byte_of[324];
  dstep_t dsteps[MAX_DSTEPS]; /* a sentencepiece-style decoder's steps */
  int n_dsteps;
  smap_t names; /* the vocab's byte-level strings -> id, for merges and names */
  arena_t names_a, keys, dec;
  int32_t max_id, n_vocab; /* largest id (vocab and added tokens), number of vocab entries */
  size_t max_str;          /* longest vocab string */
  char *tmp;
  size_t tmp_cap;
} json_load_t;

static int json_oom(json_load_t *l) {
  return err_set(l->err, l->errlen, TOKENIZER_ENOMEM, "tokenizer: %s: out of memory", l->path);
}

/* The model object: BPE without the options we do not implement. */
static int json_check_model(json_load_t *l, const cJSON *model) {
  const char *path = l->path;
  if (!cJSON_IsObject(model))
    return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: no \"model\" object", path);
  if (strcmp(type_of(model), "BPE") != 0)
    return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED, "tokenizer: %s: model type %s is unsupported (only BPE)",
                   path, type_of(model)[0] ? type_of(model) : "(none)");
  if (!empty_or_null(cJSON_GetObjectItemCaseSensitive(model, "dropout")))
    return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED, "tokenizer: %s: BPE dropout is unsupported", path);
  if (!empty_or_null(cJSON_GetObjectItemCaseSensitive(model, "continuing_subword_prefix")) ||
      !empty_or_null(cJSON_GetObjectItemCaseSensitive(model, "end_of_word_suffix")))
    return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: %s: BPE continuing_subword_prefix/end_of_word_suffix are unsupported", path);
  l->t->byte_fallback = flag(model, "byte_fallback", 0);
  return 0;
}

/* The normalizer, the pre-tokenizer and the decoder. Byte-level (GPT-2, Llama 3) when the
 * decoder or a pre-tokenizer says ByteLevel; else sentencepiece-style (Llama 2, Mistral,
 * llama2.c's exported): characters, byte_fallback. */
static int json_pipeline(json_load_t *l, const cJSON *root) {
  static const char *const pre_name[] = {"Split", "ByteLevel", "Metaspace"};
  tokenizer_t *t = l->t;
  const char *path = l->path;
  int rc, cap = 0;
  const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
  if (norm && !cJSON_IsNull(norm) && (rc = add_norm(t, norm, path, &cap, l->err, l->errlen))) return rc;
  const cJSON *dec_j = cJSON_GetObjectItemCaseSensitive(root, "decoder");
  const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer");
  cap = 0;
  if (pt && !cJSON_IsNull(pt) && (rc = add_pre(t, pt, path, &cap, l->err, l->errlen))) return rc;
  int byte_level = strcmp(type_of(dec_j), "ByteLevel") == 0;
  for (int i = 0; i < t->n_pre; i++) byte_level |= t->pre[i].kind == PRE_BYTELEVEL;
  if (!byte_level) {
    t->spm = 1;
    for (int i = 0; i < t->n_pre; i++)
      if (t->pre[i].kind == PRE_METASPACE && i != t->n_pre - 1)
        return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED,
                       "tokenizer: %s: Metaspace must be the last pre_tokenizer step (it is step %d of %d)", path,
                       i + 1, t->n_pre);
    int fused = 0;
    return spm_decoder(t, dec_j, l->dsteps, &l->n_dsteps, &fused, path, l->err, l->errlen);
  }
  if (t->byte_fallback)
    return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: %s: BPE with byte_fallback beside ByteLevel is unsupported", path);
  if (strcmp(type_of(dec_j), "ByteLevel") != 0)
    return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: %s: decoder %s with a ByteLevel pre_tokenizer is unsupported", path,
                   type_of(dec_j)[0] ? type_of(dec_j) : "null");
  if (t->n_pre == 0)
    return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: %s: no pre_tokenizer (byte-level BPE needs ByteLevel)", path);
  for (int i = 0; i < t->n_pre; i++)
    if ((t->pre[i].kind == PRE_BYTELEVEL) != (i == t->n_pre - 1) || t->pre[i].kind == PRE_METASPACE)
      return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: %s: pre_tokenizer must end in one ByteLevel (Split steps before it); step %d is %s",
                     path, i, pre_name[t->pre[i].kind]);
  return 0;
}

/* The vocab's byte-level strings (for merges, added tokens and names), its largest id. */
static int json_vocab_names(json_load_t *l, const cJSON *vocab) {
  const cJSON *it;
  cJSON_ArrayForEach(it, vocab) {
    int32_t id = json_id(it);
    if (id < 0)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: vocab token \"%.40s\" has a bad id", l->path,
                     it->string);
    if (id > l->max_id) l->max_id = id;
    size_t sl = strlen(it->string);
    if (sl > l->max_str) l->max_str = sl;
    uint32_t off;
    if (arena_add(&l->names_a, it->string, sl, &off)) return json_oom(l);
    int r = smap_add(&l->names, l->names_a.b, off, (uint32_t)sl, id);
    if (r < 0) return json_oom(l);
    if (r)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: vocab token \"%.40s\" appears twice",
                     l->path, it->string);
    l->n_vocab++;
  }
  return 0;
}

/* Added tokens take the ids the library gives them on load (it only warns when the file's
 * differ): a content the vocab has, the vocab's id; any other, the next after the largest
 * added id so far, or the vocab's entry count when that is larger. A repeated content is
 * skipped. */
static int json_added_tokens(json_load_t *l, const cJSON *added_j) {
  tokenizer_t *t = l->t;
  const char *path = l->path;
  int n_list = cJSON_GetArraySize(added_j), k = 0;
  if (n_list && !(t->added = calloc((size_t)n_list, sizeof *t->added))) return json_oom(l);
  int32_t max_added = -1;
  const cJSON *it;
  cJSON_ArrayForEach(it, added_j) {
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(it, "content");
    if (!cJSON_IsString(c) || !c->valuestring[0] || json_id(cJSON_GetObjectItemCaseSensitive(it, "id")) < 0)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT,
                     "tokenizer: %s: added_tokens[%d] needs a non-empty content and an id in [0, %d)", path, k,
                     TOK_MAX_ID);
    k++;
    if (flag(it, "single_word", 0))
      return err_set(l->err, l->errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: %s: added token %.40s: single_word is unsupported", path, c->valuestring);
    int dup = 0;
    for (int i = 0; i < t->n_added && !dup; i++) dup = strcmp(t->added[i].content, c->valuestring) == 0;
    if (dup) continue;
    added_t *a = &t->added[t->n_added];
    if (!(a->content = strdup(c->valuestring))) return json_oom(l);
    t->n_added++;
    a->len = strlen(a->content);
    a->lstrip = flag(it, "lstrip", 0);
    a->rstrip = flag(it, "rstrip", 0);
    a->normalized = flag(it, "normalized", !flag(it, "special", 0));
    a->id = smap_find(&l->names, l->names_a.b, a->content, a->len);
    if (a->id < 0) a->id = max_added >= l->n_vocab ? max_added + 1 : l->n_vocab;
    if (a->id >= TOK_MAX_ID)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: more than %d ids", path, TOK_MAX_ID);
    if (a->id > max_added) max_added = a->id;
  }
  if (max_added > l->max_id) l->max_id = max_added;
  return 0;
}

/* Vocab: decoded bytes; a key (the raw bytes) for tokens wholly of the byte-level alphabet,
 * the only ones a byte-level word can become. Then the single bytes' ids. */
static int json_vocab_tables(json_load_t *l, const cJSON *vocab) {
  tokenizer_t *t = l->t;
  char *tmp = l->tmp;
  const cJSON *it;
  cJSON_ArrayForEach(it, vocab) {
    int32_t id = json_id(it);
    size_t sl = strlen(it->string), len;
    if (t->dec_len[id] != TOK_NO_PIECE)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: vocab id %d is used twice", l->path, id);
    int key = t->spm; /* sentencepiece-style: the string is the key; byte-level: its bytes, when all are */
    if (t->spm) len = spm_decode_token(l->dsteps, l->n_dsteps, it->string, sl, tmp, tmp + l->max_str + 1);
    else key = byte_level_decode(it->string, sl, tmp, &len, l->byte_of);
    if (arena_add(&l->dec, tmp, len, &t->dec_off[id])) return json_oom(l);
    t->dec_len[id] = (uint32_t)len;
    if (key) {
      const char *k = t->spm ? it->string : tmp;
      size_t kl = t->spm ? sl : len;
      if (arena_add(&l->keys, k, kl, &t->key_off[id])) return json_oom(l);
      t->key_len[id] = (uint32_t)kl;
    }
  }
  t->key_buf = l->keys.b, l->keys.b = NULL;
  for (int32_t i = 0; i < t->vocab_size; i++)
    if (t->key_len[i] != TOK_NO_PIECE && smap_add(&t->keys, t->key_buf, t->key_off[i], t->key_len[i], i) < 0)
      return json_oom(l);
  for (int b = 0; b < 256; b++) {
    char c = (char)b, name[8];
    t->byte_id[b] = smap_find(&t->keys, t->key_buf, &c, 1);
    snprintf(name, sizeof name, "<0x%02X>", b);
    t->fallback_id[b] = t->byte_fallback ? smap_find(&l->names, l->names_a.b, name, 6) : -1;
  }
  return 0;
}

/* Merges: "a b" or ["a", "b"]; rank = position. Both sides and their concatenation must be
 * tokens of the vocab, as the library requires. */
static int json_merges(json_load_t *l, const cJSON *merges_j) {
  const char *path = l->path;
  int rank = 0;
  const cJSON *it;
  cJSON_ArrayForEach(it, merges_j) {
    const char *a = NULL, *b = NULL;
    size_t la = 0, lb = 0;
    if (cJSON_IsString(it)) {
      const char *s = it->valuestring, *sp = strchr(s, ' ');
      if (sp && !strchr(sp + 1, ' ')) a = s, la = (size_t)(sp - s), b = sp + 1, lb = strlen(b);
    } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(it->child) &&
               cJSON_IsString(it->child->next)) {
      a = it->child->valuestring, la = strlen(a), b = it->child->next->valuestring, lb = strlen(b);
    }
    if (!a)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: merges[%d] is neither \"a b\" nor [a, b]",
                     path, rank);
    int32_t ia = smap_find(&l->names, l->names_a.b, a, la), ib = smap_find(&l->names, l->names_a.b, b, lb);
    if (ia < 0 || ib < 0)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT,
                     "tokenizer: %s: merges[%d] names %.*s, which is not in the vocab", path, rank,
                     (int)(ia < 0 ? la : lb), ia < 0 ? a : b);
    if (buf_reserve(&l->tmp, &l->tmp_cap, la + lb + 1)) return json_oom(l);
    memcpy(l->tmp, a, la);
    memcpy(l->tmp + la, b, lb);
    int32_t id = smap_find(&l->names, l->names_a.b, l->tmp, la + lb);
    if (id < 0)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT,
                     "tokenizer: %s: merges[%d] makes %.*s, which is not in the vocab", path, rank, (int)(la + lb),
                     l->tmp);
    if (pmap_put(&l->t->merges, ia, ib, rank, id)) return json_oom(l);
    rank++;
  }
  return 0;
}

/* Added tokens decode as their content (ids are distinct: a vocab id is taken by one content
 * at most), and are looked for by first byte, longest first. */
static int json_added_lookup(json_load_t *l) {
  tokenizer_t *t = l->t;
  for (int i = 0; i < t->n_added; i++) {
    const added_t *a = &t->added[i];
    if (arena_add(&l->dec, a->content, a->len, &t->dec_off[a->id])) return json_oom(l);
    t->dec_len[a->id] = (uint32_t)a->len;
  }
  t->dec_buf = l->dec.b, l->dec.b = NULL;
  if (t->n_added) {
    if (!(t->added_by_byte = malloc((size_t)t->n_added * sizeof *t->added_by_byte))) return json_oom(l);
    for (int i = 0; i < t->n_added; i++) t->added_by_byte[i] = i;
    qsort_r(t->added_by_byte, (size_t)t->n_added, sizeof *t->added_by_byte, cmp_added_by_byte, t->added);
  }
  for (int b = 0, i = 0; b <= 256; b++) {
    while (i < t->n_added && (unsigned char)t->added[t->added_by_byte[i]].content[0] < b) i++;
    t->added_start[b] = i;
  }
  t->added_start[256] = t->n_added;
  return 0;
}

/* Builds t from the parsed tokenizer.json root, in the steps above. What the file asks for is
 * checked before anything is built. */
static int json_build(json_load_t *l, const cJSON *root, const cJSON *config) {
  tokenizer_t *t = l->t;
  const char *path = l->path;
  int rc;
  if (!cJSON_IsObject(root))
    return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: the JSON is not an object", path);
  const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
  if ((rc = json_check_model(l, model)) || (rc = json_pipeline(l, root))) return rc;

  const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
  if (!cJSON_IsObject(vocab))
    return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: model.vocab is not an object", path);
  const cJSON *merges_j = cJSON_GetObjectItemCaseSensitive(model, "merges");
  if (merges_j && !cJSON_IsNull(merges_j) && !cJSON_IsArray(merges_j))
    return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: model.merges is not a list", path);
  const cJSON *added_j = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
  if (added_j && !cJSON_IsNull(added_j) && !cJSON_IsArray(added_j))
    return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: added_tokens is not a list", path);
  if ((rc = json_vocab_names(l, vocab)) || (rc = json_added_tokens(l, added_j))) return rc;
  if (l->max_id < 0) return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: the vocab is empty", path);
  t->vocab_size = l->max_id + 1;
  l->tmp_cap = 2 * l->max_str + 2; /* a vocab string (and its decoding's scratch), a merge's two sides */
  if (alloc_tables(t) || !(l->tmp = malloc(l->tmp_cap))) return json_oom(l);
  if ((rc = json_vocab_tables(l, vocab)) || (rc = json_merges(l, merges_j))) return rc;

  const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
  if (cJSON_IsString(unk)) {
    t->unk_id = smap_find(&l->names, l->names_a.b, unk->valuestring, strlen(unk->valuestring));
    if (t->unk_id < 0)
      return err_set(l->err, l->errlen, TOKENIZER_EFORMAT, "tokenizer: %s: unk_token %.40s is not in the vocab", path,
                     unk->valuestring);
  }
  t->fuse_unk = flag(model, "fuse_unk", 0);
  t->ignore_merges = flag(model, "ignore_merges", 0);
  if ((rc = json_added_lookup(l))) return rc;
  find_bos_eos(t, config, &l->names, l->names_a.b);
  return 0;
}

static int load_json(tokenizer_t *t, const char *path, const char *buf, size_t len, const cJSON *config, char *err,
                     size_t errlen) {
  t->kind = TOK_BPE;
  t->unk_id = -1;
  t->space_id = -1;
  cJSON *root = cJSON_ParseWithLength(buf, len);
  if (!root) {
    const char *at = cJSON_GetErrorPtr();
    size_t off = at && at >= buf && at <= buf + len ? (size_t)(at - buf) : 0;
    return err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: bad JSON near byte %zu", path, off);
  }
  json_load_t l = {.t = t, .path = path, .err = err, .errlen = errlen, .max_id = -1, .max_str = 1};
  uint32_t cp_of[256];
  byte_level_tables(cp_of, l.byte_of);
  int rc = json_build(&l, root, config);
  cJSON_Delete(root);
  smap_free(&l.names);
  free(l.names_a.b);
  free(l.keys.b);
  free(l.dec.b);
  free(l.tmp);
  return rc;
}

/* ---------------------------------------------------------------- tokenizer_load */

int tokenizer_load(tokenizer_t **out, const char *path, char *err, size_t errlen) {
  if (!out || !path) return err_set(err, errlen, TOKENIZER_EINVAL, "tokenizer: invalid arguments");
  *out = NULL;
  char *file = NULL, *cfg_text = NULL;
  cJSON *config = NULL;
  int rc;
  struct stat st;
  if (stat(path, &st) != 0) return err_set(err, errlen, TOKENIZER_EIO, "tokenizer: %s: %s", path, strerror(errno));
  if (S_ISDIR(st.st_mode)) {
    /* A model folder: its tokenizer.json, and tokenizer_config.json for BOS/EOS when there. */
    if (asprintf(&file, "%s/tokenizer.json", path) < 0) file = NULL;
    char *cfg = NULL;
    if (!file || asprintf(&cfg, "%s/tokenizer_config.json", path) < 0) {
      free(file);
      return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: out of memory");
    }
    size_t cl;
    int r = fs_read_file(cfg, TOK_MAX_FILE, &cfg_text, &cl, NULL);
    if (r == 0 && !(config = cJSON_ParseWithLength(cfg_text, cl))) {
      rc = err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: bad JSON", cfg);
      free(cfg);
      goto done;
    }
    if (r != 0 && r != -ENOENT) {
      rc = err_set(err, errlen, TOKENIZER_EIO, "tokenizer: %s: %s", cfg, strerror(-r));
      free(cfg);
      goto done;
    }
    free(cfg);
  } else if (!(file = strdup(path))) {
    return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: out of memory");
  }

  char *buf = NULL;
  size_t len;
  long long size;
  int r = fs_read_file(file, TOK_MAX_FILE, &buf, &len, &size);
  if (r == -EFBIG) {
    rc = err_set(err, errlen, TOKENIZER_EFORMAT, "tokenizer: %s: %lld bytes is larger than a tokenizer can be", file,
                 size);
    goto done;
  }
  if (r) {
    rc = err_set(err, errlen, TOKENIZER_EIO, "tokenizer: %s: %s", file, strerror(-r));
    goto done;
  }
  tokenizer_t *t = calloc(1, sizeof *t);
  if (!t) {
    free(buf);
    rc = err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: out of memory");
    goto done;
  }
  /* JSON opens with '{' (after whitespace or a UTF-8 BOM). A tokenizer.bin opens with a small
   * int32: its first four bytes hold a NUL unless max_token_length is over 2^24. */
  size_t i = 0;
  if (len >= 3 && memcmp(buf, "\xEF\xBB\xBF", 3) == 0) i = 3;
  while (i < len && (buf[i] == ' ' || buf[i] == '\t' || buf[i] == '\n' || buf[i] == '\r')) i++;
  int is_json = i < len && buf[i] == '{' && !(len >= 4 && memchr(buf, '\0', 4));
  if (is_json)
    rc = load_json(t, file, buf + i, len - i, config, err, errlen);
  else
    rc = load_llama2c(t, file, (const unsigned char *)buf, len, err, errlen);
  free(buf);
  if (rc)
    tokenizer_free(t);
  else
    *out = t;
done:
  free(file);
  free(cfg_text);
  cJSON_Delete(config);
  return rc;
}

int tokenizer_load_within(tokenizer_t **out, const char *path, int vocab, char *err, size_t errlen) {
  int rc = tokenizer_load(out, path, err, errlen);
  if (rc) return rc;
  int n = tokenizer_vocab_size(*out);
  if (n <= vocab) return 0;
  tokenizer_free(*out);
  *out = NULL;
  return err_set(err, errlen, TOKENIZER_EVOCAB, "tokenizer %s has %d tokens, more than the model's vocab_size %d",
                 path, n, vocab);
}

/* ---------------------------------------------------------------- llama2.c to tokenizer.json */

typedef struct {
  float score; /* the merged piece's */
  int32_t id, a, b;
} l2merge_t;

static int cmp_l2merge(const void *x, const void *y) {
  const l2merge_t *p = x, *q = y;
  if (p->score != q->score) return p->score > q->score ? -1 : 1;
  if (p->id != q->id) return p->id < q->id ? -1 : 1;
  return p->a < q->a ? -1 : p->a > q->a;
}

/* The HF name of llama2.c token i: a space is "▁", a byte token <0xNN> in capitals, ids 0..2
 * (<unk>, "\n<s>\n", "\n</s>\n" as llama2.c's exporter writes them) the special <unk> <s> </s>.
 * *special is set for those. */
static int l2_name(const tokenizer_t *t, int32_t i, arena_t *a, uint32_t *off, uint32_t *len, int *special) {
  static const char *const spec[3][2] = {{"<unk>", "<unk>"}, {"\n<s>\n", "<s>"}, {"\n</s>\n", "</s>"}};
  const char *k = t->key_buf + t->key_off[i];
  size_t kl = t->key_len[i];
  char buf[16];
  *special = 0;
  for (int w = 0; i < 3 && w < 2 && !*special; w++)
    if (kl == strlen(spec[i][w]) && memcmp(k, spec[i][w], kl) == 0) {
      *special = 1;
      k = spec[i][1], kl = strlen(k);
    }
  if (t->is_byte[i]) {
    snprintf(buf, sizeof buf, "<0x%02X>", (unsigned char)t->dec_buf[t->dec_off[i]]);
    k = buf, kl = 6;
  }
  size_t spaces = 0;
  for (size_t j = 0; j < kl; j++) spaces += k[j] == ' ';
  if (buf_reserve(&a->b, &a->cap, a->n + kl + 2 * spaces + 1) || a->n + kl + 2 * spaces + 1 > UINT32_MAX)
    return TOKENIZER_ENOMEM;
  *off = (uint32_t)a->n;
  for (size_t j = 0; j < kl; j++) {
    if (k[j] == ' ') memcpy(a->b + a->n, "\xe2\x96\x81", 3), a->n += 3;
    else a->b[a->n++] = k[j];
  }
  *len = (uint32_t)(a->n - *off);
  a->b[a->n++] = '\0';
  return 0;
}

static cJSON *json_pair(const char *k1, cJSON *v1, const char *k2, cJSON *v2) {
  cJSON *o = cJSON_CreateObject();
  if (o && v1) cJSON_AddItemToObject(o, k1, v1);
  if (o && v2) cJSON_AddItemToObject(o, k2, v2);
  return o;
}

static cJSON *json_replace(const char *from, const char *to) {
  cJSON *o = json_pair("type", cJSON_CreateString("Replace"), "pattern",
                       json_pair("String", cJSON_CreateString(from), NULL, NULL));
  if (o) cJSON_AddStringToObject(o, "content", to);
  return o;
}

/* What Llama's tokenizer.json files do with a text: BOS (name, id) first (single), and before
 * each of a pair; tokenizer_load ignores it, transformers applies it. */
static cJSON *bos_template(const char *name, int id) {
  cJSON *pp = cJSON_CreateObject();
  cJSON_AddStringToObject(pp, "type", "TemplateProcessing");
  const char *const parts[2][4] = {{name, "A", NULL, NULL}, {name, "A", name, "B"}};
  for (int w = 0; w < 2; w++) {
    cJSON *list = cJSON_AddArrayToObject(pp, w ? "pair" : "single");
    for (int i = 0; i < 4 && parts[w][i]; i++) {
      cJSON *inner = json_pair("id", cJSON_CreateString(parts[w][i]), "type_id", cJSON_CreateNumber(i / 2));
      cJSON_AddItemToArray(list, json_pair(i % 2 ? "Sequence" : "SpecialToken", inner, NULL, NULL));
    }
  }
  cJSON *sp = cJSON_AddObjectToObject(pp, "special_tokens");
  cJSON *bos = cJSON_AddObjectToObject(sp, name);
  cJSON_AddStringToObject(bos, "id", name);
  cJSON_AddItemToObject(bos, "ids", cJSON_CreateIntArray((const int[]){id}, 1));
  cJSON_AddItemToObject(bos, "tokens", cJSON_CreateStringArray((const char *const[]){name}, 1));
  return pp;
}

/* root printed, a newline after it: *json malloc'd (*len bytes, NUL after). */
static int json_text(const cJSON *root, char **json, size_t *len) {
  char *text = cJSON_Print(root);
  size_t n = text ? strlen(text) : 0;
  *json = text ? malloc(n + 2) : NULL;
  if (*json) {
    memcpy(*json, text, n);
    (*json)[n] = '\n';
    (*json)[n + 1] = '\0';
    if (len) *len = n + 1;
  }
  cJSON_free(text);
  return *json ? 0 : TOKENIZER_ENOMEM;
}

/* Whether a post-processor is a template whose single is exactly BOS (id bos), then the text. */
static int is_bos_template(const cJSON *pp, int32_t bos) {
  const cJSON *single = cJSON_GetObjectItemCaseSensitive(pp, "single");
  if (cJSON_GetArraySize(single) != 2) return 0;
  const cJSON *name = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(single, 0), "SpecialToken"), "id");
  const cJSON *text = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(single, 1), "Sequence"), "id");
  if (!cJSON_IsString(name) || !cJSON_IsString(text) || strcmp(text->valuestring, "A") != 0) return 0;
  const cJSON *ids = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(pp, "special_tokens"), name->valuestring),
      "ids");
  return cJSON_GetArraySize(ids) == 1 && cJSON_IsNumber(ids->child) && ids->child->valuedouble == bos;
}

int tokenizer_json_bos_first(const tokenizer_t *t, const char *json, size_t len, char **out, size_t *outlen,
                             char *note, size_t notelen) {
  if (!t || !json || !out) return err_set(note, notelen, TOKENIZER_EINVAL, "tokenizer: invalid arguments");
  *out = NULL;
  if (note && notelen) note[0] = '\0';
  if (t->bos < 0) return 0;
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return err_set(note, notelen, TOKENIZER_EFORMAT, "tokenizer: tokenizer.json is not a JSON object");
  }
  /* The post-processor's steps: ByteLevel ones only trim offsets and are kept; a template of BOS
   * then the text is what is wanted; any other step adds tokens that trainer sample does not. */
  cJSON *pp = cJSON_GetObjectItemCaseSensitive(root, "post_processor");
  const char *type = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(pp, "type"));
  const cJSON *steps =
      type && strcmp(type, "Sequence") == 0 ? cJSON_GetObjectItemCaseSensitive(pp, "processors") : NULL;
  cJSON *keep = cJSON_CreateArray();
  int bos_first = 0;
  char other[64] = "";
  for (const cJSON *s = steps ? steps->child : cJSON_IsObject(pp) ? pp : NULL; s; s = steps ? s->next : NULL) {
    const char *k = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(s, "type"));
    if (k && strcmp(k, "ByteLevel") == 0) cJSON_AddItemToArray(keep, cJSON_Duplicate(s, 1));
    else if (k && strcmp(k, "TemplateProcessing") == 0 && !bos_first && is_bos_template(s, t->bos)) bos_first = 1;
    else if (!other[0]) snprintf(other, sizeof other, "%s", k ? k : "a step with no type");
  }
  int rc = 1;
  if (bos_first && !other[0]) {
    rc = 0;
  } else {
    size_t nl = 0;
    const char *b = tokenizer_token_bytes(t, t->bos, -1, &nl);
    char *name = strndup(b, nl);
    cJSON *bos = name ? bos_template(name, t->bos) : NULL;
    free(name);
    if (bos && cJSON_GetArraySize(keep) > 0) { /* ByteLevel's offsets, then BOS */
      cJSON_AddItemToArray(keep, bos);
      bos = json_pair("type", cJSON_CreateString("Sequence"), "processors", keep);
      keep = NULL;
    }
    int put = bos && (pp ? cJSON_ReplaceItemInObjectCaseSensitive(root, "post_processor", bos)
                         : cJSON_AddItemToObject(root, "post_processor", bos));
    if (!put) cJSON_Delete(bos);
    if (!put || json_text(root, out, outlen))
      rc = err_set(note, notelen, TOKENIZER_ENOMEM, "tokenizer: out of memory rewriting tokenizer.json");
    else if (other[0])
      err_set(note, notelen, 0, "its post-processor's %s step is dropped", other);
  }
  cJSON_Delete(keep);
  cJSON_Delete(root);
  return rc;
}

/* The parts of the document that do not depend on the vocab: normalizer, post-processor, decoder. */
static void l2_fixed_parts(cJSON *root, int dummy_prefix) {
  static const char *const dsteps[] = {"ByteFallback", "Fuse"};
  cJSON *norm = cJSON_CreateNull();
  if (dummy_prefix) { /* llama2.c's dummy prefix and its spaces, as sentencepiece's normalizer */
    cJSON_Delete(norm);
    norm = json_pair("type", cJSON_CreateString("Sequence"), "normalizers", cJSON_CreateArray());
    cJSON *list = cJSON_GetObjectItemCaseSensitive(norm, "normalizers");
    cJSON_AddItemToArray(list, json_pair("type", cJSON_CreateString("Prepend"), "prepend",
                                         cJSON_CreateString("\xe2\x96\x81")));
    cJSON_AddItemToArray(list, json_replace(" ", "\xe2\x96\x81"));
  }
  cJSON_AddItemToObject(root, "normalizer", norm);
  cJSON_AddNullToObject(root, "pre_tokenizer");
  cJSON_AddItemToObject(root, "post_processor", bos_template("<s>", 1));
  cJSON *dec = cJSON_AddObjectToObject(root, "decoder");
  cJSON_AddStringToObject(dec, "type", "Sequence");
  cJSON *list = cJSON_AddArrayToObject(dec, "decoders");
  cJSON_AddItemToArray(list, json_replace("\xe2\x96\x81", " "));
  for (int i = 0; i < 2; i++) cJSON_AddItemToArray(list, json_pair("type", cJSON_CreateString(dsteps[i]), NULL, NULL));
  cJSON *strip = json_pair("type", cJSON_CreateString("Strip"), "content", cJSON_CreateString(" "));
  cJSON_AddNumberToObject(strip, "start", 1);
  cJSON_AddNumberToObject(strip, "stop", 0);
  cJSON_AddItemToArray(list, strip);
}

/* The pieces of a llama2.c tokenizer's tokenizer.json, built before the document. */
typedef struct {
  arena_t names;     /* each token's HF name, NUL after each */
  uint32_t *off, *nl; /* (vocab_size) where each name is in names, its length */
  uint8_t *special;  /* (vocab_size) whether the token is <unk>, <s> or </s> */
  smap_t map;        /* non-special names -> id, for the merges */
  l2merge_t *m;      /* (nm) the merges, best first */
  size_t nm, mcap;
} l2_doc_t;

static int l2_oom(char *err, size_t errlen) {
  return err_set(err, errlen, TOKENIZER_ENOMEM, "tokenizer: out of memory writing tokenizer.json");
}

/* llama2.c falls back to id byte + 3 for a character it lacks, tokenizer.json to the token
 * named <0xNN>: the same only when ids 3..258 are the byte tokens in order. */
static int l2_check_bytes(const tokenizer_t *t, char *err, size_t errlen) {
  for (int b = 0; b < 256; b++)
    if (b + 3 >= t->vocab_size || !t->is_byte[b + 3] || (unsigned char)t->dec_buf[t->dec_off[b + 3]] != b)
      return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: id %d is not the byte token <0x%02X> (llama2.c falls back to byte + 3), so the "
                     "tokenizer has no tokenizer.json form",
                     b + 3, b);
  return 0;
}

/* Every token's name, checked to be one tokenizer.json can hold and tell from the others. */
static int l2_names(const tokenizer_t *t, l2_doc_t *d, char *err, size_t errlen) {
  const int32_t v = t->vocab_size;
  for (int32_t i = 0; i < v; i++) {
    int sp;
    if (l2_name(t, i, &d->names, &d->off[i], &d->nl[i], &sp)) return l2_oom(err, errlen);
    d->special[i] = (uint8_t)sp;
  }
  if (!d->special[1] || !d->special[2]) /* llama2.c's BOS and EOS are 1 and 2 whatever they read */
    return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                   "tokenizer: ids 1 and 2 are not <s> and </s>, which llama2.c takes them for, so the tokenizer has "
                   "no tokenizer.json form");
  for (int32_t i = 0; i < v; i++) {
    const char *s = d->names.b + d->off[i];
    uint32_t cp;
    for (size_t j = 0, l; j < d->nl[i]; j += l)
      if (!(l = utf8_next((const unsigned char *)s + j, d->nl[i] - j, &cp)))
        return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                       "tokenizer: token %d is not valid UTF-8, which tokenizer.json cannot hold", i);
    int r = smap_add(&d->map, d->names.b, d->off[i], d->nl[i], i);
    if (r < 0) return l2_oom(err, errlen);
    if (r)
      return err_set(err, errlen, TOKENIZER_EUNSUPPORTED,
                     "tokenizer: tokens %d and %d are both \"%.40s\", which tokenizer.json cannot tell apart",
                     smap_find(&d->map, d->names.b, s, d->nl[i]), i, s);
  }
  return 0;
}

/* Merges: every split of a piece into two pieces, at a character boundary, the best-scored
 * merged piece first (llama2.c merges the pair whose concatenation scores best). */
static int l2_merges(const tokenizer_t *t, l2_doc_t *d, char *err, size_t errlen) {
  for (int32_t i = 0; i < t->vocab_size; i++) {
    if (d->special[i]) continue;
    const char *s = d->names.b + d->off[i];
    for (size_t k = 1; k < d->nl[i]; k++) {
      if (((unsigned char)s[k] & 0xC0) == 0x80) continue;
      int32_t a = smap_find(&d->map, d->names.b, s, k), b = smap_find(&d->map, d->names.b, s + k, d->nl[i] - k);
      if (a < 0 || b < 0 || d->special[a] || d->special[b]) continue;
      if (d->nm == d->mcap) {
        d->mcap = d->mcap ? 2 * d->mcap : 1024;
        l2merge_t *g = realloc(d->m, d->mcap * sizeof *g);
        if (!g) return l2_oom(err, errlen);
        d->m = g;
      }
      d->m[d->nm++] = (l2merge_t){.score = t->score[i], .id = i, .a = a, .b = b};
    }
  }
  qsort(d->m, d->nm, sizeof *d->m, cmp_l2merge);
  return 0;
}

/* The document: the special tokens as added tokens, the fixed parts, and the BPE model. */
static void l2_document(const tokenizer_t *t, const l2_doc_t *d, cJSON *root) {
  const int32_t v = t->vocab_size;
  cJSON_AddStringToObject(root, "version", "1.0");
  cJSON_AddNullToObject(root, "truncation");
  cJSON_AddNullToObject(root, "padding");
  cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
  for (int32_t i = 0; i < v; i++) {
    if (!d->special[i]) continue;
    cJSON *a = json_pair("id", cJSON_CreateNumber(i), "content", cJSON_CreateString(d->names.b + d->off[i]));
    static const char *const flags[] = {"single_word", "lstrip", "rstrip", "normalized"};
    for (int f = 0; f < 4; f++) cJSON_AddFalseToObject(a, flags[f]);
    cJSON_AddTrueToObject(a, "special");
    cJSON_AddItemToArray(added, a);
  }
  l2_fixed_parts(root, t->space_id >= 0);
  cJSON *model = cJSON_AddObjectToObject(root, "model");
  cJSON_AddStringToObject(model, "type", "BPE");
  cJSON_AddNullToObject(model, "dropout");
  if (d->special[0]) cJSON_AddStringToObject(model, "unk_token", "<unk>");
  else cJSON_AddNullToObject(model, "unk_token");
  cJSON_AddNullToObject(model, "continuing_subword_prefix");
  cJSON_AddNullToObject(model, "end_of_word_suffix");
  cJSON_AddTrueToObject(model, "fuse_unk");
  cJSON_AddTrueToObject(model, "byte_fallback");
  cJSON_AddFalseToObject(model, "ignore_merges");
  cJSON *vocab = cJSON_AddObjectToObject(model, "vocab"), *merges = cJSON_AddArrayToObject(model, "merges");
  for (int32_t i = 0; vocab && i < v; i++) cJSON_AddNumberToObject(vocab, d->names.b + d->off[i], i);
  for (size_t i = 0; merges && i < d->nm; i++) {
    const char *pair[2] = {d->names.b + d->off[d->m[i].a], d->names.b + d->off[d->m[i].b]};
    cJSON_AddItemToArray(merges, cJSON_CreateStringArray(pair, 2));
  }
}

int tokenizer_llama2c_json(const tokenizer_t *t, char **json, size_t *len, char *err, size_t errlen) {
  if (!t || !json) return err_set(err, errlen, TOKENIZER_EINVAL, "tokenizer: invalid arguments");
  *json = NULL;
  if (t->kind != TOK_LLAMA2C)
    return err_set(err, errlen, TOKENIZER_EINVAL, "tokenizer: only a llama2.c tokenizer.bin is converted");
  int rc = l2_check_bytes(t, err, errlen);
  if (rc) return rc;
  const size_t v = (size_t)t->vocab_size;
  l2_doc_t d = {.off = malloc(v * sizeof *d.off), .nl = malloc(v * sizeof *d.nl), .special = calloc(v, 1)};
  cJSON *root = cJSON_CreateObject();
  if (!d.off || !d.nl || !d.special || !root) rc = l2_oom(err, errlen);
  else if (!(rc = l2_names(t, &d, err, errlen)) && !(rc = l2_merges(t, &d, err, errlen))) {
    l2_document(t, &d, root);
    if (json_text(root, json, len)) rc = l2_oom(err, errlen);
  }
  cJSON_Delete(root);
  free(d.names.b);
  free(d.off);
  free(d.nl);
  free(d.special);
  smap_free(&d.map);
  free(d.m);
  return rc;
}
