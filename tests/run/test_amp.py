"""Mixed precision (--precision fp16, dptrain.run.amp): the cast, layers computing in the dtype of
their input, the loss scaler's rules, the guard telling an overflow from a failure, fp16
training close to fp32, and an overflow on one rank skipping the step on every rank."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain.run import amp
from dptrain import backend, nn
from dptrain import distributed as dist
from dptrain.engine.autograd import Tensor
from dptrain.errors import NonFiniteError
from dptrain.run.nonfinite import NonFiniteGuard
from dptrain.optim import SGD
from dptrain.run.config import TrainConfig
from dptrain.run.train import train
from mpilaunch import HAVE_MPI, run

cpu = backend.get("cpu")
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason="needs an MPI launcher and mpi4py")
HALF = np.dtype(np.float16)


def test_cast_forward_and_gradient_dtypes():
    x = Tensor(np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4), requires_grad=True)
    y = F.cast(x, np.float16)
    assert y.dtype == HALF and np.array_equal(y.numpy(), x.numpy().astype(np.float16))
    (F.cast(y, np.float32) * 3.0).sum().backward()
    assert x.grad.dtype == np.float32 and np.all(x.grad.numpy() == 3.0)
    assert F.cast(x, np.float32) is x
    with pytest.raises(TypeError, match="float to float"):
        F.cast(x, np.int32)


def test_cast_parameter_accumulates_the_16_bit_gradient_into_fp32_bitwise():
    """A parameter's 16-bit gradient is added into its fp32 .grad with the cast folded in:
    the same bits as a cast followed by an add; two uses of one parameter sum in fp32."""
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((5, 6)).astype(np.float32)
    x = Tensor(rng.standard_normal((4, 6)).astype(np.float16))
    grads = []
    for cast in (F.cast, F.cast_parameter):
        w = Tensor(w0.copy(), requires_grad=True)
        w.grad = Tensor(np.full_like(w0, 0.25))  # a flat buffer's view already holds a grad
        (F.cast(F.linear(x, cast(w, HALF), None), np.float32) * 3.0).sum().backward()
        grads.append(w.grad.numpy())
        assert w.grad.dtype == np.float32
    assert grads[0].tobytes() == grads[1].tobytes()
    w = Tensor(w0.copy(), requires_grad=True)  # no grad yet; used twice
    h = F.cast_parameter(w, HALF)
    (F.cast(F.linear(x, h, None), np.float32).sum() + F.cast(F.linear(x, h, None), np.float32)
     .sum()).backward()
    assert w.grad.dtype == np.float32
    ref = Tensor(w0.copy(), requires_grad=True)
    (F.cast(F.linear(x, F.cast(ref, HALF), None), np.float32).sum() * 2.0).backward()
    np.testing.assert_allclose(w.grad.numpy(), ref.grad.numpy(), rtol=1e-3)
    assert F.cast_parameter(x, HALF) is x  # already 16-bit; non-leaves take F.cast


@pytest.mark.parametrize("layer, shape", [(lambda: nn.Linear(6, 5), (4, 6)),
                                          (lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 5, 5))])
def test_layers_compute_in_their_inputs_dtype_with_fp32_gradients(layer, shape):
    """Fed fp16, a layer returns fp16 (rounded from fp32 arithmetic on fp16-rounded operands)
    and its parameters' gradients arrive in fp32."""
    m = layer()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    y = m(Tensor(x.astype(np.float16)))
    assert y.dtype == HALF
    ref_m = layer()
    for p, q in zip(ref_m.parameters(), m.parameters()):
        p.data = q.numpy().astype(np.float16).astype(np.float32)
    ref = ref_m(Tensor(x.astype(np.float16).astype(np.float32))).numpy()
    np.testing.assert_allclose(y.numpy().astype(np.float32), ref, rtol=2e-3, atol=2e-3)
    F.cast(y, np.float32).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == np.float32 for p in m.parameters())


def _decide(scaler, overflow, flags_dtype=np.float32):
    """One guard decision on a finite loss with (overflow 1) or without an overflowed
    gradient: the scale's update. Returns (decision, count, skip)."""
    flags = np.array([0.0, overflow], flags_dtype)
    decision, count, skip = (np.zeros(1, flags_dtype) for _ in range(3))
    cpu.nonfinite_decide_(flags, decision, count, True, scaler.state, skip, scaler.interval)
    return decision[0], count[0], skip[0]


def test_scaler_halves_on_overflow_and_doubles_after_the_interval():
    scaler = amp.LossScaler(cpu, init_scale=8.0, interval=3)
    assert _decide(scaler, 1.0) == (0.0, 0.0, 1.0)  # an overflow skips, uncounted
    assert scaler.state.tolist() == [4.0, 0.0, 1.0]
    for _ in range(2):
        assert _decide(scaler, 0.0) == (0.0, 0.0, 0.0)
    assert scaler.state[0] == 4.0
    _decide(scaler, 0.0)  # third good step in a row
    assert scaler.state.tolist() == [8.0, 0.0, 1.0]
    assert scaler.read(5) == (8.0, 1) and scaler.read(6) == (8.0, 0)
    g, flag = np.full(6, 24.0, np.float32), np.zeros(1, np.float32)
    cpu.unscale_check_(g[0:2], scaler.scale, flag)
    cpu.unscale_check_(g[4:6], scaler.scale, flag)
    assert g.tolist() == [3.0, 3.0, 24.0, 24.0, 3.0, 3.0] and flag[0] == 0.0
    g[2] = np.inf
    cpu.unscale_check_(g, scaler.scale, flag)
    assert flag[0] == 1.0
    again = amp.LossScaler(cpu)
    again.load_state_dict(scaler.state_dict())
    assert again.state.tolist() == [8.0, 0.0, 0.0]


def test_scaler_stops_a_run_whose_scale_collapsed():
    scaler = amp.LossScaler(cpu, init_scale=amp.MIN_SCALE)
    _decide(scaler, 1.0)
    with pytest.raises(NonFiniteError, match="loss scale"):
        scaler.read(7)


def _guarded(scaler):
    model = nn.mlp((1, 4, 4), 3, hidden=(5,))
    opt = SGD(model.parameters(), lr=0.1)
    return opt, NonFiniteGuard(opt, dist.LocalComm(cpu), 0, scaler)


def _step(opt, guard, loss, grad):
    opt.begin_step()
    opt.flat.grad[...] = grad
    guard(np.array(loss, np.float32))
    opt.update()


def test_overflow_skips_one_step_and_halves_the_scale_without_stopping():
    scaler = amp.LossScaler(cpu, init_scale=4.0)
    opt, guard = _guarded(scaler)
    before = opt.flat.data.copy()
    _step(opt, guard, 1.0, np.inf)  # an overflowed gradient: skipped, scale halved
    assert np.array_equal(opt.flat.data, before) and scaler.state[0] == 2.0
    assert guard.read(1) == 0  # not a failure
    _step(opt, guard, 1.0, 2.0)  # applied, the gradient divided by the scale (2): 1.0
    np.testing.assert_allclose(opt.flat.data, before - 0.1 * 1.0, rtol=1e-6)
    assert scaler.read(2) == (2.0, 1)


def test_a_non_finite_loss_still_stops_an_fp16_run():
    opt, guard = _guarded(amp.LossScaler(cpu))
    _step(opt, guard, np.nan, 1.0)
    with pytest.raises(NonFiniteError, match="at step 1;"):
        guard.read(1)


class _Unknown(nn.Module):
    """A leaf layer amp knows nothing of (a user's own)."""

    def forward(self, x):
        return x


@pytest.mark.parametrize("model", ["resnet18", "vit"])
def test_models_with_norms_and_attention_run_16_bit(model):
    """Batch norm, layer norm, GELU, dropout and attention have 16-bit paths: both models are
    allowed in fp16 / bf16, and auto picks bf16 for them."""
    net = nn.build_model(model, (3, 32, 32), 10)
    amp.check_model(net, "fp16")
    amp.check_model(net, "bf16")
    assert amp.resolve("auto", _runtime("tf32", ("bf16", "fp16")), net) == "bf16"


def test_a_layer_amp_does_not_know_is_refused_by_name():
    net = nn.Sequential(nn.Linear(4, 4), _Unknown())
    with pytest.raises(ValueError, match=r"--precision fp16: layer '1' \(_Unknown\) has no "
                       r"16-bit path"):
        amp.check_model(net, "fp16")
    amp.check_model(net, "tf32")  # nothing to check


def _half_values(seed, shape=(4, 5, 3, 3)):  # values fp16 holds exactly
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float16).astype(np.float32)


def _forward_backward(layer, x32, gy, dtype):
    """(y, input gradient) of `layer` on x32 cast to `dtype`, as float32 arrays."""
    leaf = dp.tensor(x32, requires_grad=True)
    y = layer(F.cast(leaf, dtype))
    assert y.dtype == dtype
    (F.cast(y, np.float32) * dp.tensor(gy)).sum().backward()
    return y.numpy().astype(np.float32), leaf.grad.numpy()


def test_16_bit_layer_norm_is_the_fp32_layer_rounded():
    """Layer norm on fp16 input computes in float32 with its float32 parameters: its output
    and the input's gradient are exactly the fp32 layer's, rounded to fp16; the parameter
    gradients stay float32."""
    layer = nn.LayerNorm(3)
    x32, gy = _half_values(3), _half_values(4)
    (y16, g16), (y32, g32) = (_forward_backward(layer, x32, gy, d)
                              for d in (np.float16, np.float32))
    assert np.array_equal(y16, y32.astype(np.float16).astype(np.float32))
    assert np.array_equal(g16, g32.astype(np.float16).astype(np.float32))
    assert layer.weight.grad.dtype == np.float32


@pytest.mark.parametrize("layer", [nn.GELU(), nn.Dropout(0.3)], ids=["gelu", "dropout"])
def test_16_bit_gelu_and_dropout_follow_fp32(layer):
    """GELU and dropout on fp16 input: the fp32 layer's output and gradient within fp16's
    rounding (dropout's mask the same, its 1 / (1 - p) rounded to fp16)."""
    x32, gy = _half_values(5), _half_values(6)
    results = []
    for dtype in (np.float16, np.float32):
        dp.manual_seed(11)  # the same dropout mask both times
        results.append(_forward_backward(layer, x32, gy, dtype))
    (y16, g16), (y32, g32) = results
    assert np.array_equal(y16 == 0, y32 == 0)
    np.testing.assert_allclose(y16, y32, rtol=2e-3, atol=1e-3)
    np.testing.assert_allclose(g16, g32, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("model", ["resnet18", "vit"])
def test_fp16_training_of_models_with_norms(tmp_path, model):
    summary = train(TrainConfig(model=model, precision="fp16", device="cpu", train_images=64,
                                val_images=16, epochs=1, max_steps=3, batch_size=8,
                                progress=False, cache_dir=str(tmp_path)), echo=lambda s: None)
    assert summary["config"]["precision"] == "fp16" and np.isfinite(summary["train_loss"])


def _runtime(precision, mixed):
    return SimpleNamespace(precision=precision, PRECISIONS=(precision,),
                           mixed_precisions=lambda: mixed)


def test_auto_precision_is_bf16_on_a_gpu_for_models_with_a_16_bit_path():  # every model now
    cnn, vit = nn.build_model("cnn", (1, 48, 48), 7), nn.build_model("vit", (3, 32, 32), 10)
    gpu = _runtime("tf32", ("bf16", "fp16"))
    assert amp.resolve("auto", gpu, cnn) == "bf16"
    assert amp.resolve("auto", gpu, vit) == "bf16"
    assert amp.resolve("auto", _runtime("fp32", ()), cnn) == "fp32"  # no bf16 tensor cores
    assert amp.resolve("auto", cpu.runtime, cnn) == "fp32"
    assert amp.resolve("fp16", cpu.runtime, cnn) == "fp16"


def test_bfloat16_bits_round_to_nearest_even():
    from dptrain.backend.bfloat16 import from_bfloat16, to_bfloat16

    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -3.14159, 3.4e38, np.inf, -0.0], np.float32)
    bits = to_bfloat16(x)
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC049, 0x7F80, 0x7F80, 0x8000]
    assert np.isnan(from_bfloat16(to_bfloat16(np.float32(np.nan))))
    assert np.array_equal(from_bfloat16(bits)[:3], [1.0, 1.0, 1 + 2**-6])


def test_bfloat16_tensors_read_back_as_float32():
    from dptrain.backend.bfloat16 import to_bfloat16

    t = Tensor(to_bfloat16(np.array([1.5, -2.25, 3.0], np.float32)))
    assert t.numpy().dtype == np.float32 and t.numpy().tolist() == [1.5, -2.25, 3.0]


def test_bf16_is_refused_off_the_gpu():
    from dptrain.backend.bfloat16 import BFLOAT16

    with pytest.raises(ValueError, match="bf16 needs a GPU"):
        amp.check_runtime("bf16", cpu.runtime)
    amp.check_runtime("fp16", cpu.runtime)
    # the CPU converts to and from bfloat16 storage (the bf16 gradient exchange), but
    # computes in it nowhere: conversions only, tests/backend/test_cpu_bfloat16.py
    assert cpu.astype(np.ones(3, np.float32), BFLOAT16).dtype == BFLOAT16


def test_layers_without_16_bit_kernels_are_named():
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), _Unknown())
    with pytest.raises(ValueError, match=r"layer '2' \(_Unknown\) has no 16-bit path"):
        amp.check_model(net, "bf16")
    assert amp.resolve("auto", _runtime("tf32", ("bf16", "fp16")), net) == "tf32"


def test_cpu_products_of_fp16_operands_accumulate_in_fp32():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((7, 300)).astype(np.float16)
    b = rng.standard_normal((300, 5)).astype(np.float16)
    out = cpu.matmul(a, b)
    assert out.dtype == HALF
    ref = (a.astype(np.float64) @ b.astype(np.float64)).astype(np.float16)
    np.testing.assert_array_equal(out, ref)  # fp32 sums of 300 terms round to the same fp16


# -- whole runs from the command line (CPU; the GPU versions are in test_cuda_amp.py)

ARGS = ["--device", "cpu", "--model", "cnn", "--train-images", "256", "--val-images", "64",
        "--epochs", "1", "--global-batch-size", "32", "--no-progress", "--log-every", "1",
        "--seed", "2", "--optimizer", "sgd", "--lr", "0.05", "--lr-schedule", "constant",
        "--warmup-steps", "0"]


def records(log_dir):
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def weights(path):
    with np.load(path) as w:
        return {k: w[k] for k in w.files if k != "__meta__"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_fp16_training_follows_fp32(tmp_path, cache):
    losses = {}
    for precision in ("fp32", "fp16"):
        out = run(0, ARGS + ["--max-steps", "8", "--precision", precision, "--log-dir",
                             str(tmp_path / precision)], cache)
        assert out.returncode == 0, out.stderr
        losses[precision] = [r["loss"] for r in records(tmp_path / precision)]
    np.testing.assert_allclose(losses["fp16"], losses["fp32"], rtol=1e-2)
    recs = records(tmp_path / "fp16")
    assert all(r["loss_scale"] == 65536.0 and r["overflow_steps"] == 0 for r in recs)


@pytest.mark.parametrize("ranks", [0, pytest.param(2, marks=needs_mpi)])
def test_injected_overflow_on_one_rank_skips_that_step_on_every_rank(ranks, tmp_path, cache):
    """DPTRAIN_TEST_OVERFLOW=1:3 blows up the last rank's loss scale for step 3 only: every
    rank skips step 3 and halves its scale, so the weights after 3 steps are those after 2."""
    rank = 1 if ranks else 0
    fp16 = ARGS + ["--precision", "fp16"] + (["--verify-replicas"] if ranks else [])
    out = run(ranks, fp16 + ["--max-steps", "3", "--log-dir", str(tmp_path / "hit"), "--save",
                             str(tmp_path / "hit.npz")], cache,
              DPTRAIN_TEST_OVERFLOW=f"{rank}:3")
    assert out.returncode == 0, out.stderr
    recs = records(tmp_path / "hit")
    assert [r["overflow_steps"] for r in recs] == [0, 0, 1]
    # (step 2's record is read after the hook raised that rank's scale for step 3)
    assert recs[0]["loss_scale"] == 65536.0 and recs[2]["loss_scale"] == 32768.0
    out = run(ranks, fp16 + ["--max-steps", "2", "--save", str(tmp_path / "two.npz")], cache)
    assert out.returncode == 0, out.stderr
    hit, two = weights(tmp_path / "hit.npz"), weights(tmp_path / "two.npz")
    assert all(np.array_equal(hit[k], two[k]) for k in two)
