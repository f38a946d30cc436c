"""Integrations of agck's stores with other frameworks. Each lives in its own
module and imports its framework there, so ``import agck`` never needs them:

    agck.integrations.langgraph    AgckSaver, a LangGraph checkpointer (pip install 'agck[langgraph]')
    agck.integrations.lightning    AgckCheckpointIO, a Lightning CheckpointIO plugin; newest_valid_checkpoint
                                   (pip install 'agck[lightning]')
    agck.integrations.hf           AgckCallback / AgckTrainer: verified, durable Trainer checkpoints;
                                   newest_valid_checkpoint (pip install 'agck[hf]')
"""
