"""Fuzzing the three readers of user input: the data reader (stages/compute/loading.py → stages/pipeline/data.py:
a file → raw records → pairs → the split files the data stage writes), the config loader
(stages/leaves/config.py: a preset YAML file + `--set` overrides → PipelineConfig) and the reward
server's request parser (stages/compute/reward/serve.py: a POST body → prompts, responses, ended).
Whatever the bytes, each returns or raises our own error, DataError (naming the file, the row and
the rule), ConfigError (naming the key or the file) or the server's ClientError with a 4xx status
(the server answers anything else 500, its own fault); nothing else may escape.

Hypothesis runs derandomised: a fixed seed per test, so CI sees the same inputs on every run and
a failure reproduces. The number of inputs per target and outcome prints with `pytest -s`.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from config_helpers import dotted_keys
from hypothesis import strategies as st

from stages.compute.loading import DataError, read_records
from stages.compute.reward.serve import ClientError, parse_body
from stages.leaves.config import ConfigError, DataConfig, PipelineConfig, RewardServerConfig
from stages.orchestration.config_loading import load_config
from stages.pipeline.data import ASSISTANT, HUMAN, load_pairs, raw_pairs_frame, write_jsonl

COUNTS: Counter = Counter()  # (target, outcome) → inputs


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    targets = sorted({target for target, _ in COUNTS})
    print("\ninputs fuzzed per target (outcome: count)")
    for target in targets:
        outcomes = {o: n for (t, o), n in sorted(COUNTS.items()) if t == target}
        print(f"  {target:<18} {sum(outcomes.values()):>5}  {outcomes}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ----------------------------------------------------------------------------------------------
# Inputs: JSON-ish values, HH-ish dialogues (near misses of the real format) and rows of them

TEXT = st.text(max_size=30)
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                           max_leaves=8)
HH_ISH = st.lists(st.sampled_from([HUMAN, ASSISTANT, "\n\n", "Human:", "Assistant:", " "]) | TEXT,
                  max_size=8).map("".join)
DIALOGUE = st.builds(lambda q, a: f"{HUMAN} {q}{ASSISTANT} {a}", TEXT, TEXT)
PAIR = st.builds(lambda q, a, b: {"chosen": f"{HUMAN} {q}{ASSISTANT} {a}", "rejected": f"{HUMAN} {q}{ASSISTANT} {b}"},
                 TEXT, TEXT, TEXT)
ANSWER = DIALOGUE | HH_ISH | JSON_VALUES
RECORD = PAIR | st.fixed_dictionaries({}, optional={"chosen": ANSWER, "rejected": ANSWER, "_row": JSON_VALUES,
                                                    "prompt": TEXT}) | st.dictionaries(TEXT, JSON_VALUES, max_size=4)


def mutated(base: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Valid-looking bytes with a few bytes overwritten and maybe cut short."""
    def mutate(data: bytes, edits: list[tuple[int, int]], cut: int | None) -> bytes:
        out = bytearray(data)
        for position, value in edits:
            if out:
                out[position % len(out)] = value
        return bytes(out[:cut] if cut is not None else out)

    return st.builds(mutate, base, st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4),
                     st.none() | st.integers(0, 4096))


JSON_LINE = (RECORD.map(json.dumps) | RECORD.map(lambda r: json.dumps(r, ensure_ascii=False))
             | JSON_VALUES.map(json.dumps)).map(str.encode) | st.binary(max_size=40)
PAIRS_JSONL = st.lists(PAIR.map(json.dumps).map(str.encode), min_size=1, max_size=6).map(b"\n".join)
JSONL = st.lists(JSON_LINE, max_size=6).map(b"\n".join) | PAIRS_JSONL | mutated(PAIRS_JSONL) | st.binary(max_size=200)


def parse_file(path: Path, target: str) -> None:
    """The data stage's way from a file to the rows it writes; only DataError may escape it."""
    try:
        source, records = read_records(str(path), DataConfig())
        source, pairs, _ = load_pairs(PipelineConfig(), records, source)
        raw_pairs_frame(records, DataConfig(), source)
        write_jsonl(pairs, path.parent / "out" / "pairs.jsonl")
    except DataError as err:
        assert path.name in str(err) and err.rule, err  # names the file and the rule
        COUNTS[target, "DataError"] += 1
        return
    assert all(type(p["row"]) is int and p["row"] >= 1 for p in pairs)  # rows number the source's lines
    COUNTS[target, "parsed"] += 1


# ----------------------------------------------------------------------------------------------
# Data files


@fuzz(300)
@given(data=JSONL)
@example(data=b"[" * 100_000)  # nesting deeper than Python's recursion limit
@example(data=b'{"chosen": ' + b"1" * 5000 + b"}")  # an integer longer than int() reads
@example(data=b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: \\ud800", "rejected": "\\n\\nHuman: a\\n\\nAssistant: b"}')  # lone surrogate
@example(data=b'{"_row": "x", "chosen": "\\n\\nHuman: q\\n\\nAssistant: a", "rejected": "\\n\\nHuman: q\\n\\nAssistant: b"}')
def test_jsonl_files(folder, data):
    path = folder / "pairs.jsonl"
    path.write_bytes(data)
    parse_file(path, "jsonl")


@fuzz(150)
@given(data=JSONL.map(gzip.compress) | mutated(JSONL.map(gzip.compress)) | st.binary(max_size=100))
def test_gzip_files(folder, data):
    path = folder / "pairs.jsonl.gz"
    path.write_bytes(data)
    parse_file(path, "jsonl.gz")


def csv_bytes(header: list[str], rows: list[list[str]]) -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue().encode()


CSV_FIELD = DIALOGUE | HH_ISH | TEXT
CSV = (st.builds(csv_bytes, st.lists(st.sampled_from(["chosen", "rejected", "_row"]) | TEXT, max_size=4),
                 st.lists(st.lists(CSV_FIELD, max_size=4), max_size=4))
       | st.builds(csv_bytes, st.just(["chosen", "rejected"]), st.lists(PAIR.map(lambda p: [p["chosen"], p["rejected"]]),
                                                                        max_size=4)))


@fuzz(300)
@given(data=CSV | mutated(CSV) | st.text(max_size=200).map(str.encode) | st.binary(max_size=200))
@example(data=b'chosen,rejected\n"' + b"x" * 200_000 + b'",y\n')  # a field over the csv module's size limit
@example(data=b"x\na,b\n")  # more fields than the header names, and no chosen column
def test_csv_files(folder, data):
    path = folder / "pairs.csv"
    path.write_bytes(data)
    parse_file(path, "csv")


def parquet_bytes(columns: dict[str, list]) -> bytes:
    out = io.BytesIO()
    pd.DataFrame(columns).to_parquet(out)
    return out.getvalue()


def column(kind: st.SearchStrategy, rows: int) -> st.SearchStrategy[list]:
    return st.lists(kind, min_size=rows, max_size=rows)


PARQUET = st.integers(0, 4).flatmap(lambda rows: st.dictionaries(
    st.sampled_from(["chosen", "rejected", "_row", "prompt"]) | TEXT,
    column(st.none() | DIALOGUE | HH_ISH, rows) | column(st.integers(-(2**63), 2**63 - 1), rows)
    | column(st.floats(), rows) | column(st.binary(max_size=8), rows) | column(st.lists(TEXT, max_size=2), rows),
    max_size=4)).map(parquet_bytes)
PAIRS_PARQUET = st.lists(PAIR, min_size=1, max_size=4).map(
    lambda pairs: parquet_bytes({k: [p[k] for p in pairs] for k in ("chosen", "rejected")}))


@fuzz(120)
@given(data=PARQUET | PAIRS_PARQUET | mutated(PAIRS_PARQUET) | st.binary(max_size=200))
@example(data=Path(__file__).with_name("fuzz_examples").joinpath("not_utf8.parquet").read_bytes())  # found in CI
def test_parquet_files(folder, data):
    path = folder / "pairs.parquet"
    path.write_bytes(data)
    parse_file(path, "parquet")


@fuzz(300)
@given(records=st.lists(RECORD, max_size=5))
def test_records(records):
    """Rows as the hub or any reader hands them over: any JSON-ish values in any columns."""
    rows = [{**record, "_row": row} for row, record in enumerate(records, start=1)]
    try:
        _, pairs, dropped = load_pairs(PipelineConfig(), rows, "rows")
        raw_pairs_frame(rows, DataConfig(), "rows")
    except DataError as err:
        assert err.source == "rows" and err.rule
        COUNTS["records", "DataError"] += 1
        return
    assert len(pairs) + len(dropped) == len(rows)
    COUNTS["records", "parsed"] += 1


# ----------------------------------------------------------------------------------------------
# Config: preset files and overrides


KEYS = st.sampled_from(dotted_keys(PipelineConfig))
SCALAR_TEXT = st.sampled_from(["1", "0", "-3", "2e-5", "1e400", "nan", ".nan", "true", "null", "~", "[1, 2]",
                               "{a: 1}", "zero2", "float8", "'x'", "[", "{", "!!python/object:os.system x",
                               "&a [*a]", "1" * 5000]) | TEXT


def nested(key: str, value) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def resolve(preset: str, overrides, target: str) -> None:
    """What `rlhf run`/`rlhf config` do with a preset and overrides; only ConfigError may escape."""
    try:
        cfg = load_config(preset, overrides)
        cfg.config_hash()
        yaml.safe_dump(cfg.model_dump(mode="json"))
    except ConfigError as err:
        assert str(err)
        COUNTS[target, "ConfigError"] += 1
        return
    assert isinstance(cfg, PipelineConfig)
    COUNTS[target, "resolved"] += 1


PRESET_VALUES = st.lists(st.tuples(KEYS, JSON_VALUES | SCALAR_TEXT), max_size=4).map(
    lambda items: [nested(k, v) for k, v in items])
PRESET_TEXT = (PRESET_VALUES.map(lambda parts: yaml.safe_dump({k: v for part in parts for k, v in part.items()}))
               | st.lists(st.builds(lambda k, v: f"{k}: {v}", KEYS, SCALAR_TEXT), max_size=4).map("\n".join)
               | HH_ISH | TEXT).map(str.encode)


@fuzz(300)
@given(data=PRESET_TEXT | mutated(PRESET_TEXT) | st.binary(max_size=100))
@example(data=b"sft:\n  lr: caf\xe9\n")  # not UTF-8
@example(data=b"[" * 600)  # nesting deeper than Python's recursion limit
@example(data=b"sft: {epochs: " + b"1" * 5000 + b"}")  # an integer longer than int() reads
def test_preset_files(folder, data):
    path = folder / "mine.yaml"
    path.write_bytes(data)
    resolve(str(path), None, "preset file")


OVERRIDE = (st.builds(lambda k, v: f"{k}={v}", KEYS, SCALAR_TEXT)
            | st.builds(lambda k, junk, v: f"{k}{junk}={v}", KEYS, st.sampled_from([".", "..", ".x", " ", "=", ""]), TEXT)
            | TEXT)


@pytest.fixture(scope="module")
def preset(folder) -> str:
    """The defaults: a preset that sets nothing (the overrides do)."""
    (folder / "base.yaml").write_text("{}\n")
    return str(folder / "base.yaml")


@fuzz(400)
@given(overrides=st.lists(OVERRIDE, max_size=4))
@example(overrides=["sft.lr=" + "[" * 600])  # nesting deeper than Python's recursion limit
def test_override_strings(preset, overrides):
    resolve(preset, overrides, "--set overrides")


@fuzz(200)
@given(overrides=st.dictionaries(KEYS | TEXT, JSON_VALUES | SCALAR_TEXT, max_size=4)
       | st.lists(st.tuples(KEYS, JSON_VALUES), max_size=3).map(lambda items: [nested(k, v) for k, v in items]).map(
           lambda parts: {k: v for part in parts for k, v in part.items()}))
def test_override_mappings(preset, overrides):
    """Overrides as a flow parameter: `{"ppo": {"kl_coef": 0.1}}` or `{"ppo.kl_coef": 0.1}`."""
    resolve(preset, overrides, "override mappings")


# ----------------------------------------------------------------------------------------------
# The reward server's request bodies

SERVER_LIMITS = RewardServerConfig(max_prompts=8)
# JSON texts a generator cannot write: numbers past float and int, NaN literals, deep nesting.
NUMBER_TEXT = st.sampled_from(["1e999", "-1e999", "1" * 5000, "-" + "9" * 4301, "NaN", "Infinity", "-Infinity",
                               "1e-999", "0.0", "-0", "true", "null", '"\\ud800"', '"\\udc00\\ud800"', '"\\u0000"',
                               "[" * 3000 + "]" * 3000, '{"a":' * 3000 + "1" + "}" * 3000])
FIELD = JSON_VALUES.map(json.dumps) | NUMBER_TEXT | st.lists(JSON_VALUES.map(json.dumps) | NUMBER_TEXT | TEXT.map(
    json.dumps), max_size=9).map(lambda items: "[" + ", ".join(items) + "]")


def body_text(prompts: str | None, responses: str | None, ended: str | None, extra: dict) -> str:
    """A JSON object text with these fields' texts (None: the field left out) and other keys."""
    fields = {"prompts": prompts, "responses": responses, "ended": ended, **{k: json.dumps(v) for k, v in extra.items()}}
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in fields.items() if v is not None) + "}"


STRINGS = st.lists(TEXT, min_size=1, max_size=3).map(json.dumps)
BODY_TEXT = (st.builds(body_text, st.none() | STRINGS | FIELD, st.none() | STRINGS | FIELD,
                       st.none() | st.lists(st.booleans(), max_size=3).map(json.dumps) | FIELD,
                       st.dictionaries(TEXT, JSON_VALUES, max_size=2))
             | st.builds(lambda n, ended: body_text(json.dumps(["p"] * n), json.dumps(["r"] * n), ended, {}),
                         st.integers(0, 10), st.none() | st.lists(st.booleans() | st.integers(0, 1), max_size=10)
                         .map(json.dumps))
             | JSON_VALUES.map(json.dumps) | NUMBER_TEXT)
ENCODED = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1"])
BODY = (st.builds(lambda text, encoding: text.encode(encoding, "surrogatepass" if "utf" in encoding else "replace"),
                  BODY_TEXT, ENCODED)
        | mutated(BODY_TEXT.map(str.encode)) | st.binary(max_size=200))


@fuzz(400)
@given(body=BODY)
@example(body=b"[" * 100_000)  # nesting deeper than Python's recursion limit
@example(body=b'{"prompts": ' + b"[" * 5000 + b"]" * 5000 + b', "responses": ["r"]}')
@example(body=b'{"prompts": ["p"], "responses": ["r"], "ended": [' + b"1" * 5000 + b"]}")  # past int()'s digits
@example(body=b'{"prompts": ["p"], "responses": ["r"], "ended": [1e999]}')  # a float literal read as inf
@example(body=b'\xef\xbb\xbf{"prompts": ["p"], "responses": ["r"]}')  # a UTF-8 byte-order mark
@example(body='{"prompts": ["p"], "responses": ["r"]}'.encode("utf-16"))
@example(body=b'{"prompts": ["p\xff"], "responses": ["r"]}')  # not UTF-8
@example(body=b'{"prompts": ["' + b"x" * 1_000_000 + b'"], "responses": ["r"]}')  # a huge string
@example(body=b'{"prompts": ["\\ud800"], "responses": ["r"]}')  # a lone surrogate
def test_reward_server_request_bodies(body):
    try:
        prompts, responses, ended = parse_body(body, SERVER_LIMITS)
    except ClientError as err:
        assert 400 <= err.status < 500 and err.message, err
        COUNTS["reward request", f"{err.status}"] += 1
        return
    assert len(prompts) == len(responses) == len(ended) <= SERVER_LIMITS.max_prompts
    assert all(type(t) is str for t in prompts + responses) and all(type(e) is bool for e in ended)
    for text in prompts + responses:
        text.encode("utf-8")  # no lone surrogate reaches the tokenizer
    COUNTS["reward request", "parsed"] += 1
