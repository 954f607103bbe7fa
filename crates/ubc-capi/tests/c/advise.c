/* advise.c DATA_DIR — ubc_fadvise: DONTNEED writes the range back (the host file has the
 * bytes without an fsync); patterns and WILLNEED are accepted and reads stay right; bad
 * arguments are EINVAL. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>
#include "ubc.h"
#include "check.h"

int main(int argc, char **argv) {
    CHECK(argc == 2);
    char spec[4096], host[4096];
    snprintf(spec, sizeof spec, "dir:%s", argv[1]);
    snprintf(host, sizeof host, "%s/adv.dat", argv[1]);
    ubc_cache *c = ubc_cache_new(64 << 20);
    ubc_stack *s = ubc_stack_open(c, spec);
    CHECK(s != NULL);
    ubc_file *f = ubc_open(s, -1, "adv.dat", UBC_RDWR | UBC_CREAT | UBC_TRUNC);
    CHECK(f != NULL);
    static unsigned char data[1 << 20], back[1 << 20];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)(i * 31 + i / 4099 + 7);
    CHECK(ubc_pwrite(f, data, sizeof data, 0) == (ssize_t)sizeof data);

    /* DONTNEED of the first half: written back without fsync, and dropped. */
    CHECK(ubc_fadvise(f, 0, sizeof data / 2, UBC_FADV_DONTNEED) == 0);
    int fd = open(host, O_RDONLY);
    CHECK(fd >= 0);
    CHECK(pread(fd, back, sizeof data / 2, 0) == (ssize_t)(sizeof data / 2));
    CHECK(memcmp(back, data, sizeof data / 2) == 0);
    close(fd);

    /* Patterns and WILLNEED: reads stay right. */
    CHECK(ubc_fadvise(f, 0, 0, UBC_FADV_RANDOM) == 0);
    CHECK(ubc_pread(f, back, sizeof back, 0) == (ssize_t)sizeof back && memcmp(back, data, sizeof data) == 0);
    CHECK(ubc_fadvise(f, 0, 0, UBC_FADV_SEQUENTIAL) == 0);
    CHECK(ubc_fadvise(f, 0, 0, UBC_FADV_WILLNEED) == 0);
    CHECK(ubc_fadvise(f, 0, 0, UBC_FADV_NOREUSE) == 0);
    CHECK(ubc_fadvise(f, 0, 0, UBC_FADV_NORMAL) == 0);
    CHECK(ubc_pread(f, back, sizeof back, 0) == (ssize_t)sizeof back && memcmp(back, data, sizeof data) == 0);

    /* A mapping: RANDOM faults read right; a store, then DONTNEED, reaches the host file. */
    void *addr = NULL;
    struct ubc_map *m = ubc_map(f, 0, sizeof data, UBC_PROT_READ | UBC_PROT_WRITE, &addr);
    CHECK(m != NULL);
    CHECK(ubc_madvise(m, UBC_FADV_RANDOM) == 0);
    CHECK(memcmp(addr, data, sizeof data) == 0);
    CHECK(ubc_madvise(m, UBC_FADV_WILLNEED) == 0);
    memcpy((char *)addr + 5000, "MADVISED", 8);
    CHECK(ubc_madvise(m, UBC_FADV_DONTNEED) == 0);
    fd = open(host, O_RDONLY);
    char b8[8];
    CHECK(fd >= 0 && pread(fd, b8, 8, 5000) == 8 && memcmp(b8, "MADVISED", 8) == 0);
    close(fd);
    errno = 0;
    CHECK(ubc_madvise(m, 42) == -1 && errno == EINVAL);
    CHECK(ubc_unmap(m) == 0);

    /* O_DSYNC: a write is in the host file when it returns; fdatasync and fsync work. */
    ubc_file *d = ubc_open(s, -1, "dsync.dat", UBC_RDWR | UBC_CREAT | UBC_DSYNC);
    CHECK(d != NULL);
    CHECK(ubc_pwrite(d, "synchronous", 11, 100) == 11);
    snprintf(host, sizeof host, "%s/dsync.dat", argv[1]);
    fd = open(host, O_RDONLY);
    char b11[11];
    CHECK(fd >= 0 && pread(fd, b11, 11, 100) == 11 && memcmp(b11, "synchronous", 11) == 0);
    close(fd);
    CHECK(ubc_fdatasync(d) == 0 && ubc_fsync(d) == 0);
    CHECK(ubc_close(d) == 0);
    ubc_file *sy = ubc_open(s, -1, "dsync.dat", UBC_RDWR | UBC_SYNC);
    CHECK(sy != NULL && ubc_pwrite(sy, "S", 1, 0) == 1 && ubc_close(sy) == 0);

    errno = 0;
    CHECK(ubc_fadvise(f, 0, 0, 9) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(ubc_fadvise(f, -1, 0, UBC_FADV_NORMAL) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(ubc_fadvise(NULL, 0, 0, UBC_FADV_NORMAL) == -1 && errno == EINVAL);
    CHECK(ubc_close(f) == 0);
    ubc_stack_close(s);
    ubc_cache_free(c);
    printf("advise ok\n");
    return 0;
}
