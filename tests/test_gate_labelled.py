"""``bench/gate_labelled.py``: the gate's final label against resolved labels, robust to the data it meets."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "examples" / "replay" / "forbidden-then-permitted-tests.jsonl"
SUBMITTED = Path(__file__).parent / "fixtures" / "trajectories" / "done-while-last-test-run-failed.jsonl"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gate_labelled.py"), *args], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


def test_the_confusion_table_counts_every_file_and_survives_bad_ones(tmp_path: Path) -> None:
    folder = tmp_path / "runs"
    folder.mkdir()
    shutil.copy(SAMPLE, folder / "verified-run.jsonl")
    shutil.copy(SUBMITTED, folder / "submitted-run.jsonl")
    (folder / "broken.jsonl").write_text('{"role": "user", "content": "hi"}\n{not json\n')
    (folder / "nobody-labelled-me.jsonl").write_text(SAMPLE.read_text())
    (folder / "empty.jsonl").write_text("\n")  # no messages: failed to replay, not a "no verdict" run
    labels = tmp_path / "labels.csv"
    labels.write_text("file,resolved,note\nverified-run.jsonl,TRUE,x\nsubmitted-run.jsonl,0,\nbroken.jsonl,yes,\n"
                      "gone.jsonl,false,\nwhat.jsonl,maybe,\nempty.jsonl,true,\n")
    done = bench(str(folder), str(labels))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "| verified | 1 | 0 | 1 |" in out  # the sample run ends verified and is labelled resolved
    assert "| unverified | 0 | 1 | 1 |" in out  # the submitted run's stop has a gap: no passing check
    assert "| total | 1 | 1 | 2 |" in out
    assert "precision of verified 100% (1/1); recall of verified 100% (1/1); base rate (resolved) 50% (1/2)" in out
    assert "2 failed to replay" in out and "broken.jsonl:2: not JSON" in out and "empty.jsonl holds no messages" in out
    assert "1 file(s) without a label" in out and "- nobody-labelled-me.jsonl" in out
    assert "1 label(s) without a file" in out and "- gone.jsonl" in out
    assert "1 unreadable label row(s)" in out and "line 6: resolved is 'maybe'" in out
    assert "scripted verifier policy" in out


def test_unreadable_labels_or_an_empty_folder_exit_2(tmp_path: Path) -> None:
    (tmp_path / "labels.csv").write_text("name,ok\na,1\n")
    done = bench(str(tmp_path), str(tmp_path / "labels.csv"))
    assert done.returncode == 2 and "file and resolved" in done.stderr
    (tmp_path / "labels.csv").write_text("file,resolved\n")
    done = bench(str(tmp_path), str(tmp_path / "labels.csv"))
    assert done.returncode == 2 and "no trajectories" in done.stderr
