"""AlignedServe's ideas inside other serving engines (no change to their source): see
``vllm.py`` for vLLM's ``--scheduler-cls`` plug-in. Pure Python apart from the host engine;
nothing in AlignedServe's own serving path imports this package."""
