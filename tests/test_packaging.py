"""Packaging: the kernels directory is ``qerl_kernels/`` and imports as such (nothing of ours answers ``import kernels``,
the Hugging Face package's name, even run from the repository root), the CLI runs."""
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_ship_as_qerl_kernels():
    import qerl_kernels.ops

    assert Path(qerl_kernels.ops.__file__).resolve() == ROOT / "qerl_kernels" / "ops.py"
    assert [Path(p).resolve() for p in qerl_kernels.__path__][0] == ROOT / "qerl_kernels"
    assert not (ROOT / "kernels").exists()
    spec = importlib.util.find_spec("kernels")
    # no top-level `kernels` module of ours; if the HF `kernels` package is installed it is not ours
    assert spec is None or spec.origin is None or ROOT not in Path(spec.origin).resolve().parents


def test_import_kernels_from_the_repository_root_is_not_ours():
    # Python started in the repository root has it on sys.path: `import kernels` must not find a directory of ours
    # (as a namespace package it passed for HF's `kernels`, and every job logged transformers' failed probe)
    code = ("import importlib.util as u; s = u.find_spec('kernels'); "
            "print(None if s is None else [str(p) for p in (s.submodule_search_locations or [s.origin])])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    found = out.stdout.strip()
    assert found == "None" or str(ROOT) + "/kernels" not in found, found
    probe = subprocess.run([sys.executable, "-c", "from transformers.utils import is_kernels_available as f; "
                            "print(f())"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "get_kernel" not in probe.stderr and "kernels-community" not in probe.stderr


def test_every_qerl_subpackage_is_packaged():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "qerl").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject packages: {sorted(found - listed)}"
    assert "package-dir" not in cfg  # (qerl_kernels/ is the package's own name)


def test_importing_qerl_loads_no_torch():
    code = "import sys, qerl, qerl.models.arch, qerl.quant.format; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_help_for_every_verb():
    for verb in ([], ["build-tiny"], ["quantize"], ["export-merged"], ["sft"], ["train"]):
        out = subprocess.run([sys.executable, "-m", "qerl", *verb, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage: qerl" in out.stdout
