"""The `--bucket-mb auto` rule (dptrain.distributed.buckets) and the smaller first bucket."""
import numpy as np

from dptrain.distributed import buckets
from dptrain.distributed.flat import FlatParameters
from dptrain.engine.autograd import Tensor

MB = 2**20


def test_one_rank_exposes_nothing():
    assert buckets.exposed_s([MB] * 4, [1e-3, 2e-3, 3e-3, 4e-3], MB, MB, 1) == 0.0


def test_exposed_time_is_the_tail_after_backward():
    # two 1 MB gradients ready at 1 and 2 ms, one bucket each, 2 ranks on a 1 GB/s link:
    # each reduce-scatter takes alpha + 0.5 MB / 1 GB/s; the second ends after backward
    alpha, bus = 1e-5, 1e9
    one = alpha + 0.5 * MB / bus
    got = buckets.exposed_s([MB, MB], [1e-3, 2e-3], MB, MB, 2, alpha, bus)
    assert np.isclose(got, max(1e-3 + one, 2e-3) + one - 2e-3)
    # one bucket of both: it starts only when backward ends
    both = buckets.exposed_s([MB, MB], [1e-3, 2e-3], 2 * MB, 2 * MB, 2, alpha, bus)
    assert np.isclose(both, alpha + MB / bus)


def test_plan_splits_when_backward_is_slow_and_merges_when_latency_dominates():
    sizes = [MB // 4] * 64  # 16 MB in 64 parameters
    first, body, cost = buckets.plan(sizes, 2, backward_s=50e-3, alpha_s=1e-6, bus=100e9)
    assert body < 16 * MB and first <= body and cost < 1e-3  # backward hides all but a tail
    _, body_lat, _ = buckets.plan(sizes, 2, backward_s=1e-6, alpha_s=1e-3, bus=1e15)
    assert body_lat >= 16 * MB  # each collective costs 1 ms fixed: one bucket is best
    # the plan is never worse than any fixed size it considered
    ready = list(np.cumsum([50e-3 / 64] * 64))
    for size in (buckets.MIN_BYTES, 4 * MB, 16 * MB):
        assert cost <= buckets.exposed_s(sizes, ready, size, size, 2, 1e-6, 100e9) + 1e-12


def test_measured_defaults_plan_the_reference_cnn():
    from dptrain.nn import build_model

    params = list(build_model("cnn", (1, 48, 48), 7).parameters())
    first, body, cost = buckets.plan([p.size * 4 for p in reversed(params)], 2)
    assert buckets.MIN_BYTES <= first <= body and cost >= 0


def test_first_bucket_is_cut_smaller():
    params = [Tensor(np.ones(1000, np.float32), requires_grad=True) for _ in range(6)]
    flat = FlatParameters(params, 2, bucket_bytes=3 * 4096, first_bucket_bytes=4096)
    # backward order: the last parameter first, alone in the first bucket
    assert flat.buckets[0].params == [params[-1]]
    assert [len(b.params) for b in flat.buckets[1:]] == [3, 2]
