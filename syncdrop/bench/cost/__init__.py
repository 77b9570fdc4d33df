"""Analytical latency model of tensor-parallel inference with fewer sync points.

Time of one forward on ``N`` ranks = compute of the slowest rank + the sync points it waits at::

    T_forward = T_compute + n_ar * T_ar(payload_bytes, N)

One module per job (``syncdrop predict``, :mod:`syncdrop.bench.predict`, drives them):

* :mod:`.arch`: named architectures and the slowest rank's share of a block (weights per rank);
* :mod:`.comm`: ``T_ar``, the ring all-reduce on the real link plus an emulated one (alpha-beta);
* :mod:`.compute`: FLOPs and bytes of a prefill or a decode step, and ``T_compute`` (roofline);
* :mod:`.forward`: TTFT and decode step = compute + the plan's collectives;
* :mod:`.bench_files`: reading ``syncdrop bench`` result files, older formats included;
* :mod:`.fit`: calibration of the CPU model on bench files run without link emulation;
* :mod:`.check`: predicted vs measured on bench files, emulated links added;
* :mod:`.cluster`: predictions for a GPU cluster from a named hardware profile.

Each module's docstring states its part of the maths; docs/cost_model.md puts it together.
"""
