"""What happens to one run on its hosts: its run files, start, stop, restart and
standby (``runhost``), its compile cache (``compile_cache``), and what launch
recorded of it (``recorded``)."""
