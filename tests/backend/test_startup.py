"""Cold start: kernels built ahead of the first step (a no-op on the CPU), once per host under
mpirun, keyed by source + options + GPU architecture; images/s leaves out the warm-up and
capture steps, and summary.json reports the start-up time apart."""
import collections
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain import backend
from mpilaunch import mpi_command, mpi_env, needs_mpi
from dptrain.run.metrics import Throughput
from dptrain.run.config import TrainConfig
from dptrain.run.step import CAPTURE_WARMUP, TrainStep
from dptrain.run.train import train

ROOT = Path(__file__).resolve().parents[2]

# The loader by path: importing the dptrain.backend.cuda package would need CuPy.
_spec = importlib.util.spec_from_file_location(
    "_startup_loader", ROOT / "dptrain" / "backend" / "cuda" / "loader.py")
loader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(loader)


def test_cpu_prepare_builds_nothing():
    nothing = {"files": 0, "built": 0, "seconds": 0.0, "workers": 0, "traced": None}
    assert backend.get("cpu").runtime.prepare() == nothing
    ran = []
    assert backend.get("cpu").runtime.prepare(trace=lambda: ran.append(1)) == nothing
    assert ran == []  # nothing to record on the CPU: the trace is not run


def test_data_parallel_traces_the_model_on_a_copy(monkeypatch):
    """DataParallel(input_shapes=...) hands prepare a trace of the model (forward and
    backward on the first shape, eval-mode forwards on the others) that leaves the model's
    gradients, weights and batch-norm estimates as they were: run here for real, as the CPU
    backend's prepare never runs it."""
    import numpy as np

    import dptrain as dp
    from dptrain import nn
    from dptrain.distributed import world as world_module

    dp.manual_seed(0)
    model = nn.MODELS["resnet18"]((3, 8, 8), 5).to("cpu")
    before = {k: v.copy() for k, v in model.state_dict().items()}
    runtime, seen = backend.get("cpu").runtime, []
    real, forward = runtime.prepare, type(model).forward

    def spy(self, x):  # the forwards the trace runs: not on `model` itself
        seen.append((self is model, x.shape, self.training))
        return forward(self, x)

    def prepare(dtypes=None, trace=None):
        trace()
        return real(dtypes, trace)

    monkeypatch.setattr(runtime, "prepare", prepare)
    monkeypatch.setattr(type(model), "forward", spy)
    monkeypatch.setattr(world_module, "_current", None)  # a CPU world, also on a GPU machine
    world = dp.dist.init(device="cpu")
    ddp = dp.DataParallel(model, "sgd", lr=0.1, world=world,
                          input_shapes=[(4, 3, 8, 8), (3, 3, 8, 8)])
    assert seen == [(False, (4, 3, 8, 8), True), (False, (3, 3, 8, 8), False)]
    assert ddp.prepare_report["traced"] is None
    assert all(p.grad is None or not p.grad.data.any() for p in model.parameters())
    after = model.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert model.training


def test_cache_key_names_the_architecture(monkeypatch):
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/toolkit/include"))
    key = loader.cache_key("elementwise.cu", "90")
    assert key == loader.cache_key("elementwise.cu", "90")  # a pure function of its inputs
    assert key != loader.cache_key("elementwise.cu", "80")
    assert key != loader.cache_key("reduce.cu", "90")
    # the options are part of it
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/other/include"))
    assert key != loader.cache_key("elementwise.cu", "90")


def test_heavy_modules_build_first(monkeypatch):
    """A GEMM main loop (one per module) starts before any elementwise module and before a
    part of the same file that holds less work; a full elementwise part before a short one."""
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/toolkit/include"))
    units = [("elementwise.cu", p) for p in loader.parts("elementwise.cu")]
    units += [("gemm.cu", "__nv_bfloat16"), ("optim.cu", "double")]
    order = loader._build_order(units)
    assert order[0] == ("gemm.cu", "__nv_bfloat16")
    sizes = collections.Counter(loader._part_table("elementwise.cu").values())
    rest = [sizes[p] for f, p in order if f == "elementwise.cu"]
    assert rest == sorted(rest, reverse=True)


def test_files_split_into_modules_by_element_family(monkeypatch):
    """A file's 16-bit instantiations build as modules of their own (compiled in parallel with
    the rest), a family of more than CHUNK instantiations as several; every kernel name maps
    to the module that holds it."""
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/toolkit/include"))
    assert loader.parts("optim.cu") == ["main", "double", "__half", "__nv_bfloat16"]
    # a file that asks for one instantiation per module (each takes seconds to build)
    source, _ = loader.source_and_options("gemm.cu")
    assert "instantiations-per-module: 1" in source
    assert len(loader.parts("gemm.cu")) == len(loader.name_expressions(source))
    assert loader.parts("gemm_wgmma.cu") == ["main", "__half", "__nv_bfloat16"]
    parts = loader.parts("elementwise.cu")
    assert parts[:2] == ["main", "main.2"] and "__half" in parts and parts[-1].startswith("__nv")
    source, _ = loader.source_and_options("elementwise.cu")
    table = loader._part_table("elementwise.cu")
    assert set(table) == set(loader.name_expressions(source)) and set(table.values()) == set(parts)
    assert all(list(table.values()).count(p) <= loader.CHUNK for p in parts)
    assert all(p.split(".")[0] == loader.part_of(n) for n, p in table.items())
    assert loader.part_of("map1_kernel<__half, Relu>") == "__half"
    assert loader.part_of("convert_kernel<float, __nv_bfloat16>") == "__nv_bfloat16"
    assert loader.part_of("rng_advance_kernel") == "main"
    assert loader.part_of("map2_kernel<double, Add>") == "double"
    # a float kernel that reads double partial sums is float32's (a TF32 run needs it)
    assert loader.part_of("reduce_kernel<double, double, float, SumOp>") == "main"
    assert loader.part_of("reduce_kernel<double, double, __half, SumOp>") == "__half"
    keys = {loader.cache_key("elementwise.cu", "90", part) for part in loader.PARTS}
    assert len(keys) == len(loader.PARTS)
    source, _ = loader.source_and_options("elementwise.cu")
    names = loader.name_expressions(source)
    assert sum(loader.part_of(n) == "main" for n in names) > 0
    assert {loader.part_of(n) for n in names} == set(loader.PARTS)


def test_a_traced_run_builds_modules_of_its_kernels_alone(monkeypatch):
    """A traced run's modules hold exactly the kernels it launches, by element family and at
    most the file's instantiations-per-module each; a name the file does not instantiate is
    left out. Their cache keys follow the set of names, not its order."""
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/toolkit/include"))
    names = ["map2_kernel<__nv_bfloat16, Add>", "fill_kernel<unsigned int>",
             "map2_kernel<float, Add>", "no_such_kernel<float>"]
    assert loader.groups("elementwise.cu", names) == [
        ("map2_kernel<float, Add>", "fill_kernel<unsigned int>"),  # file order
        ("map2_kernel<__nv_bfloat16, Add>",)]
    gemm = [n for n in loader._part_table("gemm.cu") if loader.part_of(n) == "main"][:3]
    assert loader.groups("gemm.cu", gemm) == [(n,) for n in gemm]  # one per module
    reduce = [n for n in loader._part_table("reduce.cu") if loader.part_of(n) == "main"][:5]
    assert [len(g) for g in loader.groups("reduce.cu", reduce)] == [3, 2]
    key = loader.cache_key("elementwise.cu", "90", names=names[:3])
    assert key == loader.cache_key("elementwise.cu", "90", names=names[2::-1])
    assert key != loader.cache_key("elementwise.cu", "90", names=names[:2])
    assert key != loader.cache_key("elementwise.cu", "90", "main")


def test_traced_units_add_the_step_kernels_of_the_run_dtypes(monkeypatch):
    """Around the traced model a run builds the step's own kernels (STEP_KERNELS, each named
    in its file, the 16-bit ones for the run's 16-bit type only) and the STEP_FILES' parts of
    its families, not the large files whole."""
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/toolkit/include"))
    for f, names in loader.STEP_KERNELS.items():
        table = loader._part_table(f)
        for n in names:
            for t in ("__half", "__nv_bfloat16") if "{t}" in n else ("",):
                assert n.format(t=t) in table, (f, n, t)
    gemm = next(iter(loader._part_table("gemm.cu")))
    traced = {("gemm.cu", gemm), ("norm.cu", "bn_forward_kernel<float>")}
    units = loader.traced_units(traced, ("main", "__nv_bfloat16"))
    held = {(f, n) for f, unit in units if not isinstance(unit, str) for n in unit}
    assert ("norm.cu", "bn_forward_kernel<float>") in held
    assert ("elementwise.cu", "accumulate_kernel<float, __nv_bfloat16>") in held
    assert ("elementwise.cu", "accumulate_kernel<float, __half>") not in held
    assert ("softmax.cu", "ce_rows_kernel<float, long long>") in held
    whole = {(f, unit) for f, unit in units if isinstance(unit, str)}
    assert whole == {(f, p) for f in loader.STEP_FILES for p in loader.parts(f)
                     if p.split(".")[0] in ("main", "__nv_bfloat16")}
    assert not {f for f, _ in whole} & {"elementwise.cu", "reduce.cu"}
    assert loader._build_order(units)[0] == ("gemm.cu", (gemm,))  # the heaviest first
    # A step file's kernel of a family the run did not name (a float64 dropout mask) brings
    # the part holding it, once; a traced main loop is one module of its own.
    traced |= {("data.cu", "dropout_mask_kernel<double>"), ("optim.cu", "sgd_kernel<float>")}
    more = loader.traced_units(traced, ("main", "__nv_bfloat16"))
    assert more == units[:-2] + [("data.cu", "double")] + units[-2:]
    assert loader.alone("gemm.cu", gemm) == ("gemm.cu", (gemm,))
    assert loader.alone("norm.cu", "bn_forward_kernel<float>") is None


def test_cache_key_follows_sources_and_headers(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/toolkit/include"))
    monkeypatch.setenv("DPTRAIN_KERNEL_DIR", str(tmp_path))
    (tmp_path / "a.cu").write_text('#include "h.cuh"\n// instantiate: k\n')
    (tmp_path / "h.cuh").write_text("// v1\n")
    first = loader.cache_key("a.cu", "90")
    (tmp_path / "h.cuh").write_text("// v2\n")
    second = loader.cache_key("a.cu", "90")
    (tmp_path / "a.cu").write_text('#include "h.cuh"\n// instantiate: k; k2\n')
    assert len({first, second, loader.cache_key("a.cu", "90")}) == 3


def test_arch_specific_files_are_built_only_for_their_gpu(monkeypatch):
    monkeypatch.setattr(loader, "cuda_include_dir", lambda: Path("/toolkit/include"))
    every = sorted(p.name for p in loader.kernel_dir().glob("*.cu"))
    hopper, ampere = loader.kernel_files("90"), loader.kernel_files("80")
    assert hopper == every
    hopper_only = {"gemm_wgmma.cu", "conv2d_wgmma.cu", "conv2d_bwdw_wgmma.cu", "conv2d_strip.cu"}
    assert set(ampere) == set(every) - hopper_only


def test_throughput_leaves_out_the_warmup_steps():
    meter = Throughput(images_per_step=10, warmup_steps=2)
    time.sleep(0.2)  # the first step, compiling
    meter.step()
    assert meter.window() is None  # nothing timed yet
    time.sleep(0.2)  # the capture
    meter.step()
    for _ in range(4):
        time.sleep(0.01)
        meter.step()
    rate = meter.window()
    assert meter.total_steps == 4 and meter.total_s < 0.15
    assert rate == pytest.approx(40 / meter.total_s) and rate > 40 / 0.15


def _tiny_config(tmp_path, **kw):
    base = dict(device="cpu", model="mlp", dataset="synthetic", train_images=160, val_images=32,
                epochs=1, max_steps=8, batch_size=16, log_every=2, warmup_steps=0,
                cache_dir=str(tmp_path / "cache"), log_dir=str(tmp_path / "L"), progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_slow_first_step_is_not_in_images_per_s(tmp_path, monkeypatch):
    calls = []
    step = TrainStep.__call__

    def slow_first(self):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.0)  # as a first step that compiles its kernels
        step(self)

    monkeypatch.setattr(TrainStep, "__call__", slow_first)
    summary = train(_tiny_config(tmp_path), echo=lambda _: None)
    assert summary["steps"] == 8
    assert summary["warmup_steps_excluded"] == CAPTURE_WARMUP + 1
    assert summary["train_s"] < 0.9, summary  # the 1 s of the first step is not training time
    assert summary["images_per_s"] == pytest.approx(5 * 16 / summary["train_s"])
    assert summary["startup_s"] > 1.0  # the slow first step is start-up
    saved = json.loads((tmp_path / "L" / "summary.json").read_text())
    assert saved["startup_s"] == summary["startup_s"] and saved["prepare_s"] >= 0
    # the per-window loss still averages every step of its window
    losses = [json.loads(line) for line in (tmp_path / "L" / "metrics.jsonl").open()]
    assert all(r["loss"] == r["loss"] for r in losses if "loss" in r)  # no NaN
    assert [r["images_per_s"] is None for r in losses if "loss" in r][:2] == [True, False]


def test_short_runs_keep_one_timed_step(tmp_path):
    summary = train(_tiny_config(tmp_path, max_steps=2), echo=lambda _: None)
    assert summary["warmup_steps_excluded"] == 1 and summary["images_per_s"] > 0


def test_cli_reports_startup_apart(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "dptrain", "train", "--device", "cpu", "--model", "mlp",
           "--train-images", "160", "--val-images", "32", "--epochs", "1", "--max-steps", "6",
           "--batch-size", "16", "--no-progress", "--cache-dir", str(tmp_path / "cache"),
           "--log-dir", str(tmp_path / "L")]
    began = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - began
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "L" / "summary.json").read_text())
    # from process start (imports, data, model) to the first timed step: within the run
    assert 0.05 < summary["startup_s"] < elapsed
    assert summary["warmup_steps_excluded"] == 3 and summary["images_per_s"] > 0


# A fake compile behind an on-disk cache: the first caller "compiles" (slowly) and writes the
# cache entry; a later caller finds it and loads. Each call leaves a line in a log.
_FAKE = r"""
import os, sys, time
from pathlib import Path
from dptrain import backend
from dptrain import distributed as dist
from dptrain.distributed.startup import first_on_host

cache = Path(sys.argv[1])
world = dist.init(backend.get("cpu"))

def fake_prepare():
    began = time.time()
    entry = cache / "kernels.cubin"
    if entry.exists():
        kind = "load"
    else:
        time.sleep(0.5)
        tmp = cache / f"tmp{world.rank}"
        tmp.write_text("binary")
        os.replace(tmp, entry)
        kind = "compile"
    with open(cache / f"log{world.rank}", "w") as f:
        f.write(f"{kind} {began} {time.time()} {world.local_rank} {world.local_size}\n")

first_on_host(world, fake_prepare)
"""


@needs_mpi
def test_one_compile_per_host_under_mpirun(tmp_path):
    script = tmp_path / "fake.py"
    script.write_text(_FAKE)
    env = mpi_env(dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    cmd = mpi_command(2, [sys.executable, str(script), str(tmp_path)])
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    logs = {}
    for rank in (0, 1):
        kind, began, ended, local_rank, local_size = (tmp_path / f"log{rank}").read_text().split()
        logs[int(local_rank)] = (kind, float(began), float(ended))
        assert local_size == "2"
    assert logs[0][0] == "compile" and logs[1][0] == "load"  # compiled once on this host
    assert logs[1][1] >= logs[0][2]  # the second rank started after the first had finished


@pytest.mark.gpu
def test_prepare_leaves_nothing_to_build_for_a_training_step():
    from dptrain.backend.cuda import loader as cuda_loader

    be = backend.get("cuda")
    report = be.runtime.prepare()
    assert report["files"] == len(cuda_loader.kernel_files(cuda_loader.device_arch()))
    built = cuda_loader.builds
    assert be.runtime.prepare()["built"] == 0  # a second call finds every module built
    from dptrain import nn
    from replay import train_steps

    # eager steps, the capture, a replay
    train_steps("cuda", lambda: nn.cnn((1, 48, 48), 7), (1, 48, 48), 7, graph=True,
                steps=CAPTURE_WARMUP + 2, seed=0, images=64, batch=32)
    be.runtime.synchronize()
    assert cuda_loader.builds == built


def test_bench_startup_reports_each_build(tmp_path):
    from dptrain.bench import startup

    out = []
    assert startup.main(["--device", "cpu", "--workers", "1", "2", "--no-train",
                         "--json", str(tmp_path / "s.json")], echo=out.append) == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [b["cache"] for b in doc["build"]] == ["empty", "empty", "warm"]
    assert all(b["files"] == 0 for b in doc["build"])  # nothing to compile on the CPU
    assert out[0].startswith("kernel build, cpu") and len(out) == 2 + 3


_FAMILIES_RUN = """
import sys
from dptrain.backend.cuda import loader
from dptrain.run.config import TrainConfig
from dptrain.run.train import train
from dptrain.backend import get
rt = get("cuda").runtime
real, reports, late = rt.prepare, [], []
rt.prepare = lambda dtypes=None, trace=None: reports.append(real(dtypes, trace)) or reports[-1]
build = loader.module


def module(filename, part=loader.PARTS[0]):  # the modules built after prepare
    before = loader.builds
    mod = build(filename, part)
    if reports and loader.builds > before:
        late.append(f"{filename}:{part}")
    return mod


loader.module = module
# 100 validation images: a full evaluation batch of 64 and a ragged one of 36
train(TrainConfig(model=sys.argv[1], precision=sys.argv[2], device="cuda", train_images=512,
                  val_images=100, epochs=1, max_steps=4, eval_every=2, batch_size=64,
                  progress=False, cache_dir=sys.argv[3]), echo=lambda s: None)
print(",".join(late) or "-", reports[0]["traced"], reports[0]["built"], loader.builds)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("model, precision", [("cnn", "bf16"), ("cnn", "tf32"),
                                              ("cnn", "fp16"), ("resnet18", "bf16"),
                                              ("resnet18", "tf32"), ("vit", "bf16"),
                                              ("vit", "tf32"), ("mlp", "bf16"),
                                              ("mlp", "tf32")])
def test_a_run_builds_every_kernel_it_uses_up_front(tmp_path, model, precision):
    """prepare builds the kernels its trace of the model records (training and evaluation
    shapes) and the step's own (loader.STEP_KERNELS and STEP_FILES), yet nothing the run uses is left to build on first
    use (which would stall a step): every module this fresh process built, it built in
    prepare."""
    out = subprocess.run([sys.executable, "-c", _FAMILIES_RUN, model, precision,
                          str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    late, traced, in_prepare, total = out.stdout.split()[-4:]
    assert traced != "None" and int(traced) > 0  # the trace ran, so only what it names built
    assert late == "-"  # the modules built on first use, after prepare
    assert int(in_prepare) == int(total) > 0


@pytest.mark.gpu
def test_recording_names_the_kernels_and_launches_none(monkeypatch):
    """Inside launch.recording() a launcher's kernels are named, not built or launched (its
    output keeps the poison), and the plan made there is not kept: the same product after it
    launches the real kernel."""
    import cupy
    import numpy as np

    from dptrain.backend.cuda import launch
    from dptrain.backend.cuda import loader as cuda_loader

    be = backend.get("cuda")
    monkeypatch.setattr(launch, "new", lambda shape, dtype: cupy.full(shape, np.nan, dtype))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((67, 45), np.float32), rng.standard_normal((45, 33), np.float32)
    da, db = be.asarray(a), be.asarray(b)
    built = cuda_loader.builds
    with launch.recording() as used:
        out = be.matmul(da, db)
    assert cuda_loader.builds == built  # nothing built
    assert np.isnan(be.to_numpy(out)).all()  # nothing launched
    files = {f for f, _ in used}
    assert "gemm.cu" in files and all(name for _, name in used)
    np.testing.assert_allclose(be.to_numpy(be.matmul(da, db)), a @ b, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_builds_start_before_and_during_the_trace(monkeypatch):
    """prepare hands the step's own kernels to the builders before its trace runs and each
    heavy main loop (a file built one instantiation a module) the moment the trace records
    it, so they compile beside the trace; what the trace records is built by the end."""
    import numpy as np

    from dptrain.backend.cuda import loader as cuda_loader

    be = backend.get("cuda")
    submitted, during = [], []
    real = cuda_loader.Builds.submit

    def spy(self, units):
        units = list(units)
        submitted.append(units)
        return real(self, units)

    monkeypatch.setattr(cuda_loader.Builds, "submit", spy)
    a, b = be.asarray(np.ones((67, 45), np.float32)), be.asarray(np.ones((45, 33), np.float32))

    def trace():
        before = len(submitted)
        be.matmul(a, b)  # a gemm.cu main loop: one a module
        during.extend(submitted[before:])

    report = be.runtime.prepare((np.float32,), trace)
    assert submitted[0] == cuda_loader.step_units(("main",))
    assert during and all(f == "gemm.cu" and len(held) == 1 for batch in during
                          for f, held in batch)
    assert report["traced"] >= 1
    assert be.to_numpy(be.matmul(a, b)).tolist() == np.full((67, 33), 45.0).tolist()


@pytest.mark.gpu
def test_prebuild_hands_its_builds_to_prepare(monkeypatch):
    """prebuild starts the step's own kernels before any model exists (train calls it right
    after choosing the device); the next prepare takes those builds over, not a new set."""
    import numpy as np

    from dptrain.backend.cuda import loader as cuda_loader

    be = backend.get("cuda")
    be.runtime.prebuild([np.float32])
    early = cuda_loader._early
    assert early is not None and set(early.futures) == set(cuda_loader.step_units(("main",)))
    taken, real = [], cuda_loader.take
    monkeypatch.setattr(cuda_loader, "take", lambda: taken.append(real()) or taken[-1])
    report = be.runtime.prepare((np.float32,), lambda: None)
    assert taken == [early] and cuda_loader._early is None and report["traced"] == 0
