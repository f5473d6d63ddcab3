"""Scale-out: engine replicas on Ray Serve behind one OpenAI-compatible endpoint.

``routing`` (which replica a request goes to; pure Python, shared with the simulator),
``replica`` (one engine as a Ray Serve deployment), ``ray_router`` (Ray Serve request routers
over ``routing``), ``stats_board`` (where replicas post their metrics), ``replicated`` (the
front end's ``EngineBackend`` over the replicas) and ``launch`` (``serve --replicas N``).
Only ``routing`` may be imported without Ray installed.
"""
