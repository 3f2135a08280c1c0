/* fatal: backend_fatal, the one fatal path of device errors (see backend.h), and the hook it calls
 * before exiting (backend_on_fatal: the comm room sets it to abort every live communicator; a
 * program with backends but no communicators, a kernel test, has none). Its own file, so that
 * the comm room links it without the backend dispatch. */
#include "trainer/backend/backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void (*on_fatal)(const char *why);

__thread int backend_recording;
__thread int backend_record_error;

void backend_on_fatal(void (*hook)(const char *why)) { on_fatal = hook; }

void backend_fatal(const char *file, int line, const char *call, const char *msg) {
  char host[256] = "?";
  if (gethostname(host, sizeof host - 1) != 0) strcpy(host, "?");
  host[sizeof host - 1] = '\0';
  const char *rank = getenv("RANK");
  fprintf(stderr, "[trainer rank %s %s] %s:%d: %s: %s\n", rank && *rank ? rank : "0", host, file, line, call,
          msg ? msg : "");
  fflush(stderr);
  /* Before exit, not in an atexit handler: exit may hang in a broken driver's teardown, and the
   * peers must not wait for that. */
  if (on_fatal) on_fatal("a fatal device error on this rank");
  exit(1);
}
