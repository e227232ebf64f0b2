"""The command-line programs: the ``deeppart`` command (``cli``) and what its
subcommands run (``demo``, ``checkpoint_inspect``, ``export``, ``simulate``,
``calibrate``, ``plotting``, ``cache_cli``).

Nothing in the library imports from here (scripts/check_architecture.py).
"""
