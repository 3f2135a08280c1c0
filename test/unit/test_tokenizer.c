// deps: trainer/formats/tokenizer.c common/fs.c common/err.c test/support/files.c
/* test_tokenizer: encoding with hand-made tokenizers whose ids are worked out by hand, round
 * trips on hard text, every malformed file refused with a message naming it, and
 * tokenizer_json_bos_first's post-processor for each kind of post_processor a file may have.
 *
 * Files are written into a fresh mkdtemp directory:
 *   tiny.json / tiny_pairs.json  21 byte-level tokens, 8 merges (as "a b" strings / as [a, b]
 *                pairs), the special token <|endoftext|>, a Split regex then ByteLevel
 *   full.json    all 256 bytes + GPT-2's ByteLevel regex + 3 merges + <|endoftext|>, for round
 *                trips of any bytes (invalid UTF-8 included)
 *   tiny.bin     a llama2.c tokenizer: <unk>, <s>, </s>, the 256 <0xNN> byte tokens, 16 pieces
 * The expected ids are derived in the comments beside each case. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cJSON.h>
#include <cmocka.h>

#include "test/support/files.h"

#include "trainer/formats/tokenizer.h"

static char dir[256];

static void path_in(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", dir, name); }

static void write_text(const char *name, const char *text) {
  char p[300];
  path_in(p, sizeof p, name);
  testfile_write(p, text, strlen(text));
}

/* ---------------------------------------------------------------- the tiny tokenizer.json */

/* Byte-level strings: "Ġ" is the space, "Ċ" the newline, "Ã" and "©" the bytes C3 A9 of "é". */
static const char TINY_HEAD[] =
    "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null,\n"
    " \"added_tokens\": [{\"id\": 21, \"content\": \"<|endoftext|>\", \"single_word\": false, \"lstrip\": false,\n"
    "                   \"rstrip\": false, \"normalized\": false, \"special\": true}],\n"
    " \"normalizer\": null,\n"
    " \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [\n"
    "   {\"type\": \"Split\", \"pattern\": {\"Regex\": "
    "\"(?i:'s)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,2}|\\\\s+(?!\\\\S)|\\\\s+|[^\\\\s\\\\p{L}\\\\p{N}]+\"},\n"
    "    \"behavior\": \"Isolated\", \"invert\": false},\n"
    "   {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]},\n"
    " \"post_processor\": null,\n"
    " \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true},\n"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": null,\n"
    "   \"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,\n"
    "   \"vocab\": {\"a\": 0, \"b\": 1, \"c\": 2, \"d\": 3, \"Ġ\": 4, \"Ċ\": 5, \"'\": 6, \"s\": 7, \"1\": 8, \"2\": 9,\n"
    "             \"3\": 10, \"Ã\": 11, \"©\": 12, \"ab\": 13, \"abc\": 14, \"Ġab\": 15, \"Ġabc\": 16, \"'s\": 17,\n"
    "             \"ĠĠ\": 18, \"12\": 19, \"Ã©\": 20},\n";
/* Ranks 0..7. "Ġab c" never applies to " abc": ab + c (rank 1) is taken before Ġ + ab (rank 2). */
static const char TINY_MERGES_STR[] =
    "   \"merges\": [\"a b\", \"ab c\", \"Ġ ab\", \"Ġab c\", \"' s\", \"Ġ Ġ\", \"1 2\", \"Ã ©\"]}}\n";
static const char TINY_MERGES_PAIRS[] =
    "   \"merges\": [[\"a\", \"b\"], [\"ab\", \"c\"], [\"Ġ\", \"ab\"], [\"Ġab\", \"c\"], [\"'\", \"s\"], [\"Ġ\", \"Ġ\"],\n"
    "              [\"1\", \"2\"], [\"Ã\", \"©\"]]}}\n";

static void write_tiny(const char *name, const char *merges) {
  char *s;
  assert_true(asprintf(&s, "%s%s", TINY_HEAD, merges) > 0);
  write_text(name, s);
  free(s);
}

/* A copy of text with its first `from` replaced by `to`, written as name. */
static void write_edited(const char *name, const char *text, const char *from, const char *to) {
  const char *at = strstr(text, from);
  assert_non_null(at);
  char *o;
  assert_true(asprintf(&o, "%.*s%s%s", (int)(at - text), text, to, at + strlen(from)) > 0);
  write_text(name, o);
  free(o);
}

/* A copy of the tiny file with the first `from` replaced by `to`. */
static void write_tiny_edit(const char *name, const char *from, const char *to) {
  char *s;
  assert_true(asprintf(&s, "%s%s", TINY_HEAD, TINY_MERGES_STR) > 0);
  write_edited(name, s, from, to);
  free(s);
}

static tokenizer_t *load_ok(const char *name) {
  char p[300], err[512];
  path_in(p, sizeof p, name);
  tokenizer_t *t = NULL;
  int rc = tokenizer_load(&t, p, err, sizeof err);
  if (rc) printf("  load %s: %s\n", name, err);
  assert_int_equal(rc, 0);
  assert_non_null(t);
  return t;
}

static void expect_ids(const tokenizer_t *t, const char *text, size_t len, const int32_t *want, size_t nwant) {
  int32_t *ids;
  size_t n;
  char err[512];
  int rc = tokenizer_encode(t, text, len, &ids, &n, err, sizeof err);
  if (rc) printf("  encode: %s\n", err);
  assert_int_equal(rc, 0);
  int same = n == nwant && memcmp(ids, want, n * sizeof *ids) == 0;
  if (!same) {
    printf("  %zu-byte text: got", len);
    for (size_t i = 0; i < n; i++) printf(" %d", ids[i]);
    printf(", want");
    for (size_t i = 0; i < nwant; i++) printf(" %d", want[i]);
    printf("\n");
  }
  free(ids);
  assert_true(same);
}

#define EXPECT(t, text, ...)                                                                                          \
  do {                                                                                                                \
    const int32_t want_[] = {__VA_ARGS__};                                                                            \
    expect_ids(t, text, sizeof(text) - 1, want_, sizeof want_ / sizeof *want_);                                       \
  } while (0)

/* decode(encode(text)) == text, and the concatenated token_bytes give the same bytes. */
static void round_trip(const tokenizer_t *t, const char *text, size_t len) {
  int32_t *ids;
  size_t n, dl;
  char err[512], *back;
  assert_int_equal(tokenizer_encode(t, text, len, &ids, &n, err, sizeof err), 0);
  assert_int_equal(tokenizer_decode(t, ids, n, &back, &dl), 0);
  if (dl != len || memcmp(back, text, len) != 0)
    printf("  round trip of %zu bytes gave %zu: %.*s\n", len, dl, (int)dl, back);
  assert_int_equal(dl, len);
  assert_memory_equal(back, text, len);
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    size_t l;
    const char *p = tokenizer_token_bytes(t, ids[i], i ? ids[i - 1] : tokenizer_bos(t), &l);
    assert_non_null(p);
    assert_true(at + l <= dl);
    assert_memory_equal(p, back + at, l);
    at += l;
  }
  assert_int_equal(at, dl);
  free(ids);
  free(back);
}

static void test_tiny_json(void **state) {
  write_tiny("tiny.json", TINY_MERGES_STR);
  write_tiny("tiny_pairs.json", TINY_MERGES_PAIRS);
  const char *names[] = {"tiny.json", "tiny_pairs.json"};
  for (int f = 0; f < 2; f++) {
    tokenizer_t *t = load_ok(names[f]);
    assert_int_equal(tokenizer_vocab_size(t), 22);
    assert_int_equal(tokenizer_bos(t), 21); /* <|endoftext|>, as GPT-2 */
    assert_int_equal(tokenizer_eos(t), 21);
    EXPECT(t, "abc", 14);               /* a b c -> ab c (rank 0) -> abc (rank 1) */
    EXPECT(t, " abc", 4, 14);           /* Ġ a b c -> Ġ ab c -> Ġ abc: ab+c (1) beats Ġ+ab (2), no Ġ+abc */
    EXPECT(t, " abd", 15, 3);           /* Ġ a b d -> Ġ ab d -> Ġab d */
    EXPECT(t, "ab's", 13, 17);          /* split "ab" | "'s"; ' s -> 's */
    EXPECT(t, "12312", 19, 10, 8, 9);   /* \p{N}{1,2}: "12" "31" "2"; no "3 1" merge */
    EXPECT(t, "a   b", 0, 18, 4, 1);    /* \s+(?!\S) keeps one space for " b": "a" "  " " b" */
    EXPECT(t, "c\n\nd", 2, 5, 5, 3);    /* "\n" (lookahead), "\n" (\s+), "d" */
    EXPECT(t, "\xC3\xA9", 20);          /* é: Ã © -> Ã© */
    EXPECT(t, "aXb", 13);               /* X is not in the vocab and there is no unk: dropped, a b -> ab */
    EXPECT(t, "abc<|endoftext|> ab", 14, 21, 15); /* special token cut out before the regex */
    EXPECT(t, "<|endoftext|><|endoftext|>", 21, 21);
    EXPECT(t, "<|endoftext|", 3);       /* not the token: "<|" "endoftext" "|", of which the vocab has only d */
    tokenizer_free(t);
  }
}

/* ---------------------------------------------------------------- full byte alphabet, GPT-2 regex */

/* GPT-2's bytes_to_unicode (the test's own copy): printable bytes stand for themselves, the
 * other 68 for U+0100 onwards in byte order. Writes the JSON-escaped UTF-8 of byte b's char. */
static void byte_char_json(int b, char *out) {
  int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE, n = 0;
  for (int c = 0; c < b; c++)
    if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE)) n++;
  unsigned cp = printable ? (unsigned)b : 256u + (unsigned)n;
  if (cp == '"' || cp == '\\') sprintf(out, "\\%c", cp);
  else if (cp < 0x80) sprintf(out, "%c", cp);
  else sprintf(out, "%c%c", 0xC0 | (cp >> 6), 0x80 | (cp & 0x3F));
}

static void write_full(const char *name) {
  char p[300], ch[8];
  path_in(p, sizeof p, name);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fprintf(f, "{\"added_tokens\": [{\"id\": 259, \"content\": \"<|endoftext|>\", \"special\": true,"
             " \"normalized\": false}], \"normalizer\": null,"
             " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": true},"
             " \"decoder\": {\"type\": \"ByteLevel\"},"
             " \"model\": {\"type\": \"BPE\", \"vocab\": {");
  for (int b = 0; b < 256; b++) {
    byte_char_json(b, ch);
    fprintf(f, "\"%s\": %d, ", ch, b);
  }
  fprintf(f, "\"Ġt\": 256, \"he\": 257, \"Ġthe\": 258}, \"merges\": [\"Ġ t\", \"h e\", \"Ġt he\"]}}");
  assert_int_equal(fclose(f), 0);
}

#define S(lit) {lit, sizeof(lit) - 1}
static const struct {
  const char *s;
  size_t n;
} HARD[] = {
    S("Hello, World! It's can't we're they've I'm you'll he'd IT'S CAN'T WE'RE THEY'VE I'M YOU'LL HE'D"),
    S("\xce\x95\xce\xbb\xce\xbb\xce\xb7\xce\xbd\xce\xb9\xce\xba\xce\xac \xd0\xa0\xd1\x83\xd1\x81\xd1\x81\xd0\xba"
      "\xd0\xb8\xd0\xb9 \xd8\xa7\xd9\x84\xd8\xb9\xd8\xb1\xd8\xa8\xd9\x8a\xd8\xa9 \xe4\xb8\xad\xe6\x96\x87 "
      "\xed\x95\x9c\xea\xb5\xad\xec\x96\xb4 \xd9\xa1\xd9\xa2\xd9\xa3 \xe0\xa5\xaa\xe0\xa5\xa8 \xc2\xbd \xc2\xb2"),
    S("emoji \xf0\x9f\x98\x80 family \xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7 "
      "flag \xf0\x9f\x87\xab\xf0\x9f\x87\xb7 skin \xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd"),
    S("combining e\xcc\x81 a\xcc\x88\xcc\x84 \xe0\xa4\x95\xe0\xa5\x8d\xe0\xa4\xb7"),
    S("  two   three\t\ttabs \t mixed\n\n\nnewlines\r\nCRLF\r\n trailing   "),
    S("special<|endoftext|>inside <|endoftext|> spaced <|endoftext|><|endoftext|>twice"),
    S("1234567890123456789 3.14159 1,000,000"),
    S("\0nul\0 in the middle\0"),
    S("invalid \xff\xfe lone \xc3 stray \x80 surrogate \xed\xa0\x80 past \xf4\x90\x80\x80 end \xe2\x82"),
    S(" "),
    S(" leading space"),
    S("\n"),
    S(""),
};

static void test_full_json(void **state) {
  write_full("full.json");
  tokenizer_t *t = load_ok("full.json");
  assert_int_equal(tokenizer_vocab_size(t), 260);
  EXPECT(t, " the cat", 258, 32, 99, 97, 116); /* Ġ t h e -> Ġt h e -> Ġt he -> Ġthe; " cat" has no merges */
  EXPECT(t, "the", 116, 257);                  /* t h e -> t he: there is no "t he" merge */
  EXPECT(t, "a<|endoftext|>", 97, 259);
  for (size_t i = 0; i < sizeof HARD / sizeof *HARD; i++) round_trip(t, HARD[i].s, HARD[i].n);
  /* A long run of spaces: \s+(?!\S) backtracks over all of it (the JIT stack must hold). */
  size_t n = 1 << 20;
  char *sp = malloc(n);
  assert_non_null(sp);
  memset(sp, ' ', n);
  sp[n - 1] = 'x';
  round_trip(t, sp, n);
  free(sp);
  tokenizer_free(t);
}

/* ---------------------------------------------------------------- llama2.c tokenizer.bin */

typedef testpiece_t piece_t;

/* ids 259.. after <unk> <s> </s> and the byte tokens; "▁d" is read as " d". */
static const piece_t PIECES[] = {
    {"a", -10}, {"b", -10},  {"c", -10},  {" ", -10},          {"ab", -1},  {"bc", -2},  {" a", -3},   {" ab", -0.5f},
    {"\xc3\xa9", -5}, {"\xe2\x96\x81" "d", -4}, {"d", -10}, {"x", -10}, {"y", -10}, {"z", -10}, {"xy", -1}, {"yz", -1},
};

/* Writes a tokenizer.bin in the scratch directory; returns its size. with_bytes: the 256 <0xNN>
 * tokens at 3..258. */
static size_t write_bin(const char *name, int32_t max_len, int with_bytes, const piece_t *extra, int nextra) {
  char path[300];
  path_in(path, sizeof path, name);
  return testfile_write_llama2c_tok(path, max_len, with_bytes, extra, nextra);
}

static void test_llama2c_bin(void **state) {
  write_bin("tiny.bin", 8, 1, PIECES, (int)(sizeof PIECES / sizeof *PIECES));
  tokenizer_t *t = load_ok("tiny.bin");
  assert_int_equal(tokenizer_vocab_size(t), 275);
  assert_int_equal(tokenizer_bos(t), 1);
  assert_int_equal(tokenizer_eos(t), 2);
  /* " " is the dummy prefix (262). " abc": " "+a -3, a+b -1, b+c -2 -> ab first; then " "+ab
   * makes " ab" (-0.5); " ab"+c is no piece. */
  EXPECT(t, "abc", 266, 261);
  EXPECT(t, "bc", 262, 264);
  EXPECT(t, "\xc3\xa9", 262, 267);            /* é is a piece; " é" is not */
  EXPECT(t, "\xc3\xbc", 262, 0xC3 + 3, 0xBC + 3); /* ü is not: its bytes, id byte + 3 */
  EXPECT(t, "d", 268);                         /* " " + "d" = " d", stored as "▁d" */
  EXPECT(t, "xyz", 262, 273, 272);             /* xy and yz tie at -1: the leftmost merges */
  EXPECT(t, "a\nb", 265, 13, 260);             /* "\n" falls back to <0x0A> = 13 */
  int32_t *ids;
  size_t n;
  char err[512];
  assert_int_equal(tokenizer_encode(t, "", 0, &ids, &n, err, sizeof err), 0);
  assert_int_equal(n, 0); /* no dummy prefix for empty text */
  assert_non_null(ids);
  free(ids);

  /* Decoding: after BOS a piece loses its leading space, a <0x20> byte token does not. */
  size_t l;
  const char *p = tokenizer_token_bytes(t, 266, 1, &l);
  assert_int_equal(l, 2);
  assert_memory_equal(p, "ab", 2);
  p = tokenizer_token_bytes(t, 266, 5, &l);
  assert_int_equal(l, 3);
  assert_memory_equal(p, " ab", 3);
  p = tokenizer_token_bytes(t, 3 + 0x20, 1, &l);
  assert_int_equal(l, 1);
  assert_memory_equal(p, " ", 1);
  p = tokenizer_token_bytes(t, 268, -1, &l);
  assert_int_equal(l, 2);
  assert_memory_equal(p, " d", 2);
  p = tokenizer_token_bytes(t, 1, -1, &l);
  assert_int_equal(l, 5);
  assert_memory_equal(p, "\n<s>\n", 5);
  assert_null(tokenizer_token_bytes(t, 275, -1, &l));
  assert_null(tokenizer_token_bytes(t, -1, -1, &l));
  char *text;
  int32_t seq[] = {1, 266, 261, 3 + '\n', 269};
  assert_int_equal(tokenizer_decode(t, seq, 5, &text, &l), 0);
  assert_int_equal(l, 5 + 3 + 1 + 1);
  assert_memory_equal(text, "\n<s>\nabc\nd", l);
  free(text);
  int32_t bad[] = {266, 275};
  assert_int_equal(tokenizer_decode(t, bad, 2, &text, &l), TOKENIZER_EINVAL);
  assert_null(text);

  for (size_t i = 0; i < sizeof HARD / sizeof *HARD; i++) round_trip(t, HARD[i].s, HARD[i].n);
  tokenizer_free(t);

  /* Without byte tokens, a byte with no piece has no id to fall back to. */
  piece_t few[] = {{" ", -1}, {"a", -1}};
  write_bin("nobytes.bin", 8, 0, few, 2);
  t = load_ok("nobytes.bin");
  assert_int_equal(tokenizer_vocab_size(t), 5);
  EXPECT(t, "aa", 3, 4, 4);
  assert_int_equal(tokenizer_encode(t, "aq", 2, &ids, &n, err, sizeof err), TOKENIZER_EINVAL);
  printf("  byte past the vocab: %s\n", err);
  assert_non_null(strstr(err, "0x71"));
  tokenizer_free(t);
}

/* ---------------------------------------------------------------- llama2.c as tokenizer.json */

static void expect_refused(const char *name, int code, const char *needle);

/* The ids of text under t, malloc'd. */
static int32_t *ids_of(const tokenizer_t *t, const char *text, size_t len, size_t *n) {
  int32_t *ids;
  char err[512];
  int rc = tokenizer_encode(t, text, len, &ids, n, err, sizeof err);
  if (rc) printf("  encode: %s\n", err);
  assert_int_equal(rc, 0);
  return ids;
}

/* Converts name (a tokenizer.bin) with tokenizer_llama2c_json: the code and message. */
static int convert(const char *name, char *err, size_t errlen) {
  tokenizer_t *t = load_ok(name);
  char *json = NULL;
  size_t len;
  int rc = tokenizer_llama2c_json(t, &json, &len, err, errlen);
  tokenizer_free(t);
  if (rc == 0) {
    assert_non_null(json);
    free(json);
  } else {
    assert_null(json);
    printf("  %-22s %s\n", name, err);
  }
  return rc;
}

static void test_llama2c_json(void **state) {
  write_bin("conv.bin", 8, 1, PIECES, (int)(sizeof PIECES / sizeof *PIECES));
  tokenizer_t *bin = load_ok("conv.bin");
  char *json, err[512], p[300];
  size_t len;
  assert_int_equal(tokenizer_llama2c_json(bin, &json, &len, err, sizeof err), 0);
  assert_int_equal(strlen(json), len);
  path_in(p, sizeof p, "conv.json");
  testfile_write(p, json, len);
  /* the document names what the library needs: byte_fallback, the specials, "▁" for a space */
  assert_non_null(strstr(json, "\"byte_fallback\":\ttrue"));
  assert_non_null(strstr(json, "\"content\":\t\"<s>\""));
  assert_non_null(strstr(json, "\"\xe2\x96\x81" "ab\":\t266"));
  free(json);
  tokenizer_t *js = load_ok("conv.json");
  assert_int_equal(tokenizer_vocab_size(js), tokenizer_vocab_size(bin));
  assert_int_equal(tokenizer_bos(js), 1);
  assert_int_equal(tokenizer_eos(js), 2);
  /* the same ids as the .bin on the texts test_llama2c_bin checks and on the hard cases, and the
   * same text back */
  static const char *const texts[] = {"abc", "bc", "\xc3\xa9", "\xc3\xbc", "d", "xyz", "a\nb", "ab abc  bc d", ""};
  int compared = 0;
  for (size_t i = 0; i < sizeof texts / sizeof *texts + sizeof HARD / sizeof *HARD; i++) {
    int easy = i < sizeof texts / sizeof *texts;
    const char *text = easy ? texts[i] : HARD[i - sizeof texts / sizeof *texts].s;
    size_t tl = easy ? strlen(text) : HARD[i - sizeof texts / sizeof *texts].n, na, nb;
    /* not UTF-8: llama2.c takes a stray continuation byte with the byte before it as one
     * character ("y \x80" falls back to <0x20><0x80>), a tokenizer.json reader the space alone;
     * the library cannot be given such text at all */
    if (strncmp(text, "invalid ", 8) == 0) continue;
    int32_t *a = ids_of(bin, text, tl, &na), *b = ids_of(js, text, tl, &nb);
    if (na != nb || memcmp(a, b, na * sizeof *a) != 0) printf("  text %zu: %zu ids from the .bin, %zu from JSON\n", i, na, nb);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof *a);
    compared += (int)na;
    char *da, *db;
    size_t la, lb;
    assert_int_equal(tokenizer_decode(bin, a, na, &da, &la), 0);
    assert_int_equal(tokenizer_decode(js, b, nb, &db, &lb), 0);
    assert_int_equal(la, lb);
    assert_memory_equal(da, db, la);
    free(da), free(db), free(a), free(b);
  }
  printf("  %d ids the same from the .bin and its tokenizer.json\n", compared);
  /* a tokenizer.json is not converted */
  assert_int_equal(tokenizer_llama2c_json(js, &json, &len, err, sizeof err), TOKENIZER_EINVAL);
  tokenizer_free(bin);
  tokenizer_free(js);

  /* what has no tokenizer.json form: no byte tokens at 3..258, a piece that is not UTF-8, two
   * pieces that read the same ("a b" and "a▁b" are both "a▁b") */
  piece_t few[] = {{" ", -1}, {"a", -1}};
  write_bin("nobytes.bin", 8, 0, few, 2);
  assert_int_equal(convert("nobytes.bin", err, sizeof err), TOKENIZER_EUNSUPPORTED);
  assert_non_null(strstr(err, "id 3 is not the byte token <0x00>"));
  piece_t latin1[] = {{"a", -1}, {"\xe9t\xe9", -1}};
  write_bin("latin1.bin", 8, 1, latin1, 2);
  assert_int_equal(convert("latin1.bin", err, sizeof err), TOKENIZER_EUNSUPPORTED);
  assert_non_null(strstr(err, "token 260 is not valid UTF-8"));
  /* llama2.c takes ids 1 and 2 for BOS and EOS whatever they read; JSON finds them by name */
  write_bin("nobos.bin", 8, 1, few, 2);
  path_in(p, sizeof p, "nobos.bin");
  unsigned char *raw = testfile_read(p, &len);
  unsigned char *at = memmem(raw, len, "\n<s>\n", 5);
  assert_non_null(at);
  at[2] = 't';
  testfile_write(p, raw, len);
  free(raw);
  assert_int_equal(convert("nobos.bin", err, sizeof err), TOKENIZER_EUNSUPPORTED);
  assert_non_null(strstr(err, "ids 1 and 2 are not <s> and </s>"));
  piece_t twice[] = {{"a b", -1}, {"a\xe2\x96\x81" "b", -2}};
  write_bin("twice.bin", 8, 1, twice, 2);
  assert_int_equal(convert("twice.bin", err, sizeof err), TOKENIZER_EUNSUPPORTED);
  assert_non_null(strstr(err, "tokens 259 and 260"));
}

/* A sentencepiece-style tokenizer.json (Llama 2's layout) and what is refused in one. */
static const char SPM_JSON[] =
    "{\"added_tokens\": [{\"id\": 0, \"content\": \"<unk>\", \"special\": true, \"normalized\": false},\n"
    " {\"id\": 1, \"content\": \"<s>\", \"special\": true, \"normalized\": false}],\n"
    " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": \"_\"},\n"
    "   {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"_\"}]},\n"
    " \"pre_tokenizer\": null,\n"
    " \"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"_\"},\n"
    "   \"content\": \" \"}, {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"},\n"
    "   {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]},\n"
    " \"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"fuse_unk\": true, \"byte_fallback\": true,\n"
    "   \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"<0x21>\": 2, \"_\": 3, \"a\": 4, \"b\": 5, \"_a\": 6, \"ab\": 7, \"_ab\": 8},\n"
    "   \"merges\": [[\"a\", \"b\"], [\"_\", \"ab\"], [\"_\", \"a\"]]}}\n";

static void test_sentencepiece_json(void **state) {
  write_text("spm.json", SPM_JSON);
  tokenizer_t *t = load_ok("spm.json");
  assert_int_equal(tokenizer_bos(t), 1);
  EXPECT(t, "ab", 8);             /* "_ab": a+b first (rank 0), then _+ab */
  EXPECT(t, "a a", 6, 6);         /* "_a_a" */
  EXPECT(t, "ab!", 8, 2);         /* "!" is not in the vocab: its byte token <0x21> */
  EXPECT(t, "ab?c", 8, 0);        /* "?" and "c" have neither: one <unk> (fuse_unk) */
  EXPECT(t, "b<s>a", 3, 5, 1, 6); /* <s> is cut out first; each side is normalized on its own */
  int32_t ids[] = {8, 6, 2};
  char *text;
  size_t l;
  assert_int_equal(tokenizer_decode(t, ids, 3, &text, &l), 0);
  assert_string_equal(text, "ab a!"); /* the first space stripped, <0x21> its byte */
  free(text);
  tokenizer_free(t);

  static const struct {
    const char *from, *to, *needle;
  } edits[] = {
      {"{\"type\": \"Prepend\", \"prepend\": \"_\"}", "{\"type\": \"NFKC\"}", "normalizer NFKC"},
      {"\"String\": \" \"}, \"content\": \"_\"", "\"Regex\": \" \"}, \"content\": \"_\"", "Regex pattern"},
      {"{\"type\": \"Fuse\"},", "", "Strip is supported only as Fuse then Strip"},
      {"\"type\": \"ByteFallback\"", "\"type\": \"WordPiece\"", "decoder WordPiece"},
      {"\"content\": \" \"}, {\"type\": \"ByteFallback\"", "\"content\": \"  \"}, {\"type\": \"ByteFallback\"",
       "content longer than its pattern"},
      {"\"pre_tokenizer\": null",
       "\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Metaspace\", \"replacement\": \"_\"},"
       " {\"type\": \"Split\", \"pattern\": {\"String\": \"x\"}, \"behavior\": \"Isolated\"}]}",
       "Metaspace must be the last"},
      {"\"pre_tokenizer\": null", "\"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\": \"_\", "
       "\"prepend_scheme\": \"sometimes\"}", "prepend_scheme sometimes"},
      {"\"pre_tokenizer\": null", "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}", "byte_fallback beside ByteLevel"},
  };
  for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
    char name[32];
    snprintf(name, sizeof name, "spm%02zu.json", i);
    write_edited(name, SPM_JSON, edits[i].from, edits[i].to);
    expect_refused(name, TOKENIZER_EUNSUPPORTED, edits[i].needle);
  }
}

/* ---------------------------------------------------------------- folders, ids, arguments */

static void test_folder_and_ids(void **state) {
  char p[300], err[512];
  path_in(p, sizeof p, "model");
  assert_int_equal(mkdir(p, 0755), 0);
  tokenizer_t *t = NULL;
  assert_int_equal(tokenizer_load(&t, p, err, sizeof err), TOKENIZER_EIO); /* no tokenizer.json yet */
  printf("  folder without tokenizer.json: %s\n", err);
  assert_non_null(strstr(err, "model/tokenizer.json"));
  assert_null(t);

  /* tokenizer_config.json names BOS and EOS, as a string or as {"content": ...}. */
  write_tiny("model/tokenizer.json", TINY_MERGES_STR);
  write_text("model/tokenizer_config.json", "{\"bos_token\": {\"content\": \"abc\"}, \"eos_token\": \"ab\"}");
  t = load_ok("model");
  assert_int_equal(tokenizer_bos(t), 14);
  assert_int_equal(tokenizer_eos(t), 13);
  EXPECT(t, " abd", 15, 3);
  tokenizer_free(t);
  write_text("model/tokenizer_config.json", "{\"bos_token\": ");
  assert_int_equal(tokenizer_load(&t, p, err, sizeof err), TOKENIZER_EFORMAT);
  printf("  bad tokenizer_config.json: %s\n", err);
  assert_non_null(strstr(err, "tokenizer_config.json"));

  /* An added token takes the id the library gives it (the vocab's entry count here), whatever
   * the file says: Python's tokenizers assigns ids that way on load. */
  write_tiny_edit("id30.json", "\"id\": 21", "\"id\": 30");
  t = load_ok("id30.json");
  assert_int_equal(tokenizer_vocab_size(t), 22);
  EXPECT(t, "a<|endoftext|>", 0, 21);
  tokenizer_free(t);

  /* Arguments. */
  int32_t *ids;
  size_t n;
  assert_int_equal(tokenizer_encode(NULL, "a", 1, &ids, &n, err, sizeof err), TOKENIZER_EINVAL);
  assert_int_equal(tokenizer_load(NULL, p, err, sizeof err), TOKENIZER_EINVAL);
  assert_int_equal(tokenizer_vocab_size(NULL), 0);
  assert_int_equal(tokenizer_bos(NULL), -1);
  tokenizer_free(NULL);
}

/* ---------------------------------------------------------------- BOS first for the library */

/* tokenizer_json_bos_first on the tiny file whose post_processor is pp; returns its code, the
 * rewritten document parsed into *doc (NULL when not rewritten) and the note. */
static int bos_first(const tokenizer_t *t, const char *pp, cJSON **doc, char *note, size_t notelen) {
  char *src, *out = (char *)1;
  size_t n = 0;
  assert_true(asprintf(&src, "%s%s", TINY_HEAD, TINY_MERGES_STR) > 0);
  char *at = strstr(src, "\"post_processor\": null");
  assert_non_null(at);
  char *text;
  assert_true(asprintf(&text, "%.*s\"post_processor\": %s%s", (int)(at - src), src, pp,
                       at + strlen("\"post_processor\": null")) > 0);
  int rc = tokenizer_json_bos_first(t, text, strlen(text), &out, &n, note, notelen);
  printf("  post_processor %.60s: %d%s%s\n", pp, rc, note[0] ? ", " : "", note);
  *doc = NULL;
  if (rc == 1) {
    assert_non_null(out);
    assert_int_equal(strlen(out), n);
    *doc = cJSON_Parse(out);
    assert_non_null(*doc);
    /* the rest of the document is the source's */
    cJSON *want = cJSON_Parse(text);
    cJSON_DeleteItemFromObjectCaseSensitive(want, "post_processor");
    cJSON *got = cJSON_Duplicate(*doc, 1);
    cJSON_DeleteItemFromObjectCaseSensitive(got, "post_processor");
    assert_true(cJSON_Compare(got, want, 1));
    cJSON_Delete(got);
    cJSON_Delete(want);
    /* and done again, it is left as it is */
    char *again = NULL, note2[256];
    assert_int_equal(tokenizer_json_bos_first(t, out, n, &again, &n, note2, sizeof note2), 0);
    assert_null(again);
  } else {
    assert_null(out);
  }
  free(out);
  free(text);
  free(src);
  return rc;
}

/* Whether pp is the template <|endoftext|> (21) then the text. */
static void expect_bos_template(const cJSON *pp) {
  char *s = cJSON_PrintUnformatted(pp);
  assert_string_equal(s, "{\"type\":\"TemplateProcessing\","
                         "\"single\":[{\"SpecialToken\":{\"id\":\"<|endoftext|>\",\"type_id\":0}},"
                         "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],"
                         "\"pair\":[{\"SpecialToken\":{\"id\":\"<|endoftext|>\",\"type_id\":0}},"
                         "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}},"
                         "{\"SpecialToken\":{\"id\":\"<|endoftext|>\",\"type_id\":1}},"
                         "{\"Sequence\":{\"id\":\"B\",\"type_id\":1}}],"
                         "\"special_tokens\":{\"<|endoftext|>\":{\"id\":\"<|endoftext|>\",\"ids\":[21],"
                         "\"tokens\":[\"<|endoftext|>\"]}}}");
  cJSON_free(s);
}

#define BYTE_LEVEL "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": true}"
#define TEMPLATE(single, id)                                                                                          \
  "{\"type\": \"TemplateProcessing\", \"single\": " single ", \"pair\": [], \"special_tokens\": {\"<|endoftext|>\": " \
  "{\"id\": \"<|endoftext|>\", \"ids\": [" id "], \"tokens\": [\"<|endoftext|>\"]}}}"
#define BOS_STEP "{\"SpecialToken\": {\"id\": \"<|endoftext|>\", \"type_id\": 0}}"
#define A_STEP "{\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}"
#define BOS_A "[" BOS_STEP ", " A_STEP "]"
#define BOS_A_BOS "[" BOS_STEP ", " A_STEP ", " BOS_STEP "]"

static void test_json_bos_first(void **state) {
  write_tiny("bos.json", TINY_MERGES_STR);
  tokenizer_t *t = load_ok("bos.json");
  assert_int_equal(tokenizer_bos(t), 21);
  char note[256];
  cJSON *doc;

  /* none (prepare_data.py's): the template alone */
  assert_int_equal(bos_first(t, "null", &doc, note, sizeof note), 1);
  expect_bos_template(cJSON_GetObjectItemCaseSensitive(doc, "post_processor"));
  assert_string_equal(note, "");
  cJSON_Delete(doc);
  /* GPT-2's ByteLevel: kept, the template after it */
  assert_int_equal(bos_first(t, BYTE_LEVEL, &doc, note, sizeof note), 1);
  const cJSON *pp = cJSON_GetObjectItemCaseSensitive(doc, "post_processor");
  assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(pp, "type")), "Sequence");
  const cJSON *steps = cJSON_GetObjectItemCaseSensitive(pp, "processors");
  assert_int_equal(cJSON_GetArraySize(steps), 2);
  cJSON *bl = cJSON_Parse(BYTE_LEVEL);
  assert_true(cJSON_Compare(cJSON_GetArrayItem(steps, 0), bl, 1));
  cJSON_Delete(bl);
  expect_bos_template(cJSON_GetArrayItem(steps, 1));
  assert_string_equal(note, "");
  cJSON_Delete(doc);
  /* Llama 2's and Llama 3's: BOS first already, the file is left as it is */
  assert_int_equal(bos_first(t, TEMPLATE(BOS_A, "21"), &doc, note, sizeof note), 0);
  assert_int_equal(bos_first(t, "{\"type\": \"Sequence\", \"processors\": [" BYTE_LEVEL ", " TEMPLATE(BOS_A, "21") "]}",
                             &doc, note, sizeof note),
                   0);
  /* a template that adds more than BOS, or another token; another processor: replaced, named */
  assert_int_equal(bos_first(t, TEMPLATE(BOS_A_BOS, "21"), &doc, note, sizeof note), 1);
  expect_bos_template(cJSON_GetObjectItemCaseSensitive(doc, "post_processor"));
  assert_string_equal(note, "its post-processor's TemplateProcessing step is dropped");
  cJSON_Delete(doc);
  assert_int_equal(bos_first(t, TEMPLATE(BOS_A, "20"), &doc, note, sizeof note), 1);
  expect_bos_template(cJSON_GetObjectItemCaseSensitive(doc, "post_processor"));
  cJSON_Delete(doc);
  assert_int_equal(bos_first(t, "{\"type\": \"RobertaProcessing\", \"sep\": [\"a\", 0], \"cls\": [\"b\", 1]}", &doc,
                             note, sizeof note),
                   1);
  assert_string_equal(note, "its post-processor's RobertaProcessing step is dropped");
  cJSON_Delete(doc);
  tokenizer_free(t);

  /* no BOS: nothing to put first, nothing changed */
  write_tiny_edit("nobos.json", "<|endoftext|>", "<|x|>");
  t = load_ok("nobos.json");
  assert_int_equal(tokenizer_bos(t), -1);
  assert_int_equal(bos_first(t, "null", &doc, note, sizeof note), 0);
  tokenizer_free(t);
  char *out = NULL;
  assert_int_equal(tokenizer_json_bos_first(NULL, "{}", 2, &out, NULL, note, sizeof note), TOKENIZER_EINVAL);
}

/* ---------------------------------------------------------------- malformed files */

static void expect_refused(const char *name, int code, const char *needle) {
  char p[300], err[512] = "";
  path_in(p, sizeof p, name);
  tokenizer_t *t = (tokenizer_t *)1;
  int rc = tokenizer_load(&t, p, err, sizeof err);
  printf("  %-22s %s\n", name, err);
  assert_int_equal(rc, code);
  assert_null(t);
  assert_non_null(strstr(err, p));  /* names the file */
  assert_non_null(strstr(err, needle));
  assert_null(strchr(err, '\n')); /* one line */
}

static void test_malformed_json(void **state) {
  write_text("bad.json", "{\"model\": {\"type\": \"BPE\", ");
  expect_refused("bad.json", TOKENIZER_EFORMAT, "bad JSON");
  static const struct {
    const char *from, *to;
    int code;
    const char *needle;
  } edits[] = {
      {"\"1 2\"", "\"1 9\"", TOKENIZER_EFORMAT, "merges[6] names 9, which is not in the vocab"},
      {"\"1 2\"", "\"2 1\"", TOKENIZER_EFORMAT, "merges[6] makes 21, which is not in the vocab"},
      {"\"1 2\"", "\"12\"", TOKENIZER_EFORMAT, "merges[6] is neither"},
      {"\"type\": \"BPE\"", "\"type\": \"WordPiece\"", TOKENIZER_EUNSUPPORTED, "model type WordPiece"},
      {"\"normalizer\": null", "\"normalizer\": {\"type\": \"NFC\"}", TOKENIZER_EUNSUPPORTED, "normalizer NFC"},
      {"\"type\": \"Split\"", "\"type\": \"Whitespace\"", TOKENIZER_EUNSUPPORTED, "pre_tokenizer Whitespace"},
      {"\"Isolated\"", "\"Removed\"", TOKENIZER_EUNSUPPORTED, "behavior Removed"},
      {"\"invert\": false", "\"invert\": true", TOKENIZER_EUNSUPPORTED, "invert"},
      {"(?i:'s)|", "(?i:'s|", TOKENIZER_EUNSUPPORTED, "does not compile"},
      {"\"decoder\": {\"type\": \"ByteLevel\"", "\"decoder\": {\"type\": \"Metaspace\"", TOKENIZER_EUNSUPPORTED,
       "decoder Metaspace"},
      {"\"byte_fallback\": false", "\"byte_fallback\": true", TOKENIZER_EUNSUPPORTED, "byte_fallback"},
      {"\"dropout\": null", "\"dropout\": 0.1", TOKENIZER_EUNSUPPORTED, "dropout"},
      {"\"single_word\": false", "\"single_word\": true", TOKENIZER_EUNSUPPORTED, "single_word"},
      {"{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}",
       "{\"type\": \"Split\", \"pattern\": {\"String\": \"x\"}, \"behavior\": \"Isolated\"}", TOKENIZER_EUNSUPPORTED,
       "must end in one ByteLevel"},
      {"\"pre_tokenizer\": {", "\"pre_tokenizer\": null, \"x\": {", TOKENIZER_EUNSUPPORTED, "no pre_tokenizer"},
      {"\"d\": 3", "\"d\": -3", TOKENIZER_EFORMAT, "\"d\" has a bad id"},
      {"\"d\": 3", "\"d\": 2", TOKENIZER_EFORMAT, "vocab id 2 is used twice"},
      {"\"model\":", "\"modelx\":", TOKENIZER_EFORMAT, "no \"model\""},
      {"\"content\": \"<|endoftext|>\"", "\"content\": \"\"", TOKENIZER_EFORMAT, "added_tokens[0]"},
      {"\"unk_token\": null", "\"unk_token\": \"<unk>\"", TOKENIZER_EFORMAT, "unk_token <unk>"},
      {"\"merges\": [", "\"merges\": {\"x\": 1}, \"y\": [", TOKENIZER_EFORMAT, "model.merges is not a list"},
  };
  for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
    char name[32];
    snprintf(name, sizeof name, "edit%02zu.json", i);
    write_tiny_edit(name, edits[i].from, edits[i].to);
    expect_refused(name, edits[i].code, edits[i].needle);
  }
}

static void test_malformed_bin(void **state) {
  char p[300], q[300];
  size_t n = write_bin("good.bin", 8, 1, PIECES, (int)(sizeof PIECES / sizeof *PIECES));
  path_in(p, sizeof p, "good.bin");
  size_t len;
  unsigned char *b = testfile_read(p, &len);
  assert_int_equal(len, n);
  path_in(q, sizeof q, "cut.bin");
  testfile_write(q, b, n - 2); /* the last piece loses a byte */
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "truncated");
  testfile_write(q, b, n - 3 - 8); /* "yz" gone, 3 bytes of the record before it too */
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "truncated");
  testfile_write(q, b, 4 + 6); /* the header and half of <unk>'s record */
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "truncated");
  testfile_write(q, b, 4);
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "no tokens");
  testfile_write(q, b, 2);
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "too short");
  testfile_write(q, b, 0);
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "too short");

  int32_t neg = -1;
  memcpy(b + 4 + 4, &neg, 4); /* <unk>'s length */
  testfile_write(q, b, n);
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "token 0 has length -1");
  int32_t big = 9;
  memcpy(b + 4 + 4, &big, 4);
  testfile_write(q, b, n);
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "token 0 has length 9");
  int32_t five = 5;
  memcpy(b + 4 + 4, &five, 4);
  float nan = 0.0f / 0.0f;
  memcpy(b + 4, &nan, 4);
  testfile_write(q, b, n);
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "token 0 has score");
  int32_t zero = 0;
  memcpy(b, &zero, 4);
  testfile_write(q, b, n);
  expect_refused("cut.bin", TOKENIZER_EFORMAT, "max_token_length 0");
  free(b);

  char err[512];
  tokenizer_t *t = NULL;
  path_in(p, sizeof p, "nonexistent.json");
  assert_int_equal(tokenizer_load(&t, p, err, sizeof err), TOKENIZER_EIO);
  printf("  missing file:          %s\n", err);
  assert_non_null(strstr(err, p));
  assert_non_null(strstr(err, "No such file"));
}

static int setup(void **state) {
  return testdir_make(dir, sizeof dir, "test_tokenizer");
}
static int teardown(void **state) {
  return testdir_remove(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tiny_json),      cmocka_unit_test(test_full_json),     cmocka_unit_test(test_llama2c_bin),
      cmocka_unit_test(test_llama2c_json),   cmocka_unit_test(test_sentencepiece_json),
      cmocka_unit_test(test_folder_and_ids), cmocka_unit_test(test_json_bos_first),
      cmocka_unit_test(test_malformed_json), cmocka_unit_test(test_malformed_bin),
  };
  return cmocka_run_group_tests_name("tokenizer", tests, setup, teardown);
}
