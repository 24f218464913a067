"""The serving planner (``kvforge plan --serve``): a latency model of the two phases
(:mod:`.latency`), a discrete-event simulation of the colocated and disaggregated servers under
Poisson arrivals (:mod:`.simulate`), and the comparison of layouts with a recommendation
(:mod:`.planner`). The GPU memory plan (``kvforge plan`` without ``--serve``) is
:mod:`kvforge.compile.plan`, a different job."""
