"""One target under atheris: ``python -m fuzz.run TARGET WORKDIR SEEDDIR -- [libFuzzer flags]``.

agck is imported under atheris's instrumentation, so libFuzzer sees which of its
branches each input reaches. A target's input that raises anything but an
AgckError, runs past ``-timeout`` or grows past ``-rss_limit_mb`` is a finding:
libFuzzer writes it under ``-artifact_prefix`` and exits non-zero."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["agck"]):
    import agck  # noqa: F401
    from agck import checkpoint, cli, codec, format, journalrec, sharded  # noqa: F401
    from agck.stores import dsn, objclient, s3log, sqlite  # noqa: F401

from fuzz.targets import TARGETS  # noqa: E402


def main() -> None:
    name, dirs, flags = sys.argv[1], [], []
    rest = sys.argv[2:]
    if "--" in rest:
        i = rest.index("--")
        dirs, flags = rest[:i], rest[i + 1:]
    else:
        dirs = rest
    target = TARGETS[name]
    atheris.Setup([sys.argv[0], *flags, *dirs], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
