"""Looking for secrets where they must not be: in MLflow (params, tags, metric names, model
version tags), in artifacts and in every byte a run wrote, raw and in the encodings a secret
takes on the way (base64 in headers and serialised blobs, percent-encoding in URLs)."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote, quote_plus


def encodings(secret: str) -> dict[str, bytes]:
    """The secret raw, percent-encoded and base64-encoded (standard and URL-safe alphabets). Inside
    a longer base64 text the secret's encoding depends on its offset modulo 3: for each offset,
    the characters that encode the secret's bytes alone."""
    raw = secret.encode()
    forms = {"raw": raw, "urlencoded": quote(secret, safe="").encode(), "form-urlencoded": quote_plus(secret).encode()}
    for offset in range(3):
        start, end = -(-8 * offset // 6), 8 * (offset + len(raw)) // 6  # first and past-last whole characters
        for name, encode in (("base64", base64.b64encode), ("base64url", base64.urlsafe_b64encode)):
            forms[f"{name}@{offset}"] = encode(b"\0" * offset + raw)[start:end]
    distinct: dict[str, bytes] = {}
    for name, value in forms.items():
        if value not in distinct.values():
            distinct[name] = value
    return distinct


def leaks(secrets: Iterable[str], texts: Iterable[str] = (), blobs: dict[str, bytes] | None = None) -> list[str]:
    """Where any form of any secret occurs: `<form> in <where>` for each hit (empty: no leak)."""
    found = []
    texts = list(texts)
    for secret in secrets:
        for form, needle in encodings(secret).items():
            found += [f"{form} in text {text[:80]!r}" for text in texts if needle in text.encode()]
            found += [f"{form} in {where}" for where, blob in (blobs or {}).items() if needle in blob]
    return found


def mlflow_texts(runs: Iterable, versions: Iterable = ()) -> list[str]:
    """Everything MLflow holds as text for these runs and model versions: param names and values,
    tag names and values, metric names; version tags and sources."""
    texts = []
    for run in runs:
        texts += [*run.data.params, *run.data.params.values(), *run.data.tags, *run.data.tags.values(),
                  *run.data.metrics]
    for version in versions:
        texts += [*version.tags, *version.tags.values(), version.source]
    return texts


def files(*roots: Path) -> dict[str, bytes]:
    """Every regular file under the roots (followed into no symlink), path → bytes."""
    return {str(path): path.read_bytes() for root in roots for path in sorted(root.rglob("*"))
            if path.is_file() and not path.is_symlink()}
