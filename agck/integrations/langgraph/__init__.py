"""A LangGraph checkpointer on agck's stores: :class:`AgckSaver`.

    from agck.integrations.langgraph import AgckSaver

    saver = AgckSaver("ckpts/")              # or "sqlite:///ckpts.db", "postgresql://...", or a Store
    graph = builder.compile(checkpointer=saver)
    graph.invoke(inputs, {"configurable": {"thread_id": "chat-42"}})

Needs ``langgraph`` (``pip install 'agck[langgraph]'``); ``import agck`` does not
import this package. Every method of LangGraph's ``BaseCheckpointSaver`` is
implemented: ``get_tuple``, ``list``, ``put``, ``put_writes``, ``delete_thread``,
``delete_for_runs``, ``copy_thread``, ``prune`` and ``get_delta_channel_history``,
and their ``a...`` forms. The async forms run the sync ones on the saver's own
worker threads, as many as a Postgres store's pool has connections (``agck_pool``;
4 on other stores), so the event loop is never blocked by a store's I/O and the
conversations waiting beyond them hold no thread.

One process writes a thread at a time, as LangGraph assumes; deleting or pruning
a thread while a graph writes it is not supported (a put may refer to values the
deletion frees).

A checkpoint that fails verification is never skipped silently: reading it
raises :class:`DamagedCheckpointError`, whose ``.previous`` is the newest older
checkpoint of its namespace that reads back whole.

The details are beside the code they describe::

    layout.py     the store's runs and steps of a thread, namespace and checkpoint
                  (run names, checkpoint keys), what a record holds
    values.py     how channel values and pending writes are stored (agck's codec,
                  LangGraph's serializer without pickle) and the allowlist of
                  classes loading may rebuild
    reading.py    reading checkpoints back; a damaged checkpoint
    saver.py      AgckSaver: constructing it, writing, deleting, copying and pruning,
                  the async forms; what a crash part way leaves
"""

from ...errors import DependencyError


class LangGraphMissingError(DependencyError, ImportError):
    """``langgraph`` cannot be imported here (an ImportError too, so optional imports of this module work)."""

    default_hint = "pip install 'agck[langgraph]' (langgraph and langchain-core)"


# Every LangGraph name the modules below use, imported here first: a missing or too
# old LangGraph is then this one error, raised before any of them loads.
try:
    import ormsgpack  # noqa: F401
    from langchain_core.runnables import RunnableConfig  # noqa: F401
    from langgraph.checkpoint.base import (  # noqa: F401
        WRITES_IDX_MAP, BaseCheckpointSaver, ChannelVersions, Checkpoint, CheckpointMetadata, CheckpointTuple,
        DeltaChannelHistory, get_checkpoint_id, get_checkpoint_metadata, writes_sort_key)
    from langgraph.checkpoint.serde import _msgpack as _lg_msgpack  # noqa: F401
    from langgraph.checkpoint.serde import jsonplus as _jsonplus  # noqa: F401
    from langgraph.checkpoint.serde.types import _DeltaSnapshot  # noqa: F401
except ImportError as _e:   # pragma: no cover - exercised only where langgraph is absent
    raise LangGraphMissingError(f"agck.integrations.langgraph needs langgraph, which cannot be imported here ({_e})"
                                ) from None

from .layout import _Runs, checkpoint_key  # noqa: E402
from .reading import DamagedCheckpointError  # noqa: E402
from .saver import AgckSaver  # noqa: E402
from .values import _K_MSGPACK, _MARK  # noqa: E402  (the tests check the stored form)

__all__ = ["AgckSaver", "DamagedCheckpointError", "LangGraphMissingError", "checkpoint_key"]
