"""The documentation: the site builds with MkDocs (strict: a page left out of the nav, a broken link between pages
or an anchor that is not there fails), every relative link of the README, docs/ and config/README.md resolves to a
file or directory of the repository (and its #anchor to a heading of that Markdown file), and the README stays a
front door (<= 250 lines; the details live in docs/)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "config/README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (word characters, spaces and hyphens kept),
    spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks (links there are code, not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", prose(path.read_text()), re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))  # (inline code neither)
    return [a or b for a, b in LINK.findall(text)]


def broken(path: Path) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_the_link_checker_finds_broken_links_and_anchors(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Add an ablation\n\n[ok](b.md#the-b-part) [no](c.md) "
                                   "[bad anchor](b.md#nope) [self](#add-an-ablation) [web](https://x.org)\n"
                                   "```\n[in code](nowhere.md)\n```\n")
    (tmp_path / "b.md").write_text("# The B part\n")
    assert broken(tmp_path / "a.md") == ["c.md (no such file)", "b.md#nope (no heading #nope in b.md)"]
    assert slug("From TRL (transformers / PEFT / TRL users)") == "from-trl-transformers--peft--trl-users"


def test_the_docs_build_with_mkdocs(tmp_path):
    pytest.importorskip("mkdocs")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                          "--config-file", str(ROOT / "mkdocs.yml")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    built = {p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")}
    assert {"index.html", "features/index.html", "workflow/index.html", "training/index.html",
            "results/index.html", "gpu/index.html"} <= built


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for heading in ("Quick start", "Results", "Train your own model", "Add an ablation", "Where everything lives"):
        assert f"## {heading}" in text


def test_the_readmes_training_config_is_a_valid_qerl_train_config(tmp_path):
    """The README's my_run.yaml, as printed, loads through `qerl train`'s strict reader: QeRL, GRPO, GSM8K."""
    from qerl.train.config import load_config

    block = re.search(r"```yaml\n(# my_run\.yaml.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (tmp_path / "my_run.yaml").write_text(block)
    cfg = load_config(tmp_path / "my_run.yaml")
    assert (cfg.method, cfg.algorithm.name, cfg.data.task, cfg.steps) == ("qerl", "grpo", "gsm8k", 200)
