#!/usr/bin/env python3
"""One target under atheris: ``python -m fuzz.run TARGET DIR... -- [libFuzzer flags]``.

agck is imported under atheris's instrumentation, so libFuzzer sees which of its
branches each input reaches. A target's input that raises anything but an
AgckError, runs past ``-timeout`` or grows past ``-rss_limit_mb`` is a finding:
libFuzzer writes it under ``-artifact_prefix`` and exits non-zero."""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a file by -merge

# torch imported now, not by the codec on the first input that holds a tensor: that import
# takes longer than -timeout allows one input, and libFuzzer would report it as a hang
try:
    import torch  # noqa: F401
except ImportError:
    pass

with atheris.instrument_imports(include=["agck"]):
    import agck  # noqa: F401
    from agck import checkpoint, chunking, cli, codec, format, journalrec, sharded  # noqa: F401
    from agck.stores import content, dsn  # noqa: F401
    from agck.stores.s3 import client, log  # noqa: F401
    from agck.stores.sqlite import store  # noqa: F401
    if os.environ.get("AGCK_FUZZ_TARGET", sys.argv[1] if len(sys.argv) > 1 else None) == "commit_part":
        try:     # torch.distributed: a "dcp" commit record's metadata; only where it is read
            from agck import dcp  # noqa: F401
        except ImportError:
            pass

from fuzz.targets import TARGETS  # noqa: E402


def main() -> None:
    # the target travels in the environment: libFuzzer's -merge runs this file again with
    # its own arguments only
    args = sys.argv[1:]
    name = os.environ.get("AGCK_FUZZ_TARGET")
    if name is None:
        name, args = args[0], args[1:]
        os.environ["AGCK_FUZZ_TARGET"] = name
    if "--" in args:     # DIRS -- FLAGS
        i = args.index("--")
        args = args[i + 1:] + args[:i]
    atheris.Setup([sys.argv[0], *args], TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
