/*
 * ubc.h — C API of ubc, a user-space unified buffer cache with stackable layers.
 *
 * Link with -lubc (see ubc.pc). All functions are implemented in Rust behind
 * extern "C"; none of them lets a Rust panic escape (a panic becomes EIO).
 *
 * Errors (errno style)
 * --------------------
 * A failing call returns -1 (int / ssize_t / off_t results) or NULL (pointer results),
 * sets errno, and records a message naming the path and the cause, readable with
 * ubc_last_error() on the same thread. A NULL handle or a NULL pointer argument that is
 * required is EINVAL. Successful calls leave errno and the last message alone.
 *
 * Handles and lifetimes
 * ---------------------
 * Handles are opaque and reference-counted inside: they may be closed in any order (a
 * file keeps its stack and cache alive; a mapping keeps its file alive). Each handle
 * must be closed/freed exactly once and not used afterwards. Handles may be used from
 * any thread; ubc_cache, ubc_stack, ubc_file and ubc_map calls are thread-safe.
 * A UBC_FILE (stdio stream) is NOT thread-safe: like getc_unlocked, one thread at a time.
 *
 * Pointer arguments (what the library relies on and cannot check)
 * ----------------------------------------------------------------
 * A handle argument is NULL or a handle this library returned that is not yet
 * closed/freed. A string argument (spec, path, mode) is NULL or NUL-terminated. A buffer
 * with a length (ubc_pread/ubc_pwrite: `len` bytes; ubc_fread/ubc_fwrite: size * nmemb
 * bytes) holds that many bytes, writable for reads and readable for writes, and is not
 * changed by another thread during the call; it may be NULL only when the length is 0.
 * An out pointer (addr_out, len_out) is NULL or points to writable memory of its type.
 *
 * Durability: data written with ubc_pwrite or through a mapping is at once visible to
 * every handle and every layer of the stack (one cache), but reaches the host files
 * only when written back: ubc_fsync (durable), the cache's background writeback, or
 * when the last handle of the cache goes (best effort). ubc_fflush/ubc_fclose sync.
 */
#ifndef UBC_H
#define UBC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ubc_cache ubc_cache; /* a cache: one memory budget for all files */
typedef struct ubc_stack ubc_stack; /* a stack of layers over a cache */
typedef struct ubc_file ubc_file;   /* an open file at one layer */
struct ubc_map;                     /* a memory mapping of a file range (no typedef:
                                       the name ubc_map is the function below) */

/* ---- errors ---------------------------------------------------------------------- */

/* A static description of errno value `err` (never NULL). */
const char *ubc_strerror(int err);
/* The message of this thread's last failed ubc call (path and cause), or "no error".
 * Valid until the next failing ubc call on this thread. Never NULL. */
const char *ubc_last_error(void);

/* ---- caches and stacks ----------------------------------------------------------- */

/* A cache holding at most `budget` bytes of file pages. */
ubc_cache *ubc_cache_new(size_t budget);
/* Huge pages for a cache's memory. */
enum { UBC_HUGE_NEVER = 0, UBC_HUGE_TRY = 1, UBC_HUGE_REQUIRE = 2 };
/* ubc_cache_new with huge pages: UBC_HUGE_TRY gives the cache 2 MiB pages from the host's
 * hugetlb pool when its free pages hold the budget, else shmem THP if tmpfs allocates it
 * on writes, else ordinary pages; UBC_HUGE_REQUIRE fails (EINVAL, ubc_last_error says why)
 * when neither huge-page path is available. */
ubc_cache *ubc_cache_new_huge(size_t budget, int huge);
/* Which memory the cache's pages live in, and why ("hugetlb, 2 MiB pages (...)"), copied
 * NUL-terminated into buf (truncated to len); returns the whole length, or -1. */
ssize_t ubc_cache_page_memory(const ubc_cache *cache, char *buf, size_t len);
/* Release the caller's reference (stacks and files opened over it keep it alive).
 * NULL is ignored. */
void ubc_cache_free(ubc_cache *cache);

/* Build a stack over `cache` from a spec, layers bottom first, separated by '|':
 *   dir:PATH | mem | null | zstd[:level=N][,chunk=BYTES] | aead:keyfile=PATH |
 *   aead:passphrase-file=PATH,salt=HEX32 | union:upper=PATH
 * e.g. "dir:/data | zstd:level=3 | aead:keyfile=/etc/k". A bad spec is EINVAL. */
ubc_stack *ubc_stack_open(ubc_cache *cache, const char *spec);
/* Number of layers of the stack, or -1. */
int ubc_stack_depth(const ubc_stack *stack);
/* Release the stack handle (open files keep the stack alive). NULL is ignored. */
void ubc_stack_close(ubc_stack *stack);

/* ---- files ----------------------------------------------------------------------- */

#define UBC_RDONLY 0x0000
#define UBC_RDWR   0x0002
#define UBC_CREAT  0x0040
#define UBC_TRUNC  0x0200
/* Synchronous writes (open(2)'s values): each ubc_pwrite returns once its bytes are durable
 * (UBC_DSYNC, as fdatasync of the range) or also the file's metadata (UBC_SYNC, as fsync). */
#define UBC_DSYNC  0x1000
#define UBC_SYNC   0x101000

/* Open `path` (relative to the stack's root; a leading '/' is allowed) at layer `layer`
 * (0 is the bottom, -1 the top). flags: UBC_RDONLY or UBC_RDWR, optionally | UBC_CREAT
 * (create if missing) | UBC_TRUNC (needs UBC_RDWR) | UBC_DSYNC or UBC_SYNC (synchronous
 * writes). Unknown flag bits are EINVAL.
 * Errors: ENOENT, EISDIR, EROFS, EINVAL (bad layer/path/flags), EIO, ... */
ubc_file *ubc_open(ubc_stack *stack, int layer, const char *path, int flags);
/* Close a file handle. Dirty data stays in the cache (see Durability above); call
 * ubc_fsync first to make it durable. Returns 0, or -1 (EINVAL for NULL). */
int ubc_close(ubc_file *file);

/* Read up to `len` bytes at `offset` into `buf`; fewer only at end of file (0 = EOF).
 * offset < 0, len > SSIZE_MAX: EINVAL; offset + len past 2^63-1: EFBIG. */
ssize_t ubc_pread(ubc_file *file, void *buf, size_t len, off_t offset);
/* Write `len` bytes at `offset`; returns len (the whole buffer is written) or -1.
 * A read-only handle is EBADF. Offsets as for ubc_pread. */
ssize_t ubc_pwrite(ubc_file *file, const void *buf, size_t len, off_t offset);
/* Write everything written through this layer and the layers above down to the store
 * and make it durable, with the store's metadata (fsync). Returns 0 or -1. */
int ubc_fsync(ubc_file *file);
/* As ubc_fsync, but of the metadata only what reading the data back needs (fdatasync:
 * the length, not the times). Returns 0 or -1. */
int ubc_fdatasync(ubc_file *file);
/* posix_fadvise for this file at its layer; the advice values are POSIX_FADV_*'s.
 * NORMAL, RANDOM (no read-ahead), SEQUENTIAL (read ahead from the first miss, windows up to
 * twice the usual) and NOREUSE (pages read are kept least) set this handle's pattern for
 * its reads; WILLNEED starts filling [off, off+len) (at most half the budget) and returns;
 * DONTNEED writes the range's dirty pages back, waits, and drops its clean pages. len 0:
 * to the end of the file. Returns 0, or -1 (EINVAL: negative off/len, unknown advice). */
#define UBC_FADV_NORMAL     0
#define UBC_FADV_RANDOM     1
#define UBC_FADV_SEQUENTIAL 2
#define UBC_FADV_WILLNEED   3
#define UBC_FADV_DONTNEED   4
#define UBC_FADV_NOREUSE    5
int ubc_fadvise(ubc_file *file, off_t off, off_t len, int advice);
/* Write-ahead logging: have `hook(ctx, offset, len)` called before any of this file's
 * bytes at this layer are written back (by the cache's background writeback, reclaim,
 * ubc_fsync, ubc_msync or ubc_unmap) with their range; the write waits until it returns.
 * It returns 0 to let the bytes go, or an errno value: the write fails, the pages stay
 * dirty and ubc_fsync reports it. The bytes written are those the file held when the
 * hook was called (a store through a mapping made later is written later, through the
 * hook again): a program that appends each change to its log before making it and makes
 * its log durable in the hook never has a change in the store its log lacks.
 * The hook runs on any of the cache's threads or a thread of yours, holding the pages:
 * it must not call this library (keep the log in a plain file: write(2), fdatasync) nor
 * wait for a thread that writes this file. One hook per file, shared by its handles and
 * kept after they close; a NULL hook removes it. Returns 0 or -1. */
typedef int (*ubc_writeback_hook)(void *ctx, uint64_t offset, uint64_t len);
int ubc_set_writeback_hook(ubc_file *file, ubc_writeback_hook hook, void *ctx);
/* Size of the file as this layer sees it, or -1. */
off_t ubc_size(ubc_file *file);
/* Set the size (extend with zeros or cut). Needs a writable handle. Returns 0 or -1. */
int ubc_truncate(ubc_file *file, off_t len);

/* ---- mappings -------------------------------------------------------------------- */

#define UBC_PROT_READ  0x1
#define UBC_PROT_WRITE 0x2

/* Map bytes [off, off+len) of `file` shared (stores reach the file through the cache and
 * are seen at once by ubc_pread and every other mapping and layer). prot: UBC_PROT_READ,
 * or UBC_PROT_READ|UBC_PROT_WRITE (needs a writable handle, else EBADF). The address of
 * byte `off` is stored in *addr_out. len == 0 is EINVAL.
 * Touching a page past end of file raises SIGBUS, as with mmap(2); so does a page the
 * layers cannot read (e.g. failed authentication). The address is valid until ubc_unmap. */
struct ubc_map *ubc_map(ubc_file *file, off_t off, size_t len, int prot, void **addr_out);
/* Write the mapping's stores to this layer's store (like msync(MS_SYNC)); for durability
 * through every layer below, also call ubc_fsync. Returns 0 or -1. */
int ubc_msync(struct ubc_map *map);
/* madvise for this mapping, with the UBC_FADV_* values (MADV_NORMAL..MADV_DONTNEED have
 * the same numbers): NORMAL, RANDOM (each fault fills its page alone), SEQUENTIAL (faults
 * read ahead from the first) and NOREUSE steer its faults; WILLNEED starts filling the
 * mapped range; DONTNEED writes its stores back and waits (the pages stay mapped).
 * Returns 0 or -1 (EINVAL: unknown advice). */
int ubc_madvise(struct ubc_map *map, int advice);
/* Remove the mapping (its stores are kept in the cache). Returns 0, or -1 for NULL. */
int ubc_unmap(struct ubc_map *map);

/* ---- stdio-style streams (Mach's mapped stdio) ----------------------------------- */

/* The public prefix of a stream: the current buffer. For the inline fast paths of
 * ubc_fgetc and ubc_fputc only — never write these fields, never allocate or copy a
 * UBC_FILE; only use pointers returned by ubc_fopen. When a stream reads, its buffer is,
 * whenever possible, the cache's own pages of the whole file mapped into the process
 * (as in Mach, fopen's buffer "has, in effect, been enlarged to the size of the file"),
 * so getc costs a compare and a load until end of file. */
typedef struct ubc_stdio_buf {
    unsigned char *_ptr;  /* next byte to read or write */
    unsigned char *_rend; /* bytes before this may be read (<= _ptr when not reading) */
    unsigned char *_wend; /* bytes before this may be written (<= _ptr when not writing) */
} UBC_FILE;

#ifndef UBC_EOF
#define UBC_EOF (-1)
#endif

/* Open `path` at the stack's top layer. mode: "r" (read), "r+" (read/write, must exist),
 * "w" (write, create, truncate), "w+" (same, and read), "a" (append, create), "a+";
 * a 'b' anywhere is ignored. Errors as ubc_open; a bad mode is EINVAL. */
UBC_FILE *ubc_fopen(ubc_stack *stack, const char *path, const char *mode);
/* Push buffered writes into the cache, then sync (as ubc_fsync), then free the stream
 * and every ubc_fmap mapping. The stream is freed even on error. Returns 0 or UBC_EOF. */
int ubc_fclose(UBC_FILE *f);
/* Push buffered writes and sync them. Returns 0 or UBC_EOF (the error flag is set). */
int ubc_fflush(UBC_FILE *f);

/* Read `nmemb` items of `size` bytes; returns the number of whole items read (short at
 * end of file — feof — or on error — ferror). */
size_t ubc_fread(void *ptr, size_t size, size_t nmemb, UBC_FILE *f);
/* Write `nmemb` items of `size` bytes; returns the number of items written. In append
 * mode every write goes to the end of the file. */
size_t ubc_fwrite(const void *ptr, size_t size, size_t nmemb, UBC_FILE *f);

/* Out-of-line parts of ubc_fgetc / ubc_fputc (refill / flush the buffer). */
int ubc__fgetc_slow(UBC_FILE *f);
int ubc__fputc_slow(int c, UBC_FILE *f);
/* Non-inline versions (for FFI from other languages). */
int ubc_fgetc_func(UBC_FILE *f);
int ubc_fputc_func(int c, UBC_FILE *f);

/* Next byte as an unsigned char, or UBC_EOF at end of file or on error. */
static inline int ubc_fgetc(UBC_FILE *f) {
    if (__builtin_expect(f != NULL && f->_ptr < f->_rend, 1))
        return *f->_ptr++;
    return ubc__fgetc_slow(f);
}
/* Write byte c; returns (unsigned char)c or UBC_EOF on error. */
static inline int ubc_fputc(int c, UBC_FILE *f) {
    if (__builtin_expect(f != NULL && f->_ptr < f->_wend, 1))
        return *f->_ptr++ = (unsigned char)c;
    return ubc__fputc_slow(c, f);
}
#define ubc_getc(f) ubc_fgetc(f)
#define ubc_putc(c, f) ubc_fputc((c), (f))

/* Set the position: whence is SEEK_SET, SEEK_CUR or SEEK_END (<stdio.h> values 0, 1, 2).
 * Pushes buffered writes; clears the end-of-file flag. A negative result is EINVAL.
 * Seeking past the end is allowed (a later write leaves a hole of zeros). Returns 0/-1. */
int ubc_fseek(UBC_FILE *f, off_t offset, int whence);
/* Current position, or -1. */
off_t ubc_ftell(UBC_FILE *f);
void ubc_rewind(UBC_FILE *f);
/* Nonzero after a read hit end of file. */
int ubc_feof(UBC_FILE *f);
/* Nonzero after an I/O error on the stream. */
int ubc_ferror(UBC_FILE *f);
void ubc_clearerr(UBC_FILE *f);

/* Mach's fmap: a pointer to the whole file's data (the cache's pages, mapped), and its
 * length in *len_out (len_out may be NULL). Buffered writes are pushed first. The data is
 * writable (stores reach the file, visible to fread/pread) only if the stream was opened
 * for update ("r+", "w+", "a+"), else read-only (a store faults). The pointer stays valid
 * until ubc_fclose, even after further fmap calls; a file that grows later needs a new
 * fmap to see the new bytes. An empty file gives a non-NULL pointer and length 0.
 * Stores past *len_out, or reads after the file was cut shorter, raise SIGBUS. */
const void *ubc_fmap(UBC_FILE *f, size_t *len_out);
/* Mach's fmap(stream, size): as ubc_fmap for size 0; a larger size on a stream open for
 * writing ("w", "a", "r+", ...) first extends the file to size bytes with zeros and maps
 * them writable (Mach's write map: "the user may write into any part of the file with an
 * offset less than bufsize"; call again with a larger size to grow it). On a read-only
 * stream size is only a suggestion: the file's length is mapped. Returns void * for a
 * writable map (cast away the const). */
const void *ubc_fmap_size(UBC_FILE *f, size_t size, size_t *len_out);
/* Mach's fbufsize: the length of the last ubc_fmap/ubc_fmap_size buffer (0 before any). */
size_t ubc_fbufsize(UBC_FILE *f);

#ifdef __cplusplus
}
#endif

#endif /* UBC_H */
