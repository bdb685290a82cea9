"""TF32 GEMM in the x @ W^T layout: our wgmma kernel against cuBLAS TF32 (through PyTorch) and
our older mma.sync kernel, with an fp64 accuracy check; run from the repository root on a
Hopper GPU: PYTHONPATH=. python3 scaling/gemm_tf32.py (the BENCHMARKS.md figures came from it)."""
import os, statistics, sys, traceback
import numpy as np, cupy as cp, torch
from dptrain.backend import cuda_matmul as cm

cm.set_precision("tf32")
torch.backends.cuda.matmul.allow_tf32 = True
dev = cp.cuda.Device()
print("device", torch.cuda.get_device_name(0), "cc", dev.compute_capability, flush=True)

def tm(fn, warm=3, rep=15):
    for _ in range(warm): fn()
    s, e = cp.cuda.Event(), cp.cuda.Event(); ts = []
    for _ in range(rep):
        s.record(); fn(); e.record(); e.synchronize(); ts.append(cp.cuda.get_elapsed_time(s, e))
    return statistics.median(ts)

def diag():
    m, n, k = 1408, 3072, 32
    a = cp.random.standard_normal((m, k), dtype=cp.float32)
    b = cp.zeros((n, k), cp.float32); idx = cp.arange(n); b[idx, idx % k] = 1
    out = cm.matmul(a, b, False, True); cp.cuda.runtime.deviceSynchronize()
    A, O = cp.asnumpy(a), cp.asnumpy(out)
    print("diag kernel", cm.matmul_kernel(a, b, False, True), "nan", np.isnan(O).sum(), flush=True)
    bad = 0
    for mm in list(range(0, 20)) + [63, 64, 65, 127]:
        for nn in list(range(0, 12)) + [31, 32, 33, 255]:
            want = A[mm, nn % k]; got = O[mm, nn]
            if abs(got - want) > 1e-2 * max(1, abs(want)):
                bad += 1
                if bad <= 25:
                    w = np.argwhere(np.abs(A - got) <= 1e-3 * max(1, abs(got)))
                    print(f"  C[{mm},{nn}] want A[{mm},{nn%k}]={want:.4f} got {got:.4f} ~ A at {w[:3].tolist()}")
    print("diag bad", bad, flush=True)

rows = []
for size in (4096, 8192):
    m = n = k = size
    a = cp.random.standard_normal((m, k), dtype=cp.float32)
    b = cp.random.standard_normal((n, k), dtype=cp.float32)
    c = cp.full((m, n), cp.nan, cp.float32)
    ta, tb = torch.as_tensor(a, device="cuda"), torch.as_tensor(b, device="cuda")
    ref = ta.double() @ tb.double().T if size == 4096 else None
    fl = 2.0 * m * n * k
    os.environ.pop("DPTRAIN_WGMMA", None); cm._PLANS.clear()
    kern = cm.matmul_kernel(a, b, False, True)
    try:
        cm.matmul(a, b, False, True, out=c); cp.cuda.runtime.deviceSynchronize()
        if ref is not None:
            ct = torch.as_tensor(c, device="cuda").double()
            err = (torch.linalg.norm(ct - ref) / torch.linalg.norm(ref)).item()
            print(f"{size}: {kern} rel err vs fp64 {err:.3g}, nan {int(torch.isnan(ct).sum())}", flush=True)
            if not err < 5e-3:
                diag()
        t_w = tm(lambda: cm.matmul(a, b, False, True, out=c))
    except Exception:
        traceback.print_exc(); t_w = float("nan")
    t_cb = tm(lambda: ta @ tb.T)
    os.environ["DPTRAIN_WGMMA"] = "0"; cm._PLANS.clear()
    t_old = tm(lambda: cm.matmul(a, b, False, True, out=c), rep=5)
    os.environ.pop("DPTRAIN_WGMMA"); cm._PLANS.clear()
    rows.append((size, kern, t_w, fl / t_w / 1e9, t_cb, fl / t_cb / 1e9, t_old, fl / t_old / 1e9))
    del ref

print("\n| n (a @ b^T) | kernel | ours ms | ours TFLOP/s | cuBLAS TF32 ms | cuBLAS TFLOP/s | % cuBLAS | old mma.sync ms (TFLOP/s) |")
print("|---|---|---|---|---|---|---|---|")
for s, kern, tw, fw, tc, fc, to, fo in rows:
    print(f"| {s} | {kern} | {tw:.3f} | {fw:.0f} | {tc:.3f} | {fc:.0f} | {100*fw/fc:.0f} % | {to:.3f} ({fo:.0f}) |")
