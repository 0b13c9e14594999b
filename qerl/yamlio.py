"""YAML that refuses what PyYAML lets pass silently: a key given twice in one mapping (the last would win).

``load(text, source)`` is ``yaml.safe_load`` with a loader that raises :class:`DuplicateKeyError` naming the source,
the key and both lines. Light: PyYAML only.
"""
from __future__ import annotations

import yaml


class DuplicateKeyError(ValueError):
    """A mapping gives one key twice."""


class _StrictLoader(yaml.SafeLoader):
    source = "<yaml>"

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error follows
                continue
            if first is not None:
                raise DuplicateKeyError(f"{self.source}: key {key!r} is given twice (lines {first + 1} and "
                                        f"{key_node.start_mark.line + 1}); the last would silently win: keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load(text: str, source: str = "<yaml>"):
    """``yaml.safe_load(text)``, refusing duplicate keys (:class:`DuplicateKeyError` names ``source``)."""
    loader = type("Loader", (_StrictLoader,), {"source": source})
    return yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader subclass)
