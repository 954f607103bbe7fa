/* wc — count lines, words and bytes of a file read through a ubc stack.
 *
 *   cc -O2 -I crates/ubc-capi/include examples/c/wc.c -L target/release -lubc_capi \
 *      -Wl,-rpath,$PWD/target/release -o wc
 *   ./wc 'dir:/some/dir | zstd' path/in/stack [--fmap]
 *
 * By default reads with ubc_fgetc (an inline compare-and-load over the mapped file);
 * with --fmap it takes the whole file as one array from ubc_fmap (Mach's fmap). */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "ubc.h"

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s STACK-SPEC PATH [--fmap]\n", argv[0]);
        return 2;
    }
    int use_fmap = argc > 3 && strcmp(argv[3], "--fmap") == 0;
    ubc_cache *cache = ubc_cache_new(64u << 20);
    ubc_stack *stack = cache ? ubc_stack_open(cache, argv[1]) : NULL;
    UBC_FILE *f = stack ? ubc_fopen(stack, argv[2], "r") : NULL;
    if (f == NULL) {
        fprintf(stderr, "wc: %s (%s)\n", ubc_last_error(), ubc_strerror(errno));
        return 1;
    }
    unsigned long long lines = 0, words = 0, bytes = 0;
    int in_word = 0;
    if (use_fmap) {
        size_t len = 0;
        const unsigned char *d = ubc_fmap(f, &len);
        if (d == NULL) {
            fprintf(stderr, "wc: fmap: %s\n", ubc_last_error());
            return 1;
        }
        for (size_t i = 0; i < len; i++) {
            int c = d[i];
            lines += c == '\n';
            if (isspace(c)) in_word = 0;
            else if (!in_word) { in_word = 1; words++; }
        }
        bytes = len;
    } else {
        int c;
        while ((c = ubc_fgetc(f)) != UBC_EOF) {
            bytes++;
            lines += c == '\n';
            if (isspace(c)) in_word = 0;
            else if (!in_word) { in_word = 1; words++; }
        }
        if (ubc_ferror(f)) {
            fprintf(stderr, "wc: read: %s\n", ubc_last_error());
            return 1;
        }
    }
    printf("%llu %llu %llu %s\n", lines, words, bytes, argv[2]);
    ubc_fclose(f);
    ubc_stack_close(stack);
    ubc_cache_free(cache);
    return 0;
}
