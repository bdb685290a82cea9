"""Every kernels/*.cu compiles with nvcc for Hopper (sm_90, or sm_90a for files that ask for
it), so CI catches a broken kernel on machines without a GPU. Skipped where nvcc is not
installed."""
import shutil
import subprocess

import pytest

from dptrain.backend import kernels

NVCC = shutil.which("nvcc")
SOURCES = sorted(kernels.kernel_dir().glob("*.cu"))


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_kernel_compiles_for_sm90(source, tmp_path):
    # Taking each declared instantiation's address forces nvcc to compile it, as NVRTC
    # does through name_expressions.
    names = kernels._name_expressions(source.read_text())
    wrapper = tmp_path / f"check_{source.stem}.cu"
    refs = ",\n    ".join(f"(void*)&{name}" for name in names) or "nullptr"
    wrapper.write_text(f'#include "{source}"\nvoid* dptrain_instances[] = {{\n    {refs}\n}};\n')
    # A file that asks NVRTC for the arch-specific target (`// nvrtc-options: -arch=sm_90a`,
    # for wgmma) gets it here too, in the -gencode form (nvcc 13.0's -arch=sm_90a shorthand
    # also runs a plain sm_90 pass that rejects wgmma).
    opts = kernels.file_options(source.read_text())
    arch = ("-gencode=arch=compute_90a,code=sm_90a" if "-arch=sm_90a" in opts
            else "-arch=sm_90")
    result = subprocess.run(
        [NVCC, arch, "-std=c++17", f"-I{source.parent}", "-c", str(wrapper),
         "-o", str(tmp_path / "out.o")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_every_cuda_source_declares_its_instantiations():
    for source in SOURCES:
        text = source.read_text()
        if "template" in text and "__global__" in text:
            assert kernels._name_expressions(text), f"{source.name} has no '// instantiate:' line"


def test_file_options_are_read():
    src = "// nvrtc-options: -arch=sm_90a  -DX=1\n// instantiate: k<float>\n"
    assert kernels.file_options(src) == ("-arch=sm_90a", "-DX=1")
    assert kernels.file_options("// instantiate: k<float>\n") == ()
    wgmma = kernels.kernel_dir() / "gemm_wgmma.cu"
    assert "-arch=sm_90a" in kernels.file_options(wgmma.read_text())
