/* tokenizer: text to token ids and back, for the two tokenizer files models come with.
 *
 *   tokenizer.json   Hugging Face's: byte-level BPE as GPT-2 and Llama 3 use it. model BPE
 *                    (vocab, merges as "a b" strings or [a, b] pairs, ignore_merges, unk_token),
 *                    pre_tokenizer ByteLevel (GPT-2's regex when use_regex, add_prefix_space) or a
 *                    Sequence of Split (regex or string pattern, behavior Isolated, invert false)
 *                    ending in ByteLevel, as Llama 3's; decoder ByteLevel; added_tokens matched
 *                    literally in the input before pre-tokenization (leftmost, longest first;
 *                    lstrip/rstrip honoured), as the library does. Regexes run on PCRE2 with
 *                    Unicode properties (\p{L}, \p{N}, (?i:...), \s+(?!\S)).
 *                    Also sentencepiece-style BPE as Llama 2, Mistral and TinyLlama use it (and
 *                    tokenizer_llama2c_json writes): model BPE with byte_fallback (a character
 *                    the vocab lacks is its <0xNN> tokens) and fuse_unk; normalizer Prepend and
 *                    Replace of a String (Sequence of them), applied to each piece between added
 *                    tokens; pre_tokenizer null, or Metaspace (replacement, prepend_scheme
 *                    always/first/never, split) after any Split steps; decoder Replace,
 *                    ByteFallback, Fuse, Strip(" ", 1, 0) or Metaspace. Words are merged from
 *                    UTF-8 characters, not bytes.
 *   tokenizer.bin    llama2.c's: int32 max_token_length, then per token float score, int32 len,
 *                    len bytes; the vocab size is what the file holds. Encoding follows llama2.c's
 *                    run.c: a dummy-prefix space, each UTF-8 character its token or its bytes as
 *                    <0xNN> tokens (id byte + 3), then the adjacent pair whose merge has the best
 *                    score is merged until none can be. BOS 1, EOS 2. A sentencepiece "▁" in a
 *                    piece is read as a space.
 * The kind is told from the content (JSON opens with '{'), not the name; a folder stands for
 * its tokenizer.json (and its tokenizer_config.json, when there, names BOS and EOS).
 *
 * Added tokens get the ids the library gives them on load (a content the vocab has takes the
 * vocab's id, others follow the vocab), which are the file's ids in any file the library wrote.
 *
 * Encoding merges by rank (or score) with a priority queue, so a long word costs n log n, and
 * keeps a cache of words per call; nothing is shared between calls, so one tokenizer_t serves
 * several threads. Refused at load, with a message naming what: WordPiece, Unigram, BPE dropout
 * or subword prefixes/suffixes, byte_fallback beside ByteLevel, normalizers other than the above
 * (NFC, NFKC, Lowercase, Replace of a Regex), pre-tokenizers and decoders other than the above,
 * Split behaviors other than Isolated, single_word added tokens. Ignored: post_processor (no BOS
 * is added), truncation and padding. Input that is not valid UTF-8 is still encoded (its bytes
 * are pieces of their own), which the Python library cannot be given; decoding returns bytes as they are, without
 * the library's replacement of invalid UTF-8. Regex classes follow PCRE2's Unicode tables
 * (Unicode 14 in Debian 12), the library's Oniguruma its own: a character assigned since may
 * split differently. */
#ifndef MESHRUN_TOKENIZER_H
#define MESHRUN_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

enum {
  TOKENIZER_OK = 0,
  TOKENIZER_EINVAL = -1,       /* bad argument from the caller, or an id out of range */
  TOKENIZER_EIO = -2,          /* the file could not be read (errno text in the message) */
  TOKENIZER_EFORMAT = -3,      /* the file is malformed: bad JSON, truncated .bin, unknown token */
  TOKENIZER_EUNSUPPORTED = -4, /* a valid file asking for something this module does not do */
  TOKENIZER_ENOMEM = -5,
  TOKENIZER_EVOCAB = -6,       /* tokenizer_load_within: more ids than the model has */
};

typedef struct tokenizer tokenizer_t;

/* path: a Hugging Face tokenizer.json, a folder holding one, or llama2.c's tokenizer.bin
 * (detected from the content, not the name). Returns 0 and *out, or a negative code with a
 * one-line message naming the file and the cause in err. */
int tokenizer_load(tokenizer_t **out, const char *path, char *err, size_t errlen);
/* tokenizer_load for a model of vocab tokens: a tokenizer with more ids than that is refused
 * with TOKENIZER_EVOCAB ("tokenizer PATH has N tokens, more than the model's vocab_size V"),
 * *out NULL. What sample, export and data load their tokenizer with. */
int tokenizer_load_within(tokenizer_t **out, const char *path, int vocab, char *err, size_t errlen);
void tokenizer_free(tokenizer_t *t); /* accepts NULL */

int tokenizer_vocab_size(const tokenizer_t *t); /* ids are in [0, vocab_size) incl. added/special tokens */
/* BOS and EOS, -1 when none. llama2.c: 1 and 2. tokenizer.json: those a folder's
 * tokenizer_config.json names (bos_token, eos_token), else the first the tokenizer has of
 * <|begin_of_text|> <s> <bos> <|startoftext|> <|endoftext|> (BOS) and <|end_of_text|> </s> <eos>
 * <|endoftext|> (EOS); GPT-2's <|endoftext|> is both. */
int tokenizer_bos(const tokenizer_t *t);
int tokenizer_eos(const tokenizer_t *t);

/* The ids of text[0..len) (no BOS added); *ids malloc'd (non-NULL even when *n is 0), caller
 * frees. Returns 0 or a negative code with the message in err. */
int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, int32_t **ids, size_t *n, char *err,
                     size_t errlen);

/* The bytes one token stands for in decoded text (byte-level decoding; sentencepiece's "▁" as a
 * space and <0xNN> byte tokens as their byte; added tokens as their content), *len of them (not
 * NUL-terminated); NULL for an id out of range. prev is the token before it (-1 when none): for
 * llama2.c, a piece after BOS loses its leading space, as run.c's decode does. Concatenating
 * token_bytes of ids gives the decoded text, for streaming a sample. */
const char *tokenizer_token_bytes(const tokenizer_t *t, int32_t id, int32_t prev, size_t *len);

/* The text of ids[0..n), malloc'd with a NUL past its *len bytes. The first id is taken as
 * following BOS, so llama2.c's dummy-prefix space goes and decode(encode(x)) == x for either
 * kind. Returns 0, or TOKENIZER_EINVAL for an id out of range, TOKENIZER_ENOMEM. */
int tokenizer_decode(const tokenizer_t *t, const int32_t *ids, size_t n, char **text, size_t *len);

/* llama2.c's tokenizer t as a Hugging Face tokenizer.json (sentencepiece-style, as Llama 2's):
 * the same ids; spaces as "▁"; ids 0..2 the special <unk> <s> </s>; BPE with byte_fallback,
 * whose merges are every split of a piece into two pieces, ordered by the merged piece's score;
 * the dummy prefix as a Prepend normalizer; a post-processor that puts <s> first. Encoding with
 * it (here or in the library) gives llama2.c's ids, but where two different pieces score the
 * same, or one piece can be made by two splits at once, llama2.c merges the leftmost pair and
 * the JSON the better-ranked one. *json malloc'd (*len bytes, NUL after). Refused
 * (TOKENIZER_EUNSUPPORTED) when ids 3..258 are not the byte tokens <0x00>..<0xFF> in order, a
 * piece is not valid UTF-8, or two pieces read the same. */
int tokenizer_llama2c_json(const tokenizer_t *t, char **json, size_t *len, char *err, size_t errlen);

/* A tokenizer.json (json[0..len), the file t was loaded from) whose post-processor puts t's BOS
 * first, as trainer sample puts it before a prompt's ids, so that the library, encoding with its
 * special tokens (transformers' tokenizer(text)), gives the ids sample feeds. Returns 0 when json
 * does already (a template of BOS then the text, alone or beside ByteLevel steps) or t has no BOS,
 * *out NULL; 1 with *out malloc'd (*outlen bytes, NUL after): json with a post-processor of its
 * ByteLevel steps and that template, any other step dropped and named in note ("" when none); or
 * a negative code with the message in note. */
int tokenizer_json_bos_first(const tokenizer_t *t, const char *json, size_t len, char **out, size_t *outlen,
                             char *note, size_t notelen);

#endif
