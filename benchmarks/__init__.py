"""Benchmarks of fastlora_peft beside PEFT and the frozen floor: `python -m benchmarks.run --help`.

`harness` times and measures a step, `cases` builds the blocks and models, `report` turns result rows
into tables, target checks and plots, `run` is the command-line entry. See docs/benchmarks.md.
"""
