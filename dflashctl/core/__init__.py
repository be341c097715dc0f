"""The shared vocabulary, below everything else: the trainer contract, errors,
paths, run states, units, crash signatures, log text and terminal-safe text.

Nothing here imports another room of dflashctl. ``contract`` travels to run hosts
with the trainer, so this ``__init__`` imports nothing.
"""
