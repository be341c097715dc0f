"""The controller's benches: what dflashctl costs and how fast it reacts, on this
machine (loopback sshd hosts, real tmux, SQLite, the trainer on CPU where one runs).

    transport        fan-out and connection reuse through a jump host; wedged connections
    supervisor       one supervisor tick for 1 and N hosts; crash detection latency
    hostile          hostile run files: tick time and memory
    alerts           hostile alert hooks: memory, deadlines, bursts
    copyback         memory during a compile-artifact copy-back from a hostile host
    envaudit         one env-audit of a large environment
    standby          restart downtime with and without the standby trainer
    restart          an operator's `dflashctl restart`, standby woken against a cold restart
    restart_wrapper  crash to first step through a jump host and `pct exec` vs the local host
    status           the status console's refresh, first paint, idle CPU, the CLI's start-up
    screenshots      not a measure: the console's PNG screenshots for the docs
    gpu-e2e.yaml     the playbook of `bash bench/gpu_session.sh e2e` (dflashctl on a GPU host)
"""
