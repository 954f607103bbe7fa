#!/usr/bin/env python3
"""Scripted POSIX operations with their error cases, for a differential conformance test.

Usage: conform.py ROOT PHASE   (PHASE: root | user)

Runs every case of PHASE in a fresh directory under ROOT and prints one line per case: its
name, a tab, and a JSON list of observations — what each step returned (a value, or the
errno name of the error it raised) and the stat fields that POSIX defines. The test
(crates/ubc-cli/tests/conformance.rs) runs the same phase on a directory of the host's own
file system and on a ubc mount and compares case by case: a case passes when every
observation is the same. Nothing here knows what the answers should be; the host decides.

Times are compared as relations (advanced / unchanged / equal to what was set), never as
values; inode numbers as relations too (the same number before and after a rename).
The root phase prepares ROOT/user-area (owned by uid 65534) for the user phase.
"""

import errno
import json
import os
import stat
import sys
import time

ROOT = sys.argv[1]
PHASE = sys.argv[2]
NOBODY = 65534


def ename(e):
    return errno.errorcode.get(e.errno, str(e.errno))


def attempt(f, *a, **k):
    """f(*a) as an observation: ("ok", value) or ("err", ERRNO)."""
    try:
        v = f(*a, **k)
        if isinstance(v, bytes):
            v = v.decode("latin-1")
        if isinstance(v, os.stat_result):
            v = st(v)
        return ["ok", v if isinstance(v, (int, str, list, dict, bool, type(None))) else str(type(v))]
    except OSError as e:
        return ["err", ename(e)]


def kind(m):
    for name, test in (("file", stat.S_ISREG), ("dir", stat.S_ISDIR), ("link", stat.S_ISLNK),
                       ("fifo", stat.S_ISFIFO), ("sock", stat.S_ISSOCK), ("chr", stat.S_ISCHR),
                       ("blk", stat.S_ISBLK)):
        if test(m):
            return name
    return "?"


def st(s):
    """The stat fields compared between file systems."""
    # A directory's size is its host file system's business (and a union's upper directory
    # holds more entries than it shows): not compared.
    return {"kind": kind(s.st_mode), "mode": oct(stat.S_IMODE(s.st_mode)),
            "size": None if stat.S_ISDIR(s.st_mode) else s.st_size,
            "nlink": s.st_nlink, "uid": s.st_uid, "gid": s.st_gid}


def lst(p):
    return attempt(lambda: st(os.lstat(p)))


def tick():
    """Let the clock move past the file system's timestamp granularity."""
    time.sleep(0.02)


CASES = []


def case(phase):
    def reg(f):
        CASES.append((phase, f))
        return f
    return reg


# ----------------------------------------------------------------------------- files

@case("both")
def create_with_mode_and_umask(d):
    old = os.umask(0o027)
    try:
        fd = os.open(f"{d}/f", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o666)
    finally:
        os.umask(old)
    r = [lst(f"{d}/f")]
    os.close(fd)
    r.append(attempt(os.open, f"{d}/f", os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
    return r


@case("both")
def size_while_a_writer_has_it_open(d):
    fd = os.open(f"{d}/f", os.O_CREAT | os.O_RDWR, 0o644)
    r = [attempt(os.write, fd, b"x" * 100)]
    r.append(os.fstat(fd).st_size)
    r.append(os.stat(f"{d}/f").st_size)
    os.pwrite(fd, b"y" * 10, 5000)
    r.append(os.stat(f"{d}/f").st_size)
    os.ftruncate(fd, 7)
    r.append(os.stat(f"{d}/f").st_size)
    os.close(fd)
    r.append(os.stat(f"{d}/f").st_size)
    with open(f"{d}/f", "rb") as f:
        r.append(f.read().decode("latin-1"))
    return r


@case("both")
def truncate_by_name(d):
    with open(f"{d}/f", "wb") as f:
        f.write(b"0123456789")
    r = [attempt(os.truncate, f"{d}/f", 4), os.stat(f"{d}/f").st_size]
    r.append(attempt(os.truncate, f"{d}/f", 100000))
    r.append(os.stat(f"{d}/f").st_size)
    with open(f"{d}/f", "rb") as f:
        b = f.read()
    r.append([b[:4].decode(), b[4:].count(0)])
    r.append(attempt(os.truncate, f"{d}/f", -1))
    r.append(attempt(os.truncate, f"{d}/missing", 0))
    return r


@case("both")
def truncate_past_the_largest_file(d):
    with open(f"{d}/f", "wb") as f:
        f.write(b"abc")
    return [attempt(os.truncate, f"{d}/f", 2**63 - 1), os.stat(f"{d}/f").st_size]


@case("both")
def write_past_the_largest_offset(d):
    fd = os.open(f"{d}/f", os.O_CREAT | os.O_RDWR, 0o644)
    r = [attempt(os.pwrite, fd, b"x", 2**63 - 1)]
    os.close(fd)
    return r


@case("both")
def append_mode_writes_at_the_end(d):
    with open(f"{d}/f", "wb") as f:
        f.write(b"head")
    a = os.open(f"{d}/f", os.O_WRONLY | os.O_APPEND)
    b = os.open(f"{d}/f", os.O_WRONLY)
    os.pwrite(b, b"0123456789", 0)
    os.write(a, b"tail")
    os.close(a)
    os.close(b)
    with open(f"{d}/f", "rb") as f:
        return [f.read().decode()]


@case("both")
def concurrent_appenders_never_overwrite(d):
    fd = os.open(f"{d}/log", os.O_CREAT | os.O_WRONLY, 0o644)
    os.close(fd)
    kids = []
    for who in "ABCD":
        pid = os.fork()
        if pid == 0:
            a = os.open(f"{d}/log", os.O_WRONLY | os.O_APPEND)
            for i in range(300):
                os.write(a, f"{who}{i:05}".encode() + b"." * 93 + b"\n")
            os._exit(0)
        kids.append(pid)
    for k in kids:
        os.waitpid(k, 0)
    with open(f"{d}/log", "rb") as f:
        data = f.read()
    recs = data.split(b"\n")[:-1]
    whole = all(len(r) == 99 and r.endswith(b"." * 93) for r in recs)
    per = {w: sorted(int(r[1:6]) for r in recs if r[:1] == w.encode()) for w in "ABCD"}
    return [len(data), len(recs), whole, all(per[w] == list(range(300)) for w in "ABCD")]


@case("both")
def open_errors(d):
    os.mkdir(f"{d}/sub")
    with open(f"{d}/file", "w") as f:
        f.write("x")
    return [
        attempt(os.open, f"{d}/missing", os.O_RDONLY),
        attempt(os.open, f"{d}/sub", os.O_WRONLY),
        attempt(os.open, f"{d}/sub", os.O_RDWR | os.O_CREAT, 0o644),
        attempt(os.open, f"{d}/file/x", os.O_RDONLY),
        attempt(os.open, f"{d}/missing/x", os.O_CREAT | os.O_WRONLY, 0o644),
        attempt(os.open, f"{d}/{'n' * 256}", os.O_CREAT | os.O_WRONLY, 0o644),
        attempt(os.stat, f"{d}/{'n' * 256}"),
        attempt(os.mkdir, f"{d}/{'n' * 256}"),
        attempt(lambda: os.close(os.open(f"{d}/{'n' * 255}", os.O_CREAT | os.O_WRONLY, 0o644))),
        attempt(lambda: os.close(os.open(f"{d}/file", os.O_RDONLY | os.O_DIRECTORY))),
    ]


@case("both")
def read_and_write_after_eof(d):
    with open(f"{d}/f", "wb") as f:
        f.write(b"abc")
    fd = os.open(f"{d}/f", os.O_RDWR)
    r = [os.pread(fd, 10, 1).decode(), os.pread(fd, 10, 3).decode(), os.pread(fd, 10, 100).decode()]
    os.pwrite(fd, b"Z", 8)
    r.append(os.pread(fd, 20, 0).decode("latin-1"))
    os.close(fd)
    return r


@case("both")
def seek_ends(d):
    with open(f"{d}/f", "wb") as f:
        f.write(b"x" * 5000)
    fd = os.open(f"{d}/f", os.O_RDONLY)
    r = [os.lseek(fd, 0, os.SEEK_END), attempt(os.lseek, fd, -1, os.SEEK_SET)]
    os.close(fd)
    return r


@case("both")
def fsync_and_fdatasync(d):
    fd = os.open(f"{d}/f", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(fd, b"data")
    r = [attempt(os.fsync, fd), attempt(os.fdatasync, fd)]
    os.close(fd)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    r.append(attempt(os.fsync, dfd))
    os.close(dfd)
    return r


@case("both")
def copy_file_range_from_a_file_being_written(d):
    w = os.open(f"{d}/src", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(w, b"s" * 10000)
    src = os.open(f"{d}/src", os.O_RDONLY)
    dst = os.open(f"{d}/dst", os.O_CREAT | os.O_WRONLY, 0o644)
    done = 0
    for _ in range(100):
        if done == 10000:
            break
        try:
            n = os.copy_file_range(src, dst, 10000 - done)
        except OSError as e:
            # What callers do on these: copy by read and write.
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            n = os.pwrite(dst, os.pread(src, 10000 - done, done), done)
        if n == 0:
            break
        done += n
    for fd in (w, src, dst):
        os.close(fd)
    return [done, os.stat(f"{d}/dst").st_size]


@case("both")
def unlinked_open_file_keeps_working(d):
    fd = os.open(f"{d}/f", os.O_CREAT | os.O_RDWR, 0o640)
    os.write(fd, b"before")
    os.unlink(f"{d}/f")
    r = [attempt(os.stat, f"{d}/f")]
    r.append(attempt(os.pwrite, fd, b"after", 6))
    s = os.fstat(fd)
    r.append([s.st_size, s.st_nlink, oct(stat.S_IMODE(s.st_mode))])
    r.append(os.pread(fd, 100, 0).decode())
    r.append(attempt(os.ftruncate, fd, 3))
    r.append([os.fstat(fd).st_size, os.pread(fd, 100, 0).decode()])
    os.close(fd)
    r.append(sorted(os.listdir(d)))
    return r


@case("both")
def renamed_over_while_open(d):
    with open(f"{d}/a", "wb") as f:
        f.write(b"old contents")
    fd = os.open(f"{d}/a", os.O_RDONLY)
    with open(f"{d}/b", "wb") as f:
        f.write(b"new")
    os.rename(f"{d}/b", f"{d}/a")
    r = [os.pread(fd, 100, 0).decode(), os.fstat(fd).st_size]
    os.close(fd)
    with open(f"{d}/a", "rb") as f:
        r.append(f.read().decode())
    return r


# ----------------------------------------------------------------------------- names

@case("both")
def directories_and_their_errors(d):
    r = [attempt(os.mkdir, f"{d}/a", 0o750), lst(f"{d}/a"), attempt(os.mkdir, f"{d}/a")]
    os.mkdir(f"{d}/a/b")
    os.mkdir(f"{d}/a/c")
    with open(f"{d}/a/file", "w") as f:
        f.write("x")
    r.append(lst(f"{d}/a"))
    r += [attempt(os.rmdir, f"{d}/a"), attempt(os.rmdir, f"{d}/a/file"), attempt(os.unlink, f"{d}/a/b"),
          attempt(os.rmdir, f"{d}/a/missing"), attempt(os.mkdir, f"{d}/a/file/x"),
          attempt(os.listdir, f"{d}/a/file")]
    r.append(sorted(os.listdir(f"{d}/a")))
    r.append(attempt(os.rmdir, f"{d}/a/b"))
    r.append(lst(f"{d}/a"))
    return r


@case("both")
def rename_cases(d):
    for n in ("f1", "f2"):
        with open(f"{d}/{n}", "w") as f:
            f.write(n)
    for n in ("d1", "d2", "full", "full/x"):
        os.mkdir(f"{d}/{n}")
    ino = os.stat(f"{d}/f1").st_ino
    r = [attempt(os.rename, f"{d}/f1", f"{d}/f3"), os.stat(f"{d}/f3").st_ino == ino]
    r.append(attempt(os.rename, f"{d}/f3", f"{d}/f2"))
    with open(f"{d}/f2") as f:
        r.append(f.read())
    r += [attempt(os.rename, f"{d}/f2", f"{d}/d1"),
          attempt(os.rename, f"{d}/d1", f"{d}/f2"),
          attempt(os.rename, f"{d}/d1", f"{d}/full"),
          attempt(os.rename, f"{d}/d1", f"{d}/d1/inside"),
          attempt(os.rename, f"{d}/missing", f"{d}/x"),
          attempt(os.rename, f"{d}/d1", f"{d}/d2")]
    r.append(sorted(os.listdir(d)))
    r.append(attempt(os.rename, f"{d}/f2", f"{d}/{'n' * 256}"))
    return r


def renameat2(a, b, flags):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd = -100
    if libc.renameat2(at_fdcwd, a.encode(), at_fdcwd, b.encode(), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@case("both")
def rename_noreplace_and_exchange(d):
    noreplace, exchange = 1, 2
    for n, body in (("a", "A"), ("b", "B")):
        with open(f"{d}/{n}", "w") as f:
            f.write(body)
    os.mkdir(f"{d}/dir")
    with open(f"{d}/dir/inside", "w") as f:
        f.write("in")
    r = [attempt(renameat2, f"{d}/a", f"{d}/b", noreplace),
         attempt(renameat2, f"{d}/a", f"{d}/c", noreplace),
         attempt(renameat2, f"{d}/c", f"{d}/b", exchange),
         open(f"{d}/b").read(), open(f"{d}/c").read(),
         attempt(renameat2, f"{d}/c", f"{d}/dir", exchange),
         sorted(os.listdir(d)), attempt(lambda: open(f"{d}/c/inside").read()),
         attempt(renameat2, f"{d}/b", f"{d}/missing", exchange),
         attempt(renameat2, f"{d}/b", f"{d}/x", noreplace | exchange)]
    return r


def raw_readdir(path):
    """Name -> d_ino of every entry readdir(3) returns, `.` and `..` included (os.scandir
    leaves those out, and `ls -i` stats them instead of showing d_ino)."""
    import ctypes

    class Dirent(ctypes.Structure):  # glibc's struct dirent on 64-bit Linux
        _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64), ("d_reclen", ctypes.c_ushort),
                    ("d_type", ctypes.c_ubyte), ("d_name", ctypes.c_char * 256)]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.opendir.restype = ctypes.c_void_p
    libc.opendir.argtypes = [ctypes.c_char_p]
    libc.readdir.restype = ctypes.POINTER(Dirent)
    libc.readdir.argtypes = [ctypes.c_void_p]
    libc.closedir.argtypes = [ctypes.c_void_p]
    dp = libc.opendir(os.fsencode(path))
    out = {}
    while True:
        e = libc.readdir(dp)
        if not e:
            break
        out[e.contents.d_name.decode()] = e.contents.d_ino
    libc.closedir(dp)
    return out


@case("both")
def inode_numbers_stay(d):
    with open(f"{d}/f", "w") as f:
        f.write("x")
    os.mkdir(f"{d}/sub")
    a = os.stat(f"{d}/f").st_ino
    b = os.stat(f"{d}/f").st_ino
    os.rename(f"{d}/f", f"{d}/sub/g")
    c = os.stat(f"{d}/sub/g").st_ino
    names = {e.name: e.inode() for e in os.scandir(f"{d}/sub")}
    # readdir's `.` and `..` (scandir leaves them out): the directory's and its parent's.
    os.mkdir(f"{d}/sub/deep")
    dots = raw_readdir(f"{d}/sub/deep")
    up = [dots.get(".") == os.stat(f"{d}/sub/deep").st_ino, dots.get("..") == os.stat(f"{d}/sub").st_ino]
    return [a == b, a == c, names.get("g") == c, os.stat(d).st_ino != a, up]


@case("both")
def symlinks(d):
    with open(f"{d}/target", "w") as f:
        f.write("pointed at")
    r = [attempt(os.symlink, "target", f"{d}/link"), attempt(os.readlink, f"{d}/link"), lst(f"{d}/link")]
    r.append(attempt(lambda: open(f"{d}/link").read()))
    r.append(attempt(os.utime, f"{d}/link", ns=(3 * 10**9, 4 * 10**9), follow_symlinks=False))
    s = os.lstat(f"{d}/link")
    r.append([s.st_atime_ns, s.st_mtime_ns, os.stat(f"{d}/target").st_mtime_ns == 4 * 10**9])
    r.append(attempt(os.symlink, "x", f"{d}/link"))
    r.append(attempt(os.unlink, f"{d}/link"))
    r.append(sorted(os.listdir(d)))
    return r


@case("both")
def hard_links(d):
    with open(f"{d}/a", "w") as f:
        f.write("shared")
    r = [attempt(os.link, f"{d}/a", f"{d}/b"), lst(f"{d}/a")]
    r.append(attempt(lambda: open(f"{d}/b").read()))
    if os.path.exists(f"{d}/b"):
        with open(f"{d}/b", "a") as f:
            f.write("+more")
        r.append(open(f"{d}/a").read())
        r.append(os.stat(f"{d}/a").st_ino == os.stat(f"{d}/b").st_ino)
    r.append(attempt(os.unlink, f"{d}/a"))
    r.append(lst(f"{d}/b"))
    r.append(attempt(os.link, f"{d}/missing", f"{d}/c"))
    return r


@case("both")
def special_files(d):
    return [attempt(os.mkfifo, f"{d}/fifo", 0o644), lst(f"{d}/fifo"),
            attempt(os.mknod, f"{d}/sock", 0o644 | stat.S_IFSOCK), lst(f"{d}/sock")]


# ----------------------------------------------------------------------------- attributes

@case("both")
def chmod_and_ctime(d):
    with open(f"{d}/f", "w") as f:
        f.write("x")
    before = os.stat(f"{d}/f")
    tick()
    r = [attempt(os.chmod, f"{d}/f", 0o4751), lst(f"{d}/f")]
    after = os.stat(f"{d}/f")
    r.append(["ctime advanced", after.st_ctime_ns > before.st_ctime_ns])
    r.append(["mtime unchanged", after.st_mtime_ns == before.st_mtime_ns])
    r.append(attempt(os.chmod, f"{d}/missing", 0o644))
    return r


@case("both")
def write_moves_mtime_and_ctime(d):
    with open(f"{d}/f", "w") as f:
        f.write("x")
    before = os.stat(f"{d}/f")
    tick()
    fd = os.open(f"{d}/f", os.O_WRONLY)
    os.write(fd, b"y")
    mid = os.stat(f"{d}/f")
    os.close(fd)
    after = os.stat(f"{d}/f")
    return [["mtime advanced while open", mid.st_mtime_ns > before.st_mtime_ns],
            ["mtime advanced after close", after.st_mtime_ns > before.st_mtime_ns],
            ["ctime advanced", after.st_ctime_ns > before.st_ctime_ns]]


@case("both")
def utimes_set_exactly(d):
    with open(f"{d}/f", "w") as f:
        f.write("x")
    r = [attempt(os.utime, f"{d}/f", ns=(1_000_000_123_456_789, 1_200_000_000_987_654_321))]
    s = os.stat(f"{d}/f")
    r.append([s.st_atime_ns, s.st_mtime_ns])
    tick()
    os.utime(f"{d}/f")
    s2 = os.stat(f"{d}/f")
    r.append(["now", s2.st_mtime_ns > s.st_mtime_ns and s2.st_mtime_ns > 1_700_000_000 * 10**9])
    os.mkdir(f"{d}/dir")
    r.append(attempt(os.utime, f"{d}/dir", ns=(5 * 10**9, 6 * 10**9)))
    s3 = os.stat(f"{d}/dir")
    r.append([s3.st_atime_ns, s3.st_mtime_ns])
    return r


@case("root")
def chown_by_root(d):
    with open(f"{d}/f", "w") as f:
        f.write("x")
    os.mkdir(f"{d}/sub")
    r = [attempt(os.chown, f"{d}/f", 1234, 4321), lst(f"{d}/f"),
         attempt(os.chown, f"{d}/sub", NOBODY, NOBODY), lst(f"{d}/sub"),
         attempt(os.chown, f"{d}/f", -1, 77), lst(f"{d}/f")]
    os.chmod(f"{d}/f", 0o6755)
    os.chown(f"{d}/f", 1235, -1)
    r.append(lst(f"{d}/f"))
    os.symlink("f", f"{d}/link")
    r.append(attempt(os.lchown, f"{d}/link", 4444, 5555))
    r.append([lst(f"{d}/link"), lst(f"{d}/f")])
    return r


@case("root")
def prepare_user_area(d):
    """Not compared for its own sake: makes ROOT/user-area for the user phase."""
    area = f"{ROOT}/user-area"
    if not os.path.exists(area):
        os.mkdir(area, 0o755)
    os.chmod(area, 0o755)
    os.chown(area, NOBODY, NOBODY)
    with open(f"{area}/root-secret", "w") as f:
        f.write("secret")
    os.chmod(f"{area}/root-secret", 0o600)
    os.mkdir(f"{area}/root-dir", 0o755)
    with open(f"{area}/root-dir/readable", "w") as f:
        f.write("public")
    os.chmod(f"{area}/root-dir/readable", 0o644)
    return [lst(area), lst(f"{area}/root-secret")]


@case("user")
def permissions_hold_for_another_user(d):
    area = f"{ROOT}/user-area"
    return [attempt(lambda: open(f"{area}/root-secret").read()),
            attempt(lambda: open(f"{area}/root-dir/readable").read()),
            attempt(lambda: open(f"{area}/root-dir/readable", "a").write("x")),
            attempt(os.open, f"{area}/root-dir/new", os.O_CREAT | os.O_WRONLY, 0o644),
            attempt(os.mkdir, f"{area}/root-dir/newdir"),
            attempt(os.unlink, f"{area}/root-dir/readable"),
            attempt(os.chmod, f"{area}/root-secret", 0o644),
            attempt(os.chown, f"{area}/root-dir/readable", NOBODY, NOBODY),
            attempt(os.truncate, f"{area}/root-dir/readable", 0)]


@case("user")
def a_user_creates_and_owns(d):
    fd = os.open(f"{d}/mine", os.O_CREAT | os.O_WRONLY, 0o640)
    os.write(fd, b"mine")
    os.close(fd)
    os.mkdir(f"{d}/mydir", 0o700)
    r = [lst(f"{d}/mine"), lst(f"{d}/mydir"), attempt(os.chmod, f"{d}/mine", 0o600), lst(f"{d}/mine"),
         attempt(os.chown, f"{d}/mine", 0, 0), attempt(os.utime, f"{d}/mine", ns=(10**9, 2 * 10**9))]
    s = os.stat(f"{d}/mine")
    r.append([s.st_atime_ns, s.st_mtime_ns])
    return r


@case("user")
def setid_bits_cleared_on_write_by_owner_without_privilege(d):
    with open(f"{d}/f", "w") as f:
        f.write("x")
    os.chmod(f"{d}/f", 0o6755)
    r = [lst(f"{d}/f")]
    with open(f"{d}/f", "a") as f:
        f.write("y")
    r.append(lst(f"{d}/f"))
    os.chmod(f"{d}/f", 0o6755)
    os.truncate(f"{d}/f", 0)
    r.append(lst(f"{d}/f"))
    return r


def getlk(fd, typ, start, length):
    """F_GETLK: (type, start, len, pid) of a lock that would conflict, or type F_UNLCK."""
    import fcntl
    import struct
    fmt = "hhxxxxqqixxxx"
    r = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack(fmt, typ, 0, start, length, 0))
    return struct.unpack(fmt, r)


@case("both")
def record_locks_between_processes(d):
    import fcntl
    with open(f"{d}/f", "wb") as f:
        f.write(b"x" * 1000)
    fd = os.open(f"{d}/f", os.O_RDWR)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 100, 0)      # bytes 0..100
    fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 100, 200)    # bytes 200..300
    parent = os.getpid()
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        out = []
        c = os.open(f"{d}/f", os.O_RDWR)
        for how, length, start in ((fcntl.LOCK_EX, 10, 50), (fcntl.LOCK_SH, 10, 250), (fcntl.LOCK_EX, 10, 250),
                                   (fcntl.LOCK_EX, 10, 150)):
            out.append(attempt(fcntl.lockf, c, how | fcntl.LOCK_NB, length, start))
        t, _, s, ln, p = getlk(c, fcntl.F_WRLCK, 60, 5)
        out.append([t == fcntl.F_WRLCK, s, ln, p == parent])
        t, *_ = getlk(c, fcntl.F_WRLCK, 400, 5)
        out.append(t == fcntl.F_UNLCK)
        os.write(wr, b"ready\n")
        # Blocks until the parent unlocks 0..100.
        out.append(attempt(fcntl.lockf, c, fcntl.LOCK_EX, 10, 20))
        os.write(wr, (json.dumps(out) + "\n").encode())
        os._exit(0)
    os.close(wr)
    r = os.fdopen(rd)
    assert r.readline() == "ready\n"
    time.sleep(0.2)
    fcntl.lockf(fd, fcntl.LOCK_UN, 50, 0)                       # split: 50..100 stays
    time.sleep(0.1)
    fcntl.lockf(fd, fcntl.LOCK_UN, 0, 0)
    out = json.loads(r.readline())
    os.waitpid(pid, 0)
    # The child's lock went with its exit: the parent locks everything again.
    out.append(attempt(fcntl.lockf, fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0))
    os.close(fd)
    return out


@case("both")
def extended_attributes(d):
    with open(f"{d}/f", "w") as f:
        f.write("x")
    return [attempt(os.setxattr, f"{d}/f", "user.k", b"v"), attempt(os.getxattr, f"{d}/f", "user.k"),
            attempt(os.listxattr, f"{d}/f"), attempt(os.removexattr, f"{d}/f", "user.k"),
            attempt(os.getxattr, f"{d}/f", "user.k")]


def fallocate(fd, mode, off, length):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@case("both")
def fallocate_modes(d):
    keep_size, punch_hole, zero_range = 1, 2, 16
    fd = os.open(f"{d}/f", os.O_CREAT | os.O_RDWR, 0o644)
    r = [attempt(os.posix_fallocate, fd, 0, 8192), os.fstat(fd).st_size]
    os.pwrite(fd, b"d" * 20000, 0)
    r.append(attempt(fallocate, fd, keep_size, 0, 100000))
    r.append(os.fstat(fd).st_size)
    r.append(attempt(fallocate, fd, 0, 10000, 30000))
    r.append(os.fstat(fd).st_size)
    r.append(attempt(fallocate, fd, punch_hole | keep_size, 4096, 8192))
    b = os.pread(fd, 40000, 0)
    r.append([os.fstat(fd).st_size, b[:4096].count(b"d"), b[4096:12288].count(0), b[12288:20000].count(b"d")])
    r.append(attempt(fallocate, fd, punch_hole, 0, 10))
    r.append(attempt(fallocate, fd, zero_range, 30000, 20000))
    b = os.pread(fd, 60000, 0)
    r.append([os.fstat(fd).st_size, b[30000:].count(0)])
    r.append(attempt(fallocate, fd, 0, 0, 0))
    r.append([os.lseek(fd, 0, os.SEEK_DATA), attempt(os.lseek, fd, 10**9, os.SEEK_DATA)])
    os.close(fd)
    ro = os.open(f"{d}/f", os.O_RDONLY)
    r.append(attempt(fallocate, ro, 0, 0, 10))
    os.close(ro)
    return r


@case("both")
def punched_holes_free_space_and_seek_finds_them(d):
    # A hole punched in a synced file frees its blocks; SEEK_DATA / SEEK_HOLE find it, a
    # dirty page inside it is data before any sync, and a file grown by ftruncate has a
    # hole at its end.
    keep_size, punch_hole = 1, 2
    fd = os.open(f"{d}/f", os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"a" * (1 << 20), 0)
    os.fsync(fd)
    before = os.fstat(fd).st_blocks
    r = [attempt(fallocate, fd, punch_hole | keep_size, 65536, 512 * 1024)]
    os.fsync(fd)
    r.append(os.fstat(fd).st_blocks < before * 3 // 4)

    def seek(off, whence):
        try:
            return os.lseek(fd, off, whence)
        except OSError as e:
            return ename(e)

    r.append([seek(o, os.SEEK_DATA) for o in (0, 65536, 600000, 1 << 20)])
    r.append([seek(o, os.SEEK_HOLE) for o in (0, 65536, 600000, (1 << 20) - 1)])
    r.append([os.pread(fd, 8, 65532).hex(), os.pread(fd, 4, 65536 + 512 * 1024 - 2).hex()])
    os.pwrite(fd, b"z", 300000)
    r.append([seek(65536, os.SEEK_DATA), seek(300000, os.SEEK_HOLE)])
    os.ftruncate(fd, 4 << 20)
    r.append([seek((1 << 20) + 10, os.SEEK_DATA), seek(1 << 20, os.SEEK_HOLE)])
    os.close(fd)
    return r


@case("both")
def readdir_lists_what_was_made(d):
    for i in range(50):
        with open(f"{d}/f{i:02}", "w") as f:
            f.write(str(i))
    os.mkdir(f"{d}/zdir")
    for i in range(0, 50, 3):
        os.unlink(f"{d}/f{i:02}")
    kinds = {e.name: ("dir" if e.is_dir(follow_symlinks=False) else "file") for e in os.scandir(d)}
    return [sorted(kinds.items())]


def main():
    results = []
    for phase, f in CASES:
        if phase not in ("both", PHASE):
            continue
        d = os.path.join(ROOT, f"{PHASE}-{f.__name__}") if PHASE == "root" else \
            os.path.join(ROOT, "user-area", f.__name__)
        try:
            os.mkdir(d)
        except OSError as e:
            results.append({"case": f"{PHASE}/{f.__name__}", "obs": ["setup failed", ename(e)]})
            continue
        try:
            obs = f(d)
        except OSError as e:
            obs = ["unexpected", ename(e)]
        except Exception as e:  # a bug in a case, or a file system that broke it
            obs = ["crash", type(e).__name__]
        results.append({"case": f"{PHASE}/{f.__name__}", "obs": obs})
    for r in results:
        print(f"{r['case']}\t{json.dumps(r['obs'], sort_keys=True)}")


main()
