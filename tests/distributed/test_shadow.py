"""The parameters' 16-bit shadow (mixed precision, dptrain.distributed.flat): the flat buffer cast to 16
bits, kept current by the optimizer (its shard) and the reducer (whole, after a gather of the
fp32 data), all-gathered instead of the fp32 shards and read by the layers instead of a cast
per weight. Training with it is bitwise training without it (DPTRAIN_SHADOW=0), at one rank
and at two, where the per-step all-gathers move float16."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import dptrain.engine.functional as F
from dptrain.run import amp
from dptrain import backend, nn
from dptrain import distributed as dist
from dptrain.engine.autograd import Tensor
from dptrain.backend.bfloat16 import BFLOAT16
from dptrain.distributed.flat import FlatParameters
from dptrain.optim import SGD, SKIP_SLOT, AdamW
from dptrain.distributed.reducer import Reducer
from mpilaunch import HAVE_MPI, gpu_count, mpi_command, mpi_env, run

ROOT = Path(__file__).resolve().parents[2]
cpu = backend.get("cpu")
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs an MPI launcher and mpi4py")
HALF = np.dtype(np.float16)


def _model():
    return nn.cnn((1, 16, 16), 5, widths=(4, 8), hidden=16)


def test_shadow_is_the_flat_buffer_in_16_bits_with_a_view_per_parameter():
    model = _model()
    flat = FlatParameters(model.parameters(), world_size=2, shadow_dtype=HALF)
    assert flat.shadow.dtype == HALF and flat.shadow.shape == flat.data.shape
    assert np.array_equal(flat.shadow, flat.data.astype(HALF))
    for p in model.parameters():
        assert p.shadow.dtype == HALF and p.shadow.shape == p.shape
        assert np.shares_memory(p.shadow, flat.shadow)
        assert np.array_equal(p.shadow, p.numpy().astype(HALF))
    plain = _model()
    assert FlatParameters(plain.parameters()).shadow is None
    assert all(p.shadow is None for p in plain.parameters())


def test_shadow_dtype_follows_the_precision_and_the_switch(monkeypatch):
    assert amp.shadow_dtype("fp16") == HALF and amp.shadow_dtype("bf16") == BFLOAT16
    assert amp.shadow_dtype("fp32") is None and amp.shadow_dtype("tf32") is None
    monkeypatch.setenv("DPTRAIN_SHADOW", "0")
    assert amp.shadow_dtype("fp16") is None


def test_cast_parameter_reads_the_shadow_and_keeps_the_gradient_path(monkeypatch):
    """No cast with a shadow of the wanted dtype; the 16-bit gradient still lands in the fp32
    .grad, with the same bits as the eager cast's."""
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((3, 6)).astype(HALF))
    grads = []
    for shadow in (None, HALF):
        layer = nn.Linear(6, 4)
        layer.weight.data[...] = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
        layer.bias.data[...] = 0.5
        flat = FlatParameters(layer.parameters(), shadow_dtype=shadow)
        casts = []  # (from, to, shape) of every cast the backend makes
        monkeypatch.setattr(cpu, "astype", lambda a, d, f=cpu.astype:
                            casts.append((a.dtype, np.dtype(d), a.shape)) or f(a, d))
        w = F.cast_parameter(layer.weight, HALF)
        assert (w.data is layer.weight.shadow) == (shadow is not None)
        (F.cast(layer(x), np.float32) * 3.0).sum().backward()
        monkeypatch.undo()
        weight_casts = [c for c in casts if c[:2] == (np.float32, HALF) and c[2] in
                        ((4, 6), (4,))]  # the weight's and the bias's
        assert len(weight_casts) == (0 if shadow is not None else 3)  # w twice, bias once
        assert layer.weight.grad.dtype == np.float32
        grads.append(flat.grad.copy())
    assert grads[0].tobytes() == grads[1].tobytes()


def test_a_shadow_of_another_dtype_is_not_used():
    p = nn.Parameter(np.ones((2, 3), np.float32))
    p.shadow = np.zeros((2, 3), np.float64)
    assert np.array_equal(F.cast_parameter(p, HALF).numpy(), np.ones((2, 3)))


class PlainSGD(SGD):
    """A user's optimizer whose update does not write the shadow: update() casts it after."""

    writes_shadow = False

    def update_shard(self):
        for p, g, _, _ in self._views(self.buf):
            p -= self.lr * g


@pytest.mark.parametrize("dtype", [HALF, BFLOAT16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("opt_cls", [SGD, AdamW, PlainSGD])
def test_the_optimizer_writes_only_the_shard_it_updated(opt_cls, dtype):
    """SGD and AdamW write the shadow in their update's pass (the step ops' shadow=), other
    optimizers get a cast after; either way the shard's shadow is its data in 16 bits (the
    cast's bits), the other rank's is left, and a skipped step changes neither."""
    model = _model()
    flat = FlatParameters(model.parameters(), world_size=2, bucket_bytes=2048,
                          shadow_dtype=dtype)
    mine, theirs = flat.shard_segments(0), flat.shard_segments(1)
    opt = opt_cls(flat, lr=0.5, segments=mine)
    before = flat.shadow.copy()
    flat.grad[...] = 1.0
    opt.step()
    cast = np.empty_like(flat.shadow)
    cpu.copy_(cast, flat.data)
    for start, stop in mine:
        assert np.array_equal(flat.shadow[start:stop], cast[start:stop])
        assert not np.array_equal(flat.shadow[start:stop], before[start:stop])
    for start, stop in theirs:  # the other rank's: its all-gather brings them
        assert np.array_equal(flat.shadow[start:stop], before[start:stop])
    if opt_cls is not PlainSGD:
        data, shadow = flat.data.copy(), flat.shadow.copy()
        opt.begin_step()
        opt.hyper[SKIP_SLOT] = 1.0  # as the non-finite guard sets it on the device
        opt.update()
        assert np.array_equal(flat.data, data) and np.array_equal(flat.shadow, shadow)


class RecordingComm(dist.LocalComm):
    """Rank 0 of a world of 2 that records every all-gather (its own shard stays, the other
    rank's slice is left as it was): enough to see which buffer the reducer gathers."""

    rank, size = 0, 2

    def __init__(self):
        super().__init__(cpu)
        self.gathered = []

    def all_gather(self, send, recv):
        self.gathered.append((send.dtype, recv))


@pytest.mark.parametrize("shadow", [HALF, None])
def test_step_gathers_the_shadow_and_sync_gathers_fp32_then_casts(shadow):
    model = _model()
    comm = RecordingComm()
    flat = FlatParameters(model.parameters(), world_size=2, bucket_bytes=2048,
                          shadow_dtype=shadow)
    reducer = Reducer(flat, dist.World(rank=0, size=2, comm=comm), model)
    reducer.gather_parameters()
    wanted = HALF if shadow is not None else np.dtype(np.float32)
    assert len(comm.gathered) == len(flat.buckets)
    assert all(dtype == wanted for dtype, _ in comm.gathered)
    buffer = flat.shadow if shadow is not None else flat.data
    assert all(np.shares_memory(recv, buffer) for _, recv in comm.gathered)
    comm.gathered.clear()
    flat.data[...] = 0.25  # as if the gather of the fp32 shards brought new values
    reducer.sync_parameters()
    assert [dtype for dtype, _ in comm.gathered] == [np.float32] * len(flat.buckets)
    if shadow is not None:
        assert np.all(flat.shadow == HALF.type(0.25))  # cast whole from the fp32 data


# -- whole runs from the command line: with the shadow bitwise without it

ARGS = ["--device", "cpu", "--model", "cnn", "--train-images", "256", "--val-images", "64",
        "--epochs", "1", "--global-batch-size", "32", "--no-progress", "--log-every", "1",
        "--seed", "2", "--optimizer", "adamw", "--lr", "0.01", "--precision", "fp16",
        "--max-steps", "6", "--eval-every", "3"]  # an evaluation (a sync) mid-run


def _records(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in r.items() if k not in ("time", "images_per_s")}
            for r in map(json.loads, lines)]


def _weights(path):
    with np.load(path) as w:
        return {k: w[k] for k in w.files if k != "__meta__"}


def _assert_bitwise(tmp, a, b):
    assert _records(tmp / a) == _records(tmp / b)
    wa, wb = _weights(tmp / f"{a}.npz"), _weights(tmp / f"{b}.npz")
    assert wa.keys() == wb.keys() and all(wa[k].tobytes() == wb[k].tobytes() for k in wa)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_one_process_with_the_shadow_is_bitwise_without_it(tmp_path, cache):
    for name, switch in (("shadow", "1"), ("cast", "0")):
        out = run(0, ARGS + ["--log-dir", str(tmp_path / name), "--save",
                             str(tmp_path / f"{name}.npz")], cache, DPTRAIN_SHADOW=switch)
        assert out.returncode == 0, out.stderr
    _assert_bitwise(tmp_path, "shadow", "cast")
    assert len(_records(tmp_path / "shadow")) == 6 + 2  # 6 steps, 2 evaluations


def _two_ranks_with_and_without_shadow(flags, tmp, cache, device="cpu", half="float16",
                                       steps=6):
    """Train `flags` on 2 ranks with the shadow and with DPTRAIN_SHADOW=0, recording the
    all-gathers (tests/helpers/gather_driver.py): with the shadow every per-step all-gather moves
    `half`, each one in place of an fp32 gather of the same elements, the syncs (start,
    evaluations, the end) still gather fp32; losses and weights are bitwise the same."""
    gathers = {}
    for name, switch in (("shadow", "1"), ("cast", "0")):
        # (no --verify-replicas: its sync after every step would refresh the shadow)
        cmd = mpi_command(2, [sys.executable, str(ROOT / "tests" / "helpers" / "gather_driver.py"),
                              str(tmp / name), *flags, "--log-dir", str(tmp / name),
                              "--save", str(tmp / f"{name}.npz")], device=device)
        env = mpi_env(dict(os.environ, PYTHONPATH=str(ROOT), DPTRAIN_CACHE=str(cache),
                           DPTRAIN_SHADOW=switch), device=device)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-4000:]
        per_rank = [json.loads((tmp / f"{name}.{r}.json").read_text()) for r in (0, 1)]
        assert per_rank[0] == per_rank[1]
        gathers[name] = [(dtype, n) for dtype, n in per_rank[0]]
    _assert_bitwise(tmp, "shadow", "cast")
    assert {dtype for dtype, _ in gathers["cast"]} == {"float32"}
    moved = [n for dtype, n in gathers["shadow"] if dtype == half]
    fp32 = [n for dtype, n in gathers["shadow"] if dtype == "float32"]
    assert len(moved) + len(fp32) == len(gathers["shadow"])
    # the same gathers in each step the host issued: every step on the CPU; on the GPU the
    # eager and capturing ones (a replayed graph gathers without calling back into Python)
    issued = moved.count(moved[0]) if moved else 0
    assert issued and moved == moved[: len(moved) // issued] * issued
    assert issued == steps or device == "cuda", (issued, steps)
    assert Counter(moved) + Counter(fp32) == Counter(n for _, n in gathers["cast"])


@needs_mpi
def test_two_ranks_gather_float16_and_match_the_fp32_gather_bitwise(tmp_path, cache):
    _two_ranks_with_and_without_shadow(ARGS, tmp_path, cache)


# -- the same on the GPU: captured steps (the shadow's cast replays in the graph), NCCL


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_steps_with_the_shadow_are_bitwise_without_it(precision, monkeypatch):
    from replay import train_steps

    build = lambda: nn.cnn((1, 16, 16), 5, widths=(8, 16), hidden=32)  # noqa: E731
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("DPTRAIN_SHADOW", switch)
        for graph in (False, True):
            runs[switch, graph] = train_steps("cuda", build, (1, 16, 16), 5, graph, 12, 3,
                                              precision=precision)[1]
    ref = runs["0", False]
    for key, snapshots in runs.items():
        for step, (a, b) in enumerate(zip(snapshots, ref)):
            assert np.array_equal(a, b), f"{key}: weights differ after step {step + 1}"


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2 or not HAVE_MPI, reason="needs 2 GPUs and MPI")
@pytest.mark.parametrize("precision, half", [("bf16", "uint16"), ("fp16", "float16")])
def test_two_gpus_gather_16_bits_and_match_the_fp32_gather_bitwise(precision, half, tmp_path,
                                                                  cache):
    flags = ["--device", "cuda", "--model", "cnn", "--train-images", "960", "--val-images",
             "100", "--epochs", "1", "--global-batch-size", "64", "--max-steps", "8",
             "--eval-every", "4", "--log-every", "1", "--optimizer", "adamw", "--seed", "3",
             "--no-progress", "--precision", precision]
    _two_ranks_with_and_without_shadow(flags, tmp_path, cache, "cuda", half, steps=8)


def test_loading_weights_refreshes_the_shadow():
    """Any load_state_dict (a resume, or a user's) leaves the layers' 16-bit copy current."""
    model = _model()
    flat = FlatParameters(model.parameters(), shadow_dtype=HALF)
    state = {k: np.full(v.shape, 0.75, np.float32) for k, v in model.state_dict().items()}
    assert not np.any(flat.shadow == HALF.type(0.75))
    model.load_state_dict(state)
    for p in model.parameters():
        assert np.all(p.shadow == HALF.type(0.75))
