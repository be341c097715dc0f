"""``python -m dflashctl``: the same as the ``dflashctl`` command; nothing else."""

from dflashctl.cli import main

main()
