"""The ViT's PyTorch twin (dptrain.run.torch_twin, used by `train --torch` and `bench train`)
against our ViT on the same weights and inputs, on the CPU: the same state_dict names, the
same logits in eval mode, the same gradient of a loss for every parameter. float64 to 1e-12
(relative error: norm of the difference over the norm of PyTorch's value), float32 to 1e-4.
Skipped where torch is not installed."""
import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import nn
from dptrain.run.torch_twin import twin

torch = pytest.importorskip("torch")

TOLERANCE = {np.float32: 1e-4, np.float64: 1e-12}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _models(image_shape, dtype, **options):
    """Our ViT (every parameter perturbed, so LayerNorm's ones and zeros and the zero biases
    are not special) in `dtype`, and its twin holding the same values in that dtype."""
    dp.manual_seed(4)
    ours = nn.vit(image_shape, 7, **options)
    rng = np.random.default_rng(0)
    for _, p in ours.named_parameters():
        p.data = (p.data + rng.normal(0, 0.05, p.shape)).astype(dtype)
    net = twin(ours)
    assert net is not None
    torch_dtype = {np.float32: torch.float32, np.float64: torch.float64}[dtype]
    net = net.to(torch_dtype)  # the twin is built in float32: reload our values exactly
    net.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v))
                         for k, v in ours.state_dict().items()}, strict=True)
    return ours, net


def test_twin_has_our_names_and_dropouts():
    ours = nn.build_model("vit", (1, 48, 48), 7)
    net = twin(ours)
    assert list(net.state_dict()) == list(ours.state_dict())
    assert net.pos_drop.p == ours.pos_drop.p == 0.1
    for theirs, mine in zip(net.blocks, ours.blocks):
        assert theirs.norm_first and theirs.self_attn.batch_first
        assert theirs.activation_relu_or_gelu == 2  # exact GELU (erf), as ours
        assert theirs.norm1.eps == mine.norm1.eps and theirs.dropout.p == mine.dropout.p
        assert theirs.self_attn.dropout == mine.self_attn.dropout
    assert net.norm.eps == ours.norm.eps


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("image_shape,options", [
    ((1, 48, 48), {}),  # --model vit as trained and benchmarked: patch 8, dim 64, depth 4
    ((3, 20, 20), {"dim": 24, "depth": 2, "heads": 3, "mlp_dim": 40}),  # patch 5, head dim 8
])
def test_twin_gives_our_logits_and_gradients(dtype, image_shape, options):
    ours, net = _models(image_shape, dtype, **options)
    ours.eval()  # dropout off on both sides
    net.eval()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5,) + image_shape).astype(dtype)
    y = np.array([0, 3, 6, 1, 2])
    tol = TOLERANCE[dtype]

    with torch.no_grad():  # PyTorch's inference path, as train --torch evaluates
        ref = net(torch.from_numpy(x)).numpy()
    with dp.no_grad():
        got = ours(dp.tensor(x)).numpy()
    assert got.dtype == dtype and rel(got, ref) <= tol

    logits = ours(dp.tensor(x))
    F.cross_entropy(logits, dp.tensor(y)).backward()
    ref_logits = net(torch.from_numpy(x))
    torch.nn.functional.cross_entropy(ref_logits, torch.from_numpy(y)).backward()
    assert rel(logits.numpy(), ref_logits.detach().numpy()) <= tol
    theirs = dict(net.named_parameters())
    assert set(theirs) == {name for name, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        err = rel(p.grad.numpy(), theirs[name].grad.numpy())
        assert err <= tol, f"gradient of {name}: relative error {err:.2e}"
