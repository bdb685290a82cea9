"""Launchers of kernels/conv2d*.cu: 2-D convolution forward, backward-data and
backward-weight as implicit GEMMs (no im2col buffer), planned like matmul (gemm.py).

Conventions (kernels/conv2d.cu's header has the kernel side):
  * float32, float16 or bfloat16 (every operand: the b16 tensor-core kernels and the direct
    kernels load 16-bit data and accumulate in fp32, rounding each result once), NCHW
    activations, weight (C_out, C_in, kH, kW), PyTorch's cross-correlation; stride and padding
    are (h, w) pairs of ints. Results are new arrays or `out=`, written with `=`.
  * `channels_last=True`: activations (x, y, gy, gx) are (N, H, W, C). The wgmma kernels read
    and write them as they are (their sources are channels-last anyway and their epilogue
    stores channel pairs), and so does 16-bit / TF32 backward-weight on wgmma; the FFMA
    backward-weight of conv2d_nhwc.cu copies gy only; every other pass copies its activations
    to NCHW and its output back (layout.via_nchw).
  * The precision (runtime.precision) is part of every plan key. `workspace=` (a layer's
    cuda/workspace.py Workspace) carries the channels-last copies of x (made by the forward)
    and gy (made by backward-data) to backward-weight, which then copies neither again.

The modules:
    geometry.py    ConvGeom (kernels/conv_geom.cuh's fields) and the passes' argument checks
    routes.py      Route, the test-only injector DPTRAIN_TEST_ROUTES_OFF, explain()
    passes.py      the ops and each pass's ordered route table
    layout.py      chunks, tiles, NCHW <-> channels-last around a plan, 3xTF32 around a plan
    ahead.py       a step's 16-bit weights reordered into the kernels' operands in one launch
    implicit.py    conv2d.cu        (mma.sync / FFMA, NCHW gathers; runs everywhere)
    direct.py      conv2d_direct.cu (small filters)
    nhwc.py        conv2d_nhwc.cu   (backward-weight gathering x's channels-last copy)
    wgmma.py       conv2d_wgmma.cu  (forward / backward-data on Hopper, cp.async or TMA)
    bwdw_wgmma.py  conv2d_bwdw_wgmma.cu (backward-weight on Hopper, gathering or TMA)
    strip.py       conv2d_strip.cu  (the ImageNet stem's forward and backward-weight on Hopper)

`explain(pass, geometry)` lists the routes a shape passed over and why, ending with the one
that takes it; `describe` prints it on one line, e.g.
    from dptrain.backend.cuda.conv import describe, geometry
    print(describe("forward", geometry.forward(x, w, None, (1, 1), (1, 1))))
"""
from dptrain.backend.cuda.conv import geometry  # noqa: F401
from dptrain.backend.cuda.conv.geometry import ConvGeom  # noqa: F401
from dptrain.backend.cuda.conv.passes import (  # noqa: F401  (importing registers the ops)
    BACKWARD_DATA, BACKWARD_WEIGHT, FORWARD, TABLES, conv2d_backward_data,
    conv2d_backward_weight, conv2d_channels_last_native, conv2d_forward, conv2d_forward_stats,
    conv2d_kernels, describe, explain,
)
