"""Compile the CUDA sources in kernels/ once per process and hand out their functions.

Every launcher in the cuda backend gets its kernels here (through ``launch.kernel``):

    fn = loader.function("elementwise.cu", "map2_kernel<float, Add>")

The first request for a file compiles it with NVRTC through ``cupy.RawModule``
(all of its template instantiations at once, listed in ``name_expressions``);
later requests reuse the module. CuPy caches the compiled binary on disk
(~/.cupy/kernel_cache), so a second process start skips NVRTC too.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
from pathlib import Path

KERNEL_DIR_ENV = "DPTRAIN_KERNEL_DIR"


def kernel_dir() -> Path:
    """Where the .cu files are: beside the package in a source tree, inside it in a wheel."""
    override = os.environ.get(KERNEL_DIR_ENV)
    candidates = [Path(override)] if override else []
    here = Path(__file__).resolve().parents[2]  # dptrain/
    candidates += [here / "kernels", here.parent / "kernels"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.cu")):
            return path
    raise RuntimeError(
        "dptrain: cannot find the CUDA sources (kernels/*.cu); looked in "
        + ", ".join(str(p) for p in candidates)
    )


def cuda_include_dir() -> Path:
    """The toolkit's include directory, so <mma.h> and <cuda_bf16.h> compile under NVRTC."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots.append("/usr/local/cuda")
    for root in roots:
        if root and (Path(root) / "include" / "cuda_runtime.h").exists():
            return Path(root) / "include"
    raise RuntimeError(
        "dptrain: no CUDA toolkit headers found (looked under CUDA_PATH, CUDA_HOME, "
        "the nvcc on PATH and /usr/local/cuda); install the CUDA toolkit or set CUDA_PATH"
    )


# "// instantiate: add_kernel<float>" lines in a .cu file name the template
# instantiations NVRTC must emit; each file lists its own.
_INSTANTIATE = re.compile(r"^//\s*instantiate:\s*(.+?)\s*$", re.MULTILINE)


# "// nvrtc-options: -arch=sm_90a" lines add compiler options for that file alone (appended
# after the common ones; CuPy then appends its own -arch=sm_XX, and NVRTC 13 keeps the
# arch-specific sm_90a target over the plain sm_90 of the same family).
_OPTIONS = re.compile(r"^//\s*nvrtc-options:\s*(.+?)\s*$", re.MULTILINE)


def file_options(source: str) -> tuple[str, ...]:
    """The extra compiler options a .cu file asks for on its `// nvrtc-options:` lines."""
    return tuple(o for line in _OPTIONS.findall(source) for o in line.split())


def name_expressions(source: str) -> list[str]:
    names = []
    for line in _INSTANTIATE.findall(source):
        names += [n.strip() for n in line.split(";") if n.strip()]
    return names


@functools.lru_cache(maxsize=None)
def module(filename: str):
    import cupy

    path = kernel_dir() / filename
    source = path.read_text()
    # CuPy caches compiled code by source text and options only, so fold the local headers'
    # text into the source: editing a header (common.cuh, gemm_tiles.cuh) then recompiles
    # the files that include it.
    headers = "".join(h.read_text() for h in sorted(kernel_dir().glob("*.cuh")))
    source += f"\n// headers: {hashlib.sha256(headers.encode()).hexdigest()}\n"
    options = (
        "--std=c++17",
        f"-I{cuda_include_dir()}",
        f"-I{kernel_dir()}",
    ) + file_options(source)
    mod = cupy.RawModule(code=source, options=options, name_expressions=name_expressions(source))
    mod.compile()
    return mod


@functools.lru_cache(maxsize=None)
def function(filename: str, name: str):
    """The kernel `name` (a plain name or a template instantiation) from kernels/`filename`."""
    return module(filename).get_function(name)
