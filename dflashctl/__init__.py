"""dflashctl: deploy, supervise and record DFlash drafter training runs.

Importing this package must stay cheap and torch-free: the trainer bundle ships
this file together with ``contract.py``.
"""

__version__ = "0.1.0"
