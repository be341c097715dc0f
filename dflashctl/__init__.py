"""dflashctl: deploy, supervise and record DFlash drafter training runs.

Importing this package must stay cheap and torch-free: the trainer bundle ships
this file together with ``core/contract.py``. It never imports a submodule itself.
"""

__version__ = "0.1.0"
