"""Registries of entries by name, for a config field that names one (`ppo.policy_loss`,
`ppo.advantage_estimator`): an entry is registered once, and an unknown name fails with the names
that are registered.

The registry is a plain dict that its module holds; these functions take it as an argument, so a
test that swaps the module's dict for a copy (and back) registers into the copy.
"""

from __future__ import annotations

from typing import TypeVar

Entry = TypeVar("Entry")


def add_entry(entries: dict[str, Entry], what: str, name: str, entry: Entry) -> None:
    """`entry` as `entries[name]`, the registry of `what`s ("policy loss"); a name taken is an error."""
    if name in entries:
        article = "an" if what[0] in "aeiou" else "a"
        raise ValueError(f"{article} {what} named {name!r} is registered already")
    entries[name] = entry


def entry_named(entries: dict[str, Entry], what: str, name: str) -> Entry:
    """The entry registered as `name`; an unknown name is an error listing the registered ones."""
    try:
        return entries[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; registered: {', '.join(sorted(entries))}") from None
