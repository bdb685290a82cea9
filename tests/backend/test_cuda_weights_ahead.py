"""The step's 16-bit convolution weights reordered ahead in one launch (conv/ahead.py): the
operands are the per-layer reorders' bits, the convolutions take them only inside ready(),
and a training run with them is bitwise the run without."""
import numpy as np
import pytest

from dptrain.backend import cpu
from dptrain.backend.bfloat16 import BFLOAT16, to_bfloat16

from replay import train_steps

gpu = pytest.mark.gpu
SHAPES = [(64, 64, 3, 3),  # ResNet's 3x3: narrow forward, wide backward-data (73 KB)
          (64, 256, 1, 1),  # a 1x1: backward-data alone, narrow (32 KB)
          (512, 512, 3, 3),  # layer4: backward-data in 64 x 64 tiles, 8 x 72
          (40, 24, 5, 3),  # odd sides: no pairs, narrow throughout
          (16, 4096, 3, 3)]  # the forward's matrices past shared memory: reordered per layer


def test_the_cpu_reorders_nothing_ahead():
    assert cpu.conv2d_weight_operands([np.zeros((8, 8, 3, 3), np.float32)]) is None


@gpu
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
def test_operands_are_the_per_layer_reorders(cu, rng, dtype):
    """Each operand made ahead equals weight_reorder's run of that weight and pass, bit for
    bit; inside ready() the runs hand those out, outside they reorder afresh."""
    from dptrain.backend.cuda.conv import ahead, layout

    as_dtype = to_bfloat16 if dtype == BFLOAT16 else (lambda a: a.astype(dtype))
    ws = [cu.asarray(as_dtype(rng.standard_normal(s).astype(np.float32))) for s in SHAPES]
    ws.append(cu.asarray(as_dtype(np.ones((8, 3, 7, 7), np.float32))))  # 3 channels: not the wgmma kernels'
    operands = cu.conv2d_weight_operands(ws)
    operands.refresh()
    for w in ws:
        co, ci, kh, kw = w.shape
        modes = ([0] if kh * kw > 1 else []) + [1]
        for mode in modes:
            m, c = (co, ci) if mode == 0 else (ci, co)
            run = layout.weight_reorder(mode, m, c, kh * kw, w.dtype)
            plain = run(w)
            with operands.ready():
                taken = run(w)
                again = ahead.ready_operand(w, mode)
            made_ahead = ci % 8 == 0 and not (mode == 0 and ci * kh * kw * 2 > 48 * 1024)
            assert (again is not None) == made_ahead, (w.shape, mode)
            assert (taken.data.ptr == again.data.ptr) if made_ahead else again is None
            assert cu.to_numpy(taken).tobytes() == cu.to_numpy(plain).tobytes(), (w.shape, mode)
            assert ahead.ready_operand(w, mode) is None  # gone outside ready()
    with operands.ready(), pytest.raises(RuntimeError, match="does not nest"):
        with operands.ready():
            pass


@gpu
def test_a_run_with_the_weights_ahead_is_bitwise_the_run_without(monkeypatch):
    """ResNet-18 at 3x32x32 in fp16, captured: every step's weights equal the run that
    reorders each weight as its layer runs (the operands refreshed once a step)."""
    from dptrain import nn
    from dptrain.backend.cuda.conv import ahead

    build = lambda: nn.build_model("resnet18", (3, 32, 32), 10)  # noqa: E731
    refreshes = []
    refresh = ahead.WeightOperands.refresh
    monkeypatch.setattr(ahead.WeightOperands, "refresh",
                        lambda self: refreshes.append(self.jobs) or refresh(self))
    _, with_ahead = train_steps("cuda", build, (3, 32, 32), 10, True, 4, 7, images=64,
                                batch=16, precision="fp16")
    assert len(refreshes) >= 3 and refreshes[0] > 20  # eager steps and the capture; 35 jobs
    monkeypatch.setenv("DPTRAIN_TEST_ROUTES_OFF", "weights_ahead")
    _, without = train_steps("cuda", build, (3, 32, 32), 10, True, 4, 7, images=64,
                             batch=16, precision="fp16")
    for step, (a, b) in enumerate(zip(with_ahead, without)):
        assert np.array_equal(a, b), f"weights differ after step {step + 1}"
