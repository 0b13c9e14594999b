"""reports/real/README.md prints each number as the committed CSVs hold it, rounded once (half up from the two
decimals the CSVs carry: 21.35 -> 21.4 everywhere): its sweep, bases and arm tables are rebuilt here from
lr_sweep.csv, bases/bases.csv, runs.csv and accuracy.csv and must appear in the README as they are."""
import csv
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "reports/real"


def one(x: str | float, sign: bool = False, minus: str = "−") -> str:
    """A number as the report prints it: one decimal, half up, U+2212 for a minus sign."""
    d = Decimal(str(x)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    d = abs(d) if d == 0 else d
    s = f"{d:+}" if sign else f"{d}"
    return s.replace("-", minus)


def _rows(path):
    return list(csv.DictReader(open(path)))


def _ci(r, lo="ci95_low", hi="ci95_high", sign=False):
    return f"[{one(r[lo], sign)}, {one(r[hi], sign)}]"


def sweep_table() -> str:
    rows = {(r["method"], r["lr"]): r for r in _rows(REAL / "lr_sweep.csv")}
    out = ["| rate | bf16 LoRA | QeRL |", "|---|---|---|"]
    for lr, shown in (("1e-05", "1e-5"), ("3e-05", "3e-5"), ("0.0001", "1e-4"), ("0.0003", "3e-4")):
        cells = []
        for m in ("lora", "qerl"):
            r = rows[(m, lr)]
            if float(r["val_pass1"]) == 0:
                cells.append(f"0.0 (collapsed: {one(100 * float(r['train_truncated_frac']))}% of training "
                             "completions hit the cap)")
            else:
                cells.append(f"{one(r['val_pass1'])}{' (chosen)' if r['chosen'] == 'yes' else ''} {_ci(r)}")
        out.append(f"| {shown} | {' | '.join(cells)} |")
    return "\n".join(out)


BASES = (("qwen2.5-coder-0.5b", "bf16"), ("q05b-rtn", "RTN (max6)"), ("q05b-fos", "four-over-six"),
         ("q05b-fos-tail", "four-over-six + bf16 tail"), ("q05b-awq", "AWQ"), ("q05b-awq-fos", "AWQ + four-over-six"),
         ("q05b-awq-fos-tail", "AWQ + four-over-six + tail"))


def bases_table() -> str:
    rows = {r["model"]: r for r in _rows(REAL / "bases/bases.csv")}
    out = ["| base | val pass@1 | test pass@1 [95%] | gap to bf16 on test [95%, paired] | KL(bf16 ‖ base) | "
           "perplexity |", "|---|---|---|---|---|---|"]
    for model, name in BASES:
        r = rows[model]
        gap = "—" if not r["gap_vs_bf16"] else \
            f"{one(r['gap_vs_bf16'], True)} {_ci(r, 'gap_ci95_low', 'gap_ci95_high', True)}"
        kl = "0" if float(r["kl_vs_bf16"]) == 0 else f"{float(r['kl_vs_bf16']):.4f}"
        out.append(f"| {name}{' (chosen)' if r['chosen'] == 'yes' else ''} | {one(r['gsm8k_val_pass1'])} | "
                   f"{one(r['gsm8k_test500_pass1'])} {_ci(r)} | {gap} | {kl} | {float(r['ppl']):.2f} |")
    return "\n".join(out)


ARMS = (("lora", "bf16 LoRA"), ("lora_aqn", "bf16 LoRA + AQN"), ("nvfp4_lora", "NVFP4 LoRA (RTN base)"),
        ("qerl", "QeRL (RTN base)"),
        ("qerl@q05b-awq-fos-tail", "QeRL on the best base (AWQ + four-over-six + bf16 tail)"),
        ("qlora", "QLoRA (NF4 base)"), ("qerl_2x_lora_lr", "QeRL at 2× bf16 LoRA's tuned rate (the paper's ratio)"))


def arm_table() -> str:
    acc = {r["method"]: r for r in _rows(REAL / "accuracy.csv")}
    runs = _rows(REAL / "runs.csv")
    out = ["| arm | rate | seed 0 | seed 1 | seed 2 | seed 3 | mean [95% interval, problems x seeds] | gain over its "
           "base | completions cut |", "|---|---|---|---|---|---|---|---|---|"]
    for method, name in ARMS:
        mine = sorted((r for r in runs if r["method"] == method), key=lambda r: int(r["seed"]))
        a = acc[method]
        gain = Decimal(a["pass1_mean"]) - Decimal(a["base_pass1"])
        lr = f"{float(mine[0]['lr']):.0e}".replace("e-0", "e-")
        cut = ", ".join(f"{one(100 * float(r['truncated_frac']))}%" for r in mine)
        out.append(f"| {name} | {lr} | {' | '.join(one(r['pass1_after']) for r in mine)} | "
                   f"{one(a['pass1_mean'])} {_ci(a)} | {one(gain, True, '-')} (base {one(a['base_pass1'])}) | {cut} |")
    return "\n".join(out)


def test_the_real_reports_tables_print_the_csvs_numbers_rounded_once():
    text = (REAL / "README.md").read_text()
    for name, table in (("sweep", sweep_table()), ("bases", bases_table()), ("arms", arm_table())):
        assert table in text, f"reports/real/README.md: the {name} table differs from its CSVs; expected:\n{table}"


def test_one_rounding_rule():
    assert [one("21.35"), one("-4.05", True), one("0.25", True), one("29.45"), one("-0.04", True)] == \
        ["21.4", "−4.1", "+0.3", "29.5", "+0.0"]
