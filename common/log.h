/* log: the one logging module of both programs.
 *
 * Lines go to stderr as "<prefix> <message>", e.g. "[meshrun] round 2 closed" or
 * "[trainer r3/8] step 10/100 ...". The level comes from MESHRUN_LOG_LEVEL
 * (error, warn, info, debug; default info). log_rank0 prints only on rank 0 and is
 * meant for progress lines. Thread-safe: each line is written with one write(2). */
#ifndef MESHRUN_LOG_H
#define MESHRUN_LOG_H

#include <stdarg.h>

typedef enum { LOG_LEVEL_ERROR = 0, LOG_LEVEL_WARN, LOG_LEVEL_INFO, LOG_LEVEL_DEBUG } log_level_t;

/* Sets the prefix (copied; at most 63 bytes) and reads MESHRUN_LOG_LEVEL. */
void log_init(const char *prefix);
/* Marks this process as rank `rank` of `world`; log_rank0 prints only where rank == 0. */
void log_set_rank(int rank, int world);
log_level_t log_level(void);

void log_msg(log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void log_vmsg(log_level_t level, const char *fmt, va_list ap);
void log_rank0(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#define log_error(...) log_msg(LOG_LEVEL_ERROR, __VA_ARGS__)
#define log_warn(...)  log_msg(LOG_LEVEL_WARN, __VA_ARGS__)
#define log_info(...)  log_msg(LOG_LEVEL_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_LEVEL_DEBUG, __VA_ARGS__)

#endif
