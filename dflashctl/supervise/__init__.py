"""Supervision: the pure core (``supervisor_core.step``), the detectors, the restart
policy, alerts and placement, the shell that probes, stores and acts
(``supervisor``), and the line printer for a foreground supervisor (``console``)."""
