"""Host-loss trials for tiered checkpoints, a few (crashtests/hostloss.py; the full
campaign: ``python -m crashtests.hostloss --trials 200``): a pipeline SIGKILLed at a
random step, its local tier deleted or damaged, a replacement host restored: nothing
acknowledged durable lost, nothing corrupt, the newest step the durable tier holds
whole restored, and the resumed run ends where an uninterrupted one does. (6 here, a
sqlite and a Postgres durable tier in turn; AGCK_HOSTLOSS_TRIALS for more.)"""

from __future__ import annotations

import os

from crashtests import hostloss


def test_a_few_host_losses_lose_nothing_acknowledged_durable():
    seed = int(os.environ.get("AGCK_HOSTLOSS_SEED", "7"))
    s = hostloss.campaign(int(os.environ.get("AGCK_HOSTLOSS_TRIALS", "6")), ["sqlite", "postgres"], seed,
                          quiet=True)
    bad = [r for r in s["rows"] if r["verdict"] != "ok"]
    assert not bad, bad
    assert s["killed"] >= 1 and s["trials"] >= 6
