"""Every kernels/*.cu compiles with nvcc for Hopper (sm_90), so CI catches a broken kernel
on machines without a GPU. Skipped where nvcc is not installed."""
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
    result = subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", f"-I{source.parent}", "-c", str(wrapper),
         "-o", str(tmp_path / "out.o")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_every_cuda_source_declares_its_instantiations():
    for source in SOURCES:
        text = source.read_text()
        if "template" in text and "__global__" in text:
            assert kernels._name_expressions(text), f"{source.name} has no '// instantiate:' line"
