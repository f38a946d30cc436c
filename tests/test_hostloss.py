"""Host-loss trials for tiered checkpoints, a few (crashtests/hostloss.py; the full
campaign: ``python -m crashtests.hostloss --trials 200``): a pipeline SIGKILLed at a
random step, its local tier deleted or damaged, a replacement host restored: nothing
acknowledged durable lost, nothing corrupt, the newest step the durable tier holds
whole restored, and the resumed run ends where an uninterrupted one does. (6 here, a
sqlite and a Postgres durable tier in turn; AGCK_HOSTLOSS_TRIALS for more.) And the
same for a job of 4 ranks in 2 hosts with replicas on peers (crashtests/hostloss_ranks.py;
``python -m crashtests.hostloss_ranks --trials 200``): 3 here."""

from __future__ import annotations

import os

import pytest

from crashtests import hostloss, hostloss_ranks


def test_a_few_host_losses_lose_nothing_acknowledged_durable():
    seed = int(os.environ.get("AGCK_HOSTLOSS_SEED", "7"))
    s = hostloss.campaign(int(os.environ.get("AGCK_HOSTLOSS_TRIALS", "6")), ["sqlite", "postgres"], seed,
                          quiet=True)
    bad = [r for r in s["rows"] if r["verdict"] != "ok"]
    assert not bad, bad
    assert s["killed"] >= 1 and s["trials"] >= 6


def test_a_few_host_losses_of_a_multi_rank_job_lose_nothing_acknowledged_durable():
    pytest.importorskip("torch")
    seed = int(os.environ.get("AGCK_HOSTLOSS_SEED", "7"))
    s = hostloss_ranks.campaign(int(os.environ.get("AGCK_HOSTLOSS_RANK_TRIALS", "3")), ["sqlite", "postgres"], seed,
                                quiet=True)
    bad = [r for r in s["rows"] if r["verdict"] != "ok"]
    assert not bad, bad
    assert s["trials"] >= 3
