"""Record the convolution plans of a source tree over many shapes, on the CPU, and compare two
recordings: a check that a refactoring of dptrain/backend/cuda/conv/ keeps every plan.

    python tests/helpers/conv_plans.py record TREE CC OUT [NAME=VALUE ...]
    python tests/helpers/conv_plans.py compare BEFORE AFTER

`record` imports dptrain from TREE (a checkout, e.g. `git archive` of the commit before)
with a stand-in for CuPy: NumPy arrays with an address, a device of compute capability CC
(90, 80) and 132 SMs, kernel launches and TMA maps recorded instead of run. For each shape
case (fp32 / TF32 / fp16 / bf16, NCHW and channels-last, aligned and not, batches 1-256,
strides 1-3, odd sizes, the 3-channel 7x7/2 stem, 1x1 stride 2, ...) it runs the forward
(with and without bias), forward_stats, backward-data and backward-weight (with and without a
workspace) and writes, as JSON lines, every kernel requested and every launch: kernel,
template arguments, shared memory, grid, block, each argument (arrays by shape, dtype,
alignment and identity). NAME=VALUE sets environment variables first. `compare` reports the
cases whose launches or results differ, and apart those whose kernel requests differ.
Not a test (it needs the tree before a change); no GPU needed.
"""
import itertools
import json
import os
import sys
import types

import numpy as np


# ----------------------------------------------------------------------------- a stand-in CuPy

CAP = {"cc": 90, "sms": 132}

class ndarray(np.ndarray):
    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])

def empty(shape, dtype=np.float32):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(n + 256, np.uint8)
    at = -buf.__array_interface__["data"][0] % 256
    return buf[at:at + n].view(dtype).reshape(shape).view(ndarray)

def empty_like(a):
    return empty(a.shape, a.dtype)

def zeros(shape, dtype=np.float32):
    return empty(shape, dtype)

def asarray(a, dtype=None):
    a = np.asarray(a, dtype=dtype)
    out = empty(a.shape, a.dtype); out[...] = a
    return out

def arange(n, dtype=np.int64):
    return asarray(np.arange(n, dtype=dtype))

class Device:
    def __init__(self, i=0):
        self.id = i
    @property
    def compute_capability(self):
        return str(CAP["cc"])
    @property
    def attributes(self):
        return {"MultiProcessorCount": CAP["sms"]}
    def use(self):
        pass

class _Any:
    def __init__(self, *a, **k): pass
    def __getattr__(self, n): return _Any()
    def __call__(self, *a, **k): return _Any()

cuda = types.ModuleType("cupy.cuda")
cuda.Device = Device
cuda.Event = _Any
cuda.Stream = _Any
cuda.MemoryPool = _Any
cuda.get_current_stream = lambda: _Any()
cuda.runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                     deviceSynchronize=lambda: None)
mod = types.ModuleType("cupy")
for k, v in dict(ndarray=ndarray, empty=empty, empty_like=empty_like, zeros=zeros,
                 asarray=asarray, arange=arange, cuda=cuda, int64=np.int64,
                 asnumpy=np.asarray).items():
    setattr(mod, k, v)


def install(cc: int):
    """Make `import cupy` give the stand-in, a device of compute capability cc."""
    CAP["cc"] = cc
    sys.modules["cupy"] = mod
    sys.modules["cupy.cuda"] = cuda


# ----------------------------------------------------------------------------- record

def record(root, cc, out, settings):
    for kv in settings:
        k, v = kv.split("=", 1)
        os.environ[k] = v
    install(int(cc))
    sys.path.insert(0, root)
    global cu, launch, tma, gemm, Workspace, BFLOAT16, KERNELS
    from dptrain.backend import cuda as cu
    from dptrain.backend.cuda import launch, tma, gemm
    from dptrain.backend.cuda.workspace import Workspace
    from dptrain.backend.bfloat16 import BFLOAT16
    assert cu.__file__.startswith(os.path.abspath(root)), cu.__file__
    import importlib
    try:
        KERNELS = importlib.import_module("dptrain.backend.cuda.conv").conv2d_kernels
    except ImportError:
        KERNELS = importlib.import_module("dptrain.backend.cuda.conv2d").conv2d_kernels
    launch.kernel = _kernel
    tma.tiled = lambda a, *args: ("tiled", norm(a), list(args))
    tma.im2col = lambda a, shape, lower, upper, strides, channels, pixels: (
        "im2col", norm(a), list(shape), list(lower), list(upper), list(strides), channels,
        pixels)
    count = _record_all(out)
    print(count, "shape cases recorded")

LOG = []
class Rec:
    def __init__(self, filename, name, targs, smem):
        self.key = (filename, name, list(targs), smem)
    def __call__(self, grid, block, args, shared_mem=0, **kw):
        LOG.append(["launch", self.key, list(grid), list(block), [norm(a) for a in args],
                    shared_mem, sorted(kw)])
def _kernel(filename, name, *targs, smem=0):
    LOG.append(["request", filename, name, list(targs), smem])
    return Rec(filename, name, targs, smem)
IDS = {}
KEEP = []
def norm(a):
    if isinstance(a, ndarray):
        KEEP.append(a)
        i = IDS.setdefault(id(a), len(IDS))
        return ["arr", i, list(a.shape), str(a.dtype), a.data.ptr % 16, list(a.strides)]
    if isinstance(a, tuple):
        return [norm(b) for b in a]
    if isinstance(a, np.ndarray):
        return ["struct", str(a.dtype), repr(a.tolist())]
    if isinstance(a, np.generic):
        return [type(a).__name__, a.item()]
    if a is None:
        return None
    if isinstance(a, (int, float, str)):
        return a
    return ["?", type(a).__name__]

def arr(shape, dt, offset=0):
    a = empty((int(np.prod(shape)) + offset,), dt)
    return a[offset:].reshape(shape)

SHAPES = [  # cin, cout, (kh, kw), stride, pad, (h, w)
    (3, 64, (7, 7), (2, 2), (3, 3), (32, 32)), (3, 64, (7, 7), (2, 2), (3, 3), (224, 224)),
    (3, 16, (3, 3), (1, 1), (1, 1), (28, 28)), (1, 32, (5, 5), (1, 1), (0, 0), (28, 28)),
    (3, 200, (3, 3), (1, 1), (1, 1), (16, 16)), (8, 8, (2, 2), (2, 2), (0, 0), (9, 9)),
    (32, 64, (1, 1), (1, 1), (0, 0), (12, 12)), (4, 4, (3, 3), (1, 1), (1, 1), (10, 10)),
    (64, 64, (3, 3), (1, 1), (1, 1), (48, 48)), (64, 64, (3, 3), (1, 1), (1, 1), (7, 7)),
    (64, 128, (3, 3), (2, 2), (1, 1), (48, 48)), (64, 128, (1, 1), (2, 2), (0, 0), (48, 48)),
    (128, 128, (3, 3), (1, 1), (1, 1), (24, 24)), (128, 256, (1, 1), (2, 2), (0, 0), (24, 24)),
    (128, 256, (3, 3), (2, 2), (1, 1), (9, 9)), (256, 512, (3, 3), (2, 2), (1, 1), (12, 12)),
    (512, 512, (3, 3), (1, 1), (1, 1), (6, 6)), (64, 256, (1, 1), (1, 1), (0, 0), (14, 14)),
    (256, 64, (1, 1), (1, 1), (0, 0), (14, 14)), (5, 7, (3, 3), (1, 1), (1, 1), (13, 11)),
    (24, 40, (3, 3), (1, 1), (1, 1), (15, 15)), (24, 24, (3, 3), (2, 2), (1, 1), (15, 15)),
    (48, 96, (3, 3), (2, 2), (1, 1), (15, 17)), (17, 33, (2, 3), (2, 1), (1, 0), (11, 9)),
    (96, 96, (5, 5), (1, 1), (2, 2), (10, 10)), (16, 32, (3, 3), (1, 1), (1, 1), (8, 8)),
    (32, 32, (3, 3), (3, 3), (0, 0), (20, 20)), (128, 64, (3, 3), (1, 1), (1, 1), (12, 12)),
    (64, 32, (1, 1), (2, 2), (0, 0), (15, 15)), (40, 1, (3, 3), (1, 1), (1, 1), (8, 8)),
    (256, 256, (3, 3), (1, 1), (1, 1), (12, 12)), (192, 48, (1, 1), (1, 1), (0, 0), (8, 8)),
]
DTYPES = [("float32", "fp32"), ("float32", "tf32"), ("float16", "tf32"), ("bfloat16", "tf32"),
          ("float16", "fp32")]
BATCHES = (1, 4, 64, 256)

def case(cin, cout, ksize, stride, pad, hw, dt, n, cl, offset, bias):
    (kh, kw), (sh, sw), (ph, pw), (h, w) = ksize, stride, pad, hw
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    xs = (n, h, w, cin) if cl else (n, cin, h, w)
    gs = (n, ho, wo, cout) if cl else (n, cout, ho, wo)
    x, wt, gy = arr(xs, dt, offset), arr((cout, cin, kh, kw), dt), arr(gs, dt, offset)
    b = arr((cout,), dt) if bias else None
    recs = []
    def go(what, f):
        LOG.clear()
        try:
            r = f()
            res = norm(r) if not isinstance(r, tuple) else [norm(a) for a in r]
        except Exception as e:
            res = ["raised", type(e).__name__, str(e)]
        recs.append([what, res, list(LOG)])
    go("kernels", lambda: KERNELS(x, wt, gy, stride, pad, channels_last=cl))
    ws = Workspace()
    kw = dict(channels_last=cl)
    go("forward", lambda: cu.conv2d_forward(x, wt, b, stride, pad, workspace=ws, **kw))
    go("backward_data",
       lambda: cu.conv2d_backward_data(gy, wt, xs, stride, pad, workspace=ws, **kw))
    go("backward_weight",
       lambda: cu.conv2d_backward_weight(x, gy, wt.shape, stride, pad, workspace=ws, **kw))
    go("backward_weight_nows",
       lambda: cu.conv2d_backward_weight(x, gy, wt.shape, stride, pad, **kw))
    if not bias:
        go("forward_stats", lambda: cu.conv2d_forward_stats(x, wt, stride, pad, **kw))
    return recs

def _cases():
    for (dname, prec), shape, n, cl in itertools.product(DTYPES, SHAPES, BATCHES, (False, True)):
        if n == 256 and shape[5][0] * shape[5][1] * shape[0] > 64 * 48 * 48:
            continue  # the large images at batch 64 only
        for offset, bias in itertools.product(*([(0, 1), (False, True)] if n == 4
                                                 else [(0,), (False,)])):
            yield dname, prec, shape, n, cl, offset, bias


def _record_all(out):
    count, native = 0, set()
    with open(out, "w") as fh:
        for dname, prec, shape, n, cl, offset, bias in _cases():
            dt = BFLOAT16 if dname == "bfloat16" else np.dtype(dname)
            cu.runtime.set_precision(prec)
            if (dname, prec) not in native:
                native.add((dname, prec))
                fh.write(json.dumps(["native", dname, prec,
                                     cu.conv2d_channels_last_native(dt)]) + "\n")
            gemm.clear_plans()
            IDS.clear()
            KEEP.clear()
            key = [shape, dname, prec, n, cl, offset, bias]
            fh.write(json.dumps([key, case(*shape, dt, n, cl, offset, bias)]) + "\n")
            count += 1
    return count


# ----------------------------------------------------------------------------- compare

def compare(a, b):
    shapes = passes = diff = reqdiff = 0
    shown = 0
    for la, lb in zip(open(a), open(b)):
        da, db = json.loads(la), json.loads(lb)
        if da[0] == "native":
            if da != db:
                print("native differs", da, db); diff += 1
            continue
        assert da[0] == db[0]
        shapes += 1
        for (wa, ra, loga), (wb, rb, logb) in zip(da[1], db[1]):
            passes += 1
            launches_a = [l for l in loga if l[0] == "launch"]
            launches_b = [l for l in logb if l[0] == "launch"]
            if ra != rb or launches_a != launches_b:
                diff += 1
                if shown < 5:
                    shown += 1
                    print("DIFF", da[0], wa)
                    print(" before", ra, launches_a[:3])
                    print(" after ", rb, launches_b[:3])
                    for x, y in zip(launches_a, launches_b):
                        if x != y:
                            print("  first differing launch:\n   ", x, "\n   ", y); break
            ka = sorted({tuple(map(str, l[1:])) for l in loga if l[0] == "request"})
            kb = sorted({tuple(map(str, l[1:])) for l in logb if l[0] == "request"})
            if ka != kb:
                reqdiff += 1
                if reqdiff <= 3:
                    print("requests differ", da[0], wa, set(ka) ^ set(kb))
    print(f"{shapes} shapes, {passes} passes compared: {diff} differ in launches/results, "
          f"{reqdiff} in kernel requests")


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    else:
        compare(sys.argv[2], sys.argv[3])
