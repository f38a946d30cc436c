"""Every python example of the README runs alone, as a user runs it: a fresh
interpreter in an empty directory, nothing defined beforehand.

Examples that need torchrun, LangGraph, Lightning or Hugging Face are run by
their own tests (ELSEWHERE names each); this file runs every other one, and
checks that no example is left out of both."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from readme_examples import ROOT

BLOCKS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)

# a marker found in exactly one example -> the test that runs that example, alone, as a user would
ELSEWHERE = {
    "init_process_group": "tests/test_distributed.py::test_readme_multirank_example_runs_under_torchrun_and_resumes",
    "AgckSaver(": "tests/test_langgraph.py::test_readme_langgraph_example_runs",
    "AgckCheckpointIO()": "tests/test_lightning.py::test_readme_example_fits_then_resumes_at_its_last_step",
    "AgckCallback()": "tests/test_hf.py::test_readme_example_trains_then_resumes_with_nothing_left",
}


def _elsewhere(block: str) -> str | None:
    return next((test for marker, test in ELSEWHERE.items() if marker in block), None)


RUN_HERE = [b for b in BLOCKS if _elsewhere(b) is None]


def _name(block: str) -> str:
    first = next((line for line in block.splitlines() if line.strip() and not line.startswith(("import", "from"))),
                 block.splitlines()[0])
    return re.sub(r"\W+", "-", first.strip())[:40].strip("-")


def test_every_example_is_run_here_or_by_the_test_named():
    assert BLOCKS, "no ```python blocks found in README.md"
    for marker, test in ELSEWHERE.items():
        found = [b for b in BLOCKS if marker in b]
        assert len(found) == 1, f"{marker!r} is in {len(found)} README examples, not one"
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", open(os.path.join(ROOT, path)).read(), re.M), f"{test} not found"
    named = [b for b in BLOCKS if _elsewhere(b) is not None]
    assert len(RUN_HERE) + len(named) == len(BLOCKS) == len(RUN_HERE) + len(ELSEWHERE)


@pytest.mark.parametrize("block", RUN_HERE, ids=[_name(b) for b in RUN_HERE])
def test_readme_example_runs_alone(block, tmp_path, request):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if "torch" in block:
        pytest.importorskip("torch")
    if "AGCK_TEST_DSN" in block:           # an example on Postgres: the tests' server, or skipped saying why
        env["AGCK_TEST_DSN"] = request.getfixturevalue("pg_dsn")
    if "AGCK_TEST_S3" in block:            # an example on object storage: the tests' SeaweedFS
        from conftest import s3_url
        from crashtests.s3server import CREDENTIALS
        env.update(CREDENTIALS, AGCK_TEST_S3=s3_url(request.getfixturevalue("seaweed")))
    (tmp_path / "example.py").write_text(block)
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"the README example\n{block}\nfailed:\n{r.stderr[-3000:]}"
