/* registry: the comm backends this program knows, in the order messages name them. One line per
 * backend, X(name): its entry comm_entry_<name>, defined in its own file (comm_<name>.c), or in
 * a build without its toolkit in the stand-in the Makefile compiles instead
 * (comm_<name>_absent.c), so that every build knows every name. */
#include "trainer/comm/comm.h"

#define COMM_BACKENDS(X) \
  X(cpu)                 \
  X(nccl)                \
  X(staged)

#define DECLARE(name) extern const comm_entry_t comm_entry_##name;
#define LIST(name) &comm_entry_##name,
COMM_BACKENDS(DECLARE)

const comm_entry_t *const comm_registry[] = {COMM_BACKENDS(LIST) NULL};
