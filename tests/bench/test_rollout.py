"""`qerl bench rollout` file handling on CPU: write, read back, merge two runs of one device, --plot."""
import pytest

from qerl.bench import rollout as br


def _row(model, batch, tok_s, device="Test GPU", base="nvfp4", engine="qerl"):
    return dict(device=device, model=model, base=base, engine=engine, batch=batch, prompt_len=256, gen_len=1024,
                tok_s=tok_s, ms_per_step=1e3 * batch / tok_s, floor_ms=1.0, frac_of_floor=2.0, peak_gb=5.0, note="n")


def test_write_read_merge(tmp_path):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "out"
    br.write([_row("7B", 8, 1000.0), _row("32B", 8, 300.0)], a, "Test GPU", 3000.0)
    br.write([_row("32B", 8, 500.0), _row("32B", 64, 2000.0)], b, "Test GPU", 3010.0)
    rows = br.read(a / "Test_GPU.csv")
    assert rows[0]["batch"] == 8 and rows[0]["tok_s"] == 1000.0
    path = br.merge([a / "Test_GPU.csv", b / "Test_GPU.csv"], out)
    merged = br.read(path)
    assert [(r["model"], r["batch"], r["tok_s"]) for r in merged] == [("7B", 8, 1000.0), ("32B", 8, 500.0),
                                                                      ("32B", 64, 2000.0)]
    md = (out / "Test_GPU.md").read_text()
    assert "Copy bandwidth 3010 GB/s" in md and md.count("| 32B |") == 2
    assert (out / "Test_GPU.png").read_bytes()[:4] == b"\x89PNG"
    # merged into --output's file set: a new run alone keeps the rows already there (its own replace theirs)
    c = tmp_path / "c"
    br.write([_row("14B", 8, 700.0), _row("32B", 64, 2100.0)], c, "Test GPU", 3000.0)
    merged = br.read(br.merge([c / "Test_GPU.csv"], out))
    assert sorted((r["model"], r["batch"], r["tok_s"]) for r in merged) == [
        ("14B", 8, 700.0), ("32B", 8, 500.0), ("32B", 64, 2100.0), ("7B", 8, 1000.0)]


def test_merge_refuses_two_devices_and_foreign_csvs(tmp_path):
    br.write([_row("7B", 8, 1000.0)], tmp_path / "a", "GPU A", 3000.0)
    br.write([_row("7B", 8, 1000.0, device="GPU B")], tmp_path / "b", "GPU B", 3000.0)
    with pytest.raises(ValueError, match="different devices"):
        br.merge([tmp_path / "a" / "GPU_A.csv", tmp_path / "b" / "GPU_B.csv"], tmp_path / "out")
    other = tmp_path / "x.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a `qerl bench rollout` CSV"):
        br.read(other)


def test_lengths_and_groups_columns_and_old_files(tmp_path):
    """Rows with a length distribution / GRPO groups are their own keys in a merge; files written before those
    columns read as fixed lengths, one sample per prompt; the floor is not computed for drawn lengths."""
    old = tmp_path / "old.csv"
    cols = [c for c in br.COLUMNS if c not in br.DEFAULTS]
    row = _row("7B", 64, 900.0)
    old.write_text(",".join(cols) + "\n" + ",".join(str(row[c]) for c in cols) + "\n")
    assert br.read(old)[0]["lengths"] == "fixed" and br.read(old)[0]["group_size"] == 1
    real = {**_row("7B", 64, 700.0), "group_size": 16, "lengths": "lognormal:median=300,sigma=0.9",
            "floor_ms": float("nan"), "frac_of_floor": float("nan")}
    br.write([real], tmp_path / "new", "Test GPU", 3000.0)
    path = br.merge([old, tmp_path / "new" / "Test_GPU.csv"], tmp_path / "out")
    merged = br.read(path)
    assert [(r["group_size"], r["lengths"], r["tok_s"]) for r in merged] == [
        (1, "fixed", 900.0), (16, "lognormal:median=300,sigma=0.9", 700.0)]
    md = (tmp_path / "out" / "Test_GPU.md").read_text()
    assert ("| 7B | nvfp4 | qerl | 64 | 16 | lognormal:median=300,sigma=0.9 | 256 | 1024 | 700 | 91.43 | — | — |"
            in md)


def test_cli_refuses_bad_lengths_and_groups(capsys):
    with pytest.raises(SystemExit):
        br.main(["--lengths", "lognormal:median=300"])
    assert "takes median, sigma" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--group-size 16: must be >= 1 and divide every batch"):
        br.main(["--batches", "8", "64", "--group-size", "16"])
