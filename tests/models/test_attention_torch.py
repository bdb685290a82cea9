"""MultiHeadAttention and the pre-LN encoder block against PyTorch on the same weights and
inputs, forward and backward, in float32 on the CPU: relative error (norm of the difference
over the norm of PyTorch's value) at most 1e-4. Skipped where torch is not installed."""
import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import nn

torch = pytest.importorskip("torch")

RTOL = 1e-4


def rel_err(ours, theirs):
    theirs = theirs.detach().numpy().astype(np.float64)
    ours = np.asarray(ours, dtype=np.float64)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    return np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30)


def _load_into_torch(ours, module):
    state = {k: torch.from_numpy(v) for k, v in ours.state_dict().items()}
    missing, unexpected = module.load_state_dict(state, strict=True)
    assert not missing and not unexpected


def _compare_grads(ours, module):
    theirs = dict(module.named_parameters())
    for name, p in ours.named_parameters():
        assert rel_err(p.grad.numpy(), theirs[name].grad) <= RTOL, name


def _torch_masks(b, tq, tk, causal, lengths):
    attn_mask = torch.triu(torch.ones(tq, tk, dtype=torch.bool), 1) if causal else None
    padding = None
    if lengths is not None:
        padding = torch.arange(tk)[None, :] >= torch.as_tensor(lengths)[:, None]
    return attn_mask, padding


CASES = [(False, None), (True, None), (False, [7, 3, 5]), (True, [2, 7, 6])]


@pytest.mark.parametrize("causal,lengths", CASES)
@pytest.mark.parametrize("cross", [False, True])
def test_multihead_attention_matches_torch(causal, lengths, cross):
    b, t, d, heads = 3, 7, 12, 4  # head_dim 3: nothing is a power of two
    rng = np.random.default_rng(7)
    dp.manual_seed(3)
    ours = nn.MultiHeadAttention(d, heads)
    ours.in_proj_bias.data[...] = rng.standard_normal(3 * d) * 0.1  # not all zeros
    ours.out_proj.bias.data[...] = rng.standard_normal(d) * 0.1
    theirs = torch.nn.MultiheadAttention(d, heads, batch_first=True)
    _load_into_torch(ours, theirs)

    x = rng.standard_normal((b, t, d)).astype(np.float32)
    kv = rng.standard_normal((b, t, d)).astype(np.float32)
    weight = rng.standard_normal((b, t, d)).astype(np.float32)
    key_lengths = None if lengths is None else np.array(lengths)

    xq = dp.tensor(x, requires_grad=True)
    xk = dp.tensor(kv, requires_grad=True) if cross else None
    out = ours(xq, xk, xk, key_lengths, causal)
    (out * dp.tensor(weight)).sum().backward()

    tq = torch.tensor(x, requires_grad=True)
    tk = torch.tensor(kv, requires_grad=True) if cross else tq
    attn_mask, padding = _torch_masks(b, t, t, causal, lengths)
    ref, _ = theirs(tq, tk, tk, key_padding_mask=padding, attn_mask=attn_mask,
                    need_weights=False)
    (ref * torch.from_numpy(weight)).sum().backward()

    assert rel_err(out.numpy(), ref) <= RTOL
    assert rel_err(xq.grad.numpy(), tq.grad) <= RTOL
    if cross:
        assert rel_err(xk.grad.numpy(), tk.grad) <= RTOL
    _compare_grads(ours, theirs)


@pytest.mark.parametrize("causal,lengths", [(False, None), (True, [5, 2])])
def test_encoder_block_matches_torch(causal, lengths):
    """Pre-LN block = torch.nn.TransformerEncoderLayer(norm_first=True, activation="gelu"),
    same parameter names; dropout off (p = 0) so both are deterministic."""
    b, t, d, heads, ff = 2, 5, 16, 4, 24
    rng = np.random.default_rng(11)
    dp.manual_seed(5)
    ours = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0)
    for _, p in ours.named_parameters():  # perturb so LayerNorm's weight/bias are not 1/0
        p.data[...] += (rng.standard_normal(p.shape) * 0.05).astype(np.float32)
    theirs = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation="gelu",
                                              batch_first=True, norm_first=True)
    _load_into_torch(ours, theirs)
    x = rng.standard_normal((b, t, d)).astype(np.float32)
    weight = rng.standard_normal((b, t, d)).astype(np.float32)
    key_lengths = None if lengths is None else np.array(lengths)

    xd = dp.tensor(x, requires_grad=True)
    out = ours(xd, key_lengths, causal)
    (out * dp.tensor(weight)).sum().backward()

    tx = torch.tensor(x, requires_grad=True)
    attn_mask, padding = _torch_masks(b, t, t, causal, lengths)
    ref = theirs(tx, src_mask=attn_mask, src_key_padding_mask=padding)
    (ref * torch.from_numpy(weight)).sum().backward()

    assert rel_err(out.numpy(), ref) <= RTOL
    assert rel_err(xd.grad.numpy(), tx.grad) <= RTOL
    _compare_grads(ours, theirs)


def test_layer_norm_and_gelu_match_torch():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 6, 33)) * 3 + 1).astype(np.float32)
    w, bias = rng.standard_normal(33).astype(np.float32), rng.standard_normal(33).astype(np.float32)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(x), (33,), torch.from_numpy(w),
                                         torch.from_numpy(bias))
    ours = F.layer_norm(dp.tensor(x), dp.tensor(w), dp.tensor(bias))
    assert rel_err(ours.numpy(), ref) <= 1e-6
    assert rel_err(F.gelu(dp.tensor(x)).numpy(), torch.nn.functional.gelu(torch.from_numpy(x))) \
        <= 1e-6
