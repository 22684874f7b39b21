"""python -m jspec.tools.bench_serve ...: see ``jspec.tools.bench_serve.run``."""

from jspec.tools.bench_serve.run import main

raise SystemExit(main())
