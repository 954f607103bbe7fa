/* Tiny assertion helper for the C tests. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#define CHECK(cond) do { if (!(cond)) { \
    fprintf(stderr, "%s:%d: CHECK failed: %s (errno %d: %s; last: %s)\n", __FILE__, __LINE__, \
            #cond, errno, ubc_strerror(errno), ubc_last_error()); exit(1); } } while (0)
