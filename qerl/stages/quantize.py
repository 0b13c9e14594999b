"""``qerl quantize``: a bf16 Hugging Face checkpoint -> a compressed-tensors NVFP4 checkpoint.

Round-to-nearest by default (as the QeRL reference code does; the paper's AWQ is never run there), or after
AWQ's activation-aware scales are folded into the bf16 model (``calibration="awq"``, :mod:`qerl.quant.awq`: the
model is held in memory for the search, then quantized from a temporary copy as below). Every decoder
``nn.Linear`` is quantized (q/k/v and gate/up share the minimum global scale,
as vLLM requires); embeddings, ``lm_head`` and norms are copied unchanged.

Streaming: the source is read tensor by tensor from its shards and the output is written shard by
shard, so peak host memory is about one output shard plus one decoder layer. The whole output is
written into a temporary directory and renamed into place when complete.
"""
from __future__ import annotations

import hashlib
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qerl.checkpoint import (
    INDEX_NAME,
    CheckpointError,
    TensorIndex,
    atomic_directory,
    is_nonempty_dir,
    parse_size,
    read_json,
    save_shard,
    shard_files,
    write_json,
)
from qerl.models.arch import check_supported, fused_groups
from qerl.quant import nvfp4
from qerl.quant.format import check_patterns, is_target, quantization_config

MANIFEST = "qerl_quantize.json"
REPORT = "quantization_report.json"
_SKIP_COPY = {"config.json", INDEX_NAME, MANIFEST, REPORT}


@dataclass
class _Unit:
    """Tensors produced together: one fused group of linears, or one pass-through tensor."""

    linears: list[str] = field(default_factory=list)  # module names
    passthrough: str | None = None  # tensor name
    out_bytes: int = 0


def source_fingerprint(model_dir: Path) -> str:
    """A cheap content hash: config, shard headers and sizes, and 1 MiB at each shard's ends."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for shard in shard_files(model_dir):
        size = shard.stat().st_size
        h.update(f"{shard.name}:{size}".encode())
        with open(shard, "rb") as f:
            h.update(f.read(2**20))
            f.seek(max(0, size - 2**20))
            h.update(f.read())
    return h.hexdigest()


def _linear_modules(config) -> dict[str, tuple[int, int, bool, tuple[str, ...]]]:
    """``name -> (out_features, in_features, has_bias, class names)`` of the model's Linears."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {
        name: (m.out_features, m.in_features, m.bias is not None,
               tuple(c.__name__ for c in type(m).__mro__))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def plan(src: Path, ignore: tuple[str, ...]) -> tuple[dict, TensorIndex, list[_Unit]]:
    """Validate the source and return ``(config dict, tensor index, ordered units)``."""
    from transformers import AutoConfig

    cfg = read_json(src / "config.json")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise CheckpointError(f"{src}/config.json: model is already quantized ({method})")
    model_type = check_supported(cfg.get("model_type"), f"{src}/config.json")
    index = TensorIndex(src)
    linears = _linear_modules(AutoConfig.from_pretrained(src))
    targets = [n for n, (_, _, _, cls) in linears.items() if is_target(n, cls, ["Linear"], ignore)]
    from qerl.quant.format import _matches

    unused = [p for p in ignore if not any(_matches(p, n, cls) for n, (_, _, _, cls) in linears.items())]
    if unused:  # a typo (lm_haed) would quantize what it meant to keep, without a word
        names = sorted(linears)
        raise CheckpointError(f"--ignore {unused[0]!r} matches no Linear module of {src} (names look like "
                              f"{names[0]!r}, {names[-1]!r}; class names like 'Linear'; regexes start with 're:')")
    if not targets:
        raise CheckpointError(f"{src}: no Linear layers to quantize (ignore={list(ignore)})")
    for name in targets:
        out_f, in_f, has_bias, _ = linears[name]
        wname = f"{name}.weight"
        if wname not in index:
            raise CheckpointError(f"{src}: tensor {wname!r} is missing from the checkpoint")
        if index.shape(wname) != (out_f, in_f):
            raise CheckpointError(
                f"{src}: tensor {wname!r} has shape {index.shape(wname)}; config implies {(out_f, in_f)}"
            )
        if in_f % nvfp4.BLOCK_SIZE:
            raise CheckpointError(f"{src}: {wname} has K_in = {in_f}, not a multiple of 16")
    quantized_weights = {f"{n}.weight" for n in targets}
    order = {name: i for i, name in enumerate(index.names())}
    units = []
    for group in fused_groups(model_type, targets):
        nbytes = 0
        for n in group:
            out_f, in_f, has_bias, _ = linears[n]
            nbytes += out_f * in_f // 2 + out_f * in_f // 16 + 4
            nbytes += index.nbytes(f"{n}.bias") if has_bias and f"{n}.bias" in index else 0
        units.append(_Unit(linears=group, out_bytes=nbytes))
    biases = {f"{n}.bias" for n in targets}
    for name in index.names():
        if name not in quantized_weights and name not in biases:
            units.append(_Unit(passthrough=name, out_bytes=index.nbytes(name)))

    def first_pos(u: _Unit) -> int:
        return order[u.passthrough] if u.passthrough else min(order[f"{n}.weight"] for n in u.linears)

    units.sort(key=first_pos)
    return cfg, index, units


#: Rows quantized at a time: keeps fp32 temporaries to a few MB per chunk.
_CHUNK_ELEMENTS = 1 << 21


def _quantize_rows(w: torch.Tensor, gs: torch.Tensor, name: str, scale_rule: str = nvfp4.DEFAULT_RULE):
    """Quantize ``w`` under ``gs`` in row chunks; also return its error statistics.

    Row blocks are independent given the global scale, so chunking is bit-identical to
    ``nvfp4.quantize(w, gs)`` while keeping peak memory near one weight, not several fp32 copies.
    """
    rows = max(1, _CHUNK_ELEMENTS // w.shape[1])
    packed, scales, err2, ref2, base2 = [], [], 0.0, 0.0, 0.0
    from qerl.quant import scale_rules

    # the same tensor's global scale under the paper's max6 (the default rule), for the report's comparison
    gs6 = None if scale_rule == scale_rules.DEFAULT else gs * (scale_rules.get(scale_rules.DEFAULT).scale_cap
                                                                 / scale_rules.get(scale_rule).scale_cap)
    for chunk in w.split(rows):
        p, s, _ = nvfp4.quantize(chunk, global_scale=gs, name=name, scale_rule=scale_rule)
        diff = chunk.double() - nvfp4.dequantize(p, s, gs, dtype=torch.float32).double()
        err2 += float(diff.square().sum())
        ref2 += float(chunk.double().square().sum())
        if gs6 is not None:
            p6, s6, _ = nvfp4.quantize(chunk, global_scale=gs6, name=name)
            d6 = chunk.double() - nvfp4.dequantize(p6, s6, gs6, dtype=torch.float32).double()
            base2 += float(d6.square().sum())
        packed.append(p)
        scales.append(s)
    rel = math.sqrt(err2 / ref2) if ref2 > 0 else 0.0
    sqnr = 10 * math.log10(ref2 / err2) if err2 > 0 else float("inf")
    err = {"rel_fro_error": rel, "sqnr_db": sqnr}
    if gs6 is not None:  # the same layer under the paper's max6 rule: the report compares the two
        err["max6_rel_fro_error"] = math.sqrt(base2 / ref2) if ref2 > 0 else 0.0
        err["max6_sqnr_db"] = 10 * math.log10(ref2 / base2) if base2 > 0 else float("inf")
    return torch.cat(packed), torch.cat(scales), err


def _quantize_unit(unit: _Unit, index: TensorIndex, report: dict, scale_rule: str = nvfp4.DEFAULT_RULE
                   ) -> dict[str, torch.Tensor]:
    if unit.passthrough:
        return {unit.passthrough: index.get(unit.passthrough)}
    # The fused global scale needs every member's amax first; read them one at a time.
    gs = nvfp4.fused_global_scale((index.get(f"{n}.weight") for n in unit.linears), scale_rule)
    out = {}
    for n in unit.linears:
        w = index.get(f"{n}.weight")
        packed, scale, err = _quantize_rows(w, gs, f"{n}.weight", scale_rule)
        out[f"{n}.weight_packed"] = packed
        out[f"{n}.weight_scale"] = scale
        out[f"{n}.weight_global_scale"] = gs.clone()
        if f"{n}.bias" in index:
            out[f"{n}.bias"] = index.get(f"{n}.bias")
        report[n] = {"shape": list(w.shape), "global_scale": float(gs), "fused_with": unit.linears, **err}
        del w
    return out


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    force: bool = False,
    max_shard_size: str | int = "2GB",
    ignore: tuple[str, ...] = ("lm_head",),
    revision: str | None = None,
    progress: bool = True,
    scale_rule: str = nvfp4.DEFAULT_RULE,
    keep_bf16_last: float = 0,
    calibration: str = "none",
    calibration_data: str | Path | None = None,
    calibration_field: str = "question",
    calibration_solution_field: str | None = None,
    calibration_template: str = "raw",
    calibration_samples: int = 128,
    calibration_seq_len: int = 512,
    device: str = "auto",
) -> dict:
    """Quantize ``src`` (local dir or hub id) into ``dst``; return the error report summary.

    A ``dst`` that already holds this quantization of the same source is left alone ("up to
    date"); one that holds anything else is refused unless ``force``. ``scale_rule``: ``max6`` (the paper's) or
    ``four-over-six`` (:func:`qerl.quant.nvfp4.quantize_four_over_six`; recorded in the report and the manifest,
    the checkpoint itself is ordinary NVFP4). ``keep_bf16_last``: the last decoder layers left in bf16 (a count,
    or a fraction of the layers), written into the checkpoint's ignore list
    (:func:`qerl.quant.format.last_layers_pattern`) so compressed-tensors, vLLM and our loader agree.
    ``calibration``: ``none`` (round-to-nearest) or ``awq`` -- scales searched on ``calibration_samples`` x
    ``calibration_seq_len`` tokens of ``calibration_data`` (a JSONL file's ``calibration_field`` and, with
    ``calibration_solution_field``, its worked solution after it, or a text file's lines; each prompt formatted
    with ``calibration_template``; the paper calibrates on 256 x 2,048) on ``device``, folded into the norms /
    linears and the weights clipped before quantization (:mod:`qerl.quant.awq`); the layers kept in bf16 are left
    as they are. A tenth of the samples (at most 64) is held out of the search: on them the checkpoint's KL to bf16
    is measured against its own α = 0 base's (round-to-nearest), and a loss is said (``awq_worse_than_rtn``). The calibration settings and the data's sha256 are part of the manifest (a rerun with other data
    quantizes again).
    """
    from qerl.models.source import resolve_model_dir

    check_patterns(ignore)
    src = resolve_model_dir(src, revision)
    from qerl.models.check import check_tokenizer, check_weights

    check_tokenizer(src, "source model")  # the checkpoint carries the source's tokenizer (sampling needs it)
    check_weights(src, read_json(src / "config.json"))
    if keep_bf16_last:
        from qerl.quant.format import last_layers_pattern

        layers = int(read_json(src / "config.json").get("num_hidden_layers") or 0)
        extra = last_layers_pattern(layers, keep_bf16_last)
        ignore = tuple(ignore) + ((extra,) if extra else ())
    dst = Path(dst)
    nvfp4._check_rule(scale_rule)
    settings = {"ignore": list(ignore), "format": "nvfp4-pack-quantized",
                **({"scale_rule": scale_rule} if scale_rule != nvfp4.DEFAULT_RULE else {})}  # (max6: manifests before the rule)
    if calibration not in ("none", "awq"):
        raise CheckpointError(f"calibration {calibration!r}: expected 'none' or 'awq'")
    if calibration == "awq":
        if calibration_data is None:
            raise CheckpointError("calibration 'awq' needs calibration data (--calibration-data FILE: a JSONL of "
                                  "training prompts or a text file)")
        from qerl.checkpoint import sha256_file

        if not Path(calibration_data).is_file():
            raise CheckpointError(f"--calibration-data {calibration_data}: no such file")
        if calibration_samples < 1 or calibration_seq_len < 1:
            raise CheckpointError(f"calibration size {calibration_samples} x {calibration_seq_len}: both must be >= 1")
        settings["calibration"] = {"method": "awq", "data_sha256": sha256_file(Path(calibration_data)),
                                   "field": calibration_field, "template": calibration_template,
                                   **({"solution_field": calibration_solution_field}
                                      if calibration_solution_field else {}),
                                   "samples": calibration_samples, "seq_len": calibration_seq_len}
    fingerprint = source_fingerprint(src)
    if is_nonempty_dir(dst) and not force:
        manifest = dst / MANIFEST
        if manifest.exists():
            old = read_json(manifest)
            if old.get("source_fingerprint") == fingerprint and old.get("settings") == settings:
                from qerl.owned import modified

                if bad := modified(dst):
                    raise CheckpointError(f"{dst}: the quantization of these settings, but {', '.join(bad[:3])} "
                                          "no longer match what was written (qerl_files.json): pass --force to "
                                          "write it again")
                return {"up_to_date": True, **read_json(dst / REPORT)["summary"]}
        raise CheckpointError(
            f"{dst}: already holds a different model or quantization; refusing to overwrite "
            "(pass --force to replace it)"
        )
    awq_report, smoothed = None, None
    if calibration == "awq":
        import tempfile

        layers = int(read_json(src / "config.json").get("num_hidden_layers") or 0)
        from qerl.quant.format import kept_layers

        kept = set(range(layers - kept_layers(layers, keep_bf16_last), layers))
        smoothed = Path(tempfile.mkdtemp(prefix="qerl-awq-", dir=dst.parent if dst.parent.exists() else None))
        try:
            awq_report = _awq_smoothed_copy(src, smoothed, scale_rule, kept, calibration_data, calibration_field,
                                            calibration_template, calibration_samples, calibration_seq_len, device,
                                            progress, calibration_solution_field)
        except (ValueError, FileNotFoundError) as e:  # the calibration data's own problems, named
            shutil.rmtree(smoothed, ignore_errors=True)
            raise CheckpointError(str(e)) from None
        except torch.cuda.OutOfMemoryError as e:
            shutil.rmtree(smoothed, ignore_errors=True)
            raise CheckpointError(_awq_oom(e, calibration_samples, calibration_seq_len)) from None
    try:
        rtn = smoothed is None or (awq_report or {}).get("guard", {}).get("kept") == "round-to-nearest"
        return _write(src if rtn else smoothed, src, dst, force, ignore, max_shard_size, progress,
                      scale_rule, settings, fingerprint, awq_report)
    finally:
        if smoothed is not None:
            shutil.rmtree(smoothed, ignore_errors=True)


def _awq_oom(e: Exception, samples: int, seq_len: int) -> str:
    """The message of an AWQ search that ran out of GPU memory: what it holds, how to make it smaller."""
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    from qerl.quant.awq import CHUNK_TOKENS

    return (f"AWQ ran out of GPU memory on {samples} x {seq_len} calibration tokens ({free / 2**30:.1f} of "
            f"{total / 2**30:.1f} GiB free now; the search holds the fp32 model, every layer's inputs over all "
            f"calibration tokens and runs forwards of {CHUNK_TOKENS} tokens; other processes on the GPU count): lower "
            f"--calibration-samples or --calibration-seq-len, or free the GPU (torch: {str(e).splitlines()[0][:200]})")


def _awq_smoothed_copy(src: Path, out: Path, scale_rule: str, kept: set[int], data, field: str, template: str,
                       samples: int, seq_len: int, device: str, progress: bool,
                       solution_field: str | None = None) -> dict:
    """Load ``src`` in fp32 on ``device``, fold AWQ scales searched on the calibration data into it (and clip), and
    save it (in the source's dtype, with its tokenizer files) to ``out``; returns ``{"groups": the per-group search
    report, "guard": the held-out KL of RTN and of AWQ}``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl.quant import awq

    dev = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    tok = AutoTokenizer.from_pretrained(src)
    pairs = awq.calibration_texts(data, field, solution_field)
    held = pairs[len(pairs) - min(64, len(pairs) // 10):] if len(pairs) >= 10 else []
    ids = awq.calibration_ids(tok, pairs[:len(pairs) - len(held)], samples, seq_len, template)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(dev).eval()
    cfg = read_json(src / "config.json")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    guard = {"held_out_samples": len(held)}
    if held:
        held_ids = awq.calibration_ids(tok, held, min(4, samples), min(256, seq_len), template)
        ref = awq.logprobs(model, held_ids)
        guard.update(held_out_tokens=int(held_ids.numel()),
                     kl_rtn=awq.kl_to(ref, model, held_ids, scale_rule, kept))
    groups = awq.smooth(model, ids, scale_rule, skip_layers=kept, progress=progress)
    if held:
        guard["kl_awq"] = awq.kl_to(ref, model, held_ids, scale_rule, kept)
        guard["awq_worse_than_rtn"] = guard["kl_awq"] > guard["kl_rtn"]
        if guard["awq_worse_than_rtn"]:
            import sys

            print(f"qerl quantize: AWQ's KL(bf16 || NVFP4) on {guard['held_out_tokens']} held-out calibration tokens "
                  f"({guard['kl_awq']:.4g}) exceeds its own alpha = 0 base's (round-to-nearest, {guard['kl_rtn']:.4g})"
                  ": AWQ would make this base worse, so the checkpoint is round-to-nearest's (quantize_report.json: "
                  "awq_guard)", file=sys.stderr)
            return {"groups": groups, "guard": {**guard, "kept": "round-to-nearest"}}
    guard["kept"] = "awq"
    report = {"groups": groups, "guard": guard}
    model.to(getattr(torch, dtype)).cpu().save_pretrained(out)
    tok.save_pretrained(out)
    return report


def _write(read_from: Path, src: Path, dst: Path, force: bool, ignore, max_shard_size, progress: bool,
           scale_rule: str, settings: dict, fingerprint: str, awq_report: dict | None) -> dict:
    """Quantize the model in ``read_from`` (``src`` itself, or its AWQ-smoothed copy) into ``dst``."""
    from tqdm.auto import tqdm

    cfg, index, units = plan(read_from, ignore)
    cfg = read_json(src / "config.json")  # (the smoothed copy's is transformers' rewrite of the same)
    limit = parse_size(max_shard_size)
    shards: list[list[_Unit]] = [[]]
    size = 0
    for u in units:
        if shards[-1] and size + u.out_bytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(u)
        size += u.out_bytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    report: dict = {}
    weight_map: dict[str, str] = {}
    total = 0
    with atomic_directory(dst, force=force) as tmp:
        bar = tqdm(total=len(units), desc=f"quantize {src.name}", unit="tensor", disable=not progress)
        for shard_name, shard_units in zip(names, shards):
            tensors: dict[str, torch.Tensor] = {}
            for u in shard_units:
                tensors.update(_quantize_unit(u, index, report, scale_rule))
                bar.update(1)
            save_shard(tensors, tmp / shard_name)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({k: shard_name for k in tensors})
            del tensors
        bar.close()
        if n > 1:
            write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        cfg = dict(cfg)
        cfg["quantization_config"] = quantization_config(ignore)
        write_json(tmp / "config.json", cfg)
        for f in src.iterdir():
            if f.is_file() and f.name not in _SKIP_COPY and f.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
                shutil.copy2(f, tmp / f.name)
        summary = {**_summary(report, total), "scale_rule": scale_rule}
        if awq_report is not None:
            groups, guard = awq_report["groups"], awq_report["guard"]
            gain = [r["loss"] / r["loss_rtn"] for r in groups.values() if r["loss_rtn"] > 0]
            summary["calibration"] = "awq"
            summary["awq_loss_vs_rtn_mean"] = sum(gain) / len(gain) if gain else 1.0
            summary.update({f"awq_{k}": v for k, v in guard.items() if k not in ("awq_worse_than_rtn", "kept")})
            summary["awq_kept"] = guard.get("kept", "awq")
            if "awq_worse_than_rtn" in guard:
                summary["awq_worse_than_rtn"] = guard["awq_worse_than_rtn"]
        write_json(tmp / REPORT, {"summary": summary, "layers": report,
                                  **({"awq": awq_report["groups"], "awq_guard": awq_report["guard"]}
                                     if awq_report is not None else {})})
        write_json(tmp / MANIFEST, {"source": str(src), "source_fingerprint": fingerprint,
                                    "settings": settings, "shards": names})
    return {"up_to_date": False, **summary}


def _summary(report: dict, total_bytes: int) -> dict:
    errs = [r["rel_fro_error"] for r in report.values()]
    sqnr = [r["sqnr_db"] for r in report.values()]
    return {
        "quantized_linears": len(report),
        "checkpoint_bytes": total_bytes,
        "rel_fro_error_mean": sum(errs) / len(errs),
        "rel_fro_error_max": max(errs),
        "sqnr_db_mean": sum(sqnr) / len(sqnr),
        "sqnr_db_min": min(sqnr),
        **_against_max6(report),
    }


def _against_max6(report: dict) -> dict:
    """With another scale rule: max6's mean SQNR on the same layers and the layers where the rule did worse."""
    if not report or any("max6_sqnr_db" not in r for r in report.values()):
        return {}
    worse = [n for n, r in report.items() if r["rel_fro_error"] > r["max6_rel_fro_error"]]
    return {"max6_sqnr_db_mean": sum(r["max6_sqnr_db"] for r in report.values()) / len(report),
            "layers_worse_than_max6": worse}
