// deps: launcher/console.c
/* Unit tests of console: the rank set's text, the rank's own number in a log prefix, and the
 * merging of lines on a clock the test sets: identical lines of every open rank go out at once
 * as one, different lines each with their own "[rank<R>]:", a late line alone after the
 * window, a rank's own lines never reordered, closed ranks not waited for, long lines never
 * merged, and the trainer's "[trainer r<R>/<W>]" matched across ranks. Output is captured
 * line by line. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launcher/console.h"

#define MS 1000000ull
#define WINDOW (100 * MS)

typedef struct {
  char text[1 << 16];
  size_t len;
  int lines;
} sink_t;

static void sink_write(void *arg, const char *line, size_t n) {
  sink_t *s = arg;
  assert_true(s->len + n < sizeof s->text);
  assert_true(n > 0 && line[n - 1] == '\n'); /* whole lines, one write each */
  memcpy(s->text + s->len, line, n);
  s->len += n;
  s->text[s->len] = '\0';
  s->lines++;
}

static console_t *open_console(sink_t *s, int n, int first_rank) {
  memset(s, 0, sizeof *s);
  console_t *c = NULL;
  assert_int_equal(console_create(&c, n, first_rank, WINDOW, sink_write, s), 0);
  for (int i = 0; i < n; i++) console_open(c, i);
  return c;
}

static void line(console_t *c, int slot, const char *text, uint64_t now) {
  console_line(c, slot, text, strlen(text), now);
}

static void test_format_ranks(void **state) {
  (void)state;
  char out[64];
  struct {
    int ranks[8], n;
    const char *want;
  } cases[] = {
      {{0, 1, 2, 3, 4, 5, 6, 7}, 8, "0-7"}, {{0, 1, 2, 3, 6}, 5, "0-3,6"}, {{1, 3}, 2, "1,3"},
      {{4, 5}, 2, "4,5"},                   {{2}, 1, "2"},                 {{0, 2, 3, 4, 9, 10}, 6, "0,2-4,9,10"},
      {{8, 9, 10, 15}, 4, "8-10,15"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    size_t len = console_format_ranks(cases[i].ranks, cases[i].n, out, sizeof out);
    assert_string_equal(out, cases[i].want);
    assert_int_equal(len, strlen(cases[i].want));
  }
  /* Short buffer: terminated, the full length still reported. */
  int r[] = {100, 102, 104};
  assert_int_equal(console_format_ranks(r, 3, out, 5), strlen("100,102,104"));
  assert_string_equal(out, "100,");
}

static void test_rank_field(void **state) {
  (void)state;
  size_t at = 0, len = 0;
  assert_int_equal(console_rank_field("[trainer r3/8] step 5", 21, 3, &at, &len), 0);
  assert_int_equal(at, 10);
  assert_int_equal(len, 1);
  assert_int_equal(console_rank_field("[trainer r12/16] x", 18, 12, &at, &len), 0);
  assert_int_equal(len, 2);
  /* Another rank's number, a padded number, no world, text after the name, no bracket. */
  assert_int_equal(console_rank_field("[trainer r3/8] x", 16, 4, &at, &len), -1);
  assert_int_equal(console_rank_field("[trainer r03/8] x", 17, 3, &at, &len), -1);
  assert_int_equal(console_rank_field("[trainer r3] x", 14, 3, &at, &len), -1);
  assert_int_equal(console_rank_field("[trainer r3/] x", 15, 3, &at, &len), -1);
  assert_int_equal(console_rank_field("[a b r3/8] x", 12, 3, &at, &len), -1);
  assert_int_equal(console_rank_field("step r3/8", 9, 3, &at, &len), -1);
  assert_int_equal(console_rank_field("[trainer r3/8", 13, 3, &at, &len), -1);
}

static void test_identical_lines_merge_at_once(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 8, 0);
  const char *lines[] = {"hello", "world", "bye"};
  for (int l = 0; l < 3; l++)
    for (int r = 0; r < 8; r++) line(c, r, lines[l], 1 * MS);
  /* Out as soon as the last rank printed each: no wait for the window. */
  assert_string_equal(s.text, "[ranks 0-7]:hello\n[ranks 0-7]:world\n[ranks 0-7]:bye\n");
  assert_int_equal(console_deadline(c), UINT64_MAX);
  console_destroy(c);
}

static void test_different_lines_keep_their_prefix(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 4, 8);
  char text[32];
  for (int r = 0; r < 4; r++) {
    snprintf(text, sizeof text, "I am %d", 8 + r);
    line(c, r, text, 0);
  }
  /* The first: every other rank printed a later line, so it cannot be joined any more. */
  assert_string_equal(s.text, "[rank8]:I am 8\n");
  assert_int_equal(console_flush_due(c, WINDOW - 1), WINDOW);
  assert_int_equal(s.lines, 1);
  assert_int_equal(console_flush_due(c, WINDOW), UINT64_MAX);
  assert_string_equal(s.text, "[rank8]:I am 8\n[rank9]:I am 9\n[rank10]:I am 10\n[rank11]:I am 11\n");
  console_destroy(c);
}

static void test_late_rank_alone_after_window(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 8, 0);
  for (int r = 0; r < 7; r++) line(c, r, "sync", 10 * MS + (uint64_t)r * MS);
  assert_int_equal(s.lines, 0);
  /* Never held past the window after the first rank printed it. */
  assert_int_equal(console_deadline(c), 10 * MS + WINDOW);
  console_flush_due(c, 10 * MS + WINDOW);
  assert_string_equal(s.text, "[ranks 0-6]:sync\n");
  line(c, 7, "sync", 10 * MS + WINDOW + 1);
  console_flush_due(c, 10 * MS + 2 * WINDOW + 1);
  assert_string_equal(s.text, "[ranks 0-6]:sync\n[rank7]:sync\n");
  console_destroy(c);
}

static void test_own_order_kept(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 2, 0);
  /* Rank 0: A B; rank 1: B A. Rank 1's A may not join rank 0's A (before its own B). */
  line(c, 0, "A", 0);
  line(c, 0, "B", 0);
  line(c, 1, "B", 0);
  line(c, 1, "A", 0);
  console_flush_all(c);
  assert_string_equal(s.text, "[rank0]:A\n[ranks 0,1]:B\n[rank1]:A\n");
  /* The same line twice from each rank: two merged lines, not one and two singles. */
  s.len = 0;
  s.lines = 0;
  line(c, 0, "x", 0);
  line(c, 0, "x", 0);
  line(c, 1, "x", 0);
  line(c, 1, "x", 0);
  assert_string_equal(s.text, "[ranks 0,1]:x\n[ranks 0,1]:x\n");
  console_destroy(c);
}

static void test_closed_rank_not_waited_for(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 3, 0);
  line(c, 0, "end", 0);
  line(c, 1, "end", 0);
  assert_int_equal(s.lines, 0);
  console_close(c, 2, 1 * MS);
  assert_string_equal(s.text, "[ranks 0,1]:end\n");
  /* A rank's last line goes out with its group when the rank closes. */
  line(c, 0, "last words", 2 * MS);
  console_close(c, 0, 2 * MS);
  console_close(c, 1, 2 * MS);
  assert_string_equal(s.text, "[ranks 0,1]:end\n[rank0]:last words\n");
  console_destroy(c);
}

static void test_long_lines_not_merged(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 2, 0);
  char *big = malloc(CONSOLE_MERGE_MAX + 2);
  memset(big, 'x', CONSOLE_MERGE_MAX + 1);
  big[CONSOLE_MERGE_MAX + 1] = '\0';
  line(c, 0, big, 0);
  line(c, 1, big, 0);
  console_flush_all(c);
  assert_int_equal(s.lines, 2);
  assert_int_equal(strncmp(s.text, "[rank0]:xxx", 11), 0);
  assert_non_null(strstr(s.text, "\n[rank1]:xxx"));
  assert_int_equal(s.len, 2 * (8 + CONSOLE_MERGE_MAX + 1 + 1));
  free(big);
  console_destroy(c);
}

static void test_trainer_prefix_matched(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 4, 4);
  char text[64];
  for (int r = 0; r < 3; r++) {
    snprintf(text, sizeof text, "[trainer r%d/8] warning: slow disk", 4 + r);
    line(c, r, text, 0);
  }
  console_flush_due(c, WINDOW);
  assert_string_equal(s.text, "[ranks 4-6]:[trainer r*/8] warning: slow disk\n");
  /* Alone, the line is the rank's own, number and all. */
  line(c, 3, "[trainer r7/8] warning: slow disk", 2 * WINDOW);
  console_flush_all(c);
  assert_string_equal(s.text,
                      "[ranks 4-6]:[trainer r*/8] warning: slow disk\n[rank7]:[trainer r7/8] warning: slow disk\n");
  console_destroy(c);
}

static void test_bounded_waiting(void **state) {
  (void)state;
  sink_t s;
  console_t *c = open_console(&s, 2, 0);
  /* Rank 1 is silent: rank 0's lines would wait the window, but no more than the bound. */
  for (int i = 0; i < CONSOLE_MAX_WAITING + 10; i++) line(c, 0, i % 2 ? "odd" : "even", 0);
  assert_int_equal(s.lines, 10);
  console_destroy(c); /* flushes */
  assert_int_equal(s.lines, CONSOLE_MAX_WAITING + 10);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_format_ranks),
      cmocka_unit_test(test_rank_field),
      cmocka_unit_test(test_identical_lines_merge_at_once),
      cmocka_unit_test(test_different_lines_keep_their_prefix),
      cmocka_unit_test(test_late_rank_alone_after_window),
      cmocka_unit_test(test_own_order_kept),
      cmocka_unit_test(test_closed_rank_not_waited_for),
      cmocka_unit_test(test_long_lines_not_merged),
      cmocka_unit_test(test_trainer_prefix_matched),
      cmocka_unit_test(test_bounded_waiting),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
