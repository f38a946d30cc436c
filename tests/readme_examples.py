"""The README's python examples, found by a marker and run as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example(marker: str) -> str:
    """The one README python block that contains ``marker``."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if marker in b]
    return block


def run_as_script(marker: str, cwd, times: int = 2, timeout: float = 300) -> list[str]:
    """Write the example to ``cwd/example.py`` and run it ``times`` times in a fresh
    interpreter (each run must succeed); the last line each printed."""
    (cwd / "example.py").write_text(example(marker))
    env = {**os.environ, "PYTHONPATH": ROOT}
    last = []
    for _ in range(times):
        r = subprocess.run([sys.executable, "example.py"], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout)
        assert r.returncode == 0, r.stderr[-2000:]
        last.append(r.stdout.strip().splitlines()[-1])
    return last
