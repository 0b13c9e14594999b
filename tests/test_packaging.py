"""Packaging: the kernels directory imports as ``qerl_kernels`` (never ``kernels``), the CLI runs."""
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_ship_as_qerl_kernels():
    import qerl_kernels.ops

    assert Path(qerl_kernels.ops.__file__).resolve() == ROOT / "kernels" / "ops.py"
    assert [Path(p).resolve() for p in qerl_kernels.__path__][0] == ROOT / "kernels"
    spec = importlib.util.find_spec("kernels")
    # no top-level `kernels` module of ours; if the HF `kernels` package is installed it is not ours
    assert spec is None or spec.origin is None or ROOT not in Path(spec.origin).resolve().parents


def test_repo_root_on_sys_path_does_not_fake_the_hf_kernels_package():
    # Python started in the repository root sees ./kernels: it must not pass for HF's `kernels`.
    code = ("import kernels, sys; print(getattr(kernels, '__file__', None));"
            "from transformers.utils import is_kernels_available as f; print(f())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["None", "False"]  # a namespace package, not "available"


def test_every_qerl_subpackage_is_packaged():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "qerl").rglob("__init__.py")}
    assert found <= listed, f"add to pyproject packages: {sorted(found - listed)}"
    assert cfg["package-dir"] == {"qerl_kernels": "kernels"}


def test_importing_qerl_loads_no_torch():
    code = "import sys, qerl, qerl.models.arch, qerl.quant.format; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_help_for_every_verb():
    for verb in ([], ["build-tiny"], ["quantize"], ["export-merged"], ["sft"], ["train"]):
        out = subprocess.run([sys.executable, "-m", "qerl", *verb, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage: qerl" in out.stdout
