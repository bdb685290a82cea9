"""The scaling scripts (scaling/) and the dptrain.bench functions they call: CPU smoke runs at
tiny sizes produce CSV, Markdown, PNG and meta.json; --dry-run prints commands and creates
nothing; bad flags end in one line naming them; speedup/efficiency arithmetic; scaling/
reaches the backend only through dptrain.bench; on a GPU, the launch-shape override keeps
every kernel's results."""
import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpilaunch import LAUNCHER, needs_mpi

ROOT = Path(__file__).resolve().parents[2]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
# The launcher's flag that lets CPU ranks outnumber the cores ("" where it is the default).
OVERSUBSCRIBE = " --oversubscribe" if LAUNCHER is None or LAUNCHER.flavour == "openmpi" else ""


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def script(name, args, cache, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", f"scaling.{name}", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_outputs(out, name, result):
    """CSV, Markdown (headed by machine/date/command), meta.json and the PNG."""
    assert (out / f"{name}.csv").is_file()
    md = (out / f"{name}.md").read_text()
    assert md.startswith("<!-- machine: ") and f"scaling.{name}" in md
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"].startswith(f"python -m scaling.{name} ")
    assert meta["hostname"] and meta["date"]
    if HAVE_MPL:
        png = (out / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG")
    else:  # said so, and skipped
        assert "matplotlib is not installed" in result.stderr
    return md


# ----------------------------------------------------------------------------- smoke runs


@needs_mpi
def test_strong_cpu_smoke(tmp_path, cache):
    out = tmp_path / "strong"
    result = script("strong", ["--device", "cpu", "--gpus", "1,2", "--images", "256",
                               "--val-images", "32", "--batch-size", "16",
                               "--global-batch-size", "32", "--out", str(out), "--quiet"], cache)
    assert result.returncode == 0, result.stdout + result.stderr
    launcher = os.path.basename(LAUNCHER.program)
    assert f"{launcher} -n 1{OVERSUBSCRIBE} " in result.stdout
    assert f"{launcher} -n 2{OVERSUBSCRIBE} " in result.stdout
    rows = read_csv(out / "strong.csv")
    assert all((r["framework"], r["execution"], r["model"]) == ("ours", "eager", "cnn")
               for r in rows)  # no CUDA graphs on the CPU
    assert [(r["mode"], r["gpus"]) for r in rows] == [
        ("per-gpu batch 16", "1"), ("per-gpu batch 16", "2"),
        ("global batch 32", "1"), ("global batch 32", "2")]
    assert all(r["status"] == "ok" for r in rows)
    assert [r["global_batch"] for r in rows] == ["16", "32", "32", "32"]
    for r in rows:
        summary = json.loads((Path(r["log_dir"]) / "summary.json").read_text())
        assert summary["world_size"] == int(r["gpus"])
        assert float(r["time_s"]) == pytest.approx(summary["train_s"], rel=1e-5)
        speedup = float(r["speedup"])
        assert speedup > 0 and float(r["efficiency_pct"]) == pytest.approx(
            100 * speedup / int(r["gpus"]), rel=1e-4)
    assert float(rows[0]["speedup"]) == 1.0
    md = check_outputs(out, "strong", result)
    assert "| Framework | Execution | GPUs | Images | Global batch | Time (s) |" in md
    assert "## per-gpu batch 16" in md and "## global batch 32" in md


@needs_mpi
def test_weak_cpu_smoke(tmp_path, cache):
    out = tmp_path / "weak"
    result = script("weak", ["--device", "cpu", "--gpus", "1,2", "--images", "96",
                             "--val-images", "32", "--batch-size", "16", "--out", str(out),
                             "--quiet"], cache)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_csv(out / "weak.csv")
    assert [(r["gpus"], r["images"], r["steps"]) for r in rows] == [("1", "96", "6"),
                                                                   ("2", "192", "6")]
    assert all(r["status"] == "ok" for r in rows)
    t1, t2 = float(rows[0]["time_s"]), float(rows[1]["time_s"])
    assert float(rows[1]["efficiency_pct"]) == pytest.approx(100 * t1 / t2, rel=1e-4)
    assert float(rows[1]["speedup"]) == pytest.approx(2 * t1 / t2, rel=1e-4)
    check_outputs(out, "weak", result)


def test_threads_cpu_smoke(tmp_path, cache):
    out = tmp_path / "threads"
    result = script("threads", ["--device", "cpu", "--val-images", "24", "--train-images", "48",
                                "--steps", "2", "--batch-size", "16", "--repeats", "1",
                                "--out", str(out)], cache)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_csv(out / "threads.csv")
    assert rows and all(r["kind"] == "baseline" for r in rows)  # no GPU sweep on the CPU
    assert rows[0]["config"].startswith("NumPy CPU backend")
    assert float(rows[0]["infer_s"]) > 0 and float(rows[0]["train_s"]) > 0
    assert 0.0 <= float(rows[0]["val_accuracy"]) <= 1.0
    md = check_outputs(out, "threads", result)
    assert "CPU baselines only" in md


def test_ops_cpu_smoke(tmp_path, cache):
    out = tmp_path / "ops"
    result = script("ops", ["--device", "cpu", "--cpu-sizes", "1000,20000",
                            "--conv-batches", "1,2", "--out", str(out)], cache)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_csv(out / "ops.csv")
    ops = {r["op"] for r in rows}
    assert ops == {"add", "mul", "pow", "transpose", "matmul", "conv2d fwd"}
    assert all(float(r["cpu_ms"]) > 0 for r in rows) and not any(r["gpu_ms"] for r in rows)
    md = check_outputs(out, "ops", result)
    assert "CPU only" in md


# ----------------------------------------------------------------------------- dry runs, errors


@pytest.mark.parametrize("name, extra", [
    ("strong", ["--gpus", "1,2", "--images", "4096", "--torch"]),
    ("weak", ["--gpus", "1,2", "--images", "4096", "--torch"]),
    ("threads", []),
    ("ops", []),
])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_dry_run_prints_commands_and_creates_nothing(tmp_path, cache, name, extra, device):
    out = tmp_path / "out"
    result = script(name, ["--dry-run", "--device", device, "--out", str(out), *extra], cache)
    assert result.returncode == 0, result.stderr
    assert not out.exists() and not any(tmp_path.iterdir())
    text = result.stdout
    if name in ("strong", "weak"):
        assert "make_synthetic.py" in text
        launcher = os.path.basename(LAUNCHER.program) if LAUNCHER else "mpirun"
        for n in (1, 2):
            assert f"{launcher} -n {n} " in text and f"--nproc_per_node={n}" in text
        assert "-m dptrain train" in text and "-m scaling.torch_ddp" in text
        assert f"--device {device}" in text and "--model cnn" in text
        # PyTorch's default: its fastest, the graph, on GPUs; eager on the CPU
        torch_mode = "graph" if device == "cuda" else "eager"
        assert text.count("--torch-mode ") == text.count(f"--torch-mode {torch_mode}") > 0
        if device == "cpu":
            assert OVERSUBSCRIBE in text and "bind-to" not in text
            assert "warm-up" not in text
        else:
            assert "bind-to none" in text and "--oversubscribe" not in text
            assert "warm-up: " in text  # kernels compiled before the first timed run
    if name == "strong":
        assert "--global-batch-size" in text and "--batch-size" in text
    if name == "threads" and device == "cuda":
        assert "launch.launch_shape(threads_per_block=1, max_blocks=1)  # T = 1" in text
        assert "launch.launch_shape(threads_per_block=1024, max_blocks=32)  # T = 32768" in text
    if name == "ops" and device == "cuda":
        assert "-m dptrain bench ops" in text and "--csv" in text and "--plot" in text
        assert "--conv-batches 1,4,16,64,256" in text  # the conv sweep is a section of the bench


@pytest.mark.parametrize("name, args, flag", [
    ("strong", ["--gpus", "1,x"], "--gpus"),
    ("strong", ["--gpus", "1,2,4", "--global-batch-size", "6", "--modes", "global"],
     "--global-batch-size 6"),
    ("strong", ["--modes", "both"], "--modes"),
    ("strong", ["--gpus", "1,2", "--images", "100", "--batch-size", "64"], "--batch-size 64"),
    ("weak", ["--images", "8", "--batch-size", "16"], "--batch-size 16"),
    ("strong", ["--torch", "--torch-modes", "eager,fast"], "--torch-modes"),
    ("weak", ["--torch", "--torch-modes", "graph"], "--torch-modes graph"),  # on the CPU
    ("weak", ["--model", "vit"], "--model"),
    ("threads", ["--threads", "1,3000"], "--threads 3000"),
    ("threads", ["--steps", "100"], "--steps 100"),
    ("ops", ["--precision", "fp16"], "--precision"),
])
def test_bad_flags_name_the_value(tmp_path, cache, name, args, flag):
    result = script(name, ["--dry-run", "--device", "cpu", "--out", str(tmp_path / "o"), *args],
                    cache)
    assert result.returncode == 2
    assert flag in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- units


def test_scaling_arithmetic():
    """Speedup and efficiency from images/s: with the same images timed, the time ratios."""
    from scaling.common import add_scaling

    def rows(weak, execution="graph"):
        images = lambda g: 1000 * g if weak else 1000  # noqa: E731
        return [{"framework": "ours", "execution": execution, "mode": "m", "gpus": g,
                 "time_s": t, "images_per_s": images(g) / t, "status": "ok"}
                for g, t in ((2, 10.0), (4, 6.0), (8, 4.0))] + [
               {"framework": "ours", "execution": execution, "mode": "m", "gpus": 16,
                "status": "failed"}]
    strong = add_scaling(rows(weak=False), weak=False)  # base: 2 GPUs (the fewest that ran)
    assert [r["speedup"] for r in strong[:3]] == pytest.approx([2.0, 20 / 6, 5.0])
    assert [r["efficiency_pct"] for r in strong[:3]] == pytest.approx([100, 250 / 3, 62.5])
    assert "speedup" not in strong[3]
    weak = add_scaling(rows(weak=True), weak=True)
    assert [r["efficiency_pct"] for r in weak[:3]] == pytest.approx([100, 1000 / 6, 250])
    assert [r["speedup"] for r in weak[:3]] == pytest.approx([2, 4 * 10 / 6, 20])
    # each execution is its own series, with its own base
    both = add_scaling(rows(weak=False) + rows(weak=False, execution="eager")[1:3], weak=False)
    assert [r["speedup"] for r in both if r["execution"] == "eager"] == pytest.approx([4, 6])


def test_default_gpu_counts_are_powers_of_two_up_to_the_gpus_present():
    from scaling.common import default_counts

    assert default_counts("cuda", 1) == [1]
    assert default_counts("cuda", 4) == [1, 2, 4]
    assert default_counts("cuda", 6) == [1, 2, 4]
    assert default_counts("cuda", 8) == [1, 2, 4, 8]
    assert default_counts("cuda", 0) == [1, 2, 4, 8]  # none seen: a dry run shows all
    assert default_counts("cpu", 4) == [1, 2, 4, 8]


def dry_run(monkeypatch, capsys, name, args, gpus=4):
    """`python -m scaling.NAME --dry-run ARGS` in this process with `gpus` fake GPUs; its
    stdout lines of runs (not the dataset or the warm-up)."""
    import importlib

    from scaling import common

    monkeypatch.setattr(common, "gpu_names", lambda: ["Fake GPU"] * gpus)
    module = importlib.import_module(f"scaling.{name}")
    assert module.main(["--dry-run", "--out", "unused", *args]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if " GPU(s), " in line]


@pytest.mark.parametrize("name", ["strong", "weak"])
def test_default_gpus_follow_the_gpus_present(monkeypatch, capsys, name):
    lines = dry_run(monkeypatch, capsys, name, ["--images", "4096", "--torch"], gpus=4)
    counts = {int(re.search(r"(\d+) GPU\(s\)", line).group(1)) for line in lines}
    assert counts == {1, 2, 4}
    assert all("--device cuda" in line for line in lines)


@pytest.mark.parametrize("name", ["strong", "weak"])
def test_torch_modes_and_model_reach_the_commands(monkeypatch, capsys, name):
    """Every PyTorch mode at every count, ours once, the model in both; each torch command's
    flags are ones torch_ddp.py accepts."""
    import shlex

    from scaling import torch_ddp

    lines = dry_run(monkeypatch, capsys, name, ["--images", "4096", "--gpus", "1,2", "--model",
                                                "resnet18", "--torch-modes", "eager,compile,graph"])
    series = [line.split("] ", 1)[1].split(",", 1)[0] for line in lines]
    one_mode = ["ours graph"] * 2 + [f"torch {m}" for m in ("eager", "compile", "graph")
                                     for _ in (1, 2)]  # each at 1 and 2 GPUs
    batch_modes = 2 if name == "strong" else 1  # strong: per-gpu and global batch
    assert series == one_mode * batch_modes
    for line in lines:
        assert "--model resnet18" in line
        if line.split("] ", 1)[1].startswith("torch "):
            mode = line.split("] torch ", 1)[1].split(",")[0]
            args = shlex.split(line.split("-m scaling.torch_ddp ", 1)[1])
            parsed = torch_ddp.parse_args(args)
            assert (parsed.torch_mode, parsed.model, parsed.device) == (mode, "resnet18", "cuda")
            assert f"/runs/torch-{mode}-" in line  # each mode logs into its own folder
        else:
            assert "/runs/ours-graph-" in line and "--torch-mode" not in line


def test_ours_runs_eager_when_told_not_to_capture(monkeypatch, capsys):
    lines = dry_run(monkeypatch, capsys, "weak", ["--images", "4096", "--gpus", "1",
                                                  "--train-args=--no-cuda-graph"])
    assert len(lines) == 1 and "] ours eager, " in lines[0] and "/runs/ours-eager-" in lines[0]


def test_torch_ddp_flags():
    from scaling import torch_ddp

    base = ["--train-images", "64", "--val-images", "16"]
    args = torch_ddp.parse_args(base)
    assert (args.torch_mode, args.model, args.device) == ("eager", "cnn", "cuda")
    args = torch_ddp.parse_args(base + ["--model", "resnet18", "--torch-mode", "graph",
                                        "--precision", "fp16", "--loss-scale", "1024"])
    assert (args.model, args.torch_mode, args.precision, args.loss_scale) == (
        "resnet18", "graph", "fp16", 1024.0)
    for bad in (["--torch-mode", "graph", "--device", "cpu"], ["--model", "vit"],
                ["--torch-mode", "fast"]):
        with pytest.raises(SystemExit) as exc:
            torch_ddp.parse_args(base + bad)
        assert exc.value.code == 2


def test_torch_graph_runs_each_step_once():
    """torch_ddp.graphed: the warm-up calls run eagerly on the side stream, the next call
    captures (running nothing) and replays, and so every later call: one step per call."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from scaling import torch_ddp

    seen = {"eager": 0, "captured": 0, "replayed": 0, "stream": None, "mode": None}
    capturing = [False]

    class Graph:
        def replay(self):
            seen["replayed"] += 1

    @contextmanager
    def graph(g, capture_error_mode):
        seen["mode"] = capture_error_mode
        capturing[0] = True
        yield
        capturing[0] = False

    @contextmanager
    def stream(s):
        seen["stream"] = s
        yield
        seen["stream"] = None

    class Stream:
        def wait_stream(self, other):
            pass

    side = Stream()
    cuda = SimpleNamespace(CUDAGraph=Graph, graph=graph, stream=stream,
                           current_stream=lambda: Stream())

    def step():
        if capturing[0]:
            seen["captured"] += 1
        else:
            assert seen["stream"] is side  # eager steps run on the side stream
            seen["eager"] += 1

    run = torch_ddp.graphed(SimpleNamespace(cuda=cuda), step, warmup=11, side=side)
    for _ in range(15):
        run()
    assert (seen["eager"], seen["captured"], seen["replayed"]) == (11, 1, 4)
    assert seen["mode"] == "thread_local"


def test_sweep_outputs_name_framework_execution_and_model(tmp_path):
    """CSV and Markdown from recorded runs: a row per (framework, execution), each series
    scaled against its own base; failed runs listed with their execution."""
    from scaling import common

    runs = []
    for framework, execution, rate in (("ours", "graph", 1000.0), ("torch", "eager", 500.0),
                                       ("torch", "graph", 800.0)):
        for gpus, gain in ((1, 1.0), (2, 1.8)):  # 90% efficient at 2 GPUs
            run = common.Run(framework, execution, "resnet18", "per-gpu batch 256", gpus, 4096,
                             256, [], {}, tmp_path / f"{framework}-{execution}-{gpus}")
            run.row = {**common.result_row(run, 1), "status": "ok", "global_batch": 256 * gpus,
                       "time_s": 4096 / (rate * gain), "images_per_s": rate * gain,
                       "val_accuracy": 0.5, "val_loss": 1.0, "steps": 16 // gpus}
            runs.append(run)
    failed = common.Run("torch", "compile", "resnet18", "per-gpu batch 256", 2, 4096, 256, [],
                        {}, tmp_path / "failed")
    failed.row = common.result_row(failed, 1)
    meta = common.machine_meta("strong", ["--torch"], "cuda", ["Fake GPU"] * 2)
    common.write_sweep(tmp_path, "strong", "Strong", runs + [failed], meta, weak=False,
                       definitions="defs")
    rows = read_csv(tmp_path / "strong.csv")
    assert list(rows[0])[:4] == ["framework", "execution", "model", "mode"]
    assert [(r["framework"], r["execution"], r["gpus"]) for r in rows] == [
        ("ours", "graph", "1"), ("ours", "graph", "2"), ("torch", "eager", "1"),
        ("torch", "eager", "2"), ("torch", "graph", "1"), ("torch", "graph", "2"),
        ("torch", "compile", "2")]
    assert all(r["model"] == "resnet18" for r in rows)
    assert [float(r["efficiency_pct"]) for r in rows[:6]] == pytest.approx([100, 90] * 3)
    md = (tmp_path / "strong.md").read_text()
    assert "| Framework | Execution | GPUs |" in md
    assert "| torch | graph | 2 | 4,096 | 512 |" in md
    assert "- torch compile, per-gpu batch 256, 2 GPU(s): failed" in md


def test_torch_env_keeps_multicast_off(monkeypatch):
    from scaling import common

    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(var, raising=False)
    assert common.torch_env("cuda") == {"NCCL_NVLS_ENABLE": "0",
                                        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                        "NVSHMEM_DISABLE_NVLS": "1"}


def test_launch_env_sets_run_as_root_only_as_root_under_open_mpi(monkeypatch):
    from dptrain.distributed.launcher import Launcher

    for var in ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMP_NUM_THREADS",
                "NCCL_NVLS_ENABLE", "OMPI_MCA_rmaps_base_oversubscribe"):
        monkeypatch.delenv(var, raising=False)
    ompi, mpich = Launcher("mpirun", "openmpi"), Launcher("mpiexec", "mpich")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    env = ompi.env("cpu")
    assert "OMPI_ALLOW_RUN_AS_ROOT" not in env and env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    env = ompi.env("cuda")
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0" and "OMP_NUM_THREADS" not in env
    env = mpich.env("cpu")
    assert not any(k.startswith(("OMPI_", "PRTE_")) for k in env) and env["OMP_NUM_THREADS"] == "1"


def test_launch_commands_per_flavour():
    from dptrain.distributed.launcher import Launcher, flavour_of

    prog = ["python", "-m", "dptrain", "train"]
    assert Launcher("mpirun", "openmpi").command(4, prog, "cpu") == [
        "mpirun", "-n", "4", "--oversubscribe", *prog]
    assert Launcher("mpirun", "openmpi").command(4, prog, "cuda") == [
        "mpirun", "-n", "4", "--bind-to", "none", "-x", "NCCL_NVLS_ENABLE", "-x",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST", "-x", "NVSHMEM_DISABLE_NVLS", *prog]
    assert Launcher("mpiexec", "mpich").command(2, prog, "cpu") == ["mpiexec", "-n", "2", *prog]
    assert Launcher("mpiexec", "mpich").command(2, prog, "cuda") == [
        "mpiexec", "-n", "2", "-bind-to", "none", *prog]
    assert Launcher("srun", "srun").command(2, prog, "cpu", ["--mpi=pmix"]) == [
        "srun", "-n", "2", "--kill-on-bad-exit=1", "--mpi=pmix", *prog]
    assert flavour_of("mpirun (Open MPI) 5.0.8\n") == "openmpi"
    assert flavour_of("prterun (Open MPI) 5.0.3") == "openmpi"
    assert flavour_of("HYDRA build details:\n    Version: 4.2.0") == "mpich"
    assert flavour_of("Intel(R) MPI Library for Linux* OS, Version 2021.10") == "mpich"
    assert flavour_of("slurm 23.11.4", "/usr/bin/srun") == "srun"
    assert flavour_of("something else") is None


def test_threads_gpu_outputs_from_recorded_rows(tmp_path):
    """The GPU path's table and plots, from rows as sweep_gpu records them."""
    from scaling import common, threads

    args = threads.parse_args(["--val-images", "10", "--steps", "2", "--batch-size", "4"])
    rows = []
    fake = lambda s: (s, {"val_accuracy": 0.5, "val_loss": 1.0, "train_loss": 1.5}, 1)  # noqa
    threads.record(rows, "default launch", "default", fake(0.1), fake(0.2), args)
    for total, blocks, per_block in threads.launch_shapes("1,2,1024,2048"):
        threads.record(rows, f"T={total}", "sweep", fake(8.0 / total + 0.05),
                       fake(9.0 / total + 0.1), args, (total, blocks, per_block))
    threads.record(rows, "NumPy CPU backend", "baseline", fake(1.0), fake(2.0), args)
    threads.add_speedups(rows)
    sweep = [r for r in rows if r["kind"] == "sweep"]
    assert sweep[0]["infer_speedup"] == 1.0 and sweep[0]["infer_eff_pct"] == 100.0
    assert sweep[1]["infer_speedup"] == pytest.approx(8.05 / 4.05)
    assert sweep[3]["blocks"] == 2 and sweep[3]["threads_per_block"] == 1024
    assert "infer_eff_pct" not in rows[-1] and rows[-1]["infer_speedup"] == pytest.approx(8.05)
    meta = common.machine_meta("threads", ["--out", "x"], "cuda", ["Fake GPU"])
    written = threads.write_outputs(tmp_path, rows, args, meta)
    md = (tmp_path / "threads.md").read_text()
    assert "| T=2048 | 2048 | 2 | 1024 |" in md and "CPU baselines only" not in md
    assert (tmp_path / "threads.png" in written) == HAVE_MPL


def test_ops_reads_bench_ops_csv(tmp_path):
    """scaling/ops.py reads the CSV that `dptrain bench ops --csv` writes."""
    from dptrain.bench import ops as bench
    from scaling import common, ops

    table = bench.Table()
    table.add(section="gemm", op="matmul", shape="256x256x256", precision="tf32", ours_ms=0.01,
              ours_rate=1.0, unit="GFLOP/s", ref="cuBLAS", ref_ms=0.008, cpu_ms=0.5, size=256)
    table.add(section="elem", op="add", shape="1e+03", ours_ms=0.005, ref="CuPy", ref_ms=0.004,
              cpu_ms=0.002, size=1000)
    table.add(section="cnn", op="conv1.fwd", shape="256x1x48x48->32 k3", precision="fp32",
              ours_ms=0.2, cpu_ms=40.0)
    table.add(section="conv", op="conv2d fwd", shape="16x32x24x24->64 k3", precision="tf32",
              ours_ms=0.5, cpu_ms=4.0, size=16)
    bench.write_csv(tmp_path / "bench.csv", table.rows, "Fake GPU", "2026-01-01")
    rows = ops.bench_rows(tmp_path / "bench.csv")
    assert [(r["family"], r["op"], r["size"]) for r in rows] == [
        ("matmul", "matmul", 256), ("elementwise", "add", 1000), ("cnn layers", "conv1.fwd", None),
        ("conv2d", "conv2d fwd", 16)]
    assert rows[0]["speedup"] == pytest.approx(50.0) and rows[0]["gpu_ms"] == 0.01
    assert rows[3]["speedup"] == pytest.approx(8.0)
    meta = common.machine_meta("ops", [], "cuda", ["Fake GPU"])
    ops.write_outputs(tmp_path, rows, meta, gpu=True)
    md = (tmp_path / "ops.md").read_text()
    assert "## conv2d" in md and "| conv2d fwd | 16x32x24x24->64 k3 | tf32 |" in md


# ----------------------------------------------------------------------------- bench functions


def test_scaling_reaches_the_backend_only_through_bench():
    """No CuPy and no backend module in scaling/: measuring code lives in dptrain.bench."""
    for path in sorted((ROOT / "scaling").rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(import cupy|from cupy)", text, re.M), path
        assert not re.search(r"dptrain\.backend\.(?!get\b|resolve_device\b|cuda_available\b)",
                             text), path
        assert not re.search(r"from dptrain\.backend import (?!get\b|resolve_device\b|"
                             r"cuda_available\b)", text), path


def test_launch_shapes_for_thread_totals():
    from dptrain.bench import threads

    assert [threads.launch_shape_for(t) for t in (1, 7, 1024, 2048, 32768)] == [
        (1, 1, 1), (7, 1, 7), (1024, 1, 1024), (2048, 2, 1024), (32768, 32, 1024)]
    for bad in (0, 1025, 3000):
        with pytest.raises(ValueError, match=str(bad)):
            threads.launch_shape_for(bad)
    assert threads.describe_shape(2, 1024) == (
        "dptrain.backend.cuda.launch.launch_shape(threads_per_block=1024, max_blocks=2)")


def test_bench_inference_matches_evaluate(cache):
    """The threads sweep's inference workload computes what dptrain.run.evaluate.evaluate does."""
    import numpy as np

    from dptrain import backend, manual_seed
    from dptrain.bench import threads
    from dptrain.data import DeviceLoader, get_dataset
    from dptrain.nn import build_model
    from dptrain.run.evaluate import evaluate

    val = get_dataset("synthetic", "val", 40, 0, str(cache))
    seconds, metrics = threads.inference("cpu", val, seed=3, batch_size=16)()
    assert seconds > 0
    again = threads.inference("cpu", val, seed=3, batch_size=16)()[1]  # sums restart each run
    assert again == pytest.approx(metrics, rel=1e-6)
    manual_seed(3)
    model = build_model("cnn", val.image_shape, val.num_classes).to("cpu")
    be = backend.get("cpu")
    want = evaluate(model, DeviceLoader(val, be, 16))
    assert metrics["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    assert metrics["val_accuracy"] == pytest.approx(want["val_accuracy"])
    assert np.isfinite(metrics["val_loss"]) and 0 <= metrics["val_accuracy"] <= 1


def test_bench_measure_repeats_within_budget():
    from dptrain.bench import threads

    calls = []

    def fn():
        calls.append(1)
        return [0.5, 0.1, 0.3][len(calls) - 1], {"n": len(calls)}
    assert threads.measure(fn, repeats=3, budget_s=10) == (0.3, {"n": 1}, 3)
    calls.clear()
    assert threads.measure(fn, repeats=3, budget_s=0.4) == (0.5, {"n": 1}, 1)


# ----------------------------------------------------------------------------- the torch twin


@pytest.mark.parametrize("model, flags", [
    ("cnn", ["--train-images", "64", "--val-images", "16", "--batch-size", "16"]),
    # SGD: Adam's first steps turn float rounding into whole steps of the rate. Two small
    # steps: ResNet-18 keeps 48x48 at full size through its first stage, slow on a CPU
    ("resnet18", ["--train-images", "16", "--val-images", "8", "--batch-size", "8",
                  "--optimizer", "sgd", "--lr", "0.01"]),
])
def test_torch_ddp_matches_dptrain_on_one_process(tmp_path, cache, model, flags):
    """Same init, data, batches and optimizer: the same losses (PyTorch installed only)."""
    pytest.importorskip("torch")
    if model == "resnet18":
        pytest.importorskip("torchvision")
    flags = ["--device", "cpu", "--model", model, "--epochs", "1", "--seed", "5", *flags]
    env = dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache))
    for module, log in (("dptrain", "ours"), ("scaling.torch_ddp", "torch")):
        cmd = [sys.executable, "-m", module] + (["train", "--no-progress"] if log == "ours" else [])
        result = subprocess.run(cmd + flags + ["--log-dir", str(tmp_path / log)],
                                capture_output=True, text=True, env=env, timeout=240)
        assert result.returncode == 0, result.stderr
    ours, theirs = (json.loads((tmp_path / d / "summary.json").read_text())
                    for d in ("ours", "torch"))
    assert theirs["steps"] == ours["steps"] == (4 if model == "cnn" else 2)
    for key in ("train_loss", "val_loss"):
        assert theirs[key] == pytest.approx(ours[key], rel=1e-4)


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("threads, blocks", [(1, 1), (7, 1), (33, 1), (1024, 3)])
def test_launch_override_keeps_results(threads, blocks):
    """Every launch path (a thread per item, lane groups, a warp per row, a block per
    output, single-block sums) gives the NumPy backend's results under an odd launch shape."""
    import numpy as np

    from dptrain.backend import cpu, get
    from dptrain.bench import threads as threads_bench

    cuda = get("cuda")
    rng = np.random.default_rng(threads)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x, b, logits = f32(5, 3, 10, 9), f32(3, 1, 1), f32(37, 7)
    labels = rng.integers(0, 7, 37)
    wide, tall, across = f32(3, 5000), f32(700, 9), f32(9, 5000)
    gy = f32(5, 3, 5, 4)
    pool = ((2, 2), (2, 2), (0, 0))  # kernel, stride, padding
    cases = [
        ("relu", cpu.relu, cuda.relu, (x,)),
        ("add broadcast", cpu.add, cuda.add, (x, b)),
        ("sum, a block per output", lambda a: cpu.sum(a, axis=1),
         lambda a: cuda.sum(a, axis=1), (wide,)),
        ("sum, lane groups", lambda a: cpu.sum(a, axis=1), lambda a: cuda.sum(a, axis=1), (tall,)),
        ("sum, a thread per output", lambda a: cpu.sum(a, axis=0),
         lambda a: cuda.sum(a, axis=0), (across,)),
        ("softmax", cpu.softmax, cuda.softmax, (logits,)),
        ("max pool", lambda a: cpu.max_pool2d_forward(a, *pool)[0],
         lambda a: cuda.max_pool2d_forward(a, *pool)[0], (x,)),
        ("max pool backward",
         lambda a, g: cpu.max_pool2d_backward(g, cpu.max_pool2d_forward(a, *pool)[1], a.shape),
         lambda a, g: cuda.max_pool2d_backward(g, cuda.max_pool2d_forward(a, *pool)[1], a.shape),
         (x, gy)),
        ("cross entropy", lambda a, y: cpu.cross_entropy_forward(a, y)[0],
         lambda a, y: cuda.cross_entropy_forward(a, y)[0], (logits, labels)),
        ("count correct", cpu.count_correct, cuda.count_correct, (logits, labels)),
    ]
    launch_shape = threads_bench.launch_override()
    with launch_shape(threads_per_block=threads, max_blocks=blocks):
        for name, ref_fn, gpu_fn, inputs in cases:
            ref = np.asarray(ref_fn(*inputs))
            got = cuda.to_numpy(gpu_fn(*(cuda.asarray(a) for a in inputs)))
            np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.gpu
def test_threads_sweep_on_gpu(tmp_path, cache):
    """A tiny sweep: validation loss the same at every launch shape, outputs written."""
    out = tmp_path / "threads"
    result = script("threads", ["--device", "cuda", "--threads", "1,64,2048", "--val-images", "16",
                                "--train-images", "32", "--steps", "1", "--batch-size", "16",
                                "--repeats", "1", "--no-numpy", "--no-torch", "--out", str(out)],
                    cache, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_csv(out / "threads.csv")
    assert [r["threads"] for r in rows] == ["", "1", "64", "2048"]
    ref = float(rows[0]["val_loss"])
    for r in rows:
        assert float(r["val_loss"]) == pytest.approx(ref, rel=1e-4)
        assert float(r["train_loss"]) == pytest.approx(float(rows[0]["train_loss"]), rel=1e-4)
    check_outputs(out, "threads", result)


def test_source_digest_names_the_code_not_the_checkout(tmp_path):
    """Two copies of the same sources share a digest; editing one kernel changes it; files
    outside the source folders do not count."""
    from scaling import common

    for root in (tmp_path / "a", tmp_path / "b"):
        (root / "kernels").mkdir(parents=True)
        (root / "dptrain" / "__pycache__").mkdir(parents=True)
        (root / "kernels" / "k.cu").write_text("__global__ void k() {}\n")
        (root / "dptrain" / "m.py").write_text("x = 1\n")
        (root / "dptrain" / "__pycache__" / "m.pyc").write_bytes(b"\0")
    (tmp_path / "b" / "notes.md").write_text("not code\n")
    a, b = common.source_digest(tmp_path / "a"), common.source_digest(tmp_path / "b")
    assert a == b and len(a) == 16
    (tmp_path / "b" / "kernels" / "k.cu").write_text("__global__ void k() { }\n")
    assert common.source_digest(tmp_path / "b") != a
    meta = common.machine_meta("ops", [], "cpu", [])
    assert meta["source_digest"] == common.source_digest()
