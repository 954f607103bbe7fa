/* stdio.c DATA_DIR — the stdio-style API round trips on "dir:DATA_DIR | zstd". */
#include <stdint.h>
#include "ubc.h"
#include "check.h"

static unsigned char expect[200000];

int main(int argc, char **argv) {
    CHECK(argc == 2);
    char spec[4096];
    snprintf(spec, sizeof spec, "dir:%s | zstd", argv[1]);
    ubc_cache *c = ubc_cache_new(64 << 20);
    ubc_stack *s = ubc_stack_open(c, spec);
    CHECK(s != NULL);
    for (size_t i = 0; i < sizeof expect; i++) expect[i] = (unsigned char)((i * 131) >> 3);

    /* write: fputc + fwrite (small and large) */
    UBC_FILE *f = ubc_fopen(s, "s.bin", "w");
    CHECK(f != NULL);
    for (int i = 0; i < 1000; i++) CHECK(ubc_fputc(expect[i], f) == expect[i]);
    CHECK(ubc_fwrite(expect + 1000, 1, 9000, f) == 9000);
    CHECK(ubc_fwrite(expect + 10000, 10, 19000, f) == 19000);
    CHECK(ubc_ftell(f) == 200000);
    errno = 0;
    CHECK(ubc_fgetc(f) == UBC_EOF && errno == EBADF); /* "w" is write-only */
    CHECK(ubc_fflush(f) == 0);
    CHECK(ubc_fclose(f) == 0);

    /* read back: fgetc, fread, fseek, ftell, feof */
    f = ubc_fopen(s, "s.bin", "r");
    CHECK(f != NULL);
    for (int i = 0; i < 5000; i++) CHECK(ubc_fgetc(f) == expect[i]);
    CHECK(ubc_ftell(f) == 5000);
    static unsigned char buf[200000];
    CHECK(ubc_fread(buf, 1, 100000, f) == 100000);
    CHECK(memcmp(buf, expect + 5000, 100000) == 0);
    CHECK(ubc_fseek(f, -10, SEEK_END) == 0);
    CHECK(ubc_ftell(f) == 199990);
    CHECK(ubc_fread(buf, 4, 5, f) == 2); /* 10 bytes left: 2 whole items */
    CHECK(memcmp(buf, expect + 199990, 10) == 0);
    CHECK(ubc_feof(f));
    CHECK(ubc_fgetc(f) == UBC_EOF);
    CHECK(!ubc_ferror(f));
    CHECK(ubc_fseek(f, 12345, SEEK_SET) == 0);
    CHECK(!ubc_feof(f));
    CHECK(ubc_fgetc(f) == expect[12345]);
    CHECK(ubc_fseek(f, 100, SEEK_CUR) == 0);
    CHECK(ubc_ftell(f) == 12446);
    CHECK(ubc_fgetc(f) == expect[12446]);
    errno = 0;
    CHECK(ubc_fseek(f, -1, SEEK_SET) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(ubc_fputc('x', f) == UBC_EOF && errno == EBADF); /* "r" is read-only */
    ubc_clearerr(f);
    /* fmap: the whole file, read-only */
    size_t n = 0;
    const unsigned char *d = ubc_fmap(f, &n);
    CHECK(d != NULL && n == sizeof expect);
    CHECK(memcmp(d, expect, n) == 0);
    CHECK(ubc_fgetc(f) == expect[12447]); /* the position is unchanged */
    CHECK(ubc_fclose(f) == 0);

    /* r+: overwrite in the middle, read around it, fmap writable */
    f = ubc_fopen(s, "s.bin", "r+");
    CHECK(f != NULL);
    CHECK(ubc_fseek(f, 50, SEEK_SET) == 0);
    CHECK(ubc_fwrite("HELLO", 1, 5, f) == 5);
    memcpy(expect + 50, "HELLO", 5);
    CHECK(ubc_fgetc(f) == expect[55]); /* write then read: flushed in between */
    CHECK(ubc_fseek(f, 48, SEEK_SET) == 0);
    CHECK(ubc_fread(buf, 1, 10, f) == 10 && memcmp(buf, expect + 48, 10) == 0);
    unsigned char *w = (unsigned char *)ubc_fmap(f, &n);
    CHECK(w != NULL && n == sizeof expect);
    CHECK(memcmp(w, expect, n) == 0);
    w[1000] = 'Z';
    expect[1000] = 'Z';
    CHECK(ubc_fseek(f, 1000, SEEK_SET) == 0);
    CHECK(ubc_fgetc(f) == 'Z'); /* a store through fmap is what fgetc reads */
    /* extend past the end: the read window grows */
    CHECK(ubc_fseek(f, 0, SEEK_END) == 0);
    CHECK(ubc_fwrite("TAIL", 1, 4, f) == 4);
    CHECK(ubc_fseek(f, -4, SEEK_END) == 0);
    CHECK(ubc_fgetc(f) == 'T' && ubc_fgetc(f) == 'A' && ubc_fgetc(f) == 'I' && ubc_fgetc(f) == 'L');
    CHECK(ubc_fgetc(f) == UBC_EOF && ubc_feof(f));
    CHECK(ubc_fclose(f) == 0);

    /* append */
    f = ubc_fopen(s, "s.bin", "a");
    CHECK(f != NULL);
    CHECK(ubc_fwrite("++", 1, 2, f) == 2);
    CHECK(ubc_fputc('!', f) == '!');
    CHECK(ubc_ftell(f) == 200007);
    CHECK(ubc_fseek(f, 0, SEEK_SET) == 0);
    CHECK(ubc_fputc('?', f) == '?'); /* still to the end */
    CHECK(ubc_fclose(f) == 0);

    /* verify everything with a new stack and the low-level API */
    ubc_stack_close(s);
    ubc_cache_free(c);
    c = ubc_cache_new(32 << 20);
    s = ubc_stack_open(c, spec);
    ubc_file *lf = ubc_open(s, -1, "s.bin", UBC_RDONLY);
    CHECK(lf != NULL);
    CHECK(ubc_size(lf) == 200008);
    CHECK(ubc_pread(lf, buf, sizeof expect, 0) == (ssize_t)sizeof expect);
    CHECK(memcmp(buf, expect, sizeof expect) == 0);
    char tail[9] = {0};
    CHECK(ubc_pread(lf, tail, 8, 200000) == 8 && memcmp(tail, "TAIL++!?", 8) == 0);
    CHECK(ubc_close(lf) == 0);

    /* w+ on an empty file: fmap gives length 0 */
    f = ubc_fopen(s, "empty.bin", "w+");
    CHECK(f != NULL);
    CHECK(ubc_fmap(f, &n) != NULL && n == 0);
    CHECK(ubc_fgetc(f) == UBC_EOF && ubc_feof(f));
    CHECK(ubc_fclose(f) == 0);

    /* Mach's write map: fopen "w", fmap(stream, size) gives a zero-filled writable buffer
     * of size bytes; a second fmap with a larger size grows it; fbufsize tells the size. */
    f = ubc_fopen(s, "wmap.bin", "w");
    CHECK(f != NULL && ubc_fbufsize(f) == 0);
    unsigned char *wm = (unsigned char *)ubc_fmap_size(f, 10000, &n);
    CHECK(wm != NULL && n == 10000 && ubc_fbufsize(f) == 10000);
    for (size_t i = 0; i < n; i++) CHECK(wm[i] == 0);
    memcpy(wm + 9990, "0123456789", 10);
    unsigned char *wm2 = (unsigned char *)ubc_fmap_size(f, 20000, &n);
    CHECK(wm2 != NULL && n == 20000 && ubc_fbufsize(f) == 20000);
    CHECK(memcmp(wm2 + 9990, "0123456789", 10) == 0 && wm2[19999] == 0);
    wm2[19999] = 'E';
    CHECK(ubc_fclose(f) == 0);
    f = ubc_fopen(s, "wmap.bin", "r");
    CHECK(f != NULL);
    const unsigned char *rm = ubc_fmap_size(f, 1 << 20, &n); /* read: size is a suggestion */
    CHECK(rm != NULL && n == 20000 && memcmp(rm + 9990, "0123456789", 10) == 0 && rm[19999] == 'E');
    CHECK(ubc_fclose(f) == 0);

    /* errors */
    errno = 0;
    CHECK(ubc_fopen(s, "nope.bin", "r") == NULL && errno == ENOENT);
    CHECK(strstr(ubc_last_error(), "nope.bin") != NULL);
    errno = 0;
    CHECK(ubc_fopen(s, "s.bin", "rw") == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ubc_fclose(NULL) == UBC_EOF && errno == EINVAL);
    errno = 0;
    CHECK(ubc_fgetc(NULL) == UBC_EOF && errno == EINVAL);
    CHECK(ubc_ftell(NULL) == -1);

    ubc_stack_close(s);
    ubc_cache_free(c);
    printf("stdio ok\n");
    return 0;
}
