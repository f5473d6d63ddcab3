"""``alignedserve bench``: load generation, metrics and reports for serving engines.

Modules, one job each:

* ``workloads`` / ``traces`` / ``arrivals`` / ``prompts``: what to send and when;
* ``client`` (+ ``openai_stream``): drive any OpenAI-compatible server over HTTP;
* ``inprocess``: drive an ``LLMEngine`` directly, for scheduler-policy comparisons;
* ``metrics``: TTFT, TPOT, ITL, E2E, throughput and goodput from per-request records;
* ``report`` / ``plots``: raw JSON, markdown summary, PNG plots;
* ``runner`` / ``cli``: targets x rates x rounds, ratios against a baseline, the command line.

Importing this package is cheap: torch, aiohttp and matplotlib are imported where they are used.
"""
