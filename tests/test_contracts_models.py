"""The reward, critic and policy suites (real GX, ephemeral context) on made-up probe frames: a
passing frame and failing ones per suite, the failure message naming suite, rule, column and
rows; and a gate's Data Docs, downloaded from its MLflow run, rendered in headless Chromium."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from html import unescape
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from data_contracts import ContractError, gate, validate
from stages.leaves.config import PipelineConfig
from stages.orchestration import tracking
from stages.orchestration.config_loading import load_config

DEMO, TINY, DEFAULTS = load_config("demo"), load_config("tiny"), PipelineConfig()


def _rules(report) -> dict[tuple[str, str | None], object]:
    return {(f.rule, f.column): f for f in report.failures}


def _message(stage: str, suite: str, frame: pd.DataFrame) -> str:
    with pytest.raises(ContractError) as err:
        gate(stage, {suite: frame}, DEMO)
    return str(err.value)


# -- reward ------------------------------------------------------------------------------------


def _reward_probe(n=16, wrong=()):
    """Held-out pairs at rows 201…; the pairs at the indices in `wrong` are ranked the wrong way."""
    r_chosen = np.linspace(-1.0, 1.0, n)
    margin = np.where(np.isin(np.arange(n), list(wrong)), -0.5, 0.5)
    return pd.DataFrame({"row": range(201, 201 + n), "r_chosen": r_chosen, "r_rejected": r_chosen - margin,
                         "margin": margin})


def test_reward_contract_passes_a_model_that_ranks():
    probe = _reward_probe(wrong=range(4))  # accuracy 0.75
    assert validate("reward", probe, DEMO).success and validate("reward", probe, DEFAULTS).success


def test_reward_contract_fails_below_the_accuracy_threshold():
    report = validate("reward", _reward_probe(wrong=range(12)), DEMO)  # accuracy 0.25
    assert list(_rules(report)) == [("expect_column_mean_to_be_between", "correct")]
    message = _message("reward", "reward", _reward_probe(wrong=range(12)))
    assert "suite 'reward' failed: expect_column_mean_to_be_between on column 'correct'" in message
    assert "observed 0.25; min_value=0.5" in message


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # std with an inf
def test_reward_contract_fails_on_non_finite_and_constant_scores():
    probe = _reward_probe()
    probe.loc[2, "r_chosen"], probe.loc[5, "r_rejected"] = math.nan, math.inf
    rules = _rules(validate("reward", probe, TINY))  # finiteness is checked in the tiny preset too
    assert [e["row"] for e in rules[("expect_column_values_to_not_be_null", "r_chosen")].examples] == [203]
    assert [e["row"] for e in rules[("expect_column_values_to_be_between", "r_rejected")].examples] == [206]
    message = _message("reward", "reward", probe)
    assert "expect_column_values_to_not_be_null on column 'r_chosen': 1 of 16 rows unexpected; e.g. row 203" in message
    assert "on column 'r_rejected': 1 of 16 rows unexpected" in message and "row 206: r_rejected=inf" in message

    constant = _reward_probe().assign(r_chosen=0.3, r_rejected=0.3, margin=0.0)
    rules = _rules(validate("reward", constant, TINY))
    assert {("expect_column_stdev_to_be_between", "r_chosen"), ("expect_column_stdev_to_be_between", "r_rejected"),
            } <= set(rules)


# -- critic ------------------------------------------------------------------------------------


def _critic_probe(n=8, value_loss=0.72, explained_variance=-1.6):
    """Held-out rollouts at rows 401…, by default as the demo's under-trained critic."""
    return pd.DataFrame({"row": range(401, 401 + n), "response_tokens": 30, "score": 0.2, "values_mean": 0.1,
                         "returns_mean": 0.3, "value_loss": value_loss, "explained_variance": explained_variance})


def test_critic_contract_passes_the_demo_critic():
    assert validate("critic", _critic_probe(), DEMO).success
    assert not validate("critic", _critic_probe(), DEFAULTS).success  # not a trained critic


def test_critic_contract_fails_on_high_value_loss_and_low_explained_variance():
    probe = _critic_probe(value_loss=5.0, explained_variance=-8.0)
    rules = _rules(validate("critic", probe, DEMO))
    assert set(rules) == {("expect_column_mean_to_be_between", "value_loss"),
                          ("expect_column_values_to_be_between", "explained_variance")}
    message = _message("critic", "critic", probe)
    assert "suite 'critic' failed" in message and "on column 'value_loss' (observed 5.0; max_value=2.0)" in message
    assert ("expect_column_values_to_be_between on column 'explained_variance': 8 of 8 rows unexpected "
            "(min_value=-5.0, max_value=1.0); e.g. row 401: explained_variance=-8.0") in message
    assert validate("critic", probe, TINY).success  # the tiny preset judges finiteness only


def test_critic_contract_fails_on_nan_values_and_infinite_returns():
    probe = _critic_probe()
    probe.loc[2, "values_mean"], probe.loc[6, "returns_mean"] = math.nan, -math.inf
    rules = _rules(validate("critic", probe, TINY))
    assert [e["row"] for e in rules[("expect_column_values_to_not_be_null", "values_mean")].examples] == [403]
    assert [e["row"] for e in rules[("expect_column_values_to_be_between", "returns_mean")].examples] == [407]
    assert "row 407: returns_mean=-inf" in _message("critic", "critic", probe)


# -- policy ------------------------------------------------------------------------------------


def _policy_probe(n=8, tokens=34, eos=6, kl=0.025, perplexity=5.0):
    """Final held-out responses at rows 301…, beside the SFT policy's means (38.6 tokens, perplexity
    5.5); by default as the demo's policy: shorter, more EOS, barely moved."""
    return pd.DataFrame({"row": range(301, 301 + n), "response_tokens": tokens,
                         "ended_with_eos": [i < eos for i in range(n)], "kl": kl, "perplexity": perplexity,
                         "score": 0.1, "sft_response_tokens_mean": 38.6, "sft_perplexity_mean": 5.5})


def test_policy_contract_passes_the_demo_policy():
    assert validate("policy", _policy_probe(), DEMO).success
    assert validate("policy", _policy_probe(), DEFAULTS).success


def test_policy_contract_fails_on_a_collapsed_policy():
    collapsed = _policy_probe(tokens=1, eos=0, kl=40.0, perplexity=1.0)  # one token, always the same
    rules = _rules(validate("policy", collapsed, DEMO))
    assert {("expect_column_mean_to_be_between", "kl"), ("expect_column_mean_to_be_between", "length_ratio"),
            ("expect_column_mean_to_be_between", "perplexity_ratio"),
            ("expect_column_values_to_be_in_set", "ended_with_eos")} == set(rules)
    message = _message("ppo", "policy", collapsed)
    assert "contract gate after 'ppo': suite 'policy' failed" in message
    assert "on column 'kl' (observed 40.0; max_value=5.0)" in message
    assert "on column 'length_ratio' (observed 0.0259" in message and "min_value=0.3, max_value=3.0" in message
    assert "on column 'ended_with_eos': 8 of 8 rows unexpected" in message and "row 301: ended_with_eos=False" in message

    rambling = _policy_probe(tokens=160, perplexity=30.0)  # 4× longer, 5× more perplexed than SFT
    assert set(_rules(validate("policy", rambling, DEMO))) == {
        ("expect_column_mean_to_be_between", "length_ratio"), ("expect_column_mean_to_be_between", "perplexity_ratio")}
    assert validate("policy", collapsed, TINY).success  # the tiny preset judges finiteness only


def test_policy_contract_fails_on_nan_kl_infinite_perplexity_and_a_missing_baseline():
    probe = _policy_probe()
    probe.loc[3, "kl"], probe.loc[4, "perplexity"] = math.nan, math.inf
    rules = _rules(validate("policy", probe, TINY))
    assert [e["row"] for e in rules[("expect_column_values_to_not_be_null", "kl")].examples] == [304]
    assert [e["row"] for e in rules[("expect_column_values_to_be_between", "perplexity")].examples] == [305]
    assert "row 304: kl=None" in _message("ppo", "policy", probe)

    report = validate("policy", _policy_probe().drop(columns="sft_perplexity_mean"), DEMO)
    assert (report.failures[0].rule, report.failures[0].column) == ("expect_column_to_exist", "sft_perplexity_mean")


# -- Data Docs in a browser --------------------------------------------------------------------


def _chromium(page: Path, png: Path) -> str:
    """Screenshot `page` with headless Chromium and return its DOM. The network is off (the CDN
    scripts and stylesheets of Data Docs fail at once), as for a reader offline."""
    browser = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP * ~NOTFOUND"]
    subprocess.run([*browser, f"--screenshot={png}", "--window-size=1200,900", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    assert png.stat().st_size > 0
    return subprocess.run([*browser, "--dump-dom", page.as_uri()], check=True, capture_output=True, text=True,
                          timeout=120).stdout


def _text(dom: str) -> str:
    """What a reader sees: the DOM without scripts, styles and tags, whitespace collapsed."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", body)).split())


def _non_trivial(png: Path) -> bool:
    """More than a blank page: many colours (anti-aliased text); without PIL, a PNG too large for one colour."""
    try:
        from PIL import Image
    except ImportError:
        return png.stat().st_size > 10_000
    colours = Image.open(png).convert("RGB").getcolors(maxcolors=1 << 16)
    return colours is None or len(colours) > 10


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs the chromium browser")
def test_data_docs_from_the_mlflow_run_render_in_chromium(tmp_path):
    client = tracking.client()
    run_id = client.create_run(tracking.experiment_id(client, "contracts-docs-test")).info.run_id
    warn = load_config("demo", ["contracts.mode=warn"])
    gate("reward", {"reward": _reward_probe(wrong=range(12))}, warn, mlflow_client=client, run_id=run_id)
    docs = tracking.download(f"runs:/{run_id}/contracts/data_docs/reward")
    (page,) = (docs / "validations").rglob("*.html")

    index = _chromium(docs / "index.html", tmp_path / "index.png")
    assert _non_trivial(tmp_path / "index.png")
    # The index table is drawn by CDN scripts; its rows (suite, result, link) are in the page itself.
    assert "Data Docs" in _text(index) and "'_expectation_suite_name_sort': 'reward'" in index
    assert page.relative_to(docs).as_posix() in index

    validation = _chromium(page, tmp_path / "validation.png")
    assert _non_trivial(tmp_path / "validation.png")
    text = _text(validation)
    assert "Expectation Suite: reward" in text and "Status: Failed" in text
    assert "Unsuccessful Expectations 1" in text
    assert "correct Status Expectation Observed Value mean must be greater than or equal to 0.5" in text
    assert "standard deviation must be greater than or equal to 0.001" in text
