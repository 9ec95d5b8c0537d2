"""The logic of each experiment notebook, where tests can reach it.

One module per notebook; notebooks call these functions, show and save.
"""
