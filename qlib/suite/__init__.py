"""The experiment suite: notebooks (``catalogue``) run headless by papermill (``runner``) into
``results/`` (``results``, ``machine``), alone or as parameter sweeps on a local or Dask executor
(``sweep``, ``cluster``, ``params``), the report built from them (``report``, ``plots``), the
logic of each notebook (``experiments``), the benchmark protocol (``bench``), the command line
(``cli``).
"""
