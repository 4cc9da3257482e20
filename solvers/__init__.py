"""fxpar's solvers: they take plain data (cost arrays, resharding matrices) and return plain data.

The intra-op ILP, the stage DP and the reference solvers arrive with the planning work; this
package is installed now so that ``fxpar.solvers`` is importable from every install.
"""
