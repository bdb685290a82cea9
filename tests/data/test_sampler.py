"""StrideSampler: N ranks at per-rank batch B together equal one process at batch N*B."""
import numpy as np
import pytest

from dptrain.data import StrideSampler

# (num_samples, per-rank batch): divisible and ragged against every N*B below.
SIZES = [(120, 4), (103, 5), (50, 7)]
WORLDS = [1, 2, 3]


def ranks(num_samples, batch, world, **kw):
    return [StrideSampler(num_samples, batch, world, r, **kw) for r in range(world)]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("num_samples,batch", SIZES)
def test_ranks_union_is_single_process_batch(num_samples, batch, world, drop_last):
    samplers = ranks(num_samples, batch, world, seed=11, drop_last=drop_last)
    single = StrideSampler(num_samples, batch * world, 1, 0, seed=11, drop_last=drop_last)
    for epoch in (0, 1, 5):
        expected = single.epoch_batches(epoch)
        per_rank = [s.epoch_batches(epoch) for s in samplers]
        assert all(b.shape == (len(single), batch) for b in per_rank)
        assert all(len(s) == len(single) for s in samplers)  # same step count everywhere
        merged = np.empty_like(expected)
        for r, b in enumerate(per_rank):
            merged[:, r::world] = b  # re-interleave: rank r held positions r, r+N, ...
        np.testing.assert_array_equal(merged, expected)
        # The formula, spelled out, against the shared permutation.
        perm = samplers[0].permutation(epoch)
        g = batch * world
        for k in range(len(single)):
            if (k + 1) * g <= num_samples:
                np.testing.assert_array_equal(expected[k], perm[k * g:(k + 1) * g])
                for r, b in enumerate(per_rank):
                    np.testing.assert_array_equal(b[k], perm[k * g + r:(k + 1) * g:world])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("num_samples,batch", SIZES)
def test_steps_per_epoch(num_samples, batch, world):
    g = batch * world
    assert len(StrideSampler(num_samples, batch, world, drop_last=True)) == num_samples // g
    assert len(StrideSampler(num_samples, batch, world, drop_last=False)) == -(-num_samples // g)


@pytest.mark.parametrize("world", WORLDS)
def test_drop_last_uses_each_index_at_most_once(world):
    num_samples, batch = 103, 5
    batches = np.concatenate([s.epoch_batches(2).ravel()
                              for s in ranks(num_samples, batch, world, seed=3)])
    assert len(np.unique(batches)) == len(batches) == (103 // (5 * world)) * 5 * world
    assert batches.min() >= 0 and batches.max() < num_samples


@pytest.mark.parametrize("world", WORLDS)
def test_no_drop_last_covers_everything_and_wraps(world):
    num_samples, batch = 103, 5
    samplers = ranks(num_samples, batch, world, seed=3, drop_last=False)
    batches = np.concatenate([s.epoch_batches(0).ravel() for s in samplers])
    assert set(batches.tolist()) == set(range(num_samples))  # every sample seen
    # The padding repeats the start of the permutation, nothing else.
    g = batch * world
    pad = len(samplers[0]) * g - num_samples
    counts = np.bincount(batches, minlength=num_samples)
    perm = samplers[0].permutation(0)
    assert sorted(np.flatnonzero(counts == 2).tolist()) == sorted(perm[:pad].tolist())
    assert counts.max() <= 2


def test_same_permutation_on_every_rank_and_epochs_differ():
    samplers = ranks(1000, 8, 4, seed=5)
    perms = [s.permutation(3) for s in samplers]
    for p in perms[1:]:
        np.testing.assert_array_equal(p, perms[0])
    assert sorted(perms[0].tolist()) == list(range(1000))
    np.testing.assert_array_equal(perms[0], np.random.default_rng([5, 3]).permutation(1000))
    assert (samplers[0].permutation(4) != perms[0]).any()
    assert (StrideSampler(1000, 8, 4, 0, seed=6).permutation(3) != perms[0]).any()
    # Ranks get different samples at the same step.
    assert not set(samplers[0].epoch_batches(0)[0]) & set(samplers[1].epoch_batches(0)[0])


def test_no_shuffle_is_in_order():
    s = StrideSampler(12, 2, 2, 1, shuffle=False)
    np.testing.assert_array_equal(s.epoch_batches(0), [[1, 3], [5, 7], [9, 11]])
    np.testing.assert_array_equal(s.epoch_batches(7), s.epoch_batches(0))


def test_dtype_and_layout():
    b = StrideSampler(100, 4, 3, 2).epoch_batches(0)
    assert b.dtype == np.int64 and b.flags.c_contiguous


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_samples=0, batch_size=1), "num_samples"),
    (dict(num_samples=-5, batch_size=1), "num_samples"),
    (dict(num_samples=10, batch_size=0), "batch_size"),
    (dict(num_samples=10, batch_size=2.0), "batch_size"),
    (dict(num_samples=10, batch_size=1, world_size=0), "world_size"),
    (dict(num_samples=10, batch_size=1, world_size=2, rank=2), "rank"),
    (dict(num_samples=10, batch_size=1, world_size=2, rank=-1), "rank"),
    (dict(num_samples=10, batch_size=11), "larger than the dataset"),
    (dict(num_samples=10, batch_size=4, world_size=3), "larger than the dataset"),
    (dict(num_samples=10, batch_size=4, world_size=3, drop_last=False), "larger than the dataset"),
    (dict(num_samples=10, batch_size=1, seed=-1), "seed"),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StrideSampler(**kwargs)


def test_bad_epoch():
    with pytest.raises(ValueError, match="epoch"):
        StrideSampler(10, 2).epoch_batches(-1)
