"""
Building the compiled code: the C++/CUDA kernels under csrc/, JIT-built with
torch.utils.cpp_extension on first use and cached on disk.

Owns the build recipes (sources and flags per library), the cache directory, loading a
library so its ops appear under torch.ops, and the warn-once record of builds that failed.
Does not decide which backend runs (paged_attention.resolve_backend and model.linear do)
and holds no math. cache_root() is also where weights.py keeps converted weights.
"""
import functools
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
BUILDS = {   # torch.utils.cpp_extension.load arguments per library
    "cpu": dict(
        name="nanoserve_paged_attention_cpu", sources=["paged_attention_cpu.cpp"],
        # associative math lets dot products end in a shuffle tree, not a serial chain of
        # adds; no -ffinite-math-only: the kernel relies on -inf for "no score yet"
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros",
                      "-fno-trapping-math", "-fno-math-errno"],
        extra_ldflags=["-fopenmp"]),
    "cuda": dict(
        name="nanoserve_paged_attention_cuda",
        sources=["paged_attention_cuda_binding.cpp", "paged_attention_cuda.cu", "fused_cuda.cu", "sampling_cuda.cu"],
        extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--use_fast_math"]),
    # not attention: model.py's small-batch linear layers
    "linear_cpu": dict(
        name="nanoserve_linear_cpu", sources=["int8_cpu.cpp", "linear_cpu.cpp"],   # the last names the library in warnings
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"]),
    # model.py's fused per-layer ops: residual add + RMSNorm, RoPE in place, SwiGLU
    # (no trapping math: else GCC 12 keeps SwiGLU's compares as branches and the loop scalar on AVX2)
    "fused_cpu": dict(
        name="nanoserve_fused_cpu", sources=["fused_cpu.cpp"],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
        extra_ldflags=["-fopenmp"]),
    # model.py's decoder layer as one op on the int8 path: calls the three libraries above (loaded first)
    "layer_cpu": dict(
        name="nanoserve_decoder_layer_cpu", sources=["decoder_layer_cpu.cpp"], extra_cflags=["-O3"]),
    # not the model: structured_output.py's grammar mask, applied from llguidance's packed bitmask
    "grammar_cpu": dict(
        name="nanoserve_grammar_cpu", sources=["grammar_mask_cpu.cpp"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"]),
}
_loaded = set()     # kinds whose ops are registered in torch.ops
failed = {}         # kind -> why its build failed (warned about once)


def cache_root() -> Path:
    """Everything nanoserve caches on disk: built kernels and converted weights."""
    return Path(os.environ.get("NANOSERVE_CACHE", Path.home() / ".cache" / "nanoserve"))


def build_directory(build: dict) -> Path:
    """Cache dir named by a hash of the sources, flags, torch and Python versions and CPU:
    checkouts with different sources never rebuild over each other, -march=native code never moves
    to another CPU, and a library linked against one Python's torch never loads in another's."""
    cpuinfo = Path("/proc/cpuinfo")
    cpu = cpuinfo.read_text() if cpuinfo.exists() else platform.processor()
    cpu_flags = next((line for line in cpu.splitlines() if line.startswith("flags")), cpu)
    key = hashlib.sha1(f"{platform.machine()} {cpu_flags} {torch.__version__} {sys.version_info[:2]} "
                       f"{sorted(build.items())}".encode())
    for source in build["sources"]:
        key.update((CSRC / source).read_bytes())
    path = cache_root() / "torch_extensions" / f"{build['name']}-{key.hexdigest()[:12]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


# NANOSERVE_CPU_ISA=avx2 builds the CPU libraries for AVX2 + FMA + F16C only (-march=x86-64-v3, the
# ISA of CI's EPYCs) on any x86 CPU, into their own directories: to test or time that build on a
# CPU with AVX-512 (bench.py; torch's own kernels are held with ATEN_CPU_CAPABILITY=avx2 and
# ONEDNN_MAX_CPU_ISA=AVX2), and cpu_linear.cpu_flags() then hides the CPU's AVX-512/AMX/VNNI flags:
# an AVX-512 machine runs as CI's AVX2-only CPUs.
CPU_ISA = {"native": "-march=native", "avx2": "-march=x86-64-v3"}


def cpu_isa() -> str:
    return os.environ.get("NANOSERVE_CPU_ISA", "native")


def with_cpu_isa(build: dict) -> dict:
    """A build's arguments with -march=native replaced by NANOSERVE_CPU_ISA's flag (unset: native)."""
    isa = cpu_isa()
    if isa not in CPU_ISA:
        raise ValueError(f"NANOSERVE_CPU_ISA must be one of {sorted(CPU_ISA)}, got {isa!r}")
    flags = [CPU_ISA[isa] if f == "-march=native" else f for f in build.get("extra_cflags", [])]
    return {**build, "extra_cflags": flags} if "extra_cflags" in build else build


def load(kind: str) -> None:
    """Load the cached build of one library, or JIT-build it first; raises if the build fails."""
    if kind in _loaded:
        return
    build = with_cpu_isa(BUILDS[kind])
    build_dir = build_directory(build)
    library = build_dir / f"{build['name']}.so"
    # The directory is named by a hash of everything the library depends on, so a library in it is
    # this build: load it as is. cpp_extension.load would run ninja, which rebuilds (~10 s, in
    # whatever call first needs the library) when a source's mtime is newer than the library, as
    # after a git checkout, or when another checkout of the same sources wrote build.ninja.
    if library.exists():
        try:
            torch.ops.load_library(str(library))
            _loaded.add(kind)
            return
        except OSError as e:     # e.g. a build cut off mid-link: build it again
            print(f"cannot load {library} ({e}); rebuilding", file=sys.stderr, flush=True)
    from torch.utils import cpp_extension
    start = time.perf_counter()
    cpp_extension.load(**{**build, "sources": [str(CSRC / s) for s in build["sources"]]},
                       build_directory=str(build_dir), is_python_module=False, verbose=False)
    print(f"built {build['name']} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    _loaded.add(kind)


def try_load(kind: str, fallback: str) -> bool:
    """True if the library is usable; on failure warn once (saying what runs instead) and
    remember why, so later calls return False at once."""
    if kind in failed:
        return False
    try:
        load(kind)
        return True
    except Exception as e:  # no compiler, compile error, missing CUDA toolkit...
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        failed[kind] = f"{type(e).__name__}: {first_line}"
        warnings.warn(f"csrc/{BUILDS[kind]['sources'][-1]} unavailable ({failed[kind]}); {fallback}",
                      RuntimeWarning, stacklevel=3)
        return False


@functools.cache
def _fused_cpu_built() -> bool:
    return try_load("fused_cpu", "RMSNorm, RoPE and SwiGLU run as separate PyTorch ops (slower)")


def fused_ops_available(device, dtype) -> bool:
    """csrc/fused_cpu.cpp runs here: the per-layer ops (model.py) and the sampler's row kernels."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _fused_cpu_built()


@functools.cache
def decoder_layer_op_available() -> bool:
    """csrc/decoder_layer_cpu.cpp runs here (model.DecoderLayer's one-op path). It calls the ops of the
    attention, fused and linear libraries through the dispatcher, so those load first."""
    why = "decoder layers run as separate ops from Python (slower at a few rows)"
    return all(try_load(kind, why) for kind in ("cpu", "fused_cpu", "linear_cpu", "layer_cpu"))
