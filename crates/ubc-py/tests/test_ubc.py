"""Tests of the ubc Python bindings (pytest)."""

import io
import os
import shutil
import threading
import time

import numpy as np
import pytest

import ubc


@pytest.fixture
def env(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    key = tmp_path / "key"
    ubc.generate_key(str(key))
    return data, key


@pytest.fixture
def stack(env):
    data, key = env
    return ubc.Stack(f"dir:{data} | zstd | aead:keyfile={key}", ubc.Cache(64 << 20))


@pytest.fixture
def plain(tmp_path):
    """A host directory and a stack of it alone, to check the host file itself."""
    data = tmp_path / "plain"
    data.mkdir()
    return data, ubc.Stack(f"dir:{data}", ubc.Cache(64 << 20))


def payload(n=300_000):
    rng = np.random.default_rng(7)
    # Compressible but not trivial: words drawn at random.
    words = [b"alpha ", b"beta ", b"gamma ", b"delta ", b"secret-plaintext "]
    idx = rng.integers(0, len(words), n // 6)
    return b"".join(words[i] for i in idx)


def test_generate_key_refuses_overwrite(env):
    _, key = env
    with pytest.raises(FileExistsError):
        ubc.generate_key(str(key))


def test_round_trip_through_zstd_aead(stack, env):
    data = payload()
    assert stack.depth == 3
    with stack.open("file.bin", "wb") as f:
        assert isinstance(f, io.BufferedWriter)
        assert f.write(data) == len(data)
    with stack.open("file.bin") as f:
        assert isinstance(f, io.BufferedReader)
        assert f.read() == data
    assert stack.stat("file.bin").size == len(data)
    assert stack.stat("file.bin").kind == "file"
    assert stack.listdir() == ["file.bin"]
    # A fresh stack (fresh cache) reads the same from what reached the disk.
    data_dir, key = env
    again = ubc.Stack(f"dir:{data_dir} | zstd | aead:keyfile={key}")
    with again.open("file.bin") as f:
        assert f.read() == data


def test_buffered_and_copyfileobj(stack, tmp_path):
    data = payload()
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    with open(src, "rb") as s, stack.open("copy.bin", "wb") as d:
        shutil.copyfileobj(s, d, 10_000)
    with stack.open("copy.bin", raw=True) as r:
        assert isinstance(r, io.RawIOBase)
        with io.BufferedReader(r) as b:
            assert b.read() == data
    out = io.BytesIO()
    with stack.open("copy.bin") as s:
        shutil.copyfileobj(s, out)
    assert out.getvalue() == data
    # readline / iteration from io.
    with stack.open("lines.txt", "wb") as f:
        f.write(b"one\ntwo\nthree\n")
    with stack.open("lines.txt") as f:
        assert list(f) == [b"one\n", b"two\n", b"three\n"]
    with io.TextIOWrapper(stack.open("lines.txt"), encoding="utf-8") as t:
        assert t.read().split() == ["one", "two", "three"]


def test_seek_tell_truncate(stack):
    with stack.open("s.bin", "w+b") as f:
        assert isinstance(f, io.BufferedRandom)
        f.write(b"0123456789")
        assert f.tell() == 10
        f.seek(3)
        assert f.read(4) == b"3456"
        assert f.tell() == 7
        f.seek(-2, io.SEEK_END)
        assert f.read() == b"89"
        f.seek(2)
        f.write(b"xy")
        f.seek(0)
        assert f.read() == b"01xy456789"
        assert f.truncate(5) == 5
        f.seek(0, io.SEEK_END)
        assert f.tell() == 5
    assert stack.stat("s.bin").size == 5
    with stack.open("s.bin", "r+b", raw=True) as r:
        assert r.readable() and r.writable() and r.seekable()
        with pytest.raises(io.UnsupportedOperation):
            r.fileno()
        r.seek(8)
        r.write(b"Z")  # writing past the end leaves a zero gap
        r.seek(0)
        assert r.readall() == b"01xy4\0\0\0Z"
        r.seek(2)
        r.truncate()
        assert len(r) == 2
    with stack.open("s.bin", "ab") as a:
        a.write(b"++")
    with stack.open("s.bin") as f:
        assert f.read() == b"01++"
        with pytest.raises(io.UnsupportedOperation):
            f.write(b"no")
    with stack.open("s.bin", "wb") as f:
        pass
    assert stack.stat("s.bin").size == 0
    with pytest.raises(FileExistsError):
        stack.open("s.bin", "xb")


@pytest.mark.parametrize("mode", ["r", "w", "rt", "w+", "a", "rb+t", "q", "rwb"])
def test_text_and_bad_modes_rejected(stack, mode):
    with pytest.raises(ValueError):
        stack.open("x.bin", mode)


def test_map_numpy_zero_copy(stack):
    arr = np.arange(100_000, dtype=np.int32)
    with stack.open("arr.bin", "wb") as f:
        f.write(arr.tobytes())
    with stack.open("arr.bin") as f:
        m = f.map()
        assert len(m) == arr.nbytes
        view = np.frombuffer(m, dtype=np.int32)
        assert np.array_equal(view, arr)
        mv = memoryview(m)
        assert mv.readonly and mv.nbytes == arr.nbytes
        with pytest.raises((TypeError, BufferError)):
            mv[0] = 1
        # The mapping stays alive while buffers are exported.
        with pytest.raises(BufferError):
            m.close()
        del view
        mv.release()
        m.close()
        assert m.closed
        # Partial mapping at an offset.
        with f.map(offset=4 * 10, length=4 * 5) as part:
            assert np.frombuffer(part, dtype=np.int32).tolist() == [10, 11, 12, 13, 14]


def test_writable_map_store_visible_to_read(stack):
    with stack.open("w.bin", "wb") as f:
        f.write(bytes(8192))
    with stack.open("w.bin", "r+b") as f:
        m = f.map(writable=True)
        a = np.frombuffer(m, dtype=np.uint8)
        assert a.flags.writeable
        a[100:105] = np.frombuffer(b"HELLO", dtype=np.uint8)
        memoryview(m)[5000:5003] = b"abc"
        del a
        # Another handle (same layer) and the bottom layer see the stores.
        with stack.open("w.bin") as g:
            g.seek(100)
            assert g.read(5) == b"HELLO"
            g.seek(5000)
            assert g.read(3) == b"abc"
        m.flush()
        m.close()
    with stack.open("w.bin") as g:
        data = g.read()
    assert data[100:105] == b"HELLO" and data[5000:5003] == b"abc"
    # A read-only file cannot be mapped writable.
    with stack.open("w.bin") as g:
        with pytest.raises(OSError):
            g.map(writable=True)


def test_cleartext_top_ciphertext_bottom(stack, env):
    data = payload()
    with stack.open("secret.bin", "wb") as f:
        f.write(data)
    with stack.layer(0).open("secret.bin") as f:
        stored = f.read()
    assert len(stored) > 0
    assert b"secret-plaintext" not in stored
    on_disk = (env[0] / "secret.bin").read_bytes()
    assert b"secret-plaintext" not in on_disk
    assert stack.layer(0).stat("secret.bin").size == len(stored)
    # The top shows the cleartext size.
    assert stack.layer(2).stat("secret.bin").size == len(data)


def test_errors(stack):
    with pytest.raises(FileNotFoundError) as e:
        stack.open("missing.bin")
    assert e.value.errno == 2
    with pytest.raises(FileNotFoundError):
        stack.stat("missing.bin")
    stack.mkdir("d")
    with pytest.raises(IsADirectoryError):
        stack.open("d")
    with pytest.raises(FileExistsError):
        stack.mkdir("d")
    with pytest.raises(OSError):
        ubc.Stack("bogus:layer")
    assert issubclass(ubc.AuthenticationError, OSError)


def test_namespace_ops(stack):
    stack.mkdir("dir")
    with stack.open("dir/a.bin", "wb") as f:
        f.write(b"a")
    assert stack.layer(0).listdir("dir") == ["a.bin"]
    stack.rename("dir/a.bin", "dir/b.bin")
    assert stack.listdir("dir") == ["b.bin"]
    assert stack.top.scandir("") == [("dir", "dir")]
    with stack.open("dir/b.bin") as f:
        assert f.read() == b"a"
    stack.remove("dir/b.bin")
    assert stack.listdir("dir") == []
    assert not stack.top.exists("dir/b.bin")
    stack.top.rmdir("dir")
    assert stack.listdir() == []


def test_authentication_error(env, tmp_path):
    data_dir, key = env
    s = ubc.Stack(f"dir:{data_dir} | aead:keyfile={key}")
    body = b"authentic data " * 2000
    with s.open("t.bin", "wb") as f:
        f.write(body)
    s.sync_all()
    del s
    path = data_dir / "t.bin"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    s2 = ubc.Stack(f"dir:{data_dir} | aead:keyfile={key}")
    with pytest.raises(ubc.AuthenticationError) as e:
        with s2.open("t.bin") as f:
            f.read()
    assert isinstance(e.value, OSError)


def test_stats(stack):
    with stack.open("st.bin", "wb") as f:
        f.write(b"x" * 100_000)
    with stack.open("st.bin") as f:
        f.read()
    st = stack.stats()
    assert isinstance(st, dict)
    assert st["budget_bytes"] == 64 << 20
    assert st["hits"] + st["misses"] > 0
    assert "coherence_flushes" in st
    cs = ubc.stats(stack.cache)
    assert cs["budget_bytes"] == 64 << 20 and "coherence_flushes" not in cs
    assert stack.cache.stats()["page_size"] > 0
    # Default cache when none is given.
    assert ubc.Stack("mem").stats()["budget_bytes"] == ubc.DEFAULT_BUDGET


def test_huge_pages(tmp_path):
    # Which memory the pages got is always reported; "try" takes 2 MiB pages from the
    # hugetlb pool when it holds the budget (scripts/test reserves one and says so).
    assert ubc.Cache(8 << 20).stats()["page_memory"].startswith("shmem, 4 KiB pages")
    c = ubc.Cache(8 << 20, huge_pages="try")
    mem = c.stats()["page_memory"]
    if os.environ.get("UBC_TEST_HUGETLB") == "1":
        assert mem.startswith("hugetlb, 2 MiB pages"), mem
        assert c.stats()["page_size"] == 2 << 20
    s = ubc.Stack(f"dir:{tmp_path}", c)
    data = os.urandom(5 << 20)
    with s.open("h.bin", "wb") as f:
        f.write(data)
    with s.open("h.bin") as f:
        assert f.read() == data
    with pytest.raises(ValueError):
        ubc.Cache(8 << 20, huge_pages="sometimes")


def test_mem_files_are_served_in_place():
    # A `mem` file lives once, in its store: the cache holds no copy of it and charges
    # nothing to its budget, however small (execute-in-place); with xip=False it is cached.
    data = os.urandom(8 << 20)
    for xip in (True, False):
        c = ubc.Cache(1 << 20, xip=xip)
        s = ubc.Stack("mem", c)
        with s.open("m.bin", "wb") as f:
            f.write(data)
        with s.open("m.bin") as f:
            assert f.read() == data
        st = c.stats()
        if xip:
            assert st["resident_bytes"] == 0, st
            assert st["xip_bytes"] >= 7 << 20, st
        else:
            assert st["resident_bytes"] > 0, st
            assert st["xip_bytes"] == 0, st


def test_gil_released(env):
    data_dir, key = env
    spec = f"dir:{data_dir} | zstd | aead:keyfile={key}"
    size = 4 << 20
    blob = os.urandom(1 << 20) * 4
    with ubc.Stack(spec).open("big.bin", "wb") as f:
        f.write(blob)

    # 1. Two threads read concurrently, each through its own cold stack, and both finish.
    results = {}

    def reader(i):
        s = ubc.Stack(spec, ubc.Cache(64 << 20))
        with s.open("big.bin", raw=True) as r:
            buf = bytearray(size)
            n = r.readinto(buf)
            results[i] = (n, bytes(buf[:64]) == blob[:64] and buf == blob)

    ts = [threading.Thread(target=reader, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in ts)
    assert results == {0: (size, True), 1: (size, True)}

    # 2. While one native call (a single cold 4 MiB readinto) runs, another Python thread
    #    keeps running: it could not if the call held the GIL. The spinner stamps the time
    #    about every millisecond; with the GIL held it could stamp nothing between entering
    #    the call (t0) and the call's return (at least elapsed - one switch interval later).
    s = ubc.Stack(spec, ubc.Cache(64 << 20))
    stamps = []
    stop = threading.Event()
    started = threading.Event()

    def spin():
        last = 0.0
        started.set()
        while not stop.is_set():
            now = time.perf_counter()
            if now - last > 0.001:
                stamps.append(now)
                last = now

    r = s.open("big.bin", raw=True)
    buf = bytearray(size)
    t = threading.Thread(target=spin)
    t.start()
    started.wait()
    time.sleep(0.01)
    t0 = time.perf_counter()
    n = r.readinto(buf)
    elapsed = time.perf_counter() - t0
    stop.set()
    t.join()
    r.close()
    assert n == size and buf == blob
    assert elapsed > 0.05, f"read too fast to judge ({elapsed:.3f}s)"
    inside = [x for x in stamps if t0 < x < t0 + elapsed / 2]
    assert len(inside) >= 5, (len(inside), elapsed)


def test_readme_example(tmp_path, monkeypatch):
    """The README's Python example (the block after its readme-example marker, the one
    scripts/test-install runs against an installed package), run as written."""
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[3] / "README.md").read_text()
    marker = readme.index("<!-- readme-example: python -->")
    start = readme.index("```python\n", marker) + len("```python\n")
    end = readme.index("```", start)
    monkeypatch.chdir(tmp_path)
    exec(compile(readme[start:end], "README.md", "exec"), {})


def test_pandas_reads_a_stack_file():
    """A stack file is a real binary file object: pandas reads CSV from it directly."""
    pandas = __import__("pytest").importorskip("pandas")
    stack = ubc.Stack("mem | zstd")
    with stack.open("t.csv", "wb") as f:
        f.write(b"a,b\n1,2\n3,4\n")
    with stack.open("t.csv") as f:
        df = pandas.read_csv(f)
    assert list(df.columns) == ["a", "b"] and int(df["b"].sum()) == 6


def test_writeback_hook_runs_before_the_store_and_can_refuse(plain):
    import errno

    data, s = plain
    body = payload(1 << 20)
    calls = []

    def hook(offset, length):
        # The host file does not hold these bytes yet.
        host = (data / "db").read_bytes()
        calls.append((offset, length, host[offset : offset + length] == body[offset : offset + length]))

    with s.open("db", "w+b", buffering=0) as f:
        f.set_writeback_hook(hook)
        f.write(body)
        f.sync()
        assert calls, "the hook was never called"
        assert not any(early for _, _, early in calls), calls
        end = 0
        for off, n, _ in sorted(calls):
            assert off <= end
            end = max(end, off + n)
        assert end >= len(body)
        assert (data / "db").read_bytes() == body

        def full(offset, length):
            raise OSError(errno.ENOSPC, "log device full")

        f.set_writeback_hook(full)
        f.seek(0)
        f.write(b"LATER")
        with pytest.raises(OSError) as e:
            f.sync()
        assert e.value.errno == errno.ENOSPC
        assert (data / "db").read_bytes()[:5] == body[:5]
        f.set_writeback_hook(None)
        f.sync()
        assert (data / "db").read_bytes()[:5] == b"LATER"


def test_advise_dontneed_writes_back_and_patterns_read_right(plain):
    data, s = plain
    body = payload(1 << 20)
    with s.open("f", "w+b") as f:
        f.write(body)
        f.advise(0, 0, os.POSIX_FADV_DONTNEED)  # flushes the buffer, writes back, drops
        assert (data / "f").read_bytes() == body
        for a in (os.POSIX_FADV_RANDOM, os.POSIX_FADV_SEQUENTIAL, os.POSIX_FADV_WILLNEED, os.POSIX_FADV_NOREUSE):
            f.advise(0, 0, a)
            f.seek(0)
            assert f.read() == body
        with pytest.raises(ValueError):
            f.advise(0, 0, 99)
        f.seek(0)
        f.write(b"synced")
        f.sync(data_only=True)  # fdatasync
        assert (data / "f").read_bytes()[:6] == b"synced"
        f.sync()  # fsync


def test_mapping_madvise(plain):
    import mmap

    data, s = plain
    body = payload(1 << 20)
    with s.open("f", "w+b") as f:
        f.write(body)
        f.flush()
        with f.map(writable=True) as m:
            m.madvise(mmap.MADV_RANDOM)
            assert bytes(memoryview(m)[:1000]) == body[:1000]
            m.madvise(mmap.MADV_WILLNEED)
            memoryview(m)[5000:5008] = b"MADVISED"
            m.madvise(mmap.MADV_DONTNEED)
            assert (data / "f").read_bytes()[5000:5008] == b"MADVISED"
            with pytest.raises(ValueError):
                m.madvise(99)


def _s3_spec(name):
    """A fresh prefix on the S3 server ./scripts/test starts; skipped without one (a failure
    under UBC_TEST_S3_REQUIRED=1)."""
    endpoint = os.environ.get("UBC_TEST_S3_ENDPOINT")
    bucket = os.environ.get("UBC_TEST_S3_BUCKET")
    if not endpoint or not bucket:
        if os.environ.get("UBC_TEST_S3_REQUIRED") == "1":
            pytest.fail("UBC_TEST_S3_REQUIRED=1 but no S3 server (UBC_TEST_S3_ENDPOINT)")
        pytest.skip("no S3 server (run ./scripts/test, which starts one)")
    return f"s3:{bucket}/py-{name}-{os.getpid()}-{time.time_ns()}?endpoint={endpoint}&chunk=64K"


def test_s3_round_trip_through_zstd_and_a_restart(tmp_path):
    spec = _s3_spec("plain") + " | zstd"
    data = payload(1 << 20)
    s = ubc.Stack(spec, ubc.Cache(1 << 20))  # a budget far below the file
    s.mkdir("d")
    with s.open("d/f.bin", "w+b", buffering=0) as f:
        f.write(data)
        f.seek(4096)
        f.write(b"overwritten")
        f.sync()
    data = data[:4096] + b"overwritten" + data[4096 + 11 :]
    del s
    again = ubc.Stack(spec, ubc.Cache(1 << 20))
    assert again.listdir("d") == ["f.bin"]
    assert again.stat("d/f.bin").size == len(data)
    with again.open("d/f.bin") as f:
        assert f.read() == data
    with pytest.raises(FileNotFoundError):
        again.open("d/missing")


def test_s3_shared_between_two_caches_through_etcd():
    """Two caches with a stack each over one s3+etcd file system — two machines: a write
    returned on one is read on the other without a sync, both ways."""
    spec = _s3_spec("shared")
    etcd = os.environ.get("UBC_TEST_ETCD")
    if not etcd:
        if os.environ.get("UBC_TEST_ETCD_REQUIRED") == "1":
            pytest.fail("UBC_TEST_ETCD_REQUIRED=1 but no etcd (UBC_TEST_ETCD)")
        pytest.skip("no etcd (run ./scripts/test, which starts one)")
    spec += f"&etcd={etcd} | zstd"
    try:
        one = ubc.Stack(spec, ubc.Cache(1 << 20))
    except Exception as e:
        if "etcd" in str(e) and "feature" in str(e):
            if os.environ.get("UBC_TEST_ETCD_REQUIRED") == "1":
                pytest.fail(f"the package was built without the etcd feature: {e}")
            pytest.skip(f"built without the etcd feature: {e}")
        raise
    two = ubc.Stack(spec, ubc.Cache(1 << 20))
    data = payload(200_000)
    with one.open("f.bin", "w+b", buffering=0) as a, two.open("f.bin", "r+b", buffering=0) as b:
        a.write(data)
        assert b.read() == data
        b.seek(len(data))
        b.write(b"from-two")
        a.seek(0)
        assert a.read() == data + b"from-two"
        a.truncate(1000)
        assert two.stat("f.bin").size == 1000
        b.seek(0)
        assert b.read() == data[:1000]
