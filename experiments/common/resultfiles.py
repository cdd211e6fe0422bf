"""Where an experiment writes its results: a new dated file, never one that exists.

The results under experiments/results/ are tracked documents that docs/ cite; running a README
command must not overwrite them. `new_result_file("compare-quick-cpu")` is
`experiments/results/compare-quick-cpu_<date>.json`, or `..._<date>-2.json` (-3, ...) when that
exists. A script's `--out` still writes exactly where it says.
"""

from __future__ import annotations

import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def new_result_file(stem: str, suffix: str = ".json", companions: tuple[str, ...] = ()) -> Path:
    """A path in experiments/results that does not exist yet (nor do its `companions`: other
    suffixes written next to it, e.g. the chart's '.png')."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = f"{stem}_{datetime.date.today().isoformat()}"
    n = 1
    while True:
        path = RESULTS / f"{base}{'' if n == 1 else f'-{n}'}{suffix}"
        if not path.exists() and not any(path.with_suffix(c).exists() for c in companions):
            return path
        n += 1
