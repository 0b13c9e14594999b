"""GPU: what the first NVFP4 call at a new batch size costs, in a process with an empty kernel cache and in the next
process, which finds the compiled kernels in Triton's on-disk cache (issue 45: "compilation at a new batch size done
once per shape and cached on disk").

The parent runs this script twice as a child process with the same fresh ``TRITON_CACHE_DIR``. Each child calls
``nvfp4_matmul`` (forward, with and without a rank-32 LoRA adapter) and ``nvfp4_matmul_t`` (backward) eagerly on the
q/k/v and down projections of the chosen Qwen2.5 shapes at each M, in that order, and records the wall time of the
first call of each (synchronised) and of the call after it. The first process pays Triton's and ptxas's compiles;
the second only loads what the first wrote.

``python tools/compile_cache_check.py OUT.json [--models 0.5B 7B] [--ms 1 8 64 128 512 2048]``
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(models, ms) -> list[dict]:
    import torch

    from qerl.models.shapes import projections
    from qerl.quant import nvfp4
    from qerl_kernels import ops

    dev = torch.device("cuda")
    rows = []
    for model in models:
        for proj, (N, K) in projections(model).items():
            if proj not in ("qkv", "down"):
                continue
            p, s, gs = nvfp4.quantize(torch.randn(N, K, device=dev) * 0.02)
            la = torch.randn(32, K, device=dev, dtype=torch.bfloat16) * 0.02
            lb = torch.randn(N, 32, device=dev, dtype=torch.bfloat16) * 0.02
            for M in ms:
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
                calls = {"fwd": lambda: ops.nvfp4_matmul(x, p, s, gs),
                         "fwd_lora": lambda: ops.nvfp4_matmul(x, p, s, gs, None, None, lb, 2.0, lora_a=la),
                         "bwd": lambda: ops.nvfp4_matmul_t(dy, p, s, gs)}
                for call, fn in calls.items():
                    times = []
                    for _ in range(2):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fn()
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                    rows.append(dict(model=model, proj=proj, N=N, K=K, M=M, call=call,
                                     path=ops.route_of("fwd" if call != "bwd" else "bwd", x if call != "bwd" else dy,
                                                       p, s)[0], first_s=times[0], second_s=times[1]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file of every row of both processes")
    ap.add_argument("--models", nargs="+", default=["0.5B", "7B"])
    ap.add_argument("--ms", nargs="+", type=int, default=[1, 8, 64, 128, 512, 2048])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.models, a.ms)))
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        for label in ("empty cache", "from the disk cache"):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, a.out, "--child", "--models", *a.models, "--ms",
                                *map(str, a.ms)], env=env, capture_output=True, text=True)
            if r.returncode:
                sys.stderr.write(r.stderr[-3000:])
                return 1
            rows = json.loads(r.stdout.strip().splitlines()[-1])
            runs.append(dict(process=label, wall_s=time.perf_counter() - t0, rows=rows,
                             cache_files=sum(len(f) for _, _, f in os.walk(cache))))
    import torch

    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "runs": runs}, f, indent=1)
    for run in runs:
        firsts = [row["first_s"] for row in run["rows"]]
        print(f"{run['process']}: process {run['wall_s']:.1f} s, {len(firsts)} first calls: sum {sum(firsts):.2f} s, "
              f"median {1e3 * statistics.median(firsts):.1f} ms, max {1e3 * max(firsts):.0f} ms; second calls median "
              f"{1e3 * statistics.median(r['second_s'] for r in run['rows']):.2f} ms; cache files {run['cache_files']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
