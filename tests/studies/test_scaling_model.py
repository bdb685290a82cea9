"""The scaling model against the committed 1- and 2-GPU measurements, and its arithmetic."""
import pytest

from scaling import model as sm


def _model(**overrides):
    args = sm.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    runs = sm.measured_runs(args.results)
    return sm.Model(sm.fit_compute(runs), sm.fit_link(args.results, args), args), runs


def test_model_matches_the_two_gpu_measurements():
    model, runs = _model()
    rows = [r for r in sm.check_rows(model, runs) if r["gpus"] == 2]
    assert len(rows) >= 4
    errors = sorted(abs(r["error_points"]) for r in rows)
    # Every repeatable run within 5 points; one known outlier run (76.6%, its repeats gave
    # 93.8% and 95.4%) is the only one further off.
    assert sum(e > 5 for e in errors) <= 1, rows
    assert errors[len(errors) // 2] < 5


def test_collective_time_grows_with_ranks_and_hosts():
    model, _ = _model()
    link = model.link
    s = 4 * 2**20
    assert link.collective_s(s, 1) == 0
    assert link.collective_s(s, 2) < link.collective_s(s, 8) < link.collective_s(s, 16)
    # across hosts the slower network and hop apply
    assert link.collective_s(s, 9) - link.collective_s(s, 8) > link.hop_inter_s


def test_overlap_helps_and_bigger_batches_scale_better():
    model, _ = _model()
    assert model.weak(256, 64) > model.weak(256, 64, overlap=False)
    assert model.strong(8192, 8) > model.strong(1024, 8)
    batch = model.batch_for(8)
    assert batch is not None and model.strong(batch, 8) >= 0.9
    assert model.strong(batch // 2, 8) < 0.9


def test_bad_gpu_list_is_one_line_error(capsys):
    from scaling import common

    assert common.run_main("python -m scaling.model", sm.main, ["--gpus", "x"]) == 2
    assert "--gpus" in capsys.readouterr().err


def test_fit_line_needs_two_sizes():
    with pytest.raises(sm.ScalingError):
        sm.fit_line([(1.0, 2.0)])


def test_a_16_bit_all_gather_exposes_less():
    """Half the all-gather's bytes (the parameters' 16-bit copy) never costs time, and saves
    some where the exchange is exposed (no overlap, many ranks)."""
    full, _ = _model()
    half, _ = _model(gather_bytes=2)
    for n in (8, 64, 512):
        assert half.step_s(256, n, overlap=False) < full.step_s(256, n, overlap=False)
        assert half.step_s(256, n) <= full.step_s(256, n)
    assert half.step_s(256, 1) == full.step_s(256, 1)


def test_a_bf16_reduce_scatter_exposes_less():
    """--grad-exchange bf16 (--scatter-bytes 2) halves the reduce-scatters' bytes: never
    slower, faster where the exchange is exposed, the same on one GPU."""
    full, _ = _model(gather_bytes=2)
    half, _ = _model(gather_bytes=2, scatter_bytes=2)
    for n in (8, 64, 512):
        assert half.step_s(256, n, overlap=False) < full.step_s(256, n, overlap=False)
        assert half.step_s(256, n) <= full.step_s(256, n)
    assert half.step_s(256, 1) == full.step_s(256, 1)
