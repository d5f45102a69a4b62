"""`tools/mutants.json` stays applicable: every listed break still finds its text in the code, so
`python tools/mutants.py` keeps testing what it says it tests (a refactor of a listed line updates
its entry)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import mutants  # noqa: E402


def test_every_mutation_applies_once_and_names_existing_tests():
    listed = mutants.load()
    ids = [m["id"].split()[0] for m in listed["mutants"]]
    assert len(ids) == len(set(ids)), "mutation ids must be unique"
    for test_file in listed["default_tests"]:
        assert (REPO / test_file).is_file(), test_file
    for mutant in listed["mutants"]:
        text = (REPO / mutant["file"]).read_text()
        assert text.count(mutant["old"]) == 1, mutant["id"]
        assert mutant["new"] != mutant["old"], mutant["id"]
        for test_file in mutant.get("tests", []):
            assert (REPO / test_file).is_file(), (mutant["id"], test_file)


def test_a_run_restores_the_file_it_broke(tmp_path, monkeypatch):
    target = tmp_path / "victim.py"
    target.write_text("VALUE = 1\n")
    test_file = tmp_path / "test_victim.py"
    test_file.write_text("from victim import VALUE\n\ndef test_value():\n    assert VALUE == 1\n")
    monkeypatch.setattr(mutants, "REPO", tmp_path)
    mutant = {"id": "X1", "file": "victim.py", "old": "VALUE = 1", "new": "VALUE = 2"}
    killed, detail = mutants.run_one(mutant, ["test_victim.py"])
    assert killed and "test_value" in detail
    assert target.read_text() == "VALUE = 1\n"
    survivor = {"id": "X2", "file": "victim.py", "old": "VALUE = 1", "new": "VALUE = 1  # same"}
    assert mutants.run_one(survivor, ["test_victim.py"])[0] is False
    assert target.read_text() == "VALUE = 1\n"
