"""How workflow config files layer over each other (``--configfile config/paper.yaml my_overlay.yaml``), beyond a
plain deep merge: a model whose ``source`` an overlay switches keeps none of the keys only the old source reads.

``config/paper.yaml`` names ``qwen2.5-7b: {source: hub, hub_id: ..., revision: main}``; an overlay pointing it at local
weights says only ``qwen2.5-7b: {source: local, path: /data/qwen2.5-7b}``. Deep-merged, the entry would hold
``hub_id`` and ``revision`` beside ``path``, keys a local model never reads (the schema refuses them, rightly, when
one file sets them together). Here the keys that (a) only another source reads and (b) were set by a file *before*
the one that set the current ``source`` are dropped, each drop said in one note. An explicit ``null`` in any file
removes its key. A key the switching file (or a later one) sets itself is kept, so the schema still names a
contradiction inside one file, and every file is still checked for unknown keys (typos) on its own.
"""
from __future__ import annotations

# the keys each model source reads beyond the ones every model has (source, paper_column, scale_rule, calibration,
# keep_bf16_last): workflow/schemas/config.schema.yaml's per-source rules (tests/test_overlays.py ties them)
SOURCE_KEYS: dict[str, frozenset[str]] = {
    "tiny": frozenset({"arch", "seed", "sft_steps"}),
    "hub": frozenset({"hub_id", "revision"}),
    "local": frozenset({"path"}),
    "gguf": frozenset({"path"}),
}
_SOURCE_ONLY = frozenset().union(*SOURCE_KEYS.values())


def _entry(layer: dict, model: str) -> dict:
    entry = (layer.get("models") or {}).get(model) if isinstance(layer.get("models"), dict) else None
    return entry if isinstance(entry, dict) else {}


def settle_models(config: dict, layers: list[tuple[str, dict]]) -> list[str]:
    """Apply the layering rules to ``config["models"]`` in place (``config``: the deep merge of ``layers``, as
    snakemake or :func:`qerl.workflow_config.read_workflow_config` made it; ``layers``: ``(file name, its mapping)``
    in merge order). Returns one note per model whose stale keys were dropped, e.g. ``models.qwen2.5-7b: source
    'local' (my_overlay.yaml) does not read hub_id, revision (config/paper.yaml): dropped``."""
    notes: list[str] = []
    models = config.get("models")
    if not isinstance(models, dict):
        return notes
    for name, entry in models.items():
        if not isinstance(entry, dict):
            continue
        for key in [k for k, v in entry.items() if v is None]:
            del entry[key]  # `key: null` in an overlay: removed
        switched = [i for i, (_, layer) in enumerate(layers) if "source" in _entry(layer, name)]
        if not switched:
            continue
        last = switched[-1]
        reads = SOURCE_KEYS.get(entry.get("source"), frozenset())
        set_since = {k for _, layer in layers[last:] for k in _entry(layer, name)}
        stale = [k for k in entry if k in _SOURCE_ONLY and k not in reads and k not in set_since]
        if not stale:
            continue
        origin = sorted({f for f, layer in layers[:last] for k in stale if k in _entry(layer, name)})
        for key in stale:
            del entry[key]
        notes.append(f"models.{name}: source {entry.get('source')!r} ({layers[last][0]}) does not read "
                     f"{', '.join(stale)} ({', '.join(origin)}): dropped")
    return notes
