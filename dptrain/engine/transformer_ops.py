"""Differentiable primitives of the transformer (dptrain.nn.transformer, the ViT): one
Function per op, as in dptrain.engine.ops, whose conventions they keep.
"""
from __future__ import annotations

from dptrain.engine.autograd import Function
from dptrain.engine.rng import data_shard


class BroadcastTo(Function):
    """a broadcast to `shape` (a copy); the gradient sums back to a's shape."""

    def forward(self, a, shape):
        self.shape = a.shape
        return self.be.broadcast_to(a, shape)

    def backward(self, gy):
        return (self.be.sum_to_shape(gy, self.shape),)


class LayerNorm(Function):
    """Layer norm over the last axis, with weight and bias (D,); saves mean and rstd."""

    def forward(self, x, weight, bias, eps=1e-5):
        self.x, self.weight = x, weight
        y, self.mean, self.rstd = self.be.layer_norm_forward(x, weight, bias, eps)
        return y

    def backward(self, gy):
        return self.be.layer_norm_backward(gy, self.x, self.weight, self.mean, self.rstd)


class GELU(Function):
    """x * Phi(x), the exact (erf) form."""

    def forward(self, x):
        self.x = x
        return self.be.gelu(x)

    def backward(self, gy):
        return (self.be.gelu_backward(self.x, gy),)


class MaskedSoftmax(Function):
    """softmax(scale * x) over the last axis, keys masked by flags (causal, key_lengths)."""

    def forward(self, x, causal=False, key_lengths=None, scale=1.0):
        self.scale = scale
        self.y = self.be.masked_softmax(x, causal=causal, key_lengths=key_lengths, scale=scale)
        return self.y

    def backward(self, gy):
        return (self.be.masked_softmax_backward(self.y, gy, scale=self.scale),)


class Attention(Function):
    """Scaled dot-product attention of (B, H, T, E) operands as one backend op
    (attention_forward): scores, mask, softmax, dropout and the product with v in one pass.
    Saves q, k, v and the probabilities (dropped weights marked by their sign); dropout draws
    the global batch's mask as Dropout does."""

    def forward(self, q, k, v, scale=1.0, causal=False, key_lengths=None, dropout_p=0.0):
        self.saved, self.scale, self.p = (q, k, v), scale, dropout_p
        out, self.probs = self.be.attention_forward(q, k, v, scale, causal, key_lengths,
                                                    dropout_p, _dropout_shard(dropout_p))
        return out

    def backward(self, gout):
        return self.be.attention_backward(gout, *self.saved, self.probs, self.scale, self.p)


def _dropout_shard(p):
    """(rank, size) of the global batch whose dropout mask attention draws (see Dropout)."""
    return data_shard() if p else (0, 1)


def _heads(a, heads, parts):
    """`parts` (B, H, T, E) views of a (B, T, parts * H * E) array laid out (B, T, parts, H, E)."""
    b, t, width = a.shape
    split = a.reshape(b, t, parts, heads, width // (parts * heads))
    return tuple(split[:, :, i].transpose(0, 2, 1, 3) for i in range(parts))


class SelfAttention(Function):
    """Multi-head self-attention from a packed projection qkv (B, T, 3 * D) to (B, T, D) as
    one backend op: q, k and v are strided views of qkv, the output is written in (B, T, H, E)
    order and the gradient into one (B, T, 3, H, E) buffer, so no transpose is copied."""

    def forward(self, qkv, heads=1, scale=1.0, causal=False, key_lengths=None, dropout_p=0.0):
        self.heads, self.shape = heads, qkv.shape
        out = self.be.empty(qkv.shape[:2] + (qkv.shape[2] // 3,), qkv.dtype)
        self.saved, self.scale, self.p = _heads(qkv, heads, 3), scale, dropout_p
        _, self.probs = self.be.attention_forward(
            *self.saved, scale, causal, key_lengths, dropout_p, _dropout_shard(dropout_p),
            out=_heads(out, heads, 1)[0])
        return out

    def backward(self, gout):
        gqkv = self.be.empty(self.shape, gout.dtype)
        self.be.attention_backward(_heads(gout, self.heads, 1)[0], *self.saved, self.probs,
                                   self.scale, self.p, grads=_heads(gqkv, self.heads, 3))
        return (gqkv,)
