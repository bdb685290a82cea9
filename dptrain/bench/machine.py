"""What a benchmark records about the machine it ran on."""
from __future__ import annotations


def gpu_names() -> list[str]:
    """Names of the GPUs this process sees ([] without CuPy, a driver or a device).

    The names come from the CUDA backend's vendor module (what benchmarks compare against).
    """
    try:
        from dptrain.backend.cuda import vendor

        return vendor.device_names()
    except Exception:  # no CuPy, no driver, no device
        return []


def gpu_software() -> str:
    """The GPU array library's version, for a result's header ("" where it is missing)."""
    try:
        from dptrain.backend.cuda import vendor

        return vendor.library_version()
    except Exception:
        return ""
