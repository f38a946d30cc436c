"""Integrations of agck's stores with other frameworks. Each lives in its own
module and imports its framework there, so ``import agck`` never needs them:

    agck.integrations.langgraph    AgckSaver, a LangGraph checkpointer (pip install 'agck[langgraph]')
"""
