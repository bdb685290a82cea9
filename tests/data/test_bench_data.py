"""`bench data` on the CPU: the pipeline's rate for 1 and 2 spawned processes, warm and cold,
next to a given step rate, with the bound named; bad options refused in one line."""
import json
import os
import subprocess
import sys

import numpy as np

from dptrain.bench import data as bench_data


def _bench(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "dptrain", "bench", "data", "--device", "cpu",
                           *argv], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**os.environ, "TMPDIR": str(cwd)})


def test_bench_data_reports_rates_bounds_and_cache(tmp_path):
    out = _bench("--images", "256", "--image-size", "8", "--batch-size", "16", "--steps", "6",
                 "--warmup", "2", "--procs", "1", "2", "--cold", "--step-images-per-s", "1e9",
                 "--json", str(tmp_path / "rows.json"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert [(r["procs"], r["cache"]) for r in rows] == [(1, "warm"), (1, "cold"), (2, "warm"),
                                                        (2, "cold")]
    for r in rows:
        assert r["images_per_s"] > 0 and len(r["per_process"]) == r["procs"]
        assert r["step_images_per_s"] == 1e9 * r["procs"] and r["bound"] == "pipeline"
    assert all("dropped" in r["note"] for r in rows if r["cache"] == "cold")
    assert "pipeline img/s" in out.stdout and not list(tmp_path.glob("dptrain-bench-data-*"))


def test_bench_data_refuses_bad_options(tmp_path):
    for argv, fault in ((["--prefetch-depth", "1"], "--prefetch-depth 1"),
                        (["--procs", "0"], "--procs"),
                        (["--model", "cnn", "--step-images-per-s", "5"], "give one of them"),
                        (["--images", "64", "--batch-size", "64", "--procs", "2",
                          "--image-size", "4"], "--batch-size 64 x 2 processes")):
        out = _bench(*argv, cwd=tmp_path)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and fault in lines[0], out.stderr


def test_one_process_shard_streams_every_image(tmp_path):
    path = tmp_path / "images.npy"
    np.save(path, np.arange(64 * 12, dtype=np.uint8).reshape(64, 3, 2, 2))
    spec = dict(device="cpu", path=str(path), procs=1, rank=0, batch=8, steps=8, warmup=1,
                depth=2, workers=2, augment=True, seed=0)
    run = bench_data._shard_rate(spec)
    assert run["images"] == 64 and run["seconds"] > 0
    assert "posix_fadvise" in bench_data.drop_cache(str(path)) or "NOT" in \
        bench_data.drop_cache(str(path))
