"""The bundled DFlash drafter trainer (deployed to GPU hosts by dflashctl).

This file stays torch-free: the controller imports ``trainer.config`` to validate
playbooks without torch installed.
"""
