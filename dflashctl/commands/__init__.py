"""Command modules, one per group of commands; each registers on the shared app
(``dflashctl.commands._app``) when imported, and ``dflashctl.cli`` imports them.

Importing this package registers nothing, and nothing here imports ``dflashctl.cli``.
"""
