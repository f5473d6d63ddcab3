"""The simulator: the engine's real schedulers against a cost model of GPU servers.

Modules, one job each:

* ``hardware`` / ``models``: profiles as data (devices, links, hosts; per-token model costs);
* ``costmodel``: prices one step's compute (roofline per operation, decode-attention kernels);
* ``executor``: ``SimulatedExecutor``, the executor interface on a virtual clock, copies
  priced on the links they cross;
* ``config`` / ``variants``: what one run simulates; policy variants on the command line;
* ``runner``: the engine loop (schedule -> execute -> update) over a workload in virtual time;
* ``command`` / ``cli``: ``alignedserve simulate`` and ``alignedserve calibrate``;
* ``calibrate``: fits the ``cpu-local`` profile from the real engine and validates it;
* ``experiments`` / ``figures``: the simulated evaluation in docs/simulation.md.

Importing this package is cheap: torch and matplotlib are imported where they are used.
"""
