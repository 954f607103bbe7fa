/* s3.c SPEC MODE — the s3: bottom layer through the C API (issue 21), against the real S3
 * server (and etcd) the test script starts.
 *   MODE plain:  one cache writes, syncs and closes; a new cache and stack over the same
 *                prefix (a restart) reads every byte back.
 *   MODE shared: SPEC names an etcd (etcd=...): two caches with a stack each — two machines
 *                — use the file at once: a write returned on one is read on the other
 *                without a sync, both ways, lengths included. */
#define _GNU_SOURCE
#include <stdint.h>
#include "ubc.h"
#include "check.h"

static unsigned char a[300000], b[300000];

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 2654435761u + seed) >> 7) | 1;
}

int main(int argc, char **argv) {
    CHECK(argc == 3);
    const char *spec = argv[1];
    fill(a, sizeof a, 1);
    if (strcmp(argv[2], "plain") == 0) {
        ubc_cache *c = ubc_cache_new(1 << 20); /* far smaller than the file */
        CHECK(c != NULL);
        ubc_stack *s = ubc_stack_open(c, spec);
        CHECK(s != NULL);
        ubc_file *f = ubc_open(s, -1, "dir-less.bin", UBC_RDWR | UBC_CREAT);
        CHECK(f != NULL);
        CHECK(ubc_pwrite(f, a, sizeof a, 0) == (ssize_t)sizeof a);
        CHECK(ubc_pwrite(f, "overwritten", 11, 70000) == 11);
        memcpy(a + 70000, "overwritten", 11);
        CHECK(ubc_fsync(f) == 0);
        CHECK(ubc_close(f) == 0);
        ubc_stack_close(s);
        ubc_cache_free(c);
        /* A restart: nothing of the first cache is left. */
        c = ubc_cache_new(1 << 20);
        s = ubc_stack_open(c, spec);
        CHECK(s != NULL);
        f = ubc_open(s, -1, "dir-less.bin", UBC_RDONLY);
        CHECK(f != NULL);
        CHECK(ubc_size(f) == (off_t)sizeof a);
        CHECK(ubc_pread(f, b, sizeof b, 0) == (ssize_t)sizeof b);
        CHECK(memcmp(a, b, sizeof a) == 0);
        /* Errors are typed: a missing file, a write to a read-only handle. */
        CHECK(ubc_pwrite(f, "x", 1, 0) == -1 && errno == EBADF);
        CHECK(ubc_open(s, -1, "missing", UBC_RDONLY) == NULL && errno == ENOENT);
        CHECK(ubc_close(f) == 0);
        ubc_stack_close(s);
        ubc_cache_free(c);
        printf("s3 plain ok\n");
        return 0;
    }
    CHECK(strcmp(argv[2], "shared") == 0);
    ubc_cache *c1 = ubc_cache_new(1 << 20), *c2 = ubc_cache_new(1 << 20);
    CHECK(c1 != NULL && c2 != NULL);
    ubc_stack *m1 = ubc_stack_open(c1, spec), *m2 = ubc_stack_open(c2, spec);
    CHECK(m1 != NULL && m2 != NULL);
    ubc_file *f1 = ubc_open(m1, -1, "shared.bin", UBC_RDWR | UBC_CREAT);
    CHECK(f1 != NULL);
    CHECK(ubc_pwrite(f1, a, sizeof a, 0) == (ssize_t)sizeof a);
    /* No sync: the other machine's read takes the write token, which stores first. */
    ubc_file *f2 = ubc_open(m2, -1, "shared.bin", UBC_RDWR);
    CHECK(f2 != NULL);
    CHECK(ubc_size(f2) == (off_t)sizeof a);
    CHECK(ubc_pread(f2, b, sizeof b, 0) == (ssize_t)sizeof b);
    CHECK(memcmp(a, b, sizeof a) == 0);
    /* And back: an extension and an overwrite on the second, seen on the first. */
    CHECK(ubc_pwrite(f2, "from-two", 8, sizeof a) == 8);
    CHECK(ubc_pwrite(f2, "middle", 6, 1000) == 6);
    CHECK(ubc_size(f1) == (off_t)sizeof a + 8);
    char got[8];
    CHECK(ubc_pread(f1, got, 8, sizeof a) == 8 && memcmp(got, "from-two", 8) == 0);
    CHECK(ubc_pread(f1, got, 6, 1000) == 6 && memcmp(got, "middle", 6) == 0);
    /* A truncation on the first, seen on the second. */
    CHECK(ubc_truncate(f1, 5000) == 0);
    CHECK(ubc_size(f2) == 5000);
    CHECK(ubc_fsync(f1) == 0 && ubc_fsync(f2) == 0);
    CHECK(ubc_close(f1) == 0 && ubc_close(f2) == 0);
    ubc_stack_close(m1);
    ubc_stack_close(m2);
    ubc_cache_free(c1);
    ubc_cache_free(c2);
    printf("s3 shared ok\n");
    return 0;
}
