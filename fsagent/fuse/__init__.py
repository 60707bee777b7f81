"""FUSE mode: the mode probe (``probe``), one collection's life (``mount``), the
pyfuse3 operations (``fs``) and their boundary (``glue``), request counters
(``stats``). Only ``fs``, ``glue`` and ``mount`` import pyfuse3 at module level;
``probe`` imports it only in the test mount's own process."""
