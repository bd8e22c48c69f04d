"""toma's API beside toma 1.1.0 itself (installed from PyPI in the test venv): the same
script with only its import line changed gives the same results; out-of-memory errors
are injected (torch.OutOfMemoryError above a capacity) and counted."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

# One script, run with each import line: a batch size sweep, a range and a chunked
# fill over 1000 items, each called 4 times; out of memory above 100 items at once.
SCRIPT = """
{import_line}
import json, sys, torch

# The cache keyed by call stack alone: free CPU memory moves between calls on a busy
# machine, which makes toma's own count of out-of-memory errors vary from run to run.
sys.modules[toma.__module__].StacktraceMemoryBatchsizeCache.TRACK_RAM = False

CAPACITY = 100
ooms = {{"batch": 0, "range": 0, "chunked": 0}}
sizes = {{"batch": [], "range": [], "chunked": []}}

def check(kind, n):
    if n > CAPACITY:
        ooms[kind] += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    sizes[kind].append(n)

data = torch.arange(1000, dtype=torch.float64)

@toma.batch(initial_batchsize=512{policy})
def total(batchsize, data):
    check("batch", batchsize)
    return sum(float(data[i:i + batchsize].sum()) for i in range(0, len(data), batchsize))

@toma.range(initial_step=512{policy})
def squares(start, end, out):
    check("range", end - start)
    out[start:end] = data[start:end] ** 2

@toma.chunked(initial_step=512{policy})
def doubled(chunk, start, end):
    check("chunked", end - start)
    chunk.copy_(data[start:end] * 2)

results = []
for _ in range(4):
    out = torch.zeros(1000, dtype=torch.float64)
    squares(0, 1000, out)
    filled = torch.zeros(1000, dtype=torch.float64)
    doubled(filled)
    results.append([total(data), float(out.sum()), float(filled.sum())])
print(json.dumps({{"results": results, "ooms": ooms, "largest": {{k: max(v) for k, v in sizes.items()}}}}))
"""


def run(import_line, clean_env, policy=""):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(import_line=import_line, policy=policy)],
        capture_output=True,
        text=True,
        env=clean_env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_same_script_gives_the_same_results_as_toma(clean_env):
    theirs = run("from toma import toma", clean_env)
    # By default toma's rule, exactly: the same results, sizes and out-of-memory errors.
    ours = run("from torchtools.toma import toma", clean_env)
    assert ours == theirs
    # One keyword away, the search back up: the same results, the largest size that
    # fits, at the cost of the out-of-memory errors of the search (2 here, 64 -> 96 ->
    # 112 -> 104 -> 100; at most log2(512) = 9 per kind).
    searching = run("from torchtools.toma import toma", clean_env, policy=', policy="search"')
    assert searching["results"] == theirs["results"]
    for kind in ("batch", "range", "chunked"):
        assert theirs["largest"][kind] == 64, theirs
        assert searching["largest"][kind] == 100, searching
        assert searching["ooms"][kind] <= theirs["ooms"][kind] + 9, (kind, searching, theirs)


def test_tomas_module_layout_has_every_import_line_of_its_readme_and_tests():
    from torchtools.toma import batchsize_cache, cpu_memory, explicit, simple, stacktrace, toma, torch_cuda_memory
    from torchtools.toma.batchsize_cache import GlobalBatchsizeCache, NoBatchsizeCache, StacktraceMemoryBatchsizeCache

    assert toma.batch and explicit.batch and simple.batch
    assert batchsize_cache.NoBatchsizeCache is NoBatchsizeCache
    assert issubclass(StacktraceMemoryBatchsizeCache, batchsize_cache.BatchsizeCache)
    assert issubclass(GlobalBatchsizeCache, batchsize_cache.BatchsizeCache)
    assert cpu_memory.get_available_cpu_memory() > 0
    assert cpu_memory.is_out_of_cpu_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried"))
    assert torch_cuda_memory.is_cuda_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried"))
    assert not torch_cuda_memory.is_cudnn_snafu(RuntimeError("other"))

    def here():
        return stacktrace.get_simple_traceback()

    first = here()
    second = here()
    assert first != second  # two call sites
    again = [here() for _ in range(2)]
    assert again[0] == again[1]  # one call site, twice
    with stacktrace.watermark():
        assert len(here()) == 2  # here, and this test's frame


def test_a_cpu_memory_limit_makes_large_allocations_fail_as_out_of_memory(clean_env):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import torch
            from torchtools.toma import cpu_memory, toma
            torch.empty(1)
            cpu_memory.set_cpu_memory_limit(cpu_memory.get_available_cpu_memory() / 2**30 + 4)
            try:
                torch.empty((64, 2**30), dtype=torch.uint8)
            except RuntimeError as e:
                print("out of memory:", cpu_memory.is_out_of_cpu_memory(e))
        """)],
        capture_output=True, text=True, env=clean_env, timeout=600,
    )
    assert out.stdout.strip() == "out of memory: True", out.stderr


def test_other_errors_pass_through_and_size_one_raises_the_oom():
    from torchtools.toma import explicit, toma, NoBatchsizeCache

    @toma.batch(initial_batchsize=8)
    def broken(batchsize):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()

    tried = []

    def never_fits(batchsize):
        tried.append(batchsize)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        explicit.batch(never_fits, 8, toma_cache_type=NoBatchsizeCache)
    assert tried == [8, 4, 2, 1]


def test_out_of_memory_is_the_rust_classifiers_answer():
    """One rule: the toma module asks torchtools' Rust classifier (tt-adaptive's), so an
    out-of-memory it knows beyond toma's three (cuBLAS's, MPS's) is retried smaller too,
    and toma's type check stays (a ValueError saying "out of memory" is not one)."""
    from torchtools import _native
    from torchtools.toma import should_reduce_batch_size
    from torchtools.toma.cpu_memory import is_out_of_cpu_memory
    from torchtools.toma.torch_cuda_memory import is_cuda_out_of_memory, is_cudnn_snafu

    cases = {
        "CUDA out of memory. Tried to allocate 2.00 GiB": "cuda",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if": "cudnn",
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`": "cublas",
        "[enforce fail at alloc_cpu.cpp:114] DefaultCPUAllocator: can't allocate memory": "cpu",
        "MPS backend out of memory (MPS allocated: 1.2 GB)": "mps",
        "mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)": None,
    }
    for message, kind in cases.items():
        assert _native.oom_kind(message) == kind, message
        error = RuntimeError(message)
        assert should_reduce_batch_size(error) == (kind is not None), message
        assert is_cuda_out_of_memory(error) == (kind == "cuda"), message
        assert is_cudnn_snafu(error) == (kind == "cudnn"), message
        assert is_out_of_cpu_memory(error) == (kind == "cpu"), message
    assert should_reduce_batch_size(torch.OutOfMemoryError("CUDA out of memory."))
    assert not should_reduce_batch_size(ValueError("CUDA out of memory."))
    assert not should_reduce_batch_size(RuntimeError("CUDA out of memory.", 2))


def test_each_call_site_remembers_its_own_size(monkeypatch):
    import torchtools.toma
    from torchtools.toma import StacktraceMemoryBatchsizeCache, toma

    class ByCallSite(StacktraceMemoryBatchsizeCache):
        # Keyed by call stack alone: free CPU memory (counted in 256 MiB steps) moves
        # between calls on a busy machine and starts a call over from 64 (a CI run
        # failed so; below, the free memory changes at every call, as the worst case).
        TRACK_RAM = False

    free = iter(range(1 << 30, 1 << 40, 1 << 30))
    monkeypatch.setattr(torchtools.toma, "get_available_cpu_memory", lambda: next(free))
    calls = []

    @toma.batch(initial_batchsize=64, policy="halve", cache_type=ByCallSite)
    def run(batchsize, capacity):
        calls.append(batchsize)
        if batchsize > capacity:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return batchsize

    assert [run(10) for _ in range(3)] == [8, 8, 8]  # one line: 64, 32, 16 ran out once
    assert run(1000) == 64  # another line: its own entry, from 64
    assert calls == [64, 32, 16, 8, 8, 8, 64]


def test_chunked_fills_every_index_once():
    from torchtools.toma import toma

    seen = torch.zeros(300, dtype=torch.int64)

    @toma.chunked(initial_step=128)
    def fill(chunk, start, end):
        if end - start > 50:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        chunk += 1

    fill(seen)
    assert torch.equal(seen, torch.ones(300, dtype=torch.int64))
