/* basic.c DATA_DIR KEY_FILE — files, pread/pwrite, mappings and errors through
 * dir | zstd | aead. */
#define _GNU_SOURCE
#include <stdint.h>
#include "ubc.h"
#include "check.h"

int main(int argc, char **argv) {
    CHECK(argc == 3);
    char spec[4096];
    snprintf(spec, sizeof spec, "dir:%s | zstd | aead:keyfile=%s", argv[1], argv[2]);
    /* huge pages: asked for, reported; a bad choice is EINVAL */
    ubc_cache *h = ubc_cache_new_huge(8 << 20, UBC_HUGE_TRY);
    CHECK(h != NULL);
    char mem[512];
    ssize_t ml = ubc_cache_page_memory(h, mem, sizeof mem);
    CHECK(ml > 0 && (size_t)ml == strlen(mem));
    const char *req = getenv("UBC_TEST_HUGETLB");
    if (req && strcmp(req, "1") == 0) CHECK(strncmp(mem, "hugetlb, 2 MiB pages", 20) == 0);
    ubc_stack *hs = ubc_stack_open(h, "mem");
    CHECK(hs != NULL);
    ubc_file *hf = ubc_open(hs, -1, "h", UBC_RDWR | UBC_CREAT);
    CHECK(hf != NULL);
    static unsigned char hb[3 << 20], hr[3 << 20];
    for (size_t i = 0; i < sizeof hb; i++) hb[i] = (unsigned char)(i * 13 + 1);
    CHECK(ubc_pwrite(hf, hb, sizeof hb, 5) == (ssize_t)sizeof hb);
    CHECK(ubc_pread(hf, hr, sizeof hr, 5) == (ssize_t)sizeof hr);
    CHECK(memcmp(hb, hr, sizeof hb) == 0);
    CHECK(ubc_close(hf) == 0);
    ubc_stack_close(hs);
    ubc_cache_free(h);
    CHECK(ubc_cache_new_huge(8 << 20, 7) == NULL && errno == EINVAL);
    CHECK(ubc_cache_page_memory(NULL, mem, sizeof mem) == -1);

    ubc_cache *c = ubc_cache_new(64 << 20);
    CHECK(c != NULL);
    ubc_stack *s = ubc_stack_open(c, spec);
    CHECK(s != NULL);
    CHECK(ubc_stack_depth(s) == 3);

    /* pwrite / pread round trip at the top */
    ubc_file *f = ubc_open(s, -1, "hello.txt", UBC_RDWR | UBC_CREAT | UBC_TRUNC);
    CHECK(f != NULL);
    const char msg[] = "meet at noon, bring the key";
    CHECK(ubc_pwrite(f, msg, sizeof msg - 1, 0) == (ssize_t)(sizeof msg - 1));
    CHECK(ubc_pwrite(f, "NOON", 4, 8) == 4);
    char buf[256] = {0};
    CHECK(ubc_pread(f, buf, sizeof buf, 0) == (ssize_t)(sizeof msg - 1));
    CHECK(memcmp(buf, "meet at NOON, bring the key", sizeof msg - 1) == 0);
    CHECK(ubc_pread(f, buf, 10, 1000) == 0); /* EOF */
    CHECK(ubc_size(f) == (off_t)(sizeof msg - 1));

    /* a big write spanning chunks, then truncate */
    static unsigned char big[300000];
    for (size_t i = 0; i < sizeof big; i++) big[i] = (unsigned char)(i * 7 + i / 251);
    CHECK(ubc_pwrite(f, big, sizeof big, 100) == (ssize_t)sizeof big);
    static unsigned char back[300000];
    CHECK(ubc_pread(f, back, sizeof back, 100) == (ssize_t)sizeof back);
    CHECK(memcmp(big, back, sizeof big) == 0);
    CHECK(ubc_truncate(f, 200000) == 0);
    CHECK(ubc_size(f) == 200000);

    /* map + store, pread sees it */
    void *addr = NULL;
    struct ubc_map *m = ubc_map(f, 4096, 8192, UBC_PROT_READ | UBC_PROT_WRITE, &addr);
    CHECK(m != NULL && addr != NULL);
    CHECK(((unsigned char *)addr)[0] == big[4096 - 100]);
    memcpy((char *)addr + 10, "STORED-THROUGH-MAP", 18);
    CHECK(ubc_pread(f, buf, 18, 4096 + 10) == 18);
    CHECK(memcmp(buf, "STORED-THROUGH-MAP", 18) == 0);
    /* and a pwrite is seen through the mapping */
    CHECK(ubc_pwrite(f, "PW", 2, 4096 + 100) == 2);
    CHECK(memcmp((char *)addr + 100, "PW", 2) == 0);
    CHECK(ubc_msync(m) == 0);
    CHECK(ubc_unmap(m) == 0);
    CHECK(ubc_fsync(f) == 0);

    /* the bottom layer holds ciphertext only */
    ubc_file *raw = ubc_open(s, 0, "hello.txt", UBC_RDONLY);
    CHECK(raw != NULL);
    off_t rn = ubc_size(raw);
    CHECK(rn > 0);
    char *rb = malloc((size_t)rn);
    CHECK(ubc_pread(raw, rb, (size_t)rn, 0) == rn);
    CHECK(memmem(rb, (size_t)rn, "STORED-THROUGH-MAP", 18) == NULL);
    free(rb);
    CHECK(ubc_close(raw) == 0);

    /* read-only handle: writes and writable maps are EBADF */
    ubc_file *ro = ubc_open(s, -1, "hello.txt", UBC_RDONLY);
    CHECK(ro != NULL);
    errno = 0;
    CHECK(ubc_pwrite(ro, "x", 1, 0) == -1 && errno == EBADF);
    errno = 0;
    CHECK(ubc_map(ro, 0, 10, UBC_PROT_WRITE, &addr) == NULL && errno == EBADF);
    CHECK(ubc_close(ro) == 0);

    /* errors */
    errno = 0;
    CHECK(ubc_open(s, -1, "missing.txt", UBC_RDONLY) == NULL);
    CHECK(errno == ENOENT);
    CHECK(strcmp(ubc_strerror(errno), "No such file or directory") == 0);
    CHECK(strstr(ubc_last_error(), "missing.txt") != NULL);
    errno = 0;
    CHECK(ubc_open(s, 7, "hello.txt", UBC_RDONLY) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ubc_open(s, -1, "hello.txt", 0x4000) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ubc_open(NULL, -1, "hello.txt", UBC_RDONLY) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ubc_pread(NULL, buf, 1, 0) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(ubc_pread(f, buf, 1, -1) == -1 && errno == EINVAL);
    errno = 0;
    CHECK(ubc_pwrite(f, buf, 16, INT64_MAX - 4) == -1 && errno == EFBIG);
    errno = 0;
    CHECK(ubc_map(f, 0, 0, UBC_PROT_READ, &addr) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ubc_stack_open(c, "bogus:layer") == NULL && errno == EINVAL);
    errno = 0;
    CHECK(ubc_stack_open(c, NULL) == NULL && errno == EINVAL);
    CHECK(ubc_close(NULL) == -1 && errno == EINVAL);
    CHECK(strcmp(ubc_strerror(EINVAL), "Invalid argument") == 0);

    /* handles may go in any order */
    ubc_stack_close(s);
    ubc_cache_free(c);
    CHECK(ubc_pread(f, buf, 4, 0) == 4 && memcmp(buf, "meet", 4) == 0);
    CHECK(ubc_close(f) == 0);

    /* reopen: data survives a new cache */
    c = ubc_cache_new(16 << 20);
    s = ubc_stack_open(c, spec);
    CHECK(s != NULL);
    f = ubc_open(s, -1, "hello.txt", UBC_RDONLY);
    CHECK(f != NULL);
    CHECK(ubc_size(f) == 200000);
    CHECK(ubc_pread(f, buf, 18, 4096 + 10) == 18 && memcmp(buf, "STORED-THROUGH-MAP", 18) == 0);
    CHECK(ubc_close(f) == 0);
    ubc_stack_close(s);
    ubc_cache_free(c);
    printf("basic ok\n");
    return 0;
}
