/* hook.c DATA_DIR — ubc_set_writeback_hook: called before the bytes reach the host file,
 * with ranges that cover them; an errno from the hook fails ubc_fsync and keeps the data;
 * a NULL hook removes it. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>
#include "ubc.h"
#include "check.h"

struct log {
    const char *host;       /* the host file below the cache */
    const unsigned char *want;
    size_t len;
    int calls, early, fail; /* early: host already held the bytes at the call */
    uint64_t covered_to;
};

static int hook(void *ctx, uint64_t off, uint64_t len) {
    struct log *l = ctx;
    l->calls++;
    if (l->fail) return l->fail;
    int fd = open(l->host, O_RDONLY);
    if (fd >= 0) {
        unsigned char *b = malloc(len);
        ssize_t n = pread(fd, b, len, (off_t)off);
        if (n == (ssize_t)len && off + len <= l->len && memcmp(b, l->want + off, len) == 0) l->early++;
        free(b);
        close(fd);
    }
    if (off <= l->covered_to && off + len > l->covered_to) l->covered_to = off + len;
    return 0;
}

int main(int argc, char **argv) {
    CHECK(argc == 2);
    char spec[4096], host[4096];
    snprintf(spec, sizeof spec, "dir:%s", argv[1]);
    snprintf(host, sizeof host, "%s/wal.db", argv[1]);
    ubc_cache *c = ubc_cache_new(64 << 20);
    CHECK(c != NULL);
    ubc_stack *s = ubc_stack_open(c, spec);
    CHECK(s != NULL);
    ubc_file *f = ubc_open(s, -1, "wal.db", UBC_RDWR | UBC_CREAT | UBC_TRUNC);
    CHECK(f != NULL);

    static unsigned char data[1 << 20];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 13 + i / 4093 + 1);
    struct log l = {host, data, sizeof data, 0, 0, 0, 0};
    CHECK(ubc_set_writeback_hook(f, hook, &l) == 0);
    CHECK(ubc_pwrite(f, data, sizeof data, 0) == (ssize_t)sizeof data);
    CHECK(ubc_fsync(f) == 0);
    CHECK(l.calls > 0);
    CHECK(l.early == 0);
    CHECK(l.covered_to >= sizeof data);

    /* A hook that fails: fsync reports its errno, and the new bytes wait in the cache. */
    l.fail = ENOSPC;
    CHECK(ubc_pwrite(f, "LATER", 5, 0) == 5);
    errno = 0;
    CHECK(ubc_fsync(f) == -1 && errno == ENOSPC);
    int fd = open(host, O_RDONLY);
    char b[5];
    CHECK(fd >= 0 && pread(fd, b, 5, 0) == 5 && memcmp(b, data, 5) == 0);

    /* Removed: the write goes. */
    CHECK(ubc_set_writeback_hook(f, NULL, NULL) == 0);
    int before = l.calls;
    CHECK(ubc_fsync(f) == 0);
    CHECK(l.calls == before);
    CHECK(pread(fd, b, 5, 0) == 5 && memcmp(b, "LATER", 5) == 0);
    close(fd);

    errno = 0;
    CHECK(ubc_set_writeback_hook(NULL, hook, &l) == -1 && errno == EINVAL);
    CHECK(ubc_close(f) == 0);
    ubc_stack_close(s);
    ubc_cache_free(c);
    printf("hook ok\n");
    return 0;
}
