"""`make` inside an active virtualenv uses it: with every dependency importable there and the
package index unreachable, the set-up of `make test` downloads nothing and succeeds."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_in_an_active_venv_uses_it_offline(tmp_path):
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True)
    # the environment holds every dependency: this test run's own packages
    Path(purelib.stdout.strip(), "deps.pth").write_text(
        "\n".join(p for p in sys.path if p.endswith("-packages")) + "\n")
    env = dict(os.environ, VIRTUAL_ENV=str(env_dir),
               PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
               PIP_INDEX_URL="http://127.0.0.1:9/", PIP_NO_INDEX="1")
    stamps = tmp_path / "stamps"
    out = subprocess.run(["make", "-C", str(ROOT), f"{stamps}/.test", f"VENV={stamps}",
                          "PYTHON=python3"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "installing" not in out.stdout and "import already" in out.stdout, out.stdout
    assert f"using the active environment: {python}" in out.stdout
    assert not (stamps / "bin").exists()  # no venv nested in it
