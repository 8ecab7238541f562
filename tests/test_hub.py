"""Data sets from the Hugging Face Hub, tested like the hub with no network: a loopback stand-in
(tests/hub_standin.py) serves a copy of the hub mirror (HF_ENDPOINT points at it). The demo's data
stage downloads HH-RLHF through it into an empty Hugging Face cache, runs again from that cache with
the stand-in stopped and HF_HUB_OFFLINE=1, and with neither the hub nor a cached copy stops in one
line that names the data set, where it looked and both fixes; C-Eval the same way. The rows, the
lineage's commit and the files' digests are the mirror's."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HUB_MIRROR
from hub_standin import HubStandIn
from stages.compute.loading import DataError, locate, split_patterns
from stages.orchestration import lineage
from stages.orchestration.config_loading import load_config
from stages.pipeline.data import load_pairs, make_splits, splits_digest

HH_PATH = "harmless-base/test.jsonl.gz"
CEVAL_SUBJECTS = ["law", "physician"]
HUB_VARIABLES = ("RLHF_DATA_DIR", "HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


@pytest.fixture(scope="module")
def hub(hh_file, tmp_path_factory):
    """The stand-in serving a copy of the mirror (never the mirror itself)."""
    copy = tmp_path_factory.mktemp("hub") / "hub-mirror"
    shutil.copytree(HUB_MIRROR, copy)
    with HubStandIn(copy) as standin:
        yield standin


def _env(cache: Path, **extra: str) -> dict[str, str]:
    """A user's environment: no RLHF_DATA_DIR, the Hugging Face cache at `cache`, `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in HUB_VARIABLES and not k.startswith("PREFECT_API")}
    return {**env, "HF_HOME": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def _rlhf(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "run", "--preset", "demo", "--stages", "data", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def _data_run(out: subprocess.CompletedProcess):
    assert out.returncode == 0, out.stderr[-3000:]
    run_id = re.search(r"Pipeline run (\w+) finished", out.stdout).group(1)
    (data,) = lineage.stage_runs(run_id)
    return data.data


def _mirror_digest(repo: str, path: str) -> str:
    return hashlib.sha256((HUB_MIRROR / "datasets" / repo / path).read_bytes()).hexdigest()


def _assert_one_line_with_both_fixes(out: subprocess.CompletedProcess, repo: str, cache: Path) -> None:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    (line,) = [line for line in out.stderr.splitlines() if line.startswith("rlhf: ")]
    assert line.startswith(f"rlhf: data set {repo} (")
    assert str(cache) in line and "no mirror (RLHF_DATA_DIR unset)" in line  # where it looked
    assert "connect to the network" in line and "set RLHF_DATA_DIR to an offline mirror" in line  # both fixes


def test_the_demo_data_stage_downloads_from_the_hub_then_reads_its_cache_offline(hub, hh_file, tmp_path):
    commit = hub.repo("Anthropic", "hh-rlhf").commit
    cfg = load_config("demo", [f"data.pairs={hh_file}"])
    _, pairs, _ = load_pairs(cfg)
    expected_digest = splits_digest(make_splits(pairs, cfg))  # the splits of the mirror's own file

    cache = tmp_path / "hf"
    online = _env(cache, HF_ENDPOINT=hub.url)
    data = _data_run(_rlhf(online))
    assert data.params["data.source"] == f"hf://datasets/Anthropic/hh-rlhf@{commit}/{HH_PATH}"
    assert data.params["data.repo"] == "Anthropic/hh-rlhf" and data.params["data.revision"] == commit
    assert json.loads(data.params["data.sha256"]) == {HH_PATH: _mirror_digest("Anthropic/hh-rlhf", HH_PATH)}
    assert data.params["data.digest"] == expected_digest and data.metrics["data/rows"] == 2312
    assert f"GET /datasets/Anthropic/hh-rlhf/resolve/{commit}/{HH_PATH}" in hub.requests  # through the stand-in
    assert list(cache.glob(f"hub/datasets--Anthropic--hh-rlhf/snapshots/{commit}/{HH_PATH}"))

    hub.stop()
    offline = _data_run(_rlhf({**online, "HF_HUB_OFFLINE": "1"}))
    assert {k: offline.params[k] for k in ("data.source", "data.revision", "data.sha256", "data.digest")} == \
           {k: data.params[k] for k in ("data.source", "data.revision", "data.sha256", "data.digest")}

    for variables in ({}, {"HF_HUB_OFFLINE": "1"}):  # the hub unreachable, or outgoing traffic off
        empty = tmp_path / f"empty{len(variables)}"
        _assert_one_line_with_both_fixes(_rlhf(_env(empty, HF_ENDPOINT=hub.url, **variables)), "Anthropic/hh-rlhf",
                                         empty / "hub")


CEVAL_PROBE = """
import json
from stages.compute.evaluate import ceval
from stages.compute.loading import DataError
from stages.orchestration.config_loading import load_config
cfg = load_config("demo").data
try:
    val, dev = ceval.load(cfg, {subjects})
except DataError as err:
    print(json.dumps({{"error": str(err)}}))
else:
    found = ceval.locate(cfg, {subjects}, ("val", "dev"))
    print(json.dumps({{"val": {{s: [q.__dict__ for q in qs] for s, qs in val.items()}},
                      "dev": {{s: [q.__dict__ for q in qs] for s, qs in dev.items()}},
                      "revision": found.revision, "digests": found.digests()}}))
"""


def _ceval(env: dict[str, str], subjects: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CEVAL_PROBE.format(subjects=subjects)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_c_eval_downloads_only_its_subjects_then_reads_them_offline(hub, tmp_path):
    """The stand-in here is the module's: the HH test may have stopped it, so a new one serves
    the same copy (the same commit)."""
    from stages.compute.evaluate import ceval  # deferred: torch, for this test only

    val, dev = ceval.load(load_config("demo").data, CEVAL_SUBJECTS)  # from the mirror (the session's RLHF_DATA_DIR)
    expected = {"val": {s: [q.__dict__ for q in qs] for s, qs in val.items()},
                "dev": {s: [q.__dict__ for q in qs] for s, qs in dev.items()}}
    with HubStandIn(hub.folder) as standin:
        commit = standin.repo("ceval", "ceval-exam").commit
        online = _env(tmp_path / "hf", HF_ENDPOINT=standin.url)
        got = _ceval(online, CEVAL_SUBJECTS)
        downloads = sorted(r.split("/")[-1] for r in standin.requests if r.startswith("GET /datasets/ceval/"))
    assert downloads == sorted(f"{s}_{split}.csv" for s in CEVAL_SUBJECTS for split in ("dev", "val"))
    assert {k: got[k] for k in ("val", "dev")} == json.loads(json.dumps(expected))
    assert got["revision"] == commit
    assert got["digests"] == {f"{split}/{s}_{split}.csv": _mirror_digest("ceval/ceval-exam", f"{split}/{s}_{split}.csv")
                              for split in ("val", "dev") for s in CEVAL_SUBJECTS}
    assert _ceval({**online, "HF_HUB_OFFLINE": "1"}, CEVAL_SUBJECTS) == got
    missing = _ceval({**online, "HF_HUB_OFFLINE": "1"}, ["logic"])["error"]  # never downloaded
    assert missing.startswith("data set ceval/ceval-exam (splits val, dev of 1 subjects): not found; looked at the hub")
    assert "\n" not in missing and "connect to the network" in missing and "RLHF_DATA_DIR" in missing


def test_a_mirror_in_the_hubs_layout_is_read_instead_of_the_hub(hh_file):
    found = locate("Anthropic/hh-rlhf", load_config("demo").data)  # the session's RLHF_DATA_DIR is the mirror
    assert (found.repo, found.revision, found.files) == ("Anthropic/hh-rlhf", "mirror", (HH_PATH,))
    assert found.name == str(hh_file.resolve())
    assert json.loads(found.lineage("data")["data.sha256"]) == {HH_PATH: _mirror_digest("Anthropic/hh-rlhf", HH_PATH)}
    with pytest.raises(DataError, match=r"no files of harmless-base, split train in this mirror"):
        locate("Anthropic/hh-rlhf", load_config("demo", ["data.hub_split=train"]).data)


@pytest.mark.parametrize("folder,split,files,expected", [
    ("harmless-base", "test", ["harmless-base/test.jsonl.gz", "harmless-base/train.jsonl.gz", "helpful-base/test.jsonl.gz"],
     ["harmless-base/test.jsonl.gz"]),
    (None, "train", ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test-0.parquet",
                     "README.md"], ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]),
    (None, "train", ["train.jsonl", "contest.jsonl", "train/part.csv"], ["train.jsonl", "train/part.csv"]),
])
def test_a_splits_files_are_found_by_the_hubs_naming_conventions(folder, split, files, expected):
    patterns = split_patterns(folder, split)
    assert [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)] == [f for f in expected]
