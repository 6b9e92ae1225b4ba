"""Tests of the README, the results/ files and bench.py's output side (benchmarks/report.py, the progress lines)."""
import glob
import io
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import harness, report

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "README.md")


def readme_text():
    with open(README) as f:
        return f.read()


# ----------------------------------------------------------------------------- the README

def test_readme_is_at_most_16000_bytes():
    assert os.path.getsize(README) <= 16_000


def test_readme_results_table_is_what_the_newest_results_file_gives():
    current, generated = report.readme_section(readme_text())
    assert current == generated, "run `python bench.py --readme` after adding a results/ file"


def test_readme_table_figures_are_the_newest_json_figures():
    """Independent of the generator: the run named above the table is the newest non-quick JSON by its
    recorded date, and the table's figures are that JSON's, rounded to 3 significant digits."""
    runs = []
    for path in glob.glob(os.path.join(HERE, "results", "*.json")):
        r = json.load(open(path))
        if r["sizes"]["name"] != "quick":
            runs.append((r["date"], path, r))
    date, path, r = max(runs)
    text = readme_text()
    section = text[text.index(report.BEGIN):text.index(report.END)]
    assert f"results/{os.path.basename(path)}" in section and f"`{r['commit']}`" in section and date[:16] in section
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in section.splitlines() if line.startswith("| ")}
    if "peers" in r:
        [(name, cells)] = [(k, v) for k, v in rows.items() if k.startswith("offline")]
        assert float(cells[0].replace(",", "")) == float(f"{r['peers']['nanoserve']['default']['useful_tok_s']:.3g}")
    if "throughput" in r:
        cells = rows["continuous batching (useful out tok/s)"]
        assert cells[2] == f"{r['throughput']['continuous_over_best_static']:.2f}x"


def test_readme_test_command_is_what_ci_runs():
    ci = open(os.path.join(HERE, ".ci", "run")).read().strip().splitlines()[-1]
    assert ci.endswith("python -m pytest -q -rs test_all.py") and ci in readme_text().splitlines()


def test_readme_and_docs_name_no_private_context():
    """A reader of a fork sees no issue numbers, sessions or dated run logs in the README."""
    text = readme_text()
    for pattern in (r"\bissues?\b", r"\bsessions?\b", r"#\d+", r"\d\d:\d\d UTC", r"\bthis run\b"):
        assert not re.search(pattern, text[:text.index(report.BEGIN)] + text[text.index(report.END):], re.I), pattern
    for path in glob.glob(os.path.join(HERE, "docs", "*.md")):
        assert not re.search(r"\bissues?\b|\bsessions?\b", open(path).read(), re.I), path
        assert os.path.getsize(path) <= 9_000, path


# ----------------------------------------------------------------------------- results/ files

def test_every_results_json_names_date_machine_cpu_flags_and_commit():
    paths = glob.glob(os.path.join(HERE, "results", "*.json"))
    assert paths
    for path in paths:
        r = json.load(open(path))
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", r["date"]), path
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*-\d+c", r["machine"]), path
        assert isinstance(r["cpu_flags"], list) and r["cpu_flags"] and r["cpu_model"], path
        assert re.fullmatch(r"[0-9a-f]{7,40}", r["commit"]), path
        stem = os.path.basename(path)[:-len(".json")]
        assert stem.startswith(f"{r['date'][:10]}-{r['machine']}-{r['commit']}"), path
        assert os.path.exists(path[:-len(".json")] + ".md"), f"{path}: the printed tables belong beside it"


@pytest.mark.parametrize("info, cores, gpu, slug", [
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC", "cpu family": "25", "model": "17",
      "flags": "avx2 fma avx512f avx512_bf16"}, 2, "none", "epyc-zen4-2c"),
    ({"vendor_id": "AuthenticAMD", "model name": "AMD EPYC 7B13", "cpu family": "25", "model": "1",
      "flags": "avx2 fma"}, 2, "none", "epyc-zen3-2c"),
    ({"vendor_id": "AuthenticAMD", "model name": "AMD Ryzen 9 9950X", "cpu family": "26", "model": "68",
      "flags": "avx2 avx512f"}, 16, "none", "ryzen-zen5-16c"),
    ({"vendor_id": "GenuineIntel", "model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "143",
      "flags": "avx2 avx512f amx_tile amx_bf16"}, 16, "NVIDIA H100 80GB HBM3", "h100-xeon-amx-16c"),
    ({"vendor_id": "GenuineIntel", "model name": "Intel(R) Core(TM) i7-10700", "cpu family": "6", "model": "165",
      "flags": "avx2 fma"}, 8, "none", "intel-avx2-8c"),
])
def test_machine_slug_names_the_cpu_line_generation_and_cores(info, cores, gpu, slug):
    assert report.machine_slug(info, cores, gpu) == slug


def test_write_run_keeps_printed_tables_and_never_overwrites(tmp_path):
    printed = "# nanoserve benchmark\n\n## Machine\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
    r = {"date": "2026-01-02 03:04:05 UTC", "machine": "epyc-zen4-2c", "cpu_model": "AMD EPYC", "cpu_flags": ["avx2"],
         "commit": "abcdef1", "dirty": False, "sizes": {"name": "quick"}, "x": float("inf")}
    first = report.write_run(dict(r), printed, str(tmp_path))
    second = report.write_run(dict(r), printed, str(tmp_path))
    assert [os.path.basename(p) for p in first] == ["2026-01-02-epyc-zen4-2c-abcdef1-quick.md", "2026-01-02-epyc-zen4-2c-abcdef1-quick.json"]
    assert [os.path.basename(p) for p in second] == ["2026-01-02-epyc-zen4-2c-abcdef1-quick-2.md", "2026-01-02-epyc-zen4-2c-abcdef1-quick-2.json"]
    assert open(first[0]).read() == printed
    assert json.load(open(first[1]))["x"] is None                     # JSON has no inf
    with pytest.raises(FileNotFoundError):                            # --quick runs never feed the README
        report.newest_results(str(tmp_path))


def test_update_readme_rewrites_only_between_the_markers(tmp_path):
    src = sorted(glob.glob(os.path.join(HERE, "results", "*.json")))
    runs = tmp_path / "results"
    runs.mkdir()
    for i, path in enumerate(src):                                    # the same runs, the first made newest
        r = json.load(open(path))
        r["date"] = "2099-01-01 00:00:00 UTC" if i == 0 else r["date"]
        (runs / os.path.basename(path)).write_text(json.dumps(r))
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{report.BEGIN}\nold table\n{report.END}\nafter\n")
    assert report.update_readme(str(readme), str(runs)) == str(runs / os.path.basename(src[0]))
    text = readme.read_text()
    assert text.startswith(f"before\n{report.BEGIN}\n") and text.endswith(f"{report.END}\nafter\n")
    assert "old table" not in text and "2099-01-01 00:00 UTC" in text


def test_bench_out_dir_writes_exactly_what_it_printed(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    p = subprocess.run([sys.executable, "bench.py", "--quick", "copy_on_write", "--out", str(tmp_path)],
                       cwd=HERE, env=env, timeout=300, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    [md] = glob.glob(str(tmp_path / "*.md"))
    [js] = glob.glob(str(tmp_path / "*.json"))
    printed, last = p.stdout.rsplit("results: ", 1)
    assert open(md).read() == printed and md in last and js in last
    r = json.load(open(js))
    commit = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    assert r["commit"] == commit and r["sections"] == ["copy_on_write"] and r["sizes"]["name"] == "quick"
    assert r["copy_on_write"]["cow_peak_blocks"] == r["copy_on_write"]["one_prompt_plus_4_tails"]
    assert "\r" not in p.stderr                                       # no progress bar redraws in a log


# ----------------------------------------------------------------------------- progress in a log file

def test_progress_in_a_log_is_plain_lines_at_most_every_interval(monkeypatch, capsys):
    now = [1000.0]
    monkeypatch.setattr(harness.LineProgress, "last_print", 0.0)
    bar = harness.LineProgress(total=600, desc="walk", unit="tok", interval=10.0, clock=lambda: now[0])
    for _ in range(600):                      # 600 updates over 60 s
        now[0] += 0.1
        bar.update(1)
    bar.close()
    short = harness.LineProgress(total=5, desc="short", unit="tok", interval=10.0, clock=lambda: now[0])
    for _ in range(5):                        # a bar shorter than the interval stays silent
        now[0] += 0.1
        short.update(1)
    short.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and 5 <= len(lines) <= 60 / 10 + 1, lines
    assert lines[-1].startswith("walk: 600/600 tok") and not any(ln.startswith("short") for ln in lines)


def test_progress_off_a_terminal_is_line_mode(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())                 # not a TTY
    assert isinstance(harness.progress(10, "x", "tok"), harness.LineProgress)
