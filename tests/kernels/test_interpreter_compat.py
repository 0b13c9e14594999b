"""Triton 3.6's interpreter under NumPy >= 2.4 (``qerl_kernels.interpreter_compat``): a loop bound taken from
``tl.program_id`` calls ``tl.tensor.__index__`` on a one-element 1-d array, which NumPy 2.4 refuses to convert. The
pinned NumPy (2.3) only warns about that conversion (a DeprecationWarning since 1.25), so the tests turn the warning
into an error: the same failure, whatever NumPy this machine has."""
import json
import os
import re
import subprocess
import sys

KERNEL = """
import json, sys, torch, triton, triton.language as tl
if sys.argv[1] == "fixed":
    from qerl_kernels import interpreter_compat
    print(json.dumps({"needed": interpreter_compat.patch(), "again": interpreter_compat.patch()}))
@triton.jit
def _count(out_ptr, PER: tl.constexpr):
    pid = tl.program_id(0)
    acc = 0
    for t in range(pid * PER, tl.minimum(7, (pid + 1) * PER)):  # bounds from program_id: __index__
        acc += t
    tl.store(out_ptr + pid, acc)
out = torch.zeros(3, dtype=torch.int32)
_count[(3,)](out, PER=3)
print(json.dumps({"out": out.tolist()}))
"""


def _run(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", KERNEL, mode],
                          env=env, capture_output=True, text=True, timeout=300)


def test_loop_bounds_from_program_id_run_under_the_interpreter():
    broken = _run("plain")  # Triton's interpreter as it ships: the conversion NumPy >= 2.4 refuses
    said = broken.stderr + broken.stdout  # 2.3: "Conversion of an array with ndim > 0 to a scalar is deprecated"
    assert broken.returncode != 0 and re.search(r"ndim > 0 to a scalar|0-dimensional arrays", said), said[-2000:]
    fixed = _run("fixed")
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    first, last = (json.loads(line) for line in fixed.stdout.strip().splitlines())
    assert first == {"needed": True, "again": True}
    assert last == {"out": [0 + 1 + 2, 3 + 4 + 5, 6]}  # t in [0, 3), [3, 6), [6, 7)


def test_the_kernels_import_the_fix():
    """Every route of the NVFP4 kernels reaches Triton's interpreter only after the fix (launch and nvfp4_matmul,
    which every kernel module imports, apply it)."""
    code = ("import qerl_kernels.nvfp4_mmv, triton.runtime.interpreter as i; "
            "print(getattr(i._patch_lang_tensor, 'qerl_index_fix', False))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
