"""Tools on top of the engine: the ``jspec`` command line, benchmarks, acceptance evaluation, the demo model and
the bundled model's presets. They use the core (``jspec``, ``models``, ``pallas_kernels``); the core never
imports them (tests/test_import_direction.py)."""
