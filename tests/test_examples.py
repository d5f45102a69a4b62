"""The offline example runs through the fused path and its loss goes down."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_tiny_offline_example_trains():
    spec = importlib.util.spec_from_file_location("tiny_offline", EXAMPLES / "tiny_offline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    first = module.main(steps=1)
    last = module.main(steps=4)
    assert last < first
