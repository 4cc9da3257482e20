"""Planning: choosing a strategy for every node of an annotated Program.

- :mod:`fxpar.planning.cost`: THE cost and memory model (roofline compute, alpha-beta
  collectives, memory per device, saved activations, numbered layers), read by the problem
  builder, the plan report and the stage DP alike;
- :mod:`fxpar.planning.problem`: the annotated graph to the solvers' plain-data problem
  (coarsening, repeated layers) and the answer back onto the graph;
- :mod:`fxpar.planning.plan`: :class:`Plan` and :func:`plan_program`;
- :mod:`fxpar.passes.manual`: hand-written plans (data, tensor and fully sharded parallelism);
- :mod:`fxpar.planning.plan_file`: plans saved as editable JSON and loaded back;
- :mod:`fxpar.planning.grouping`: which collectives travel together (gradient buckets,
  per-layer gathers, views recomputed from the backward's gather);
- :mod:`fxpar.planning.collective_schedule`: every conversion of a planned graph decided once
  as data, which the lowering emits and the report and the stage DP count;
- :mod:`fxpar.planning.report`: the plan report (time, memory, collectives per layer).
"""
