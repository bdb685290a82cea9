"""Every kernels/*.cu compiles with nvcc for Hopper (sm_90, or sm_90a for files that ask for
it), so CI catches a broken kernel on machines without a GPU. Skipped where nvcc is not
installed."""
import importlib.util
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# The loader by path: importing the dptrain.backend.cuda package would need CuPy.
_spec = importlib.util.spec_from_file_location(
    "_kernel_loader", Path(__file__).parents[2] / "dptrain" / "backend" / "cuda" / "loader.py")
loader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loader)

NVCC = shutil.which("nvcc")
SOURCES = sorted(loader.kernel_dir().glob("*.cu"))


def _compile(source, out_dir):
    """(nvcc's exit code, its stderr) for `source` with every declared instantiation."""
    # Taking each declared instantiation's address forces nvcc to compile it, as NVRTC
    # does through name_expressions.
    names = loader.name_expressions(source.read_text())
    wrapper = out_dir / f"check_{source.stem}.cu"
    refs = ",\n    ".join(f"(void*)&{name}" for name in names) or "nullptr"
    wrapper.write_text(f'#include "{source}"\nvoid* dptrain_instances[] = {{\n    {refs}\n}};\n')
    # A file that asks NVRTC for the arch-specific target (`// nvrtc-options: -arch=sm_90a`,
    # for wgmma) gets it here too, in the -gencode form (nvcc 13.0's -arch=sm_90a shorthand
    # also runs a plain sm_90 pass that rejects wgmma).
    opts = loader.file_options(source.read_text())
    arch = ("-gencode=arch=compute_90a,code=sm_90a" if "-arch=sm_90a" in opts
            else "-arch=sm_90")
    result = subprocess.run(
        [NVCC, arch, "-std=c++17", f"-I{source.parent}", "-c", str(wrapper),
         "-o", str(out_dir / f"{source.stem}.o")],
        capture_output=True, text=True, timeout=600,
    )
    return result.returncode, result.stderr


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """source -> a future of _compile's result. In one pytest process every file is
    compiled at the first request, the largest first, on every CPU this process may use
    (one at a time they took about 250 s of `make test` on 2 cores); under xdist, whose
    workers are the parallelism, each file when its test asks."""
    out = tmp_path_factory.mktemp("nvcc")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield {s: _Deferred(_compile, s, out) for s in SOURCES}
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with ThreadPoolExecutor(cpus or 1) as pool:
        largest_first = sorted(SOURCES, key=lambda s: -s.stat().st_size)
        yield {s: pool.submit(_compile, s, out) for s in largest_first}
        pool.shutdown(cancel_futures=True)


class _Deferred:
    """A future that runs its call when its result is asked for."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def result(self):
        return self.fn(*self.args)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_kernel_compiles_for_sm90(source, compiled):
    code, stderr = compiled[source].result()
    assert code == 0, stderr[-4000:]


def test_every_cuda_source_declares_its_instantiations():
    for source in SOURCES:
        text = source.read_text()
        if "template" in text and "__global__" in text:
            assert loader.name_expressions(text), f"{source.name} has no '// instantiate:' line"


def test_headers_are_shared_not_repeated():
    """The kernels' shared macros and helpers are defined once, in common.cuh."""
    shared = ("#define GRID_STRIDE", "#define FULL_MASK", "#define DP_MAX_DIMS", "struct Layout {",
              "neg_inf<float>()", "dp_exp(float x)")
    sources = sorted(loader.kernel_dir().glob("*.cu*"))
    for needle in shared:
        holders = [s.name for s in sources if needle in s.read_text()]
        assert holders == ["common.cuh"], (needle, holders)


def test_file_options_are_read():
    src = "// nvrtc-options: -arch=sm_90a  -DX=1\n// instantiate: k<float>\n"
    assert loader.file_options(src) == ("-arch=sm_90a", "-DX=1")
    assert loader.file_options("// instantiate: k<float>\n") == ()
    wgmma = loader.kernel_dir() / "gemm_wgmma.cu"
    assert "-arch=sm_90a" in loader.file_options(wgmma.read_text())


def test_kernel_dir_inside_an_installed_package(tmp_path, monkeypatch):
    """In a wheel the sources sit at dptrain/kernels, beside the package's modules: the loader
    (dptrain/backend/cuda/loader.py) finds them there first; DPTRAIN_KERNEL_DIR overrides."""
    pkg = tmp_path / "dptrain"
    (pkg / "backend" / "cuda").mkdir(parents=True)
    (pkg / "kernels").mkdir()
    (pkg / "kernels" / "x.cu").write_text("// instantiate: k<float>\n")
    copy = pkg / "backend" / "cuda" / "loader.py"
    copy.write_text(Path(loader.__file__).read_text())
    spec = importlib.util.spec_from_file_location("_installed_loader", copy)
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    monkeypatch.delenv("DPTRAIN_KERNEL_DIR", raising=False)
    assert installed.kernel_dir() == (pkg / "kernels").resolve()
    monkeypatch.setenv("DPTRAIN_KERNEL_DIR", str(loader.kernel_dir()))
    assert installed.kernel_dir() == loader.kernel_dir()


def test_instantiate_lines_expand_their_products():
    """One line per template: braces hold alternatives, the last brace varies fastest; a
    plain name and ';'-separated expressions as before."""
    text = ("// instantiate: k<{float, __half}, {32, 64}>; k<float, 16, true>\n"
            "// instantiate: plain_kernel\n")
    assert loader.name_expressions(text) == [
        "k<float, 32>", "k<float, 64>", "k<__half, 32>", "k<__half, 64>", "k<float, 16, true>",
        "plain_kernel"]
