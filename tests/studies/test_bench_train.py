"""`python -m dptrain bench train` on the CPU with tiny sizes: rows, derived columns, CSV,
JSON and the printed table; the FLOP counter against a hand count; the per-op profile; the
PyTorch twin computes what our model computes."""
import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dptrain.bench import flops, profile
from dptrain.bench import train as bench
from dptrain.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def test_flops_of_the_reference_cnn_by_hand():
    # 3x3 convs, padding 1, each followed by a 2x2 max-pool: 48 -> 24 -> 12 -> 6
    conv = [2 * 32 * 1 * 9 * 48 * 48, 2 * 64 * 32 * 9 * 24 * 24, 2 * 128 * 64 * 9 * 12 * 12]
    fc = [2 * 128 * 6 * 6 * 256, 2 * 256 * 7]
    counted = flops.forward_flops_per_image("cnn", (1, 48, 48), 7)
    assert counted == {"flops": sum(conv) + sum(fc), "conv2d_forward": sum(conv),
                       "matmul": sum(fc)}
    per_image = flops.training_flops_per_image("cnn", (1, 48, 48), 7)
    assert per_image == 3 * 46_157_312  # 138.5 MFLOP, the "about 139" of the design notes
    assert 138e6 < per_image < 139e6


def test_flop_counting_leaves_the_backend_as_it_was():
    from dptrain import backend

    cpu = backend.get("cpu")
    before = (cpu.conv2d_forward, cpu.matmul)
    flops.forward_flops_per_image("mlp", (1, 8, 8), 3)
    assert (cpu.conv2d_forward, cpu.matmul) == before


def test_cpu_run_writes_csv_and_json_and_prints_the_table_last(tmp_path):
    out = []
    code = bench.main(["--device", "cpu", "--models", "cnn", "mlp", "--batch-sizes", "2", "3",
                       "--image-size", "16", "--steps", "1", "--repeats", "1", "--warmup", "1",
                       "--no-torch", "--profile", "--peak-tflops", "0.5",
                       "--csv", str(tmp_path / "t.csv"), "--json", str(tmp_path / "t.json")],
                      echo=out.append)
    assert code == 0
    with open(tmp_path / "t.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["model"], r["batch"], r["precision"], r["impl"], r["mode"]) for r in rows] == [
        ("cnn", "2", "fp32", "dptrain", "eager"), ("cnn", "3", "fp32", "dptrain", "eager"),
        ("mlp", "2", "fp32", "dptrain", "eager"), ("mlp", "3", "fp32", "dptrain", "eager")]
    for r in rows:
        ms, rate = float(r["ms"]), float(r["images_per_s"])
        assert ms > 0 and rate == pytest.approx(int(r["batch"]) / ms * 1e3)
        tflops = int(r["flops_per_image"]) * int(r["batch"]) / ms / 1e9
        assert float(r["tflops"]) == pytest.approx(tflops)
        assert float(r["pct_of_floor"]) == pytest.approx(100 * tflops / 0.5)
        assert r["vs_best_torch"] == ""  # no PyTorch rows to compare with
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["device"] == "cpu" and len(doc["rows"]) == 4
    assert doc["peak_tflops"]["fp32"] == 0.5
    assert [(p["model"], p["batch"]) for p in doc["profiles"]] == [
        ("cnn", 2), ("cnn", 3), ("mlp", 2), ("mlp", 3)]
    ops = {r["op"].split()[0] for r in doc["profiles"][0]["ops"]}
    assert {"conv2d_forward", "conv2d_backward_weight", "matmul", "sgd_step_"} <= ops
    assert sum(r["pct"] for r in doc["profiles"][0]["ops"]) == pytest.approx(100)
    assert all(p["kernels"] is None for p in doc["profiles"])  # no replayed step on the CPU
    text = "\n".join(out)
    assert "device time per op" in text and "per kernel" not in text
    table = out[-1].splitlines()
    assert table[0].split()[:5] == ["model", "batch", "prec", "impl", "mode"]
    assert len(table) == 2 + 4  # header, rule, one line per row: the table comes last


def test_derived_columns_compare_within_a_precision():
    def r(impl, mode, precision, ms):
        return {"model": "cnn", "batch": 100, "precision": precision, "impl": impl,
                "mode": mode, "ms": ms, "flops_per_image": 1e9}

    rows = [r("dptrain", "graph", "tf32", 2.0), r("pytorch", "eager", "tf32", 5.0),
            r("pytorch", "graph", "tf32", 4.0), r("pytorch", "graph-autocast-cl", "bf16", 1.0),
            r("dptrain", "graph", "fp32", 8.0), r("pytorch", "compile", "tf32", None)]
    bench.fill_derived(rows, {"tf32": 500.0, "bf16": 1000.0})
    assert rows[0]["vs_best_torch"] == pytest.approx(2.0)  # against torch's 4 ms TF32, not bf16
    assert rows[1]["vs_best_torch"] == pytest.approx(0.8)
    assert rows[3]["vs_best_torch"] == pytest.approx(1.0)
    assert rows[4]["vs_best_torch"] is None  # no PyTorch fp32 row
    assert rows[0]["tflops"] == pytest.approx(1e9 * 100 / 2e-3 / 1e12)  # 50 TFLOP/s
    assert rows[0]["pct_of_floor"] == pytest.approx(10.0)
    assert rows[4]["pct_of_floor"] is None  # no fp32 peak given
    assert rows[5]["tflops"] is None and rows[5]["vs_best_torch"] is None


def test_peak_rates_by_name_and_by_flag():
    assert bench.peak_tflops(None, "NVIDIA H200")["tf32"] == 495.0
    assert bench.peak_tflops(None, "NVIDIA H100 80GB HBM3")["bf16"] == 989.0
    assert bench.peak_tflops(None, "NVIDIA H100 PCIe")["tf32"] == 378.0
    assert bench.peak_tflops(None, "") == {}
    assert bench.peak_tflops("100", "NVIDIA H200")["tf32"] == 100.0
    assert bench.peak_tflops("tf32=1,bf16=2", "") == {"tf32": 1.0, "bf16": 2.0}
    with pytest.raises(UsageError, match="--peak-tflops 'fast'"):
        bench.peak_tflops("fast", "")


@pytest.mark.parametrize("args, message", [
    (["--precisions", "bf16"], "--precisions bf16: the cpu runtime offers fp32"),
    (["--models", "nope"], "--models nope: unknown model"),
    (["--models", "cnn", "--image-size", "4"], "--models cnn: does not build"),
    (["--batch-sizes", "0"], "--batch-sizes/--batch-size: must be positive, got 0"),
    (["--torch-modes", "fast"], "--torch-modes: invalid choice: 'fast'"),
])
def test_bad_flags_are_one_line_errors(args, message):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-m", "dptrain", "bench", "train", "--device", "cpu",
                             "--no-torch", *args], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_profile_times_outermost_calls_and_restores_the_backend():
    calls = []

    def mul(a, b):
        calls.append("mul")
        return a * b

    be = SimpleNamespace(runtime=SimpleNamespace(records_graphs=False), mul=mul)
    be.add = lambda a, b: be.mul(a, 1) + b  # an op calling another op of the backend
    original = (be.add, be.mul)
    with profile.OpProfile(be) as prof:
        be.add(np.ones(3), np.ones(3))
        be.mul(np.ones((2, 5)), 2)
    assert (be.add, be.mul) == original
    rows = {r["op"]: r for r in prof.rows()}
    assert set(rows) == {"add 3", "mul 2x5"}  # the inner mul is counted in add
    assert calls == ["mul", "mul"] and all(r["calls"] == 1 for r in rows.values())
    assert "sum of op times" in profile.format_rows(prof.rows(), "title")


@pytest.mark.skipif(not HAVE_TORCH, reason="needs PyTorch")
@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_torch_twin_computes_our_forward(name):
    import torch

    import dptrain as dp
    from dptrain import nn
    from dptrain.engine.autograd import Tensor
    from dptrain.run.torch_twin import twin

    dp.manual_seed(1)
    ours = nn.build_model(name, (1, 16, 16), 7)
    net = twin(ours)
    x = np.random.default_rng(0).standard_normal((3, 1, 16, 16)).astype(np.float32)
    want = ours(Tensor(x)).numpy()
    got = net(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_torch_twin_is_none_for_other_layers():
    from dptrain import nn
    from dptrain.run.torch_twin import twin

    if not HAVE_TORCH:
        pytest.skip("needs PyTorch")

    class Odd(nn.Module):
        def forward(self, x):
            return x

    assert twin(nn.Sequential(nn.Flatten(), Odd())) is None
    assert twin(Odd()) is None


def test_torch_rows_follow_the_chosen_modes():
    from dptrain.bench import torch_step

    default = torch_step.rows(("tf32", "bf16"), torch_step.DEFAULT_MODES, graphs=True)
    assert default == [("tf32", "eager"), ("tf32", "graph"), ("tf32", "compile"),
                       ("bf16", "graph-autocast-cl")]  # no max-autotune unless asked
    asked = torch_step.rows(("tf32", "fp16"), ("graph", "compile-max-autotune",
                                               "graph-autocast-cl"), graphs=True)
    assert asked == [("tf32", "graph"), ("bf16", "graph-autocast-cl"),
                     ("bf16", "compile-max-autotune"), ("fp16", "graph-autocast-cl"),
                     ("fp16", "compile-max-autotune")]
    assert torch_step.rows(("fp32",), tuple(torch_step.MODES), graphs=False) == [
        ("fp32", "eager")]  # the CPU: eager only
    assert torch_step.rows(("fp32",), ("compile-max-autotune",), graphs=False) == []
    assert set(torch_step.DEFAULT_MODES) | {"compile-max-autotune"} == set(torch_step.MODES)


def test_vs_best_torch_counts_max_autotune_when_it_ran():
    def r(impl, mode, ms):
        return {"model": "vit", "batch": 64, "precision": "bf16", "impl": impl, "mode": mode,
                "ms": ms, "flops_per_image": 1e9}

    rows = [r("dptrain", "graph", 3.0), r("pytorch", "graph-autocast-cl", 4.0),
            r("pytorch", "compile-max-autotune", 2.0)]
    bench.fill_derived(rows, {})
    assert rows[0]["vs_best_torch"] == pytest.approx(2.0 / 3.0)
    assert rows[1]["vs_best_torch"] == pytest.approx(0.5)
    failed = [r("dptrain", "graph", 3.0), r("pytorch", "graph-autocast-cl", 4.0),
              r("pytorch", "compile-max-autotune", None)]  # failed: not a reference
    bench.fill_derived(failed, {})
    assert failed[0]["vs_best_torch"] == pytest.approx(4.0 / 3.0)


def test_compile_time_is_a_note_apart_from_the_step_time():
    assert bench.compile_note("compile-max-autotune", 93.25) == "compile + autotune 93.2 s"
    assert bench.compile_note("compile", 12.0) == "compile 12.0 s"
    assert bench.compile_note("graph", None) == ""
    row = {"model": "vit", "batch": 64, "precision": "bf16", "impl": "pytorch",
           "mode": "compile-max-autotune", "ms": 2.0, "images_per_s": 32000.0,
           "vs_best_torch": 1.0, "tflops": None, "pct_of_floor": None, "compile_s": 93.25,
           "note": bench.compile_note("compile-max-autotune", 93.25)}
    line = bench.format_table([row]).splitlines()[-1]
    assert line.split()[4] == "compile-max-autotune"
    assert line.endswith("(compile + autotune 93.2 s)")
    assert "compile_s" in bench.FIELDS


@pytest.mark.gpu
def test_kernel_profile_of_the_replayed_step(tmp_path):
    """--profile on a GPU with PyTorch: the replayed step's kernels, ours by name, their
    shares summing to 100%."""
    pytest.importorskip("torch")
    from dptrain.bench.train import main

    out = []
    assert main(["--device", "cuda", "--models", "cnn", "--batch-sizes", "8", "--precisions",
                 "bf16", "--no-torch", "--profile", "--steps", "2", "--repeats", "1",
                 "--json", str(tmp_path / "k.json")], echo=out.append) == 0
    kernels = json.loads((tmp_path / "k.json").read_text())["profiles"][0]["kernels"]
    assert kernels and any("sgd" in k["op"] for k in kernels)
    assert sum(k["pct"] for k in kernels) == pytest.approx(100)
    assert "device time per kernel" in "\n".join(out)
