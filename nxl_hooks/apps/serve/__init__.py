"""Attach to a running program without editing it: ``nxl run``, ``import nxl_hooks.auto``, the control endpoint.

- :mod:`.bootstrap` (``sitecustomize.py``) and :mod:`.lazy`: the start-up hook, standard library only, that waits
  for the program to import transformers;
- :mod:`.patches`: what changes in transformers then (``from_pretrained`` adopts models; ``transformers serve``
  passes request ids);
- :mod:`.controller`: the process's models (weakly), their probes (on the models), pause / resume / re-attach;
- :mod:`.settings`: the ``NXL_*`` variables; :mod:`.runs`: run folders, sockets, tokens;
- :mod:`.endpoint` / :mod:`.readout`: the control endpoint and its JSON; :mod:`.client`: what the commands use.

Importing this package imports nothing heavy (``nxl run`` reads the bootstrap's location from it).
"""
