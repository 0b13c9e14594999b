"""How a report prints a number: once, the same way in every file."""
from __future__ import annotations


def p1(x: float, sign: bool = False) -> str:
    """A fraction as points with one decimal, rounded half up from the two decimals the CSVs print (0.2135 ->
    "21.35" -> "21.4"), so that a number reads the same in every file."""
    from decimal import ROUND_HALF_UP, Decimal

    d = Decimal(f"{100 * x:.2f}").quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    d = abs(d) if d == 0 else d
    return f"{d:+}" if sign else f"{d}"


def csv_text(rows: list[list[str]]) -> str:
    """``rows`` as CSV text (``\\n`` line ends)."""
    import csv
    import io

    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def cell(text: str) -> str:
    """A Markdown table cell: a ``|`` escaped, line breaks as spaces (a label holding either would split the row)."""
    return " ".join(str(text).replace("|", "\\|").split("\n")).replace("\r", " ")
