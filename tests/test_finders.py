"""Before a run: the batch-size finder, the learning-rate range test, learning-rate scaling and the global batch."""

import json
import math
from itertools import pairwise
from pathlib import Path

import pytest
from PIL import Image

from difftune.cli import main
from difftune.config import load_config
from difftune.errors import DifftuneError
from difftune.training.finders import batch_and_accumulation, largest_fitting, suggest_learning_rate
from difftune.training.metrics import read_metrics
from difftune.training.optim import learning_rate_scale
from difftune.training.resolved import with_accumulation
from difftune.training.train import train


def _job_file(config, tmp_path):
    """The job as a TOML file with a comment, as users keep them."""
    path = tmp_path / "job.toml"
    path.write_text("# my job: keep this comment\n" + config.to_toml(), encoding="utf-8")
    return path


def test_largest_fitting_doubles_then_bisects():
    tried = []

    def fits(size):
        tried.append(size)
        return size <= 11

    assert largest_fitting(fits, 64) == 11
    assert tried == [1, 2, 4, 8, 16, 12, 10, 11]
    tried.clear()
    assert largest_fitting(lambda size: tried.append(size) or True, 20) == 20
    assert tried == [1, 2, 4, 8, 16, 20]
    assert largest_fitting(lambda size: False, 64) == 0


def test_batch_and_accumulation_reach_the_global_batch():
    assert batch_and_accumulation(12, 0, 1) == {
        "batch_size": 12,
        "gradient_accumulation_steps": 1,
        "global_batch_size": 12,
    }
    # 12 fits, but 8 is the largest batch that divides 32 evenly.
    assert batch_and_accumulation(12, 32, 1) == {
        "batch_size": 8,
        "gradient_accumulation_steps": 4,
        "global_batch_size": 32,
    }
    assert batch_and_accumulation(5, 24, 2) == {
        "batch_size": 4,
        "gradient_accumulation_steps": 3,
        "global_batch_size": 24,
    }
    assert batch_and_accumulation(64, 16, 1) == {
        "batch_size": 16,
        "gradient_accumulation_steps": 1,
        "global_batch_size": 16,
    }
    with pytest.raises(DifftuneError, match="not a multiple of the 3 process"):
        batch_and_accumulation(4, 16, 3)


@pytest.mark.slow
def test_find_batch_runs_real_trials_and_writes_the_job(make_config, tmp_path, capsys):
    config = make_config()
    job = _job_file(config, tmp_path)
    assert main(["find-batch", "--config", str(job), "--max-batch", "3", "--write"]) == 0
    result = json.loads(capsys.readouterr().out)  # stdout is the JSON line alone
    assert [trial["batch_size"] for trial in result["trials"]] == [1, 2, 3]
    assert all(trial["fits"] and trial["peak_bytes"] > 100 * 2**20 for trial in result["trials"])
    assert result["batch_size"] == result["largest_batch_size"] == 3
    assert load_config(job).train.batch_size == 3
    assert job.read_text().startswith("# my job: keep this comment\n")
    assert not (tmp_path / "run").exists()  # the probes trained elsewhere


@pytest.mark.slow
def test_find_batch_on_the_default_job_stops_at_what_the_data_holds(capsys):
    """The default job's 16 images hold no batch of 32: the search stops at 16 and says that the data, not memory,
    set the limit (before, the trial's refusal ended the search in an error)."""
    job = Path(__file__).parents[1] / "configs" / "tiny_lora.toml"
    assert main(["find-batch", "--config", str(job), "--steps", "1"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["largest_batch_size"] == result["batch_size"] == 16 and result["limited_by"] == "data"
    assert [trial["batch_size"] for trial in result["trials"]] == [1, 2, 4, 8, 16]  # 32 ended before any work
    assert "batch 32: more than the data holds (at most 16)" in captured.err
    assert "the data, not memory, sets the limit" in captured.err


@pytest.mark.slow
def test_find_batch_says_when_nothing_fits(make_config, tmp_path, capsys):
    job = _job_file(make_config(), tmp_path)
    before = job.read_text()
    assert main(["find-batch", "--config", str(job), "--max-memory-gb", "0.01", "--write"]) == 2
    assert "batch size 1 does not fit" in capsys.readouterr().err
    assert job.read_text() == before


@pytest.mark.slow
def test_find_batch_reports_a_trial_that_fails_for_another_reason(make_config, tmp_path, capsys):
    job = _job_file(make_config(), tmp_path)
    assert main(["find-batch", "--config", str(job), f"model.base={tmp_path / 'missing'}"]) == 2
    err = capsys.readouterr().err
    assert "trial at batch size 1 failed" in err and "model.base" in err


def test_find_batch_needs_a_size_to_try(capsys):
    assert main(["find-batch", "--max-batch", "0"]) == 2
    assert "--max-batch and --steps must be 1 or more, got 0 and 2" in capsys.readouterr().err


def test_write_needs_a_config_file(capsys):
    assert main(["find-lr", "--write"]) == 2
    assert "--write needs --config" in capsys.readouterr().err


def test_suggestion_on_a_known_curve():
    rates = [10 ** (-6 + 5 * i / 49) for i in range(50)]  # 1e-6 .. 1e-1
    # A valley at 1e-2 in log space, then a steep rise.
    smoothed = [1 + (math.log10(rate) + 2) ** 2 for rate in rates]
    result = suggest_learning_rate(rates, smoothed, diverged=False)
    assert result["min_loss_lr"] == pytest.approx(1e-2, rel=0.15)
    assert result["suggested_lr"] == pytest.approx(result["min_loss_lr"] / 10)
    assert "raise --end-lr" in result["note"]
    # A low first value is noise, not the minimum: the first tenth of the sweep is not searched.
    assert suggest_learning_rate(rates, [0.5] + smoothed[1:], diverged=True)["min_loss_lr"] == result["min_loss_lr"]


@pytest.mark.slow
def test_find_lr_sweeps_until_divergence_and_leaves_the_job_alone(make_config, tmp_path, capsys):
    config = make_config(optim__scale_lr="linear")  # batch 2: the suggestion is written halved
    job = _job_file(config, tmp_path)
    out = tmp_path / "lr"
    assert (
        main(
            [
                "find-lr",
                "--config",
                str(job),
                "--steps",
                "40",
                "--start-lr",
                "1e-5",
                "--end-lr",
                "1000",
                "--out",
                str(out),
                "--write",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["diverged"] and result["steps_run"] < 40
    assert 1e-5 <= result["suggested_lr"] <= 1000
    assert result["suggested_lr"] == pytest.approx(result["min_loss_lr"] / 10)
    assert result["learning_rate"] == pytest.approx(result["suggested_lr"] / 2)
    curve = json.loads((out / "lr_range.json").read_text())
    ratios = [b / a for a, b in pairwise(curve["lrs"])]
    assert ratios == pytest.approx([(1000 / 1e-5) ** (1 / 39)] * len(ratios))  # exponential
    assert len(curve["losses"]) == len(curve["smoothed_losses"]) == result["steps_run"]
    with Image.open(out / "lr_range.png") as plot:
        assert plot.size[0] > 300 and plot.size[1] > 200
    assert load_config(job).optim.learning_rate == pytest.approx(result["learning_rate"])
    assert not (tmp_path / "run").exists()


def test_learning_rate_scale_rules():
    assert learning_rate_scale("none", 32) == 1
    assert learning_rate_scale("linear", 32) == 32
    assert learning_rate_scale("sqrt", 16) == 4


def test_global_batch_size_sets_the_accumulation_and_scales_the_rate(make_config, tmp_path):
    config = make_config(train__max_steps=2, train__global_batch_size=8, optim__scale_lr="sqrt")
    train(config)
    metrics = read_metrics(tmp_path / "run")
    assert [line["lr"] for line in metrics] == pytest.approx([1e-3 * math.sqrt(8)] * 2)
    saved = load_config(tmp_path / "run" / "config.toml")  # the resolved config re-runs as it ran
    assert (saved.train.gradient_accumulation_steps, saved.train.global_batch_size) == (4, 0)


def test_global_batch_size_is_checked(make_config):
    with pytest.raises(DifftuneError, match="leave train.gradient_accumulation_steps"):
        make_config(train__global_batch_size=8, train__gradient_accumulation_steps=2)
    with pytest.raises(DifftuneError, match="not a multiple of train.batch_size 2"):
        make_config(train__global_batch_size=5)
    with pytest.raises(DifftuneError, match=r"2 x 3 process\(es\) = 6"):
        with_accumulation(make_config(train__global_batch_size=8), num_processes=3)
