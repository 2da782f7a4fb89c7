"""The engine model fitted to replicas' step logs (threefold/sim/step_fit.py, `--calibration-from-step-log`)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from threefold.engine.step_log import LoggedStep, read_step_log
from threefold.errors import ThreefoldError
from threefold.sample.params import SamplingParams
from threefold.sim.engine_model import EngineModel, attention_pairs
from threefold.sim.step_fit import calibrate_from_step_logs, fit_steps, nnls


def _truth() -> EngineModel:
    """A known engine: the profile carries each knot's own attention, as a calibration's does."""
    cost = {1: 0.02, 16: 0.03, 128: 0.1, 512: 0.45, 1024: 0.95, 1536: 1.45, 2048: 2.0}
    attention = 3e-7
    profile = {k: c + attention * attention_pairs(k) for k, c in cost.items()}
    return EngineModel(profile, 2e-7, 5e-8, attention, num_blocks=999, max_num_batched_tokens=2048)


def _shapes(rng: random.Random, count: int) -> list[tuple[tuple[int, int], ...]]:
    """Steps as a serving replica runs them: decodes alone, fresh prompts, later turns' chunks after a
    cached prefix, several chunks in one step, decodes beside a chunk."""
    shapes = []
    for _ in range(count):
        decodes = [(1, rng.randint(5, 1500)) for _ in range(rng.choice((0, 1, 3, 16, 40)))]
        chunks = [(rng.randint(2, 2000 // 3), rng.choice((0, 0, rng.randint(16, 1000))))
                  for _ in range(rng.choice((0, 0, 1, 1, 1, 2, 3)))]
        if rng.random() < 0.2:
            chunks = [(rng.randint(1200, 2048 - len(decodes)), 0)]
        shapes.append(tuple(decodes + chunks) or ((1, 100),))
    return shapes


def _log(path, steps: list[LoggedStep]) -> None:
    path.write_text("".join(json.dumps([s.time, s.seconds, [list(p) for p in s.shape]]) + "\n" for s in steps))


def _known_steps(count: int = 400) -> list[LoggedStep]:
    truth = _truth()
    shapes = [((2048, 0),), *_shapes(random.Random(0), count)]  # one full step: the last knot's own value
    return [LoggedStep(float(i), truth.shape_seconds(shape), shape) for i, shape in enumerate(shapes)]


def test_a_log_made_from_a_known_model_is_fitted_back_to_it():
    truth, steps = _truth(), _known_steps()
    model = fit_steps(steps, truth)
    assert model.per_context_s == pytest.approx(truth.per_context_s, rel=1e-6)
    assert model.per_prefill_context_s == pytest.approx(truth.per_prefill_context_s, rel=1e-6)
    assert model.prefill_attention_s == pytest.approx(truth.prefill_attention_s, rel=1e-6)
    assert model.token_profile == pytest.approx(truth.token_profile, rel=1e-6)
    assert (model.num_blocks, model.max_num_batched_tokens) == (999, 2048)  # the rest from the base
    for shape in _shapes(random.Random(1), 50):  # steps it never saw
        assert model.shape_seconds(shape) == pytest.approx(truth.shape_seconds(shape), rel=1e-6)
    # the log reaches 2,048 tokens: every knot of the calibration's grid, none invented past it
    short = [s for s in steps if sum(n for n, _ in s.shape) <= 1100]
    assert sorted(fit_steps(short).token_profile) == [1, 16, 128, 512, 1024]


def test_nnls_keeps_prices_non_negative_and_solves_the_free_problem():
    rng = random.Random(2)
    a = np.array([[rng.random(), 1e-6 * rng.random(), 1.0] for _ in range(30)])
    x = np.array([0.5, 2e5, 0.01])
    assert nnls(a, a @ x) == pytest.approx(x, rel=1e-8)
    b = a @ np.array([0.5, -2e5, 0.01])  # the best fit wants a negative price: it gets 0
    solved = nnls(a, b)
    assert solved[1] == 0.0 and (solved >= 0).all()


def test_bad_step_logs_get_a_clear_error(tmp_path):
    with pytest.raises(ThreefoldError, match="not found"):
        calibrate_from_step_logs([tmp_path / "missing.jsonl"])
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ThreefoldError, match="has no steps"):
        calibrate_from_step_logs([tmp_path / "empty.jsonl"])
    for bad in ('{"not": "a step"}\n', "[1.0, 0.1, [[5, 0]]]\nnot json\n", "[1.0, 0.1]\n"):
        (tmp_path / "bad.jsonl").write_text(bad)
        with pytest.raises(ThreefoldError, match="not a threefold step log"):
            calibrate_from_step_logs([tmp_path / "bad.jsonl"])
    short = [s for s in _known_steps() if sum(n for n, _ in s.shape if n > 1) < 400]
    _log(tmp_path / "short.jsonl", short)
    with pytest.raises(ThreefoldError, match=r"0 steps with a prefill of 512\+ tokens"):
        calibrate_from_step_logs([tmp_path / "short.jsonl"])
    with pytest.raises(ThreefoldError, match="needs at least"):
        calibrate_from_step_logs([tmp_path / "short.jsonl"])
    with pytest.raises(ThreefoldError, match="no step logs"):
        calibrate_from_step_logs([])


def test_simulate_calibrates_from_step_logs(tmp_path, capsys):
    from threefold.cli import main as cli_main

    steps = _known_steps()
    _log(tmp_path / "a.jsonl", steps[:200])
    _log(tmp_path / "b.jsonl", steps[200:])
    _truth().save(tmp_path / "pool.json")
    args = ["simulate", "--instances", "2", "--policy", "round_robin", "--trace", "sessions", "--rates", "0.1",
            "--requests-per-instance", "6", "--bisect-steps", "0", "--out", str(tmp_path / "out")]
    assert cli_main([*args, "--calibration-from-step-log", str(tmp_path / "a.jsonl")]) == 2
    assert "also needs --calibration FILE" in capsys.readouterr().err
    logs = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"
    assert cli_main([*args, "--calibration", str(tmp_path / "pool.json"), "--calibration-from-step-log", logs]) == 0
    fitted = EngineModel.load(tmp_path / "out" / "engine_model.json")
    assert fitted.prefill_attention_s == pytest.approx(_truth().prefill_attention_s, rel=1e-6)
    assert fitted.source.startswith("step logs: ") and fitted.num_blocks == 999
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "a.jsonl" in report["calibration"] and len(report["runs"]) == 1


def test_a_real_engines_step_log_gives_a_model_that_prices_its_steps(make_llm, tmp_path):
    path = tmp_path / "steps.jsonl"
    llm = make_llm(step_log=str(path))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)  # 5 decode steps each: 20 in all
    for k, long in enumerate((520, 560, 600)):  # a long prompt beside a short one, then their decodes
        first = 1000 * (k + 1)
        prompts = [list(range(first, first + long)), list(range(first + 900, first + 940 + 30 * k))]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    # a later turn: the first prompt again with 100 more tokens, a chunk after its cached prefix
    llm.generate([{"prompt_token_ids": list(range(1000, 1520)) + list(range(50, 150))}], params)
    llm.close()
    steps = read_step_log(path)
    model = fit_steps(steps)
    drift = model.drift(steps)  # (a busy machine's noisy steps move it by a few percent)
    assert drift["all"]["ratio"] == pytest.approx(1.0, abs=0.05)
    assert drift["prefill >= 512"]["steps"] == 3 and drift["prefill >= 512"]["ratio"] == pytest.approx(1.0, abs=0.15)
    assert drift["decode only"]["ratio"] == pytest.approx(1.0, abs=0.15)
    assert model.prefill_seconds(600) > model.prefill_seconds(100) > 0
