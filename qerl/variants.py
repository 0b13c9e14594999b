"""Variants that change nothing: an arm whose override equals what its base method already trains with.

``variants: {qerl_s5e-2: {method: qerl, overrides: {aqn: {sigma_start: 5.0e-2}}}}`` over a config whose ``train.aqn``
already says ``sigma_start: 0.05`` retrains the ``qerl`` baseline under a new name, and its report would say it
"changes aqn.sigma_start 0.05". A plain variant all of whose overrides are the base's own values, trained beside the base
method itself, is refused; a sweep's point that lands on the base's value (a grid arm, or a variant whose base is not
in the matrix) is kept, with a note; either way the report's ``changes`` column lists only what differs
(:func:`arm_changes`).
"""
from __future__ import annotations

import dataclasses


def arm_changes(config: dict, method: str) -> str:
    """What an arm changes against its base method, flattened (``"aqn.sigma_start 0.01; lora.r 8"``); ``""`` for a
    base method itself. (``method_overrides`` apply to the base method and its variants alike: not a change; nor is
    an override equal to what the base method trains with, :func:`unchanged_keys`: a sweep's point on the base's own
    value reads ``none (optim.lr 0.0001: lora's own)``.)"""
    from qerl.tracking import flatten
    from qerl.workflow_config import base_method

    over = config.get("variants", {}).get(method, {}).get("overrides") or {}
    same = set(unchanged_keys(config, method)) if over else set()
    flat = flatten(over)
    if flat and same == set(flat):
        return f"none ({'; '.join(f'{k} {v}' for k, v in flat.items())}: {base_method(config, method)}'s own)"
    return "; ".join(f"{k} {v}" for k, v in flat.items() if k not in same)


def _first_run(config: dict, arm: str):
    from qerl.workflow_config import runs

    return next((r for r in runs(config) if r.method == arm), None)


def unchanged_keys(config: dict, arm: str) -> list[str]:
    """The dotted override keys of variant ``arm`` whose value its base method's resolved train config already has
    (compared on the arm's first run of the matrix; ``[]`` when the arm runs nowhere)."""
    from qerl.tracking import flatten
    from qerl.workflow_config import train_config

    variant = (config.get("variants") or {}).get(arm) or {}
    over = flatten(variant.get("overrides") or {})
    run = _first_run(config, arm)
    if not over or run is None:
        return []
    try:
        mine = flatten(train_config(config, run))
        base = flatten(train_config(config, dataclasses.replace(run, method=variant["method"])))
    except (KeyError, TypeError, AttributeError):  # an undefined name: the config's own checks say which
        return []
    return [k for k in over if k in base and base[k] == mine.get(k)]


def _beside_its_base(config: dict, arm: str, base: str) -> bool:
    """Whether the matrix also trains ``base`` itself in a cell (model, algorithm, dataset, seed) of ``arm``'s."""
    from qerl.workflow_config import runs

    cells = {(r.model, r.algo, r.dataset, r.seed) for r in runs(config) if r.method == base}
    return any((r.model, r.algo, r.dataset, r.seed) in cells for r in runs(config) if r.method == arm)


def check_variants(config: dict, grid_arms=frozenset()) -> list[str]:
    """Refuse (``ValueError``, one line) a variant outside ``grid_arms`` whose every override is its base method's own
    value while the matrix trains that base in the same cells; return one note per other arm with such keys (named,
    with the values)."""
    from qerl.tracking import flatten

    notes = []
    for arm, variant in (config.get("variants") or {}).items():
        same = unchanged_keys(config, arm)
        if not same:
            continue
        over = flatten(variant.get("overrides") or {})
        what = "; ".join(f"{k} {over[k]}" for k in same)
        base = variant["method"]
        if len(same) == len(over) and arm not in grid_arms and _beside_its_base(config, arm, base):
            raise ValueError(f"config variants.{arm}: {what} {'is' if len(same) == 1 else 'are'} what {base!r} "
                             f"already trains with: the arm would retrain {base!r} under another name (change the "
                             "value, or remove the variant)")
        notes.append(f"variants.{arm}: {what} {'is' if len(same) == 1 else 'are'} {base!r}'s own "
                     f"value{'' if len(same) == 1 else 's'} (no change; the report lists only what differs)")
    return notes
