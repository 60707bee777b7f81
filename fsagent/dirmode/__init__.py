"""Dir mode, where FUSE is unavailable: one collection's life (``serve``), its
scan (``scan``), state (``store``) and files reached from a pinned root
(``fs``), hydration progress (``progress``). Nothing here imports pyfuse3."""
