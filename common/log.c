/* log: prefix, level from MESHRUN_LOG_LEVEL, one write(2) per line so that lines from
 * threads and processes sharing a pipe never interleave mid-line. */
#include "common/log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static char g_prefix[64] = "[meshrun]";
static log_level_t g_level = LOG_LEVEL_INFO;
static int g_rank = 0;

void log_init(const char *prefix) {
  if (prefix) snprintf(g_prefix, sizeof g_prefix, "%s", prefix);
  const char *lv = getenv("MESHRUN_LOG_LEVEL");
  if (!lv || !*lv) return;
  if (!strcasecmp(lv, "error")) g_level = LOG_LEVEL_ERROR;
  else if (!strcasecmp(lv, "warn") || !strcasecmp(lv, "warning")) g_level = LOG_LEVEL_WARN;
  else if (!strcasecmp(lv, "info")) g_level = LOG_LEVEL_INFO;
  else if (!strcasecmp(lv, "debug")) g_level = LOG_LEVEL_DEBUG;
}

void log_set_rank(int rank, int world) {
  g_rank = rank;
  (void)world;
}

log_level_t log_level(void) { return g_level; }

static void write_line(const char *fmt, va_list ap) {
  char line[4096];
  int n = snprintf(line, sizeof line, "%s ", g_prefix);
  int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
  if (len > sizeof line - 2) len = sizeof line - 2;
  if (len == 0 || line[len - 1] != '\n') line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len);
  (void)w;
}

void log_vmsg(log_level_t level, const char *fmt, va_list ap) {
  if (level > g_level) return;
  write_line(fmt, ap);
}

void log_msg(log_level_t level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_vmsg(level, fmt, ap);
  va_end(ap);
}

void log_rank0(const char *fmt, ...) {
  if (g_rank != 0 || g_level < LOG_LEVEL_INFO) return;
  va_list ap;
  va_start(ap, fmt);
  write_line(fmt, ap);
  va_end(ap);
}
