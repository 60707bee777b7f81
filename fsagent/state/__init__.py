"""One collection's state dir: life cycle (``statedir``), records, the
journal, the tree, file contents, the store composed of them (``store``), and
hydration from the controller's manifest (``hydrate``). Both modes use it."""
