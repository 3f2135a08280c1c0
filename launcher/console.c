/* console: the waiting lines are groups, in the order each was first seen (a list), and also in
 * hash buckets for the lookup of a rank's new line. A group goes out from the head only, so it
 * is always the head of its bucket too when it goes.
 *
 * Every group has a sequence number; each slot remembers the number of the last group it
 * joined. A slot may join only a group numbered above that (so its own lines keep their
 * order), and a group is done waiting when every open slot's number has reached it: each
 * open slot either printed the line or printed a later one. */
#include "launcher/console.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUCKETS 1024

typedef struct group group_t;
struct group {
  group_t *next;  /* the next waiting group, in the order first seen */
  group_t *chain; /* the next in its bucket, same order; unmatchable groups are in none */
  uint64_t seq, hash, deadline;
  int first_slot, count;
  int matchable;
  int has_field;   /* key holds '*' at field_at in place of the first slot's rank number */
  size_t field_at;
  size_t len;      /* of key */
  unsigned char *members; /* a bit per slot */
  char *key;
};

struct console {
  int n, first_rank;
  uint64_t window;
  console_write_fn write_fn;
  void *arg;
  uint64_t next_seq;
  uint64_t *last;      /* per slot: the sequence number of the last group it joined, 0 none */
  unsigned char *open; /* per slot */
  group_t *head, *tail;
  group_t *bucket_head[BUCKETS], *bucket_tail[BUCKETS];
  size_t waiting, bytes;
  char *out; /* a line being written: prefix, text, '\n' */
  size_t outcap;
  int *ranks; /* n: a group's ranks, for its prefix */
  char key[CONSOLE_MERGE_MAX];
};

size_t console_format_ranks(const int *ranks, int n, char *out, size_t outlen) {
  size_t len = 0;
  if (outlen) out[0] = '\0';
  for (int i = 0; i < n;) {
    int j = i;
    while (j + 1 < n && ranks[j + 1] == ranks[j] + 1) j++;
    if (j - i < 2) j = i; /* a pair is two ranks, not a range */
    char piece[32];
    int k = j > i ? snprintf(piece, sizeof piece, "%s%d-%d", i ? "," : "", ranks[i], ranks[j])
                  : snprintf(piece, sizeof piece, "%s%d", i ? "," : "", ranks[i]);
    if (outlen && len < outlen - 1) {
      size_t room = outlen - 1 - len, copy = (size_t)k < room ? (size_t)k : room;
      memcpy(out + len, piece, copy);
      out[len + copy] = '\0';
    }
    len += (size_t)k;
    i = j + 1;
  }
  return len;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

int console_rank_field(const char *p, size_t n, int rank, size_t *at, size_t *len) {
  if (n < 1 || p[0] != '[') return -1;
  size_t i = 1;
  while (i < n && p[i] != ' ' && p[i] != '[' && p[i] != ']') i++;
  if (i == 1 || i + 2 >= n || p[i] != ' ' || p[i + 1] != 'r') return -1;
  size_t d = i + 2, e = d;
  while (e < n && is_digit(p[e])) e++;
  /* The number exactly as the rank prints it, so that putting it back restores the line. */
  char num[16];
  int k = snprintf(num, sizeof num, "%d", rank);
  if (e - d != (size_t)k || memcmp(p + d, num, (size_t)k) || e >= n || p[e] != '/') return -1;
  size_t f = e + 1;
  while (f < n && is_digit(p[f])) f++;
  if (f == e + 1 || f >= n || p[f] != ']') return -1;
  *at = d;
  *len = e - d;
  return 0;
}

int console_create(console_t **out, int n, int first_rank, uint64_t window_ns, console_write_fn write_fn,
                   void *arg) {
  console_t *c = calloc(1, sizeof *c);
  if (!c) return -1;
  c->n = n;
  c->first_rank = first_rank;
  c->window = window_ns;
  c->write_fn = write_fn;
  c->arg = arg;
  c->last = calloc((size_t)n, sizeof *c->last);
  c->open = calloc((size_t)n, 1);
  c->ranks = calloc((size_t)n, sizeof *c->ranks);
  if (!c->last || !c->open || !c->ranks) {
    console_destroy(c);
    return -1;
  }
  *out = c;
  return 0;
}

/* The group's line into c->out: "[rank<R>]:" and the first slot's own text when it is alone,
 * else "[ranks <set>]:" and the key. NULL when out of memory. */
static const char *format_group(console_t *c, const group_t *g, size_t *outlen) {
  int nr = 0;
  for (int s = 0; s < c->n; s++)
    if (g->members[s / 8] & (1u << (s % 8))) c->ranks[nr++] = c->first_rank + s;
  size_t need = 32 + (size_t)nr * 12 + g->len + 16;
  if (need > c->outcap) {
    char *p = realloc(c->out, need);
    if (!p) return NULL;
    c->out = p;
    c->outcap = need;
  }
  size_t len;
  if (g->count == 1) {
    len = (size_t)snprintf(c->out, c->outcap, "[rank%d]:", c->ranks[0]);
    size_t cut = g->has_field ? g->field_at : g->len;
    memcpy(c->out + len, g->key, cut);
    len += cut;
    if (g->has_field) {
      len += (size_t)snprintf(c->out + len, c->outcap - len, "%d", c->ranks[0]);
      memcpy(c->out + len, g->key + cut + 1, g->len - cut - 1);
      len += g->len - cut - 1;
    }
  } else {
    len = (size_t)snprintf(c->out, c->outcap, "[ranks ");
    len += console_format_ranks(c->ranks, nr, c->out + len, c->outcap - len);
    memcpy(c->out + len, "]:", 2);
    len += 2;
    memcpy(c->out + len, g->key, g->len);
    len += g->len;
  }
  c->out[len++] = '\n';
  *outlen = len;
  return c->out;
}

/* The head group goes out and is freed. */
static void emit_head(console_t *c) {
  group_t *g = c->head;
  c->head = g->next;
  if (!c->head) c->tail = NULL;
  if (g->matchable) {
    size_t b = g->hash % BUCKETS;
    c->bucket_head[b] = g->chain; /* the oldest group is the oldest of its bucket */
    if (!g->chain) c->bucket_tail[b] = NULL;
  }
  c->waiting--;
  c->bytes -= g->len;
  size_t len;
  const char *line = format_group(c, g, &len);
  if (line) c->write_fn(c->arg, line, len);
  free(g);
}

uint64_t console_deadline(const console_t *c) { return c && c->head ? c->head->deadline : UINT64_MAX; }

uint64_t console_flush_due(console_t *c, uint64_t now) {
  if (!c) return UINT64_MAX;
  uint64_t reached = UINT64_MAX; /* every open slot has joined this group or a later one */
  for (int s = 0; s < c->n; s++)
    if (c->open[s] && c->last[s] < reached) reached = c->last[s];
  while (c->head) {
    const group_t *g = c->head;
    int full = c->waiting > CONSOLE_MAX_WAITING || c->bytes > CONSOLE_MAX_BYTES;
    if (!(g->seq <= reached || g->deadline <= now || !g->matchable || full)) break;
    emit_head(c);
  }
  return console_deadline(c);
}

void console_flush_all(console_t *c) {
  while (c && c->head) emit_head(c);
}

void console_destroy(console_t *c) {
  if (!c) return;
  console_flush_all(c);
  free(c->last);
  free(c->open);
  free(c->ranks);
  free(c->out);
  free(c);
}

void console_open(console_t *c, int slot) {
  if (slot >= 0 && slot < c->n) c->open[slot] = 1;
}

void console_close(console_t *c, int slot, uint64_t now) {
  if (slot >= 0 && slot < c->n) c->open[slot] = 0;
  console_flush_due(c, now);
}

/* The line's key into c->key (the rank's number in its log prefix as '*'), its length in *len;
 * *field_at where the '*' is, or -1 in *has_field's absence. 0, or -1 when too long to match. */
static int make_key(console_t *c, int slot, const char *p, size_t n, size_t *len, int *has_field, size_t *field_at) {
  if (n > CONSOLE_MERGE_MAX) return -1;
  size_t at, flen;
  *has_field = !console_rank_field(p, n, c->first_rank + slot, &at, &flen);
  if (!*has_field) {
    memcpy(c->key, p, n);
    *len = n;
    return 0;
  }
  memcpy(c->key, p, at);
  c->key[at] = '*';
  memcpy(c->key + at + 1, p + at + flen, n - at - flen);
  *len = n - flen + 1;
  *field_at = at;
  return 0;
}

static uint64_t hash_bytes(const char *p, size_t n) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a */
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)p[i]) * 1099511628211ull;
  return h;
}

/* The oldest waiting group with this key that the slot may join, or NULL. */
static group_t *find_group(console_t *c, int slot, uint64_t hash, size_t len) {
  for (group_t *g = c->bucket_head[hash % BUCKETS]; g; g = g->chain)
    if (g->seq > c->last[slot] && g->hash == hash && g->len == len && !memcmp(g->key, c->key, len)) return g;
  return NULL;
}

/* A new group for the slot's line (from c->key when matchable, else p), appended; NULL when out
 * of memory. */
static group_t *new_group(console_t *c, int slot, const char *text, size_t len, int matchable, uint64_t hash,
                          uint64_t now) {
  size_t bits = ((size_t)c->n + 7) / 8;
  group_t *g = calloc(1, sizeof *g + bits + len);
  if (!g) return NULL;
  g->members = (unsigned char *)(g + 1);
  g->key = (char *)g->members + bits;
  memcpy(g->key, text, len);
  g->len = len;
  g->seq = ++c->next_seq;
  g->deadline = now + c->window;
  g->first_slot = slot;
  g->matchable = matchable;
  g->hash = hash;
  if (c->tail) c->tail->next = g;
  else c->head = g;
  c->tail = g;
  if (matchable) {
    size_t b = hash % BUCKETS;
    if (c->bucket_tail[b]) c->bucket_tail[b]->chain = g;
    else c->bucket_head[b] = g;
    c->bucket_tail[b] = g;
  }
  c->waiting++;
  c->bytes += len;
  return g;
}

void console_line(console_t *c, int slot, const char *p, size_t n, uint64_t now) {
  if (slot < 0 || slot >= c->n) return;
  size_t len = n, field_at = 0;
  int has_field = 0;
  int matchable = !make_key(c, slot, p, n, &len, &has_field, &field_at);
  uint64_t hash = matchable ? hash_bytes(c->key, len) : 0;
  group_t *g = matchable ? find_group(c, slot, hash, len) : NULL;
  if (!g) {
    g = new_group(c, slot, matchable ? c->key : p, len, matchable, hash, now);
    if (!g) {
      /* Out of memory: what waits goes out first, then this line alone, in order. */
      console_flush_all(c);
      char pre[32];
      int k = snprintf(pre, sizeof pre, "[rank%d]:", c->first_rank + slot);
      c->write_fn(c->arg, pre, (size_t)k);
      c->write_fn(c->arg, p, n);
      c->write_fn(c->arg, "\n", 1);
      return;
    }
    g->has_field = has_field;
    g->field_at = field_at;
  }
  g->members[slot / 8] |= (unsigned char)(1u << (slot % 8));
  g->count++;
  c->last[slot] = g->seq;
  console_flush_due(c, now);
}
