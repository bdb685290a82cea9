"""The autodiff engine: ``Tensor`` and reverse-mode differentiation over backend arrays.

    autograd.py    Tensor, Function, backward() in topological order, no_grad, detach
    ops.py         one Function per primitive, forward and backward side by side, on raw
                   backend arrays (never Tensors), so the engine never knows the device
    transformer_ops.py  the same for the transformer's primitives (layer norm, attention)
    functional.py  the functional API (``from dptrain import functional as F``) and the
                   Tensor methods composed from the primitives
    losses.py      mse_loss, binary_cross_entropy_with_logits, composed from the primitives
    rng.py         the random state of the run (init, dropout, data order), kept per backend

May import: dptrain.backend, dptrain.errors. Nothing above it.
"""
