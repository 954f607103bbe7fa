/* table61.c DATA_DIR NAME — Mach's Table 6-1 over ubc: read a file three ways and time it.
 *   old_read: libc fopen + getc loop (the host's stdio over the host file)
 *   new_read: ubc_fopen + ubc_fgetc loop (mapped stdio: the buffer is the cached file)
 *   map_read: ubc_fmap + array reference
 * Each prints its time and a checksum; the checksums must agree. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <time.h>
#include "ubc.h"
#include "check.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

#define MIX(h, c) ((h) = ((h) ^ (uint64_t)(c)) * 1099511628211ull)

int main(int argc, char **argv) {
    CHECK(argc == 3);
    char spec[4096], host[4096];
    snprintf(spec, sizeof spec, "dir:%s", argv[1]);
    snprintf(host, sizeof host, "%s/%s", argv[1], argv[2]);
    ubc_cache *c = ubc_cache_new(64 << 20);
    ubc_stack *s = ubc_stack_open(c, spec);
    CHECK(s != NULL);

    for (int round = 1; round <= 2; round++) {
        /* old_read */
        double t0 = now();
        FILE *lf = fopen(host, "r");
        CHECK(lf != NULL);
        uint64_t h1 = 14695981039346656037ull, n1 = 0;
        int ch;
        while ((ch = getc(lf)) != EOF) { MIX(h1, ch); n1++; }
        fclose(lf);
        double t1 = now();

        /* new_read */
        UBC_FILE *f = ubc_fopen(s, argv[2], "r");
        CHECK(f != NULL);
        uint64_t h2 = 14695981039346656037ull, n2 = 0;
        while ((ch = ubc_fgetc(f)) != UBC_EOF) { MIX(h2, ch); n2++; }
        CHECK(!ubc_ferror(f));
        CHECK(ubc_fclose(f) == 0);
        double t2 = now();

        /* map_read */
        f = ubc_fopen(s, argv[2], "r");
        CHECK(f != NULL);
        size_t len = 0;
        const unsigned char *d = ubc_fmap(f, &len);
        CHECK(d != NULL);
        uint64_t h3 = 14695981039346656037ull;
        for (size_t i = 0; i < len; i++) MIX(h3, d[i]);
        CHECK(ubc_fclose(f) == 0);
        double t3 = now();

        printf("round %d (%s)\n", round, round == 1 ? "first time" : "second time");
        printf("old_read libc fopen+getc   %8.3f ms  bytes %llu checksum %016llx\n", (t1 - t0) * 1e3, (unsigned long long)n1, (unsigned long long)h1);
        printf("new_read ubc_fopen+fgetc   %8.3f ms  bytes %llu checksum %016llx\n", (t2 - t1) * 1e3, (unsigned long long)n2, (unsigned long long)h2);
        printf("map_read ubc_fmap+array    %8.3f ms  bytes %llu checksum %016llx\n", (t3 - t2) * 1e3, (unsigned long long)len, (unsigned long long)h3);
        CHECK(n1 == n2 && n2 == len);
        CHECK(h1 == h2 && h2 == h3);
    }
    printf("checksums agree\n");
    ubc_stack_close(s);
    ubc_cache_free(c);
    return 0;
}
