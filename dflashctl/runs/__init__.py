"""What happens to one run on its hosts.

    access         how the run modules reach a run's hosts: transport, tmux, one probe
    files          the run's files on its hosts: config.json, run.sh, rendezvous.key, standby.sh
    standby        the next process's trainer, started early, woken by a restart
    logs           what the run wrote on its hosts: trainer.log and metrics.jsonl
    evaluate       the run's drafter evaluated on its host
    runhost        start, signal, stop, restart, reap; it re-exports its siblings' entry
                   points (``__all__``)
    compile_cache  the controller's store of compile artifacts
    recorded       the run's config as launch recorded it, against its playbook now
"""
