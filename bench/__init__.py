"""Benchmarks of dflashctl and its trainer; the figures they printed are in bench/RESULTS.md.

Run from the repository root, as modules (no path set-up needed)::

    .venv/bin/python -m bench.controller.transport --hosts 8
    python3 -m bench.trainer.reference --runs cold,warm --steps 30

    bench/common.py        what the benches share: timing, this machine's counters, tables
                           of figures, fake hosts and throwaway runs, trainer processes and
                           their figures, GPU helpers
    bench/controller/      the controller's questions: transport, supervisor, alerts,
                           restarts and the standby, env-audit, the status console
    bench/trainer/         the trainer's questions: speed and start-up, the cold-start
                           drill, the soak, several GPUs, the loss, the masks, eval
    bench/gpu_session.sh   the GPU measurements by name (`bash bench/gpu_session.sh help`)
"""
