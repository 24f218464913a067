"""Disaggregated prefill/decode serving on one machine (issue 25, items 1, 3 and 5).

    kvforge serve OUT --prefill-workers P --decode-workers D [--threads-per-worker T]

Modules, by job: :mod:`.workers` (the worker-client interface the router drives, and its
implementation over a spawned process and a pipe), :mod:`.worker` (the worker process: an engine,
a scheduler, the message loop; KV hand-offs go through :mod:`kvforge.runtime.kv.shm`),
:mod:`.router` (:class:`DisaggServer`: the one-process server's surface for the HTTP layer,
routing, faults and restarts), :mod:`.metrics` (the per-role series).
"""
