"""What a benchmark records about the machine it ran on."""
from __future__ import annotations


def gpu_names() -> list[str]:
    """Names of the GPUs this process sees ([] without CuPy, a driver or a device).

    The backend contract counts devices (``be.runtime.device_count()``) but does not name
    them, so the name comes from the CUDA runtime through CuPy, imported only here.
    """
    try:
        import cupy

        names = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names
    except Exception:  # no CuPy, no driver, no device
        return []


def gpu_software() -> str:
    """The GPU array library's version, for a result's header ("" where it is missing)."""
    try:
        import cupy

        return f"cupy {cupy.__version__}"
    except Exception:
        return ""
