"""The experiment suite: notebooks (``catalogue``) run headless by papermill (``runner``) into
``results/`` (``results``, ``machine``), the report built from them (``report``), the logic of
each notebook (``experiments``), the benchmark protocol (``bench``), the command line (``cli``).
"""
